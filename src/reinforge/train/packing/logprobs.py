"""Chunked LM head: chosen-token logprobs and entropies without the full [tokens, vocab] logits.

Contract
- `chunked_logprobs(hidden_NH, weight_VH, targets_N, temperature, chunk_size)` returns
  `logprobs_N` and `entropy_N` (float32) for N token positions, equal to
  `log_softmax((hidden @ weight.T).float() / temperature)` at the targets and to
  `-(p * log p).sum(-1)` of the same distribution.
- Memory: logits exist for one chunk of `chunk_size` rows at a time, in the forward and in the
  backward, which recomputes each chunk's logits from the saved inputs. The autograd graph holds
  only the inputs (hidden, weight, targets) and, on CUDA, each position's logsumexp and entropy
  (N floats): never [N, V]. Peak extra memory on CUDA is one chunk's logits in the weight dtype
  (`chunk_size * V * 2` bytes in bf16: the Triton kernels of `logprob_kernels` reduce them in
  place and write the backward's gradient over them); the CPU path adds two float32 [c, V]
  buffers. When the head weight is trained, add a [V, H] gradient accumulator in the weight's
  dtype (each chunk's product accumulates in float32 inside the matmul, then joins the sum).
- `weight_grad_in_place=True` (the trainer's single-process path) sums the head-weight gradient
  straight into the weight's `.grad` (a leaf parameter) and hands autograd none: no [V, H]
  accumulator. Measured on G1 (0.5B shape, tied embeddings, `torch.cuda.memory` history of one
  update): autograd holds a tied weight's head gradient in its input buffer until the embedding's
  backward, at the very end, so the accumulator (0.25 GiB) sat beside every layer's backward,
  where the update's peak is. The result is the same `.grad` as `.backward()` gives; code that
  asks autograd for gradients (`torch.autograd.grad`) must leave it off.
- Precision: the matmuls run in the weights' dtype (bf16 on a GPU); softmax, logsumexp,
  entropy and the logits' gradient run in float32.
- Gradients flow to both outputs (an entropy bonus trains through `entropy_N`) and to hidden
  states and the head weight; a frozen head (LoRA) costs no weight-gradient matmul.

`final_hidden_states(model, ...)` runs a HF causal LM's decoder (`model.get_decoder()`, which
includes any PEFT adapter layers) and stops before its LM head, so the model never builds logits;
`lm_head_weight(model)` is the output embedding (the tied input embedding when tied). Together
they give the packed trainer's logprobs (`train.packing.forward`); tests check them against full logits on
padded batches (`tests/padded_reference.py`).
"""

from __future__ import annotations

import torch

# Rows per chunk. Measured on G1 (0.5B shape, vocabulary 151,936, H100, compiled layers, a
# float32 head-gradient accumulator): 1,024 rows gave a 2.15 s training phase and a 5.9 GiB
# peak; 256 rows 2.72 s and 5.5 GiB (each chunk reads the whole head weight again, three times).
DEFAULT_CHUNK_SIZE = 512


def chunked_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    weight_grad_in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target and the entropy at each position, [N] float32 each (float64 for
    float64 inputs). `weight_grad_in_place`: see the module's contract (a no-op unless the
    weight is a leaf that requires grad)."""
    assert hidden_NH.ndim == 2 and weight_VH.ndim == 2 and hidden_NH.shape[1] == weight_VH.shape[1]
    assert targets_N.shape == hidden_NH.shape[:1], "one target per hidden state"
    assert hidden_NH.dtype == weight_VH.dtype, "hidden states and head weight share a dtype"
    assert temperature > 0 and chunk_size >= 1
    in_place = weight_grad_in_place and weight_VH.is_leaf and weight_VH.requires_grad
    return ChunkedLogprobs.apply(
        hidden_NH, weight_VH, targets_N, float(temperature), chunk_size, in_place
    )


class ChunkedLogprobs(torch.autograd.Function):
    """Saves only its inputs; each backward chunk recomputes its logits. With z = h W^T / T,
    p = softmax(z) and H = -sum p log p:
        d logp_target / dz = onehot(target) - p
        d H / dz           = -p * (log p + H)
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature, chunk_size, in_place=False):
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        # the parameter itself (saved_tensors gives an alias whose .grad is not the parameter's)
        ctx.weight_param = weight_VH if in_place else None
        num = hidden_NH.shape[0]
        logprobs_N = torch.empty(num, dtype=_math_dtype(weight_VH), device=hidden_NH.device)
        entropy_N = torch.empty_like(logprobs_N)
        kernels = triton_kernels(hidden_NH.device, weight_VH.dtype)
        # the Triton path keeps each row's logsumexp and entropy for the backward (N floats),
        # which then makes one elementwise pass per chunk instead of two reductions and a pass
        ctx.lse_N = torch.empty_like(logprobs_N) if kernels is not None else None
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
            logprobs_N[start:end] = z_CV.gather(1, targets_N[start:end, None])[:, 0] - lse_C
            probs_CV = (z_CV - lse_C[:, None]).exp_()
            entropy_N[start:end] = lse_C - probs_CV.mul_(z_CV).sum(-1)  # H = lse - sum p z
        ctx.entropy_N = entropy_N.clone() if kernels is not None else None
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N, grad_entropy_N):
        hidden_NH, weight_VH, targets_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        grad_hidden_NH = torch.empty_like(hidden_NH) if needs_hidden else None
        # The head-weight gradient: summed over chunks in the weight's own dtype. Each chunk's
        # product accumulates in float32 inside the matmul (addmm's beta=1 reads the running
        # sum), so a bf16 weight gets one bf16 rounding per chunk, as the other parameters get
        # per micro-batch; a float32 [V, H] accumulator would cost 0.5 GiB more at Qwen's V.
        # In place: the sum starts from, and is, the parameter's own .grad.
        grad_weight_VH = None
        param = ctx.weight_param
        if needs_weight and param is not None:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad_weight_VH = param.grad
        elif needs_weight:
            grad_weight_VH = torch.zeros_like(weight_VH)
        kernels = triton_kernels(hidden_NH.device, weight_VH.dtype)
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = min(start + chunk_size, hidden_NH.shape[0])
            hidden_CH = hidden_NH[start:end]
            if ctx.lse_N is not None:
                assert kernels is not None
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
            if needs_hidden:
                grad_hidden_NH[start:end] = grad_z_CV @ weight_VH
            if needs_weight:
                grad_weight_VH.addmm_(grad_z_CV.t(), hidden_CH)
        if param is not None:
            grad_weight_VH = None  # already in param.grad
        return grad_hidden_NH, grad_weight_VH, None, None, None, None


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


def _math_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 weights; float64 stays float64 (exact gradient checks)."""
    return torch.promote_types(weight.dtype, torch.float32)


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


def _row_dot(a_CV: torch.Tensor, b_CV: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) as a batched matmul: no [C, V] temporary. (Under TF32 matmuls this H is
    good to about 1e-3 relative; it only scales the entropy term of the gradient.)"""
    return torch.bmm(a_CV[:, None, :], b_CV[:, :, None])[:, 0, 0]


# ---------------------------------------------------------------------------------------------
# HF causal LMs without their logits


def lm_head_weight(model) -> torch.Tensor:
    """The LM head weight [V, H] (the input embedding when the model ties them)."""
    head = model.get_output_embeddings()
    assert getattr(head, "bias", None) is None, "LM heads with a bias are not supported"
    assert getattr(model.config, "final_logit_softcapping", None) is None, "no logit softcapping"
    return head.weight


def final_hidden_states(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm), [B, T, H]. `kwargs` reach the
    attention functions (e.g. `cu_seq_lens_q` for packed rows)."""
    decoder = model.get_decoder()
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    return out.last_hidden_state
