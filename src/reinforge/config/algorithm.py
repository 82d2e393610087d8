"""`[algorithm]`: a union on `name`, one section model per algorithm preset, and `preset_values`,
the field values a preset implies.

Every algorithm shares the policy-loss, KL, data-side and mismatch settings (`AlgorithmBase`);
what belongs to one estimator lives only where that estimator does: `gamma`, `lam`,
`value_clip` and `value_lr` under `ppo` (GAE and its value head), `gamma` under
`reinforce_pp_token`, `advantage` and `ema_decay` under the sequence-level algorithms. A setting
under an algorithm that does not have it is refused, naming the algorithm that has it.

A setting left unset takes the preset's value when the section is validated, so after loading
every field holds a concrete value; `origins()` says where each came from.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from reinforge.algorithms.table import (
    PRESETS,
    SCALES,
    Aggregation,
    KLEstimator,
    KLPlacement,
    LossName,
    Scale,
    SeqCount,
)
from reinforge.config.base import Section

# Preset fields whose "off" value is 0 in the config (TOML has no null): the preset's None maps to it.
_OFF_IS_ZERO = ("dual_clip_c", "overlong_buffer")
SequenceAdvantage = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ema_baseline"]
# token-level estimators and the algorithm that has each
_TOKEN_LEVEL = {"gae": "ppo", "reinforce_pp_token": "reinforce_pp_token"}


def preset_values(name: str, fields: Any = None) -> dict[str, Any]:
    """The `[algorithm]` field values preset `name` implies (config names, no None), limited to
    `fields` (a section model's fields) when given."""
    preset = dict(PRESETS[name])
    values: dict[str, Any] = {
        k: v for k, v in preset.items() if k not in ("aggregation", "value_model")
    }
    values["loss_aggregation"] = preset["aggregation"]
    for key in _OFF_IS_ZERO:
        values[key] = values[key] or 0
    values["kl_placement"] = preset["kl_placement"] or "loss"  # inert while kl_coef is 0
    values = {k: v for k, v in values.items() if v is not None}
    if fields is not None:
        values = {k: v for k, v in values.items() if k in fields}
    return values


class AlgorithmBase(Section):
    """Every setting left unset takes the value of the preset `name`; set one to override it alone.
    After loading, every field holds a concrete value (`--dry-run` shows each one's origin)."""

    loss: LossName | None = None
    """Policy loss: ppo_clip (token ratio, clipped), gspo (sequence ratio), cispo (clipped,
    detached IS weight). Default: the preset's."""
    clip_low: float | None = Field(None, ge=0.0, le=1.0)
    """Ratios below 1 - clip_low are clipped (CISPO: 1.0 = no lower bound). Default: the preset's."""
    clip_high: float | None = Field(None, ge=0.0, le=10.0)
    """Ratios above 1 + clip_high are clipped (DAPO's clip-higher: 0.28). Default: the preset's."""
    dual_clip_c: float | None = Field(None, ge=0.0)
    """PPO dual clip: cap a negative-advantage token's loss at -c * A (c > 1; 0 = off). Default:
    the preset's."""
    loss_aggregation: Aggregation | None = None
    """How token losses become one number: token_mean (over all tokens of the step), token_sum
    (their plain sum, verl's token-sum), seq_mean_token_mean (per sequence, then over
    sequences), seq_mean_token_sum_norm (token sums over rollout.max_new_tokens, then over
    sequences), seq_mean_token_sum (token sums, then over sequences). Default: the preset's."""
    seq_count: SeqCount = "with_tokens"
    """The sequence count the seq_mean_* aggregations divide by: with_tokens (rows with at least
    one loss token, as verl counts) or all (every row, as TRL's grpo and dr_grpo losses do).
    They differ only when a row has no loss token (e.g. mask_truncated)."""
    scale_rewards: Scale | None = None
    """Which standard deviation divides the advantages (TRL's scale_rewards): group (each
    prompt's group of rewards), batch (the whole step's rewards; for reinforce_pp_baseline the
    step's group-centred rewards; token-level estimators whiten over every token) or none (Dr.
    GRPO). Each estimator accepts a subset (docs/algorithms.md). Default: the preset's."""
    advantage_eps: float = Field(1e-6, ge=0.0, le=1.0)
    """Added to the standard deviation that divides the advantages (verl 1e-6, TRL 1e-4).
    Whitening of token-level advantages uses rsqrt(var + 1e-8), as verl does."""
    kl_coef: float | None = Field(None, ge=0.0)
    """Weight of the KL to the reference policy (the policy as RL started; 0 = no reference is
    kept). Default: the preset's."""
    kl_estimator: KLEstimator | None = None
    """KL estimator: k1 (log ratio), k2 (half its square), k3 (Schulman's low-variance,
    non-negative; clamped as verl's low_var_kl), abs (|log ratio|), k3+ (k3's value with k2's
    gradient, verl's k3+). Default: the preset's."""
    kl_placement: KLPlacement | None = None
    """Where the KL acts: loss (a differentiated loss term), reward_token (a per-token reward
    penalty; needs a token-level algorithm: ppo or reinforce_pp_token) or reward_sequence (summed
    over the completion and taken off its reward). Ignored while kl_coef is 0. Default: the
    preset's."""
    kl_importance_correction: bool = False
    """Multiply the KL loss term by the current/old ratio pi / pi_old, gradient through both (TRL's
    use_bias_correction_kl, from DeepSeek-V3.2): an unbiased KL under the current policy when the
    data comes from an older one. kl_placement = loss only."""
    entropy_coef: float | None = Field(None, ge=0.0)
    """Weight of an entropy bonus (entropy is always reported). Default: the preset's."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal) and sample
    more prompts until the step has rollout.prompts_per_step informative groups (1.5-3x the
    rollouts where half the groups or more score alike). Default: the preset's (on in dapo and
    cispo); the shipped GRPO configs turn it on: in the learning suite (bench/RESULTS.md, sessions
    17-18, builtin:small, 3 seeds) it raised held-out pass@1 on 4 of the 5 datasets compared, e.g.
    shortest_path +10.8 -> +14.3 and sokoban +2.3 -> +4.2 points over 200 steps. Not yet with
    distributed.mode = 'disaggregated'."""
    max_sampling_rounds: int = Field(4, ge=1, le=1000)
    """Most rollout rounds per step under dynamic sampling; if the batch is still short after
    them, it is filled with the dropped groups (they carry no advantage) and the metric
    `filled_groups` says how many."""
    overlong_buffer: int | None = Field(None, ge=0)
    """DAPO's soft overlong punishment: the reward falls linearly from 0 to -1 over the last this
    many tokens before rollout.max_new_tokens (0 = off). Default: the preset's."""
    mask_truncated: bool | None = None
    """Leave completions cut off by rollout.max_new_tokens out of the loss (overlong filtering).
    Default: the preset's."""
    tis_cap: float = Field(0.0, ge=0.0)
    """Truncated importance sampling: weight each token's policy-gradient term by
    min(pi_trainer / pi_sampler, tis_cap), correcting for sampler/trainer mismatch (0 = off; the
    mismatch KL `kl_sampler` is reported either way)."""
    tis_level: Literal["token", "sequence"] = "token"
    """The ratio tis_cap truncates: each token's, or each sequence's (the product of its token
    ratios, on all its tokens)."""
    mis_low: float = Field(0.0, ge=0.0)
    """Masked importance sampling: tokens (or sequences, mis_level) whose pi_trainer / pi_sampler
    is below this leave the policy gradient (0 = no lower bound). Metrics: mis_masked_frac,
    is_ratio_mean/min/max."""
    mis_high: float = Field(0.0, ge=0.0)
    """Masked importance sampling: tokens (or sequences) whose ratio is above this leave the
    policy gradient (0 = no upper bound; e.g. 2.0)."""
    mis_level: Literal["token", "sequence"] = "token"
    """What masked importance sampling drops: single tokens, or whole sequences (by the product
    of their token ratios)."""
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Old-policy logprobs for the ratio: the trainer's own forward (detached; ratio exactly 1 on
    policy) or the sampler's. Their KL is reported either way."""
    router_aux_coef: float | None = Field(None, ge=0.0, le=1.0)
    """Mixture-of-experts models: weight of the router's load-balancing loss (Switch
    Transformer's, as transformers computes it) added to the policy loss; 0 = off. Default (unset):
    the checkpoint's `router_aux_loss_coef` (Qwen3-MoE: 0.001). Unused on dense models. Metric:
    router_aux_loss."""
    routing_replay: bool = False
    """Mixture-of-experts models: the engine records the top-k experts of every token at each
    sparse layer while sampling, and the trainer's forward routes each token to those experts
    (gate weights from its current router at those ids, so the router still learns) instead of
    its own top-k: no router mismatch between sampler and trainer. Needs the paged engine; a
    dense model is refused. Host memory: positions x sparse layers x k bytes (uint8). Metric:
    routing_replay_changed (share of replayed token-layer pairs whose own top-k set differs)."""

    @model_validator(mode="before")
    @classmethod
    def _take_preset(cls, data: Any) -> Any:
        name = cls.model_fields["name"].default
        if not isinstance(data, dict):
            return data
        given = {k: v for k, v in data.items() if v is not None}
        values = {**preset_values(name, cls.model_fields), **given}
        advantage = values.get("advantage", PRESETS[name]["advantage"])
        if "scale_rewards" not in given and values["scale_rewards"] not in SCALES[advantage]:
            # an estimator chosen over the preset's keeps its std division, at its own level
            values["scale_rewards"] = "none" if values["scale_rewards"] == "none" else "batch"
        return values

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmBase:
        if 0.0 < self.dual_clip_c <= 1.0:
            raise ValueError(
                f"dual_clip_c = {self.dual_clip_c} must be above 1 (it caps the loss at c times "
                "the advantage); use e.g. dual_clip_c = 3.0, or 0 to turn it off"
            )
        if self.kl_coef > 0 and self.kl_placement == "reward_token" and not self.is_token_level:
            raise ValueError(
                f"kl_placement = 'reward_token' needs token-level advantages, but advantage = "
                f"{self.advantage!r} gives one per sequence; use kl_placement = 'reward_sequence' "
                "(or 'loss'), or name = 'reinforce_pp_token' or 'ppo' (advantage = 'gae')"
            )
        if self.kl_importance_correction and self.kl_placement != "loss":
            raise ValueError(
                f"kl_importance_correction = true weights the KL loss term, but kl_placement = "
                f"{self.kl_placement!r} puts the KL in the rewards; set kl_placement = 'loss' or "
                "kl_importance_correction = false"
            )
        if self.scale_rewards not in SCALES[self.advantage]:
            raise ValueError(
                f"scale_rewards = {self.scale_rewards!r} does not apply to advantage = "
                f"{self.advantage!r}; use one of {', '.join(repr(x) for x in SCALES[self.advantage])}"
            )
        self._check_mismatch()
        return self

    def _check_mismatch(self) -> None:
        if self.mis_high and self.mis_low >= self.mis_high:
            raise ValueError(
                f"mis_low = {self.mis_low} must be below mis_high = {self.mis_high}; e.g. "
                "mis_low = 0.5, mis_high = 2.0"
            )
        if self.tis_level == "sequence" and not self.tis_cap:
            raise ValueError(
                "tis_level = 'sequence' has no effect while tis_cap = 0; set tis_cap (e.g. 2.0)"
            )
        if self.mis_level == "sequence" and not (self.mis_low or self.mis_high):
            raise ValueError(
                "mis_level = 'sequence' has no effect while mis_low and mis_high are 0; set "
                "mis_high (e.g. 2.0) and/or mis_low (e.g. 0.5)"
            )

    @property
    def is_token_level(self) -> bool:
        return self.advantage in _TOKEN_LEVEL

    @property
    def uses_value_model(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def origins(self) -> dict[str, str]:
        """Where each preset-backed field's value came from: the preset, or a setting."""
        origins = {}
        for key, value in preset_values(self.name, type(self).model_fields).items():
            if getattr(self, key) != value:
                origins[key] = f"set (preset {self.name}: {value!r})"
            else:
                origins[key] = f"preset {self.name}"
        return origins


class _SequenceLevel(AlgorithmBase):
    """An algorithm with one advantage per sequence, from the group's rewards."""

    advantage: SequenceAdvantage | None = None
    """Advantage estimator: grpo (group mean, optional std), rloo (leave-one-out),
    reinforce_pp (batch-normalised), reinforce_pp_baseline (group mean, batch std),
    ema_baseline (running mean of rewards). The token-level ones are algorithms of their own:
    name = "ppo" (GAE) or "reinforce_pp_token". Default: the preset's."""
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0)
    """Decay of the running reward baseline (advantage = ema_baseline only)."""

    @model_validator(mode="before")
    @classmethod
    def _token_level_elsewhere(cls, data: Any) -> Any:
        advantage = data.get("advantage") if isinstance(data, dict) else None
        if advantage in _TOKEN_LEVEL:
            raise ValueError(
                f"advantage = {advantage!r} is token-level, an algorithm of its own: set name = "
                f"{_TOKEN_LEVEL[advantage]!r} (with its own settings) instead"
            )
        return data

    @model_validator(mode="after")
    def _ema_only_with_its_baseline(self) -> _SequenceLevel:
        if self.ema_decay != 0.9 and self.advantage != "ema_baseline":
            raise ValueError(
                f"ema_decay = {self.ema_decay} has no effect with advantage = {self.advantage!r}; "
                "set advantage = 'ema_baseline' or leave ema_decay out"
            )
        return self


class GRPOAlgorithm(_SequenceLevel):
    name: Literal["grpo"] = "grpo"
    """GRPO (Shao et al. 2024): group mean/std advantages, KL to the reference in the loss."""


class DrGRPOAlgorithm(_SequenceLevel):
    name: Literal["dr_grpo"] = "dr_grpo"
    """Dr. GRPO (Liu et al. 2025): no std division, token sums over the generation budget."""


class DAPOAlgorithm(_SequenceLevel):
    name: Literal["dapo"] = "dapo"
    """DAPO (Yu et al. 2025): clip-higher, token_mean, dynamic sampling, overlong punishment."""


class GSPOAlgorithm(_SequenceLevel):
    name: Literal["gspo"] = "gspo"
    """GSPO (Zheng et al. 2025): one clipped importance ratio per sequence."""


class CISPOAlgorithm(_SequenceLevel):
    name: Literal["cispo"] = "cispo"
    """CISPO (MiniMax 2025): a clipped, detached importance weight on every token."""


class RLOOAlgorithm(_SequenceLevel):
    name: Literal["rloo"] = "rloo"
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline, KL in the sequence reward."""


class ReinforcePPAlgorithm(_SequenceLevel):
    name: Literal["reinforce_pp"] = "reinforce_pp"
    """REINFORCE++ w/ Baseline (Hu et al. 2025): group mean, batch std, k2 KL in the loss."""


class ReinforcePPTokenAlgorithm(AlgorithmBase):
    name: Literal["reinforce_pp_token"] = "reinforce_pp_token"
    """REINFORCE++ (Hu et al. 2025, the base variant): a k1 KL penalty on each token's reward,
    discounted returns, whitened over every token of the step (scale_rewards = batch)."""
    gamma: float | None = Field(None, ge=0.0, le=1.0)
    """Discount of the token returns G_t = sum_s gamma^(s-t) r_s. Default: the preset's (1.0)."""

    @property
    def advantage(self) -> str:
        return "reinforce_pp_token"


class PPOAlgorithm(AlgorithmBase):
    name: Literal["ppo"] = "ppo"
    """PPO with GAE and a value head (Schulman et al. 2017; Ouyang et al. 2022)."""
    gamma: float | None = Field(None, ge=0.0, le=1.0)
    """GAE discount. Default: the preset's."""
    lam: float | None = Field(None, ge=0.0, le=1.0)
    """GAE lambda. Default: the preset's."""
    value_clip: float | None = Field(None, ge=0.0)
    """Clip of the value loss: V may move at most this far from its old value (0 = unclipped).
    Default: the preset's."""
    value_lr: float | None = Field(None, gt=0.0, le=1.0)
    """Learning rate of the value head (it has its own AdamW parameter group and the policy's
    schedule). Default: optim.lr."""

    @property
    def advantage(self) -> str:
        return "gae"


AlgorithmSection = Annotated[
    GRPOAlgorithm
    | DrGRPOAlgorithm
    | DAPOAlgorithm
    | GSPOAlgorithm
    | CISPOAlgorithm
    | RLOOAlgorithm
    | ReinforcePPAlgorithm
    | ReinforcePPTokenAlgorithm
    | PPOAlgorithm,
    Field(discriminator="name"),
]
