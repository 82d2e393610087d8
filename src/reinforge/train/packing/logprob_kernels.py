"""Triton kernels for the chunked LM head's two reductions over one chunk's logits [C, V].

- `row_stats(logits_CV, targets_C, temperature)` -> (logprob of each target, entropy, logsumexp),
  float32 [C] each: one pass over the logits (an online softmax per row: running max, sum of
  exp and sum of exp * z, kept per lane and combined at the end).
- `grad_logits(logits_CV, targets_C, lse_C, entropy_C, grad_logprobs_C, grad_entropy_C,
  temperature, col_offset=0)` -> dL/dlogits [C, V] in the logits' dtype: one read and one write
  per element, from the forward's logsumexp and entropy (no second reduction). The logits may be
  a vocabulary slice [col_offset, col_offset + V) of each row.
- `target_logits(hidden_NH, weight_VH, targets_N)` -> each row's own target logit, h . W[target],
  in the weights' dtype (float32 sums, one rounding: what the head's product gives at that
  column), without the [N, V] logits or a [N, H] gather: what the LM head's forward needs when
  the engine kept each row's log-sum-exp and entropy (`logprobs.chunked_logprobs`'s `stats_N2`).

Why by hand: the same math through `torch.compile(dynamic=True)` took 2.1-2.6 ms per
512 x 151,936 bf16 chunk on an H100 (session 14's G1 profile: 1.32 s of a 2.59 s update's device
time), about 40 passes' worth of memory time; these kernels make one (forward) and two
(backward) passes over the logits. Math in float32 whatever the logits' dtype; the
reference expressions are `logprob_math.chunk_stats` / `logprob_math.chunk_grad_logits`
(`tests/train/test_logprobs.py::test_triton_reductions_equal_the_reference_math`, GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Lanes per program and warps: a row of Qwen's 151,936 logits is 37 blocks of 4,096; measured
# by bench/logprob_kernels.py on an H100 and an H200 (bench/RESULTS.md, session 15).
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    vocab,
    inv_temp,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    # per lane: running max m, sum of exp(z - m) s, sum of exp(z - m) * z t
    m = tl.full([BLOCK], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        inside = cols < vocab
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) * inv_temp
        z = tl.where(inside, z, -1.0e30)
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        e = tl.where(inside, tl.exp(z - m_new), 0.0)
        s = s * scale + e
        t = t * scale + e * tl.where(inside, z, 0.0)
        m = m_new
    top = tl.max(m, axis=0)
    weights = tl.exp(m - top)
    total = tl.sum(s * weights, axis=0)
    weighted_z = tl.sum(t * weights, axis=0)
    lse = top + tl.log(total)
    target = tl.load(targets_ptr + row)
    z_target = tl.load(base + target).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, lse - weighted_z / total)  # H = lse - sum p z
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad_logits_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    stride_grad,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    g_logp_ptr,
    g_ent_ptr,
    vocab,
    col_offset,
    inv_temp,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    out = grad_ptr + row * stride_grad
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_logp = tl.load(g_logp_ptr + row).to(tl.float32)
    g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
    # the target's column among these logits' (a target outside a vocabulary slice matches none)
    target = tl.load(targets_ptr + row) - col_offset
    lanes = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        inside = cols < vocab
        z = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) * inv_temp
        logp = z - lse
        p = tl.exp(logp)
        # d logp_target / dz = onehot - p;  d H / dz = -p (log p + H)
        grad = -p * (g_ent * (logp + entropy) + g_logp)
        grad = tl.where(cols == target, grad + g_logp, grad) * inv_temp
        # a row the loss does not read (masked out: its saved statistics may be placeholders,
        # `ChunkedLogprobs` with the engine's) has no gradient, whatever they hold
        grad = tl.where((g_logp == 0.0) & (g_ent == 0.0), 0.0, grad)
        tl.store(out + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _target_logits_kernel(
    hidden_ptr,
    stride_h,
    weight_ptr,
    stride_w,
    targets_ptr,
    out_ptr,
    width,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, width, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        inside = cols < width
        h = tl.load(hidden_ptr + row * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + target * stride_w + cols, mask=inside, other=0.0).to(tl.float32)
        acc += h * w
    tl.store(out_ptr + row, tl.sum(acc, 0).to(out_ptr.dtype.element_ty))


def target_logits(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor
) -> torch.Tensor:
    """[N] in the weights' dtype: row n's logit at its target, hidden[n] . weight[targets[n]]."""
    assert hidden_NH.stride(1) == 1 and weight_VH.stride(1) == 1
    rows, width = hidden_NH.shape
    out = torch.empty(rows, dtype=weight_VH.dtype, device=hidden_NH.device)
    if rows:
        _target_logits_kernel[(rows,)](
            hidden_NH,
            hidden_NH.stride(0),
            weight_VH,
            weight_VH.stride(0),
            targets_N,
            out,
            width,
            BLOCK_H=min(1024, triton.next_power_of_2(width)),
            num_warps=4,
        )
    return out


def row_stats(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy, logsumexp of logits / temperature), float32 [C]."""
    assert logits_CV.ndim == 2 and logits_CV.stride(1) == 1  # CUDA, or the Triton interpreter
    rows, vocab = logits_CV.shape
    logp, entropy, lse = (
        torch.empty(rows, dtype=torch.float32, device=logits_CV.device) for _ in range(3)
    )
    if rows:
        _row_stats_kernel[(rows,)](
            logits_CV,
            logits_CV.stride(0),
            targets_C,
            logp,
            entropy,
            lse,
            vocab,
            1.0 / temperature,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return logp, entropy, lse


def grad_logits(
    logits_CV: torch.Tensor,
    targets_C: torch.Tensor,
    lse_C: torch.Tensor,
    entropy_C: torch.Tensor,
    grad_logprobs_C: torch.Tensor,
    grad_entropy_C: torch.Tensor,
    temperature: float,
    out: torch.Tensor | None = None,
    col_offset: int = 0,
) -> torch.Tensor:
    """dL/dlogits of one chunk in the logits' dtype, given the forward's logsumexp and entropy
    of these rows' full vocabulary. `out` may be the logits themselves (each element is read
    before it is written): the trainer's backward passes them, so the gradient costs no [C, V]
    buffer. `col_offset`: the logits are the vocabulary columns [col_offset, col_offset + V) of
    each row (a slice of the head, as the backward of a trained head computes them); a target
    outside those columns adds no one-hot term."""
    assert logits_CV.ndim == 2 and logits_CV.stride(1) == 1  # CUDA, or the Triton interpreter
    rows, vocab = logits_CV.shape
    grad_CV = torch.empty_like(logits_CV) if out is None else out
    assert grad_CV.shape == logits_CV.shape and grad_CV.stride(1) == 1
    if rows:
        _grad_logits_kernel[(rows,)](
            logits_CV,
            logits_CV.stride(0),
            grad_CV,
            grad_CV.stride(0),
            targets_C,
            lse_C,
            entropy_C,
            grad_logprobs_C.contiguous(),
            grad_entropy_C.contiguous(),
            vocab,
            col_offset,
            1.0 / temperature,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return grad_CV
