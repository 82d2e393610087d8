"""Fused small ops of the decode step on CUDA (Triton).

Each op reproduces transformers' rounding (bf16 residual add, RMSNorm normalised in float32 then
scaled in the model dtype, SiLU rounded before the product), so it changes launch counts, not
numbers. On a 0.5B model at batch 256, the unfused norm, residual and activation cost about 20
tiny kernels per layer: more time than the matrix products.

The on-device samplers: `triton_sampling`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr,  # [T, E], updated in place to hidden + delta
    delta_ptr,  # [T, E] or unused
    weight_ptr,  # [E]
    out_ptr,  # [T, E]
    stride_h,
    stride_d,
    stride_o,
    eps,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    mask = offs < E
    h = tl.load(hidden_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(hidden_ptr.dtype.element_ty)
        tl.store(hidden_ptr + row * stride_h + offs, h, mask=mask)
    x = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / E + eps)
    y = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    hidden_TE: torch.Tensor, delta_TE: torch.Tensor | None, weight_E: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(hidden + delta), hidden + delta); `hidden` is updated in place."""
    T, E = hidden_TE.shape
    assert hidden_TE.stride(-1) == 1 and weight_E.is_contiguous()
    assert weight_E.dtype == hidden_TE.dtype, "transformers' RMSNorm scales in the model dtype"
    out = torch.empty_like(hidden_TE)
    if T == 0:
        return out, hidden_TE
    if delta_TE is not None:
        assert delta_TE.shape == hidden_TE.shape and delta_TE.stride(-1) == 1
    E_PAD = triton.next_power_of_2(E)
    _add_rms_norm_kernel[(T,)](
        hidden_TE,
        delta_TE if delta_TE is not None else hidden_TE,
        weight_E,
        out,
        hidden_TE.stride(0),
        delta_TE.stride(0) if delta_TE is not None else 0,
        out.stride(0),
        eps,
        E=E,
        E_PAD=E_PAD,
        HAS_DELTA=delta_TE is not None,
        num_warps=min(16, max(1, E_PAD // 256)),
    )
    return out, hidden_TE


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over rows [T, I] that may be strided (the halves of one fused gate/up
    product, `engine.layout`); the result is contiguous."""
    assert gate.shape == up.shape and gate.dim() == 2
    assert gate.stride(-1) == 1 and up.stride(-1) == 1
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    if rows and n:
        BLOCK = 2048
        grid = (rows, triton.cdiv(n, BLOCK))
        _silu_mul_kernel[grid](
            gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=BLOCK, num_warps=4
        )
    return out
