"""Chunked LM head: chosen-token logprobs and entropies without the full [tokens, vocab] logits.

Contract
- `chunked_logprobs(hidden_NH, weight_VH, targets_N, temperature, chunk_size)` returns
  `logprobs_N` and `entropy_N` (float32) for N token positions, equal to
  `log_softmax((hidden @ weight.T).float() / temperature)` at the targets and to
  `-(p * log p).sum(-1)` of the same distribution.
- Memory: the forward computes logits for one chunk of `chunk_size` rows at a time. The autograd
  graph holds only the inputs (hidden, weight, targets) and each position's logsumexp and
  entropy (2N floats): never [N, V]. The backward recomputes the logits piece by piece, from
  those saved values, and each piece's gradient needs no reduction over the vocabulary:
  - a trained head walks vocabulary slices of `vocab_slice_width(N, V, chunk_size)` columns (a
    multiple of 128, at most V) over all N rows, so a slice's logits [N, Vc] hold about as many
    elements as one chunk's [chunk_size, V]. Each slice's share of the head-weight gradient is
    one product over all N rows, so the [V, H] gradient is written once per call; the hidden
    gradient is summed over the slices in a float32 [N, H] accumulator (N * H * 4 bytes: 44 MB
    at 12k rows x 896), cast to the hidden states' dtype at the end. Measured on G1 (0.5B shape,
    V = 151,936, about 12k rows a call, bf16) before this: per 512-row chunk, the `addmm_` into
    the bf16 [V, H] gradient took 348 us where its FLOPs need about 175 us, since each of the
    256 chunks of an update read and wrote the whole gradient (272 MB) again. Measured on an
    H200 (torch profiler, one 12,288-row bf16 call at G1's shape, head gradient in place): the
    backward's device time went from 18.0 ms (24 row chunks) to 16.2 ms (25 slices of 6,272
    columns); the head-weight products from 6.5 ms to 4.6 ms, the hidden-gradient products from
    4.5 ms to 4.9 ms (the float32 accumulator is read and written by each slice's product).
  - a frozen head (LoRA) walks row chunks over the whole vocabulary, as the forward does: no
    weight gradient to write and no [N, H] accumulator.
  Peak extra memory on CUDA is one piece's logits in the weight dtype (`chunk_size * V * 2`
  bytes in bf16: the Triton kernels of `logprob_kernels` reduce them in place and write the
  backward's gradient over them); the CPU path adds two float32 buffers of that size. When the
  head weight is trained, add a [V, H] gradient in the weight's dtype (each slice's product
  accumulates in float32 inside the matmul and is rounded once), unless it goes in place.
- `weight_grad_in_place=True` (the trainer's single-process path) sums the head-weight gradient
  straight into the weight's `.grad` (a leaf parameter) and hands autograd none: no [V, H]
  accumulator. Measured on G1 (0.5B shape, tied embeddings, `torch.cuda.memory` history of one
  update): autograd holds a tied weight's head gradient in its input buffer until the embedding's
  backward, at the very end, so the accumulator (0.25 GiB) sat beside every layer's backward,
  where the update's peak is. The result is the same `.grad` as `.backward()` gives; code that
  asks autograd for gradients (`torch.autograd.grad`) must leave it off.
- Precision: the matmuls run in the weights' dtype (bf16 on a GPU); softmax, logsumexp,
  entropy and the logits' gradient run in float32, and so does the sum of a trained head's
  vocabulary slices into the hidden gradient (on CUDA inside the matmul, `out_dtype`; a CPU
  rounds each bf16 slice product once before adding it).
- Gradients flow to both outputs (an entropy bonus trains through `entropy_N`) and to hidden
  states and the head weight; a frozen head (LoRA) costs no weight-gradient matmul.

The model's side (its last hidden states and head weight, without logits): `packing.hidden`.
The eager math (a CPU, float64) and the Triton kernels' reference expressions:
`packing.logprob_math`.
"""

from __future__ import annotations

import torch

from reinforge.train.packing.logprob_math import (
    _add_product,
    _chunk_grad_logits,
    _chunk_logits,
    _math_dtype,
    _slice_grad_logits,
)

# Rows per chunk of the forward and of a frozen head's backward; a trained head's backward
# sizes its vocabulary slices to the same logits budget (`vocab_slice_width`). Measured on G1
# (0.5B shape, vocabulary 151,936, H100, compiled layers, a float32 head-gradient accumulator)
# when the backward also walked row chunks: 1,024 rows gave a 2.15 s training phase and a
# 5.9 GiB peak; 256 rows 2.72 s and 5.5 GiB (each chunk read the whole head weight again, three
# times). The forward still reads the whole weight once per chunk.
DEFAULT_CHUNK_SIZE = 512


def chunked_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    weight_grad_in_place: bool = False,
    stats_N2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and the entropy at each position, [N] float32 each (float64 for
    float64 inputs). `weight_grad_in_place`: see the module's contract (a no-op unless the
    weight is a leaf that requires grad). `stats_N2`: each row's log-sum-exp and entropy of
    softmax(logits / temperature), known already (the engine sampled from them:
    `train.packing.records.engine_stats`; NaN for a row the loss does not read): the forward
    then computes no logits, only each target's own (a row's logprob and entropy are 0 where
    NaN, and it gets no gradient)."""
    assert hidden_NH.ndim == 2 and weight_VH.ndim == 2 and hidden_NH.shape[1] == weight_VH.shape[1]
    assert targets_N.shape == hidden_NH.shape[:1], "one target per hidden state"
    assert hidden_NH.dtype == weight_VH.dtype, "hidden states and head weight share a dtype"
    assert temperature > 0 and chunk_size >= 1
    in_place = weight_grad_in_place and weight_VH.is_leaf and weight_VH.requires_grad
    return ChunkedLogprobs.apply(
        hidden_NH, weight_VH, targets_N, float(temperature), chunk_size, in_place, stats_N2
    )


class ChunkedLogprobs(torch.autograd.Function):
    """Saves its inputs and each row's logsumexp and entropy; the backward recomputes the logits
    piece by piece. With z = h W^T / T, p = softmax(z) and H = -sum p log p:
        d logp_target / dz = onehot(target) - p
        d H / dz           = -p * (log p + H)
    A trained head's backward walks vocabulary slices over all rows (`_backward_by_vocab`); a
    frozen head's walks row chunks over the whole vocabulary (`_backward_by_rows`)."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH,
        weight_VH,
        targets_N,
        temperature,
        chunk_size,
        in_place=False,
        stats_N2=None,
    ):
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        # the parameter itself (saved_tensors gives an alias whose .grad is not the parameter's)
        ctx.weight_param = weight_VH if in_place else None
        if stats_N2 is not None:
            return _from_stats(ctx, hidden_NH, weight_VH, targets_N, temperature, stats_N2)
        num = hidden_NH.shape[0]
        logprobs_N = torch.empty(num, dtype=_math_dtype(weight_VH), device=hidden_NH.device)
        entropy_N = torch.empty_like(logprobs_N)
        kernels = triton_kernels(hidden_NH.device, weight_VH.dtype)
        # each row's logsumexp and entropy (N floats each) are kept for the backward, whose
        # gradient of the logits is then one elementwise pass, with no reduction over the
        # vocabulary (a vocabulary slice could not reduce over the whole row)
        ctx.lse_N = torch.empty_like(logprobs_N)
        for start in range(0, num, chunk_size):
            end = min(start + chunk_size, num)
            if kernels is not None:
                logprobs_N[start:end], entropy_N[start:end], ctx.lse_N[start:end] = (
                    kernels.row_stats(
                        hidden_NH[start:end] @ weight_VH.t(), targets_N[start:end], temperature
                    )
                )
                continue
            z_CV = _chunk_logits(hidden_NH[start:end], weight_VH, temperature)
            lse_C = torch.logsumexp(z_CV, dim=-1)
            ctx.lse_N[start:end] = lse_C
            logprobs_N[start:end] = z_CV.gather(1, targets_N[start:end, None])[:, 0] - lse_C
            probs_CV = (z_CV - lse_C[:, None]).exp_()
            entropy_N[start:end] = lse_C - probs_CV.mul_(z_CV).sum(-1)  # H = lse - sum p z
        ctx.entropy_N = entropy_N.clone()  # a copy: the caller may change the output in place
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_NH, weight_VH, targets_N = ctx.saved_tensors
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        kernels = triton_kernels(hidden_NH.device, weight_VH.dtype)
        if not needs_weight:
            grad_hidden_NH = None
            if needs_hidden:
                grad_hidden_NH = _backward_by_rows(
                    ctx, kernels, hidden_NH, weight_VH, targets_N, grad_logprobs_N, grad_entropy_N
                )
            return grad_hidden_NH, None, None, None, None, None, None
        # The head-weight gradient, in the weight's own dtype, each vocabulary slice of it
        # written by one product over all rows (float32 inside the matmul, then one rounding).
        # In place: the sum starts from, and is, the parameter's own .grad.
        param = ctx.weight_param
        if param is not None and param.grad is not None:
            grad_weight_VH, fresh = param.grad, False
        else:
            grad_weight_VH, fresh = torch.empty_like(weight_VH), True  # every slice is written
            if param is not None:
                param.grad = grad_weight_VH
        grad_hidden_NH = _backward_by_vocab(
            ctx,
            kernels,
            hidden_NH,
            weight_VH,
            targets_N,
            grad_logprobs_N,
            grad_entropy_N,
            needs_hidden,
            grad_weight_VH,
            fresh,
        )
        if param is not None:
            grad_weight_VH = None  # already in param.grad
        return grad_hidden_NH, grad_weight_VH, None, None, None, None, None


def _from_stats(ctx, hidden_NH, weight_VH, targets_N, temperature, stats_N2):
    """`ChunkedLogprobs.forward` given each row's log-sum-exp and entropy: the logprob is the
    target's logit (rounded to the weights' dtype, as the head's product rounds it) less the
    log-sum-exp; no [rows, vocab] logits. Rows whose statistics are NaN (not read by the loss)
    give 0 and save an infinite log-sum-exp, which the backward's unread rows ignore."""
    math = _math_dtype(weight_VH)
    lse_N = stats_N2[:, 0].to(math)
    known_N = torch.isfinite(lse_N)
    kernels = triton_kernels(hidden_NH.device, weight_VH.dtype)
    if kernels is not None:
        z_N = kernels.target_logits(hidden_NH, weight_VH, targets_N).to(math)
    else:
        target_WH = weight_VH.index_select(0, targets_N)
        z_N = (hidden_NH.to(math) * target_WH.to(math)).sum(-1).to(weight_VH.dtype).to(math)
    logprobs_N = torch.where(known_N, z_N / temperature - lse_N, 0.0)
    entropy_N = torch.where(known_N, stats_N2[:, 1].to(math), 0.0)
    ctx.lse_N = torch.where(known_N, lse_N, float("inf"))
    ctx.entropy_N = entropy_N.clone()
    return logprobs_N, entropy_N


def vocab_slice_width(num_rows: int, vocab: int, chunk_size: int) -> int:
    """Columns of each vocabulary slice in a trained head's backward: the slice's logits
    [num_rows, width] hold about as many elements as one row chunk's [chunk_size, vocab] (no
    more, unless the 128-column floor binds), in multiples of 128 columns, at most `vocab`."""
    width = chunk_size * vocab // max(num_rows, 1) // 128 * 128
    return min(vocab, max(128, width))


def _backward_by_vocab(
    ctx,
    kernels,
    hidden_NH,
    weight_VH,
    targets_N,
    grad_logprobs_N,
    grad_entropy_N,
    needs_hidden,
    grad_weight_VH,
    fresh,
):
    """A trained head's backward, one vocabulary slice [v0, v1) at a time over all N rows: the
    slice's logits, their gradient in place (from the forward's logsumexp and entropy), then
    grad_weight[v0:v1] from one product with K = N (so the [V, H] gradient is written once per
    call, not once per row chunk: see the module's contract) and the slice's share of the hidden
    gradient, summed in float32 over the slices. `fresh`: grad_weight_VH holds no values yet."""
    temperature = ctx.temperature
    num, vocab = hidden_NH.shape[0], weight_VH.shape[0]
    width = vocab_slice_width(num, vocab, ctx.chunk_size)
    grad_hidden_acc_NH = None
    if needs_hidden:  # float32 (float64 for float64), not the hidden states' bf16
        grad_hidden_acc_NH = torch.zeros(
            hidden_NH.shape, dtype=_math_dtype(hidden_NH), device=hidden_NH.device
        )
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        weight_SH = weight_VH[v0:v1]
        if kernels is not None:
            logits_NS = hidden_NH @ weight_SH.t()
            grad_z_NS = kernels.grad_logits(
                logits_NS,
                targets_N,
                ctx.lse_N,
                ctx.entropy_N,
                grad_logprobs_N,
                grad_entropy_N,
                temperature,
                out=logits_NS,
                col_offset=v0,
            )
        else:
            grad_z_NS = _slice_grad_logits(
                _chunk_logits(hidden_NH, weight_SH, temperature),
                targets_N - v0,
                ctx.lse_N,
                ctx.entropy_N,
                grad_logprobs_N,
                grad_entropy_N,
            ).div_(temperature)
        grad_z_NS = grad_z_NS.to(weight_VH.dtype)  # matmuls in the weights' dtype
        grad_weight_VH[v0:v1].addmm_(grad_z_NS.t(), hidden_NH, beta=0 if fresh else 1)
        if needs_hidden:
            _add_product(grad_hidden_acc_NH, grad_z_NS, weight_SH)
    return grad_hidden_acc_NH.to(hidden_NH.dtype) if needs_hidden else None


def _backward_by_rows(
    ctx, kernels, hidden_NH, weight_VH, targets_N, grad_logprobs_N, grad_entropy_N
):
    """A frozen head's backward (the hidden gradient only), one chunk of rows at a time over the
    whole vocabulary: no weight gradient to write, and no float32 [N, H] accumulator."""
    temperature, chunk_size = ctx.temperature, ctx.chunk_size
    grad_hidden_NH = torch.empty_like(hidden_NH)
    for start in range(0, hidden_NH.shape[0], chunk_size):
        end = min(start + chunk_size, hidden_NH.shape[0])
        hidden_CH = hidden_NH[start:end]
        if kernels is not None:
            logits_CV = hidden_CH @ weight_VH.t()
            grad_z_CV = kernels.grad_logits(
                logits_CV,
                targets_N[start:end],
                ctx.lse_N[start:end],
                ctx.entropy_N[start:end],
                grad_logprobs_N[start:end],
                grad_entropy_N[start:end],
                temperature,
                out=logits_CV,
            )
        else:
            grad_z_CV = _chunk_grad_logits(
                _chunk_logits(hidden_CH, weight_VH, temperature),
                targets_N[start:end],
                grad_logprobs_N[start:end],
                grad_entropy_N[start:end],
            ).div_(temperature)
        grad_z_CV = grad_z_CV.to(weight_VH.dtype)  # matmuls in the weights' dtype
        grad_hidden_NH[start:end] = grad_z_CV @ weight_VH
    return grad_hidden_NH


def triton_kernels(device: torch.device, dtype: torch.dtype):
    """The Triton reductions (`logprob_kernels`) for CUDA logits in bf16/fp16/fp32; None
    elsewhere (a CPU, float64, or a torch without Triton), where the in-place eager path runs.
    Measured on the G1 workload (H100): the eager LM head was 1.65 s of a 3.6 s update; the
    same math compiled with dynamic shapes took 2.1-2.6 ms a 512-row chunk (bench/RESULTS.md)."""
    if device.type != "cuda" or dtype == torch.float64:
        return None
    try:
        import reinforge.train.packing.logprob_kernels as logprob_kernels
    except ImportError:  # no Triton (e.g. Windows builds of torch)
        return None
    return logprob_kernels
