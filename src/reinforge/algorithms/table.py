"""The algorithm presets and the names of every choice, as plain data: no torch, so the config
layer (which must stay instant to import) validates `[algorithm]` against it and resolves a preset.

`presets.py` re-exports `PRESETS` beside the registries that turn these names into functions
(`ADVANTAGES`, `POLICY_LOSSES`); a test checks that every name here has its function there.

Values are the papers' where we could check them; a comment says so where we could not. Paper
settings not listed (learning rate, group size, batch size) belong to other config sections.
"""

from __future__ import annotations

from typing import Literal, TypedDict

AlgorithmName = Literal[
    "grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "reinforce_pp_token", "ppo"
]
# keys of presets.ADVANTAGES, plus the two estimators that are not (rewards) -> advantages
# functions: "gae" (token-level, needs the value model) and "ema_baseline" (holds a running mean)
AdvantageName = Literal[
    "grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gae",
    "ema_baseline",
    "reinforce_pp_token",
]
Scale = Literal["group", "batch", "none"]  # which std divides the advantages (TRL's scale_rewards)
# "with_tokens": a step's sequence count is its rows with a loss token (verl); "all": every row (TRL)
SeqCount = Literal["with_tokens", "all"]
# the scales each estimator accepts, its paper's first (batch for the token-level ones: whitening)
SCALES: dict[str, tuple[Scale, ...]] = {
    "grpo": ("group", "batch", "none"),
    "rloo": ("none", "group", "batch"),
    "reinforce_pp": ("batch", "none"),
    "reinforce_pp_baseline": ("batch", "none"),
    "ema_baseline": ("batch", "none"),
    "gae": ("batch", "none"),
    "reinforce_pp_token": ("batch", "none"),
}
LossName = Literal["ppo_clip", "gspo", "cispo"]  # keys of presets.POLICY_LOSSES
Aggregation = Literal[
    "token_mean",
    "token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "seq_mean_token_sum",
]
KLEstimator = Literal["k1", "k2", "k3", "abs", "k3+"]
KLPlacement = Literal["loss", "reward_token", "reward_sequence"]


class Preset(TypedDict):
    advantage: AdvantageName  # key of ADVANTAGES, or "gae" (token-level, needs the value model)
    scale_rewards: Scale  # group std (GRPO), batch std (REINFORCE++), whitening (PPO), none
    loss: LossName  # key of POLICY_LOSSES
    clip_low: float
    clip_high: float
    dual_clip_c: float | None
    aggregation: Aggregation
    kl_coef: float  # 0 = no reference model
    kl_estimator: KLEstimator
    kl_placement: KLPlacement | None  # loss term, per-token reward penalty, or sequence penalty
    entropy_coef: float
    dynamic_sampling: bool  # drop zero-variance groups and resample (DAPO)
    overlong_buffer: int | None  # tokens before rollout.max_new_tokens where the penalty ramps
    mask_truncated: bool  # drop finish_reason == "length" completions from the loss
    value_model: bool
    gamma: float | None  # GAE discount (value_model only)
    lam: float | None  # GAE lambda (value_model only)
    value_clip: float | None  # clipped value loss eps (value_model only)


# fmt: off
PRESETS: dict[str, Preset] = {
    # DeepSeekMath (Shao et al. 2024, arXiv:2402.03300): group mean/std advantages, a mean over
    # each sequence's tokens then over sequences, KL to the reference as a k3 loss term with
    # beta = 0.04. The paper does not state its clip eps; 0.2 is PPO's default.
    "grpo": {
        "advantage": "grpo", "scale_rewards": "group", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None,
        "aggregation": "seq_mean_token_mean",
        "kl_coef": 0.04, "kl_estimator": "k3", "kl_placement": "loss", "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): drop the std division and the 1/|o_i| length
    # normalisation; token sums divided by a constant (the generation budget), mean over
    # sequences. No KL term in their runs (beta = 0, as we read the paper); clip 0.2.
    "dr_grpo": {
        "advantage": "grpo", "scale_rewards": "none", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None,
        "aggregation": "seq_mean_token_sum_norm",
        "kl_coef": 0.0, "kl_estimator": "k3", "kl_placement": None, "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # DAPO (Yu et al. 2025, arXiv:2503.14476): clip-higher 0.2 / 0.28, token_mean loss, dynamic
    # sampling, soft overlong punishment with a 4096-token buffer of a 20480 budget (here the
    # buffer sits before rollout.max_new_tokens), no KL term. Overlong *filtering* appears as a
    # step of the paper's cumulative ablation table, but its four headline techniques and the
    # authors' verl recipe name only the soft punishment; we leave filtering off (turn on
    # mask_truncated to match the table).
    "dapo": {
        "advantage": "grpo", "scale_rewards": "group", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": None,
        "aggregation": "token_mean",
        "kl_coef": 0.0, "kl_estimator": "k3", "kl_placement": None, "entropy_coef": 0.0,
        "dynamic_sampling": True, "overlong_buffer": 4096, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # GSPO (Zheng et al. 2025, arXiv:2507.18071): sequence-level ratio clipped to
    # [1 - 3e-4, 1 + 4e-4], group-normalised advantages, objective averaged over sequences
    # (seq_mean_token_mean makes the GSPO-token form equal the sequence form). The paper
    # describes no KL term.
    "gspo": {
        "advantage": "grpo", "scale_rewards": "group", "loss": "gspo",
        "clip_low": 3e-4, "clip_high": 4e-4, "dual_clip_c": None,
        "aggregation": "seq_mean_token_mean",
        "kl_coef": 0.0, "kl_estimator": "k3", "kl_placement": None, "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # CISPO (MiniMax-M1, arXiv:2506.13585): no lower bound on the IS weight (clip_low 1.0 ->
    # floor 0), only eps_high tuned; normalised by all tokens of the batch (token_mean); group-
    # normalised advantages. The paper does not print eps_high: 5.0 matches NVIDIA NeMo RL's
    # MiniMax-M1 recipe (ratio_clip_max 5.0, weight <= 6); Tinker's default caps the weight at 4
    # instead. UNVERIFIED. MiniMax-M1 says it also adopts DAPO's dynamic sampling and length
    # penalty (our reading); it gives no buffer length we could find, so overlong_buffer is unset.
    "cispo": {
        "advantage": "grpo", "scale_rewards": "group", "loss": "cispo",
        "clip_low": 1.0, "clip_high": 5.0, "dual_clip_c": None,
        "aggregation": "token_mean",
        "kl_coef": 0.0, "kl_estimator": "k3", "kl_placement": None, "entropy_coef": 0.0,
        "dynamic_sampling": True, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # RLOO (Ahmadian et al. 2024, arXiv:2402.14740): leave-one-out baseline, the completion as one
    # action (sum of token logprobs, mean over sequences), KL folded into the sequence reward
    # (r - beta * sum_t log(pi/pi_ref), a k1 sum). The paper's update is plain REINFORCE, one
    # step per batch: ratio = 1, where ppo_clip's gradient equals REINFORCE's, so the clip only
    # acts if data is reused. beta = 0.05 is TRL's RLOO default; the paper tunes beta per task and
    # we did not verify its values. UNVERIFIED.
    "rloo": {
        "advantage": "rloo", "scale_rewards": "none", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None,
        "aggregation": "seq_mean_token_sum",
        "kl_coef": 0.05, "kl_estimator": "k1", "kl_placement": "reward_sequence",
        "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # REINFORCE++ w/ Baseline (Hu et al. 2025, arXiv:2501.03262, later versions): the paper's
    # variant for reasoning with k > 1 samples per prompt: subtract the group mean, normalise by
    # the batch std; PPO clip 0.2; KL as a k2 loss term. The base variant (k >= 1, k1 KL folded
    # into token rewards, batch-whitened returns) is `advantages.reinforce_pp_token_advantages`.
    # kl_coef 1e-3 and token_mean aggregation are our choice, not verified against the paper.
    "reinforce_pp": {
        "advantage": "reinforce_pp_baseline", "scale_rewards": "batch", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None,
        "aggregation": "token_mean",
        "kl_coef": 1e-3, "kl_estimator": "k2", "kl_placement": "loss", "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": None, "lam": None, "value_clip": None,
    },
    # REINFORCE++ as first published (Hu et al. 2025, arXiv:2501.03262, v1): no baseline, the
    # reward on the last token, a k1 KL penalty on every token's reward, discounted returns
    # (gamma = 1), whitened over every token of the batch; PPO clip 0.2. verl's
    # reinforce_plus_plus estimator computes the same; its example
    # (examples/reinforce_plus_plus_trainer) puts a k1 KL in the reward at verl's default
    # kl_ctrl.kl_coef 1e-3 with token-mean aggregation. beta = 1e-3 is that, UNVERIFIED against
    # the paper.
    "reinforce_pp_token": {
        "advantage": "reinforce_pp_token", "scale_rewards": "batch", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None,
        "aggregation": "token_mean",
        "kl_coef": 1e-3, "kl_estimator": "k1", "kl_placement": "reward_token",
        "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": False, "gamma": 1.0, "lam": None, "value_clip": None,
    },
    # PPO (Schulman et al. 2017, arXiv:1707.06347) with GAE (Schulman et al. 2016,
    # arXiv:1506.02438) as used for LMs by InstructGPT (Ouyang et al. 2022, arXiv:2203.02155):
    # clip 0.2, value clip 0.2, per-token k1 KL penalty in the reward. gamma = 1, lam = 0.95 and
    # beta = 0.02 are common LM-PPO settings we recall from that line of work, UNVERIFIED;
    # advantages whitened over the batch.
    "ppo": {
        "advantage": "gae", "scale_rewards": "batch", "loss": "ppo_clip",
        "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": None,
        "aggregation": "token_mean",
        "kl_coef": 0.02, "kl_estimator": "k1", "kl_placement": "reward_token",
        "entropy_coef": 0.0,
        "dynamic_sampling": False, "overlong_buffer": None, "mask_truncated": False,
        "value_model": True, "gamma": 1.0, "lam": 0.95, "value_clip": 0.2,
    },
}
# fmt: on
