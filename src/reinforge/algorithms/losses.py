"""Policy losses as pure functions: `(LossInputs, PolicyLossSettings) -> (loss, metrics)`.

Contract: a micro-batch's loss is already divided by the *whole optimizer step's* normalisers
(`num_tokens_total`, `num_seqs_total`, and the constant `token_sum_norm` of Dr. GRPO), so summing
micro-batch losses over gradient accumulation gives exactly the configured aggregate, whatever the
micro-batching. Metrics follow the same rule (token means over the step's tokens), so the loop
sums them over micro-batches too.

Every loss builds a per-token loss [B, T], then `_finish` applies what all of them share: the
rollout/trainer mismatch weight (truncated or masked importance sampling, `mismatch.py`), the
KL-to-reference loss term (optionally importance-corrected), the entropy bonus, and the
aggregation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reinforge.algorithms.counts import at_least_one
from reinforge.algorithms.kl import KL_ESTIMATORS, kl_estimate
from reinforge.algorithms.mismatch import MismatchCorrection, MismatchLevel, mismatch_weights
from reinforge.algorithms.table import Aggregation, KLEstimator

# exp() of a log-ratio above this overflows float32 towards inf, and inf * 0 in the backward pass
# is NaN; a ratio of e^20 is far outside every clip range anyway.
MAX_LOG_RATIO = 20.0


@dataclass
class LossInputs:
    logprobs_BT: torch.Tensor  # current policy, with grad
    old_logprobs_BT: torch.Tensor  # behaviour policy, no grad
    advantages_B: torch.Tensor  # [B] one per sequence, or [B, T] per token (GAE, REINFORCE++ token)
    mask_BT: torch.Tensor  # 1.0 on completion tokens that count, 0.0 elsewhere
    # mask.sum() and the sequences over the whole optimizer step: floats, or 0-d device tensors
    # where the update replays a CUDA graph (`train.loop.graphs`: read them through `at_least_one`)
    num_tokens_total: float | torch.Tensor
    num_seqs_total: float | torch.Tensor
    ref_logprobs_BT: torch.Tensor | None = None
    entropy_BT: torch.Tensor | None = None
    sampler_logprobs_BT: torch.Tensor | None = None  # rollout engine's logprobs; needed for TIS
    token_sum_norm: float | None = None  # seq_mean_token_sum_norm's divisor (Dr. GRPO: budget)


@dataclass(frozen=True)
class PolicyLossSettings:
    clip_low: float = 0.2  # ratio floor 1 - clip_low (CISPO: 1.0 = no floor)
    clip_high: float = 0.2  # ratio ceiling 1 + clip_high
    kl_coef: float = 0.0  # weight of the KL-to-reference *loss* term
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    aggregation: Aggregation = "token_mean"
    dual_clip_c: float | None = None  # PPO dual clip: cap the loss at -c * A for A < 0 (c > 1)
    tis_cap: float | None = None  # truncated IS for sampler/trainer mismatch (None = off)
    tis_level: MismatchLevel = "token"  # TIS ratio per token, or one per sequence
    mis_low: float | None = None  # masked IS: drop where the ratio < mis_low (None = no floor)
    mis_high: float | None = None  # ... or > mis_high (None = no ceiling)
    mis_level: MismatchLevel = "token"  # drop tokens, or whole sequences
    # TRL's use_bias_correction_kl: the KL term times the current/old ratio (with its gradient)
    kl_importance_correction: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low <= 1.0:
            raise ValueError(f"clip_low={self.clip_low} must be in [0, 1] (1.0 = no lower bound)")
        if self.clip_high < 0.0:
            raise ValueError(f"clip_high={self.clip_high} must be >= 0")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c={self.dual_clip_c} must be > 1 (or None to turn it off)")
        self.mismatch.check()
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.aggregation!r}: use one of {sorted(AGGREGATIONS)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"kl_estimator {self.kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}"
            )

    @property
    def mismatch(self) -> MismatchCorrection:
        return MismatchCorrection(
            self.tis_cap, self.tis_level, self.mis_low, self.mis_high, self.mis_level
        )


PPOClipSettings = PolicyLossSettings  # the name the loop imported first; same settings


# ---------------------------------------------------------------------------------- aggregation


def _token_mean(values_BT: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """DAPO: sum over all tokens of the step / tokens in the step; long answers weigh more."""
    return (values_BT * x.mask_BT).sum() / at_least_one(x.num_tokens_total)


def _seq_mean_token_mean(values_BT: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """GRPO: mean over each sequence's own tokens, then mean over the step's sequences."""
    per_seq_B = (values_BT * x.mask_BT).sum(-1) / x.mask_BT.sum(-1).clamp(min=1.0)
    return per_seq_B.sum() / at_least_one(x.num_seqs_total)


def _seq_mean_token_sum_norm(values_BT: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """Dr. GRPO: each sequence's token *sum* / a constant (the generation budget), then mean over
    sequences; no length-dependent weighting of a token's gradient."""
    if x.token_sum_norm is None or x.token_sum_norm <= 0:
        raise ValueError(
            "seq_mean_token_sum_norm needs LossInputs.token_sum_norm > 0: set it to the "
            "generation budget (rollout.max_new_tokens), as Dr. GRPO does"
        )
    return (values_BT * x.mask_BT).sum() / (x.token_sum_norm * at_least_one(x.num_seqs_total))


def _seq_mean_token_sum(values_BT: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """RLOO: the completion is one action, log pi(y) = sum_t log pi(y_t); mean over sequences."""
    return (values_BT * x.mask_BT).sum() / at_least_one(x.num_seqs_total)


def _token_sum(values_BT: torch.Tensor, x: LossInputs) -> torch.Tensor:
    """verl's token-sum: every token's loss added up, no normaliser; the step's gradient grows
    with its token count (scale the learning rate accordingly)."""
    return (values_BT * x.mask_BT).sum()


AGGREGATIONS: dict[str, Callable[[torch.Tensor, LossInputs], torch.Tensor]] = {
    "token_mean": _token_mean,
    "token_sum": _token_sum,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
    "seq_mean_token_sum": _seq_mean_token_sum,
}


def aggregate(values_BT: torch.Tensor, x: LossInputs, mode: Aggregation) -> torch.Tensor:
    """Masked per-token values [B, T] -> one number, normalised by the step's totals."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; use one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[mode](values_BT, x)


def token_advantages(x: LossInputs) -> torch.Tensor:
    """Advantages laid out per token [B, T]: a per-sequence advantage repeats on its tokens."""
    adv = x.advantages_B
    return adv[:, None].expand_as(x.mask_BT) if adv.dim() == 1 else adv


# ------------------------------------------------------------------------------------- losses


def ppo_clip_loss(
    x: LossInputs, s: PolicyLossSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token (Schulman et al. 2017, arXiv:1707.06347), with decoupled
    clip (DAPO "clip-higher", Yu et al. 2025) and optional dual clip (Ye et al. 2020,
    arXiv:1912.09729):

      r = pi / pi_old,  L = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
      dual clip, A < 0:  L = min(L, -c * A)

    Tokens whose clipped branch is active get zero gradient; so do tokens capped by the dual clip
    (A < 0 and r > c), which otherwise carry an unbounded -r * A.
    """
    ratio_BT = torch.exp((x.logprobs_BT - x.old_logprobs_BT).clamp(max=MAX_LOG_RATIO))
    adv_BT = token_advantages(x)
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = ratio_BT.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) * adv_BT
    token_loss_BT = -torch.minimum(unclipped_BT, clipped_BT)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        metrics["clip_frac"] = aggregate((clipped_BT < unclipped_BT).float(), x, "token_mean")
        metrics["ratio_mean"] = aggregate(ratio_BT, x, "token_mean")
    if s.dual_clip_c is not None:
        cap_BT = -s.dual_clip_c * adv_BT
        is_capped_BT = (adv_BT < 0) & (token_loss_BT > cap_BT)
        token_loss_BT = torch.where(is_capped_BT, cap_BT, token_loss_BT)
        metrics["dual_clip_frac"] = aggregate(is_capped_BT.float(), x, "token_mean").detach()
    return _finish(token_loss_BT, x, s, metrics)


def gspo_loss(x: LossInputs, s: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): one
    importance ratio per sequence, the geometric mean of its token ratios, clipped per sequence:

      s_i = exp(1/|y_i| * sum_t log(pi(y_t) / pi_old(y_t)))
      L_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)

    Written in the paper's GSPO-token form, s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: every token
    carries the value s_i, and its gradient s_i * grad log pi(y_t). With seq_mean_token_mean this is
    exactly grad L_i = -A_i * s_i * 1/|y_i| * sum_t grad log pi(y_t), the sequence-level gradient;
    a clipped sequence passes no gradient to any of its tokens. The paper's clip ranges are tiny
    (3e-4 / 4e-4) because s_i is a per-token geometric mean.
    """
    mask_BT = x.mask_BT
    log_ratio_BT = (x.logprobs_BT - x.old_logprobs_BT) * mask_BT
    seq_log_ratio_B = log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
    log_s_BT = seq_log_ratio_B.detach()[:, None] + x.logprobs_BT - x.logprobs_BT.detach()
    s_BT = torch.exp(log_s_BT.clamp(max=MAX_LOG_RATIO))
    adv_BT = token_advantages(x)
    unclipped_BT = s_BT * adv_BT
    clipped_BT = s_BT.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) * adv_BT
    token_loss_BT = -torch.minimum(unclipped_BT, clipped_BT)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        has_tokens_B = mask_BT.sum(-1) > 0
        is_clipped_B = ((clipped_BT < unclipped_BT) & (mask_BT > 0)).any(-1) & has_tokens_B
        metrics["clip_frac"] = is_clipped_B.to(mask_BT.dtype).sum() / at_least_one(x.num_seqs_total)
        metrics["seq_ratio_mean"] = (seq_log_ratio_B.exp() * has_tokens_B).sum() / at_least_one(
            x.num_seqs_total
        )
    return _finish(token_loss_BT, x, s, metrics)


def cispo_loss(
    x: LossInputs, s: PolicyLossSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv:2506.13585): clip the importance weight,
    not the update, and stop its gradient, so every token keeps a gradient:

      w = sg(clip(pi / pi_old, 1 - clip_low, 1 + clip_high)),  L = -w * A * log pi

    The paper sets no lower bound (clip_low = 1.0 here) and tunes only clip_high. The loss *value*
    is the paper's surrogate (it includes log pi), so it is not comparable to PPO's; its gradient
    -w * A * grad log pi is what matters.
    """
    ratio_BT = torch.exp((x.logprobs_BT - x.old_logprobs_BT).clamp(max=MAX_LOG_RATIO))
    weight_BT = ratio_BT.clamp(1.0 - s.clip_low, 1.0 + s.clip_high).detach()
    token_loss_BT = -weight_BT * token_advantages(x) * x.logprobs_BT
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        is_clipped_BT = (weight_BT != ratio_BT).float()
        metrics["clip_frac"] = aggregate(is_clipped_BT, x, "token_mean")
        metrics["ratio_mean"] = aggregate(ratio_BT, x, "token_mean")
    return _finish(token_loss_BT, x, s, metrics)


def _finish(
    token_loss_BT: torch.Tensor,
    x: LossInputs,
    s: PolicyLossSettings,
    metrics: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Shared tail: the sampler/trainer correction weight on the policy-gradient term, KL and
    entropy terms, aggregation."""
    correction = s.mismatch
    if correction.is_active:
        if x.sampler_logprobs_BT is None:
            raise ValueError(
                "a sampler/trainer correction (tis_cap or mis_low/mis_high) is set but "
                "LossInputs.sampler_logprobs_BT is None: pass the rollout engine's logprobs, or "
                "turn the correction off"
            )
        weight_BT, weight_metrics = mismatch_weights(
            x.old_logprobs_BT, x.sampler_logprobs_BT, x.mask_BT, correction, x.num_tokens_total
        )
        token_loss_BT = token_loss_BT * weight_BT
        metrics.update(weight_metrics)
    metrics["pg_loss"] = aggregate(token_loss_BT, x, s.aggregation).detach()
    if x.ref_logprobs_BT is not None:
        token_loss_BT = _add_kl(token_loss_BT, x, s, metrics)
    if x.entropy_BT is not None:
        metrics["entropy"] = aggregate(x.entropy_BT, x, "token_mean").detach()
        if s.entropy_coef > 0:
            token_loss_BT = token_loss_BT - s.entropy_coef * x.entropy_BT
    return aggregate(token_loss_BT, x, s.aggregation), metrics


def _add_kl(
    token_loss_BT: torch.Tensor,
    x: LossInputs,
    s: PolicyLossSettings,
    metrics: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The KL-to-reference loss term, and two metrics: `kl_ref`, the token mean of the configured
    estimator, and `kl_ref_trl`, what TRL's GRPOTrainer logs as "kl": the token mean of k3, times
    the current/old ratio when the importance correction is on.

    With `kl_importance_correction` (TRL's use_bias_correction_kl, from DeepSeek-V3.2) each
    token's KL is multiplied by pi / pi_old, gradient through both factors: the tokens were
    sampled by pi_old, and the ratio turns their average into an estimate of the KL under pi,
    whose gradient then includes the score-function term KL * grad log pi."""
    assert x.ref_logprobs_BT is not None
    kl_BT = kl_estimate(x.logprobs_BT, x.ref_logprobs_BT, s.kl_estimator)
    ratio_BT = torch.exp((x.logprobs_BT - x.old_logprobs_BT).clamp(max=MAX_LOG_RATIO))
    with torch.no_grad():
        metrics["kl_ref"] = aggregate(kl_BT, x, "token_mean")
        k3_BT = kl_estimate(x.logprobs_BT, x.ref_logprobs_BT, "k3")
        if s.kl_importance_correction:
            k3_BT = k3_BT * ratio_BT
        metrics["kl_ref_trl"] = aggregate(k3_BT, x, "token_mean")
    if s.kl_importance_correction:
        kl_BT = kl_BT * ratio_BT
    if s.kl_coef > 0:
        token_loss_BT = token_loss_BT + s.kl_coef * kl_BT
    return token_loss_BT
