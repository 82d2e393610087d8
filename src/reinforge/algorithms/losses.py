"""Policy losses as pure functions: typed inputs -> (loss, metrics).

The loss of a micro-batch is already divided by the *whole step's* token (or sequence) count,
so summing micro-batch losses over gradient accumulation gives exactly the configured aggregate,
whatever the micro-batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reinforge.algorithms.kl import KLEstimator, kl_estimate

Aggregation = Literal["token_mean", "seq_mean_token_mean"]


@dataclass
class LossInputs:
    logprobs_BT: torch.Tensor  # current policy, with grad
    old_logprobs_BT: torch.Tensor  # behaviour policy, no grad
    advantages_B: torch.Tensor
    mask_BT: torch.Tensor  # 1.0 on completion tokens that count, 0.0 elsewhere
    num_tokens_total: float  # completion tokens in the whole optimizer step
    num_seqs_total: float  # sequences in the whole optimizer step
    ref_logprobs_BT: torch.Tensor | None = None
    entropy_BT: torch.Tensor | None = None


@dataclass(frozen=True)
class PPOClipSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    aggregation: Aggregation = "token_mean"


def aggregate(values_BT: torch.Tensor, x: LossInputs, mode: Aggregation) -> torch.Tensor:
    mask = x.mask_BT
    if mode == "token_mean":
        return (values_BT * mask).sum() / max(x.num_tokens_total, 1.0)
    assert mode == "seq_mean_token_mean", mode
    per_seq = (values_BT * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(x.num_seqs_total, 1.0)


def ppo_clip_loss(
    x: LossInputs, s: PPOClipSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate per token (Schulman et al. 2017) with separate low/high clip:
    L = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) + kl_coef * KL - entropy_coef * H."""
    log_ratio = x.logprobs_BT - x.old_logprobs_BT
    ratio = torch.exp(log_ratio)
    adv = x.advantages_B[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) * adv
    token_loss = -torch.minimum(unclipped, clipped)
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        metrics["clip_frac"] = aggregate((clipped < unclipped).float(), x, "token_mean")
        metrics["ratio_mean"] = aggregate(ratio, x, "token_mean")
    metrics["pg_loss"] = aggregate(token_loss, x, s.aggregation).detach()
    if x.ref_logprobs_BT is not None:
        kl = kl_estimate(x.logprobs_BT, x.ref_logprobs_BT, s.kl_estimator)
        metrics["kl_ref"] = aggregate(kl, x, "token_mean").detach()
        if s.kl_coef > 0:
            token_loss = token_loss + s.kl_coef * kl
    if x.entropy_BT is not None:
        metrics["entropy"] = aggregate(x.entropy_BT, x, "token_mean").detach()
        if s.entropy_coef > 0:
            token_loss = token_loss - s.entropy_coef * x.entropy_BT
    return aggregate(token_loss, x, s.aggregation), metrics
