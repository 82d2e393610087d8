"""Rollout/trainer mismatch: the sampler (an inference engine) and the trainer compute slightly
different probabilities for the same tokens (kernels, batch shapes, precision), so "on-policy"
data is in fact a little off-policy.

`mismatch_kl` measures the gap; `tis_weights` corrects for it with truncated importance sampling
(TIS; Yao, Liu, Zhang, Dong, Shang, Gao 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", blog post, no arXiv id): each token's policy-gradient term is multiplied
by min(pi_trainer_old / pi_sampler, C), detached. Capping trades a little bias for bounded
variance; the losses apply it through `PolicyLossSettings.tis_cap`.
"""

from __future__ import annotations

import torch

from reinforge.algorithms.kl import kl_estimate


@torch.no_grad()
def mismatch_kl(
    sampler_logprobs_BT: torch.Tensor,
    trainer_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens_total: float | None = None,
) -> torch.Tensor:
    """KL(sampler || trainer) per token by k3 (tokens were drawn by the sampler, so the sampler is
    the first argument), averaged over the mask. Pass the step's `num_tokens_total` when summing
    the metric over micro-batches; by default the micro-batch's own token count is used."""
    kl_BT = kl_estimate(sampler_logprobs_BT, trainer_logprobs_BT.detach(), "k3")
    denominator = float(mask_BT.sum()) if num_tokens_total is None else num_tokens_total
    return (kl_BT * mask_BT).sum() / max(denominator, 1.0)


@torch.no_grad()
def tis_weights(
    old_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """w_t = min(exp(logp_trainer_old - logp_sampler), cap), detached: a correction factor on the
    data, never a path for gradient."""
    return torch.exp(old_logprobs_BT.detach() - sampler_logprobs_BT).clamp(max=cap)
