"""The chunked LM head's math in torch (`packing.logprobs`): the eager path of a CPU, of float64
and of a torch without Triton, and the reference expressions the Triton kernels
(`logprob_kernels`) are tested against (`chunk_stats`, `chunk_grad_logits`)."""

from __future__ import annotations

import torch


def _math_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 weights; float64 stays float64 (exact gradient checks)."""
    return torch.promote_types(weight.dtype, torch.float32)


def chunk_stats(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy) of one chunk's raw logits (the matmul's output, in the
    weights' dtype): the forward's math as one expression, the reference the Triton kernels
    (`logprob_kernels.row_stats`) are tested and benched against."""
    z_CV = logits_CV.to(_math_dtype(logits_CV)) / temperature
    lse_C = torch.logsumexp(z_CV, dim=-1)
    logprobs_C = z_CV.gather(1, targets_C[:, None])[:, 0] - lse_C
    probs_CV = torch.exp(z_CV - lse_C[:, None])
    return logprobs_C, lse_C - (probs_CV * z_CV).sum(-1)


def chunk_grad_logits(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    grad_logprobs_C: torch.Tensor,
    grad_entropy_C: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """dL/d(logits) of one chunk, in the logits' dtype: `_chunk_grad_logits` as one expression
    (the target's one-hot is a comparison, so nothing is scattered); the reference of
    `logprob_kernels.grad_logits`."""
    z_CV = logits_CV.to(_math_dtype(logits_CV)) / temperature
    logp_CV = z_CV - torch.logsumexp(z_CV, dim=-1, keepdim=True)
    probs_CV = torch.exp(logp_CV)
    entropy_C = -(probs_CV * logp_CV).sum(-1)
    is_target_CV = torch.arange(z_CV.shape[1], device=z_CV.device)[None, :] == targets_C[:, None]
    grad_CV = grad_logprobs_C[:, None] * is_target_CV - probs_CV * (
        grad_entropy_C[:, None] * (logp_CV + entropy_C[:, None]) + grad_logprobs_C[:, None]
    )
    return (grad_CV / temperature).to(logits_CV.dtype)


def _chunk_logits(hidden_CH, weight_VH, temperature: float) -> torch.Tensor:
    z_CV = (hidden_CH @ weight_VH.t()).to(_math_dtype(weight_VH))
    return z_CV.div_(temperature) if temperature != 1.0 else z_CV


def _chunk_grad_logits(z_CV, targets_C, grad_logprobs_C, grad_entropy_C) -> torch.Tensor:
    """dL/dz for one chunk, computed in z's buffer (z is consumed)."""
    logp_CV = z_CV.sub_(torch.logsumexp(z_CV, dim=-1, keepdim=True))
    probs_CV = logp_CV.exp()
    entropy_C = -_row_dot(probs_CV, logp_CV)
    # -p * (g_ent * (log p + H) + g_logp), then + g_logp at the target
    grad_CV = (
        logp_CV.add_(entropy_C[:, None])
        .mul_(grad_entropy_C[:, None])
        .add_(grad_logprobs_C[:, None])
        .mul_(probs_CV)
        .neg_()
    )
    del probs_CV
    rows = torch.arange(len(targets_C), device=grad_CV.device)
    grad_CV[rows, targets_C] += grad_logprobs_C
    return grad_CV


def _slice_grad_logits(
    z_NS, local_targets_N, lse_N, entropy_N, grad_logprobs_N, grad_entropy_N
) -> torch.Tensor:
    """dL/dz for one vocabulary slice of every row, computed in z's buffer (z is consumed), from
    each row's logsumexp and entropy over the whole vocabulary. `local_targets_N`: each target's
    column in the slice; those outside [0, S) get no one-hot term."""
    logp_NS = z_NS.sub_(lse_N[:, None])
    probs_NS = logp_NS.exp()
    grad_NS = (
        logp_NS.add_(entropy_N[:, None])
        .mul_(grad_entropy_N[:, None])
        .add_(grad_logprobs_N[:, None])
        .mul_(probs_NS)
        .neg_()
    )
    del probs_NS
    rows = ((local_targets_N >= 0) & (local_targets_N < grad_NS.shape[1])).nonzero()[:, 0]
    grad_NS.index_put_(
        (rows, local_targets_N[rows]), grad_logprobs_N[rows].to(grad_NS.dtype), accumulate=True
    )
    # a row the loss does not read has no gradient, whatever its saved statistics hold (the
    # engine's placeholders for positions it never sampled from: `engine_stats`)
    unread_N = (grad_logprobs_N == 0) & (grad_entropy_N == 0)
    return grad_NS.masked_fill_(unread_N[:, None], 0.0)


def _add_product(acc_NH: torch.Tensor, a_NS: torch.Tensor, b_SH: torch.Tensor) -> None:
    """acc += a @ b, with acc float32 (or float64) and a, b possibly narrower: on CUDA the
    product accumulates into acc inside the matmul (`out_dtype`); a CPU, which has no such
    matmul, rounds the bf16/fp16 product once before adding it."""
    if a_NS.dtype == acc_NH.dtype:
        acc_NH.addmm_(a_NS, b_SH)
    elif acc_NH.is_cuda and _ADDMM_OUT_DTYPE:
        torch.addmm(acc_NH, a_NS, b_SH, out_dtype=acc_NH.dtype, out=acc_NH)
    else:
        acc_NH.add_(a_NS @ b_SH)


# `addmm(..., out_dtype=)` (a bf16 product summed in float32) is recent; the project allows
# torch 2.6, whose addmm has no such argument: there the product is rounded once, as on a CPU
_ADDMM_OUT_DTYPE = "out_dtype" in (torch.addmm.__doc__ or "")


def _row_dot(a_CV: torch.Tensor, b_CV: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) as a batched matmul: no [C, V] temporary. (Under TF32 matmuls this H is
    good to about 1e-3 relative; it only scales the entropy term of the gradient.)"""
    return torch.bmm(a_CV[:, None, :], b_CV[:, :, None])[:, 0, 0]
