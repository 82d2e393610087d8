"""Rollout/trainer mismatch: the sampler (an inference engine) and the trainer compute slightly
different probabilities for the same tokens (kernels, batch shapes, bf16), and a disaggregated
sampler may hold weights a step old, so "on-policy" data is in fact a little off-policy.

`mismatch_kl` measures the gap. `mismatch_weights` corrects for it with the importance ratio
rho = pi_trainer_old / pi_sampler, per token or per sequence (the product of its token ratios),
detached, multiplied into each token's policy-gradient term (not the KL or entropy terms):

  truncated IS (TIS; Yao, Liu, Zhang, Dong, Shang, Gao 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", blog post): w = min(rho, C). Unbiased where
  rho <= C, bounded variance; every token still counts.
  masked IS (MIS; TRL's token_mask / sequence_mask, verl's rollout rejection sampling): w = 0
  where rho leaves [low, high], the token (or the whole sequence) drops out of the policy
  gradient. With TIS on too, the kept ones get min(rho, C) (TRL's *_mask modes: C = high).

Which to use. A small, even gap (one engine, bf16 against float32 logits: kl_sampler ~1e-3)
needs token TIS at most. A gap concentrated on a few tokens (a numerically fragile kernel, a
token the sampler gave near-zero probability) is what token MIS removes, where truncation would
keep the token at weight C. Sequence level is the exact correction for a sequence-level
objective (the product of ratios), but the product of hundreds of ratios is far from 1 for
long completions, so sequence TIS mostly truncates; sequence MIS drops a whole completion whose
sampling went wrong (e.g. a disaggregated sampler a step behind on a drifting policy). Masked
tokens keep their place in the loss's token and sequence counts (as in TRL): the masked share
(`mis_masked_frac`) says how much of the step's signal was dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from reinforge.algorithms.counts import at_least_one
from reinforge.algorithms.kl import kl_estimate

MismatchLevel = Literal["token", "sequence"]
# exp() of a sequence's summed log-ratio overflows float32 past ~88; a ratio of e^20 is past any
# cap or mask bound anyway
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class MismatchCorrection:
    tis_cap: float | None = None  # w = min(rho, tis_cap); None = no truncation
    tis_level: MismatchLevel = "token"
    mis_low: float | None = None  # w = 0 where rho < mis_low; None = no floor
    mis_high: float | None = None  # w = 0 where rho > mis_high; None = no ceiling
    mis_level: MismatchLevel = "token"

    @property
    def is_active(self) -> bool:
        return self.tis_cap is not None or self.is_masking

    @property
    def is_masking(self) -> bool:
        return self.mis_low is not None or self.mis_high is not None

    def check(self) -> None:
        if self.tis_cap is not None and self.tis_cap <= 0.0:
            raise ValueError(f"tis_cap={self.tis_cap} must be > 0 (or None to turn TIS off)")
        low, high = self.mis_low, self.mis_high
        if low is not None and high is not None and not low < high:
            raise ValueError(f"mis_low={low} must be below mis_high={high} (e.g. 0.5 and 2.0)")
        for level in (self.tis_level, self.mis_level):
            if level not in ("token", "sequence"):
                raise ValueError(f"mismatch level {level!r}: use 'token' or 'sequence'")


@torch.no_grad()
def mismatch_kl(
    sampler_logprobs_BT: torch.Tensor,
    trainer_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens_total: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """KL(sampler || trainer) per token by k3 (tokens were drawn by the sampler, so the sampler is
    the first argument), averaged over the mask. Pass the step's `num_tokens_total` when summing
    the metric over micro-batches; by default the micro-batch's own token count is used."""
    kl_BT = kl_estimate(sampler_logprobs_BT, trainer_logprobs_BT.detach(), "k3")
    denominator = float(mask_BT.sum()) if num_tokens_total is None else num_tokens_total
    return (kl_BT * mask_BT).sum() / at_least_one(denominator)


@torch.no_grad()
def importance_ratios(
    old_logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    level: MismatchLevel,
) -> torch.Tensor:
    """rho [B, T]: per token exp(old - sampler); per sequence exp(sum over the mask of the same),
    repeated on each of the sequence's tokens. Detached."""
    log_rho_BT = (old_logprobs_BT.detach() - sampler_logprobs_BT) * mask_BT
    if level == "sequence":
        log_rho_BT = log_rho_BT.sum(-1, keepdim=True).expand_as(mask_BT)
    return torch.exp(log_rho_BT.clamp(max=MAX_LOG_RATIO))


@torch.no_grad()
def mismatch_weights(
    old_logprobs_BT: torch.Tensor,
    sampler_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    c: MismatchCorrection,
    num_tokens_total: float | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The correction weight [B, T] of each token's policy-gradient term, and its metrics: token
    means over the step (`num_tokens_total`, so they add up over micro-batches) of the weight
    (`tis_weight_mean`), of the share masked (`mis_masked_frac`) and of the token ratio
    (`is_ratio_mean`), and the token ratio's extremes over the micro-batch (`is_ratio_min`,
    `is_ratio_max`: the loop takes the min and max over micro-batches)."""
    denominator = at_least_one(num_tokens_total)
    weight_BT = torch.ones_like(mask_BT)
    if c.tis_cap is not None:
        tis_rho_BT = importance_ratios(old_logprobs_BT, sampler_logprobs_BT, mask_BT, c.tis_level)
        weight_BT = tis_rho_BT.clamp(max=c.tis_cap)
    metrics: dict[str, torch.Tensor] = {}
    if c.is_masking:
        rho_BT = importance_ratios(old_logprobs_BT, sampler_logprobs_BT, mask_BT, c.mis_level)
        low = c.mis_low if c.mis_low is not None else 0.0
        high = c.mis_high if c.mis_high is not None else float("inf")
        is_masked_BT = (rho_BT < low) | (rho_BT > high)
        weight_BT = weight_BT.masked_fill(is_masked_BT, 0.0)
        metrics["mis_masked_frac"] = (is_masked_BT * mask_BT).sum() / denominator
    metrics["tis_weight_mean"] = (weight_BT * mask_BT).sum() / denominator
    token_rho_BT = importance_ratios(old_logprobs_BT, sampler_logprobs_BT, mask_BT, "token")
    metrics["is_ratio_mean"] = (token_rho_BT * mask_BT).sum() / denominator
    valid = token_rho_BT[mask_BT > 0]
    if valid.numel():
        metrics["is_ratio_min"], metrics["is_ratio_max"] = valid.min(), valid.max()
    return weight_BT, metrics
