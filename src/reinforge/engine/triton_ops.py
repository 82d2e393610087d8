"""Fused small ops of the decode step on CUDA (Triton).

Each op reproduces transformers' rounding (bf16 residual add, RMSNorm normalised in float32 then
scaled in the model dtype, SiLU rounded before the product), so it changes launch counts, not
numbers. On a 0.5B model at batch 256, the unfused norm, residual and activation cost about 20
tiny kernels per layer: more time than the matrix products.

`rope_write_kv`: RoPE on q and k and the new K/V written to the paged pool, one launch a layer
(a decode step with heads up to 64 wide runs it inside the attention kernel instead:
`triton_attention.paged_decode_rope`).

The on-device samplers: `triton_sampling`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    hidden_ptr,  # [T, E]
    delta_ptr,  # [T, E] or unused
    weight_ptr,  # [E]
    out_ptr,  # [T, E]
    residual_ptr,  # [T, E]: hidden + delta (hidden itself: in place)
    stride_h,
    stride_d,
    stride_o,
    stride_r,
    eps,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    STORE: tl.constexpr,  # write the residual (a delta, or a separate residual buffer)
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    mask = offs < E
    h = tl.load(hidden_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(hidden_ptr.dtype.element_ty)
    if STORE:
        tl.store(residual_ptr + row * stride_r + offs, h, mask=mask)
    x = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / E + eps)
    y = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    hidden_TE: torch.Tensor,
    delta_TE: torch.Tensor | None,
    weight_E: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(hidden + delta), hidden + delta); the sum is written to `residual_out` (rows
    that may be strided), else into `hidden` in place."""
    T, E = hidden_TE.shape
    residual = hidden_TE if residual_out is None else residual_out
    assert residual.shape == hidden_TE.shape and residual.stride(-1) == 1
    assert hidden_TE.stride(-1) == 1 and weight_E.is_contiguous()
    assert weight_E.dtype == hidden_TE.dtype, "transformers' RMSNorm scales in the model dtype"
    out = torch.empty_like(hidden_TE)
    if T == 0:
        return out, residual
    if delta_TE is not None:
        assert delta_TE.shape == hidden_TE.shape and delta_TE.stride(-1) == 1
    E_PAD = triton.next_power_of_2(E)
    _add_rms_norm_kernel[(T,)](
        hidden_TE,
        delta_TE if delta_TE is not None else hidden_TE,
        weight_E,
        out,
        residual,
        hidden_TE.stride(0),
        delta_TE.stride(0) if delta_TE is not None else 0,
        out.stride(0),
        residual.stride(0),
        eps,
        E=E,
        E_PAD=E_PAD,
        HAS_DELTA=delta_TE is not None,
        STORE=delta_TE is not None or residual_out is not None,
        num_warps=min(16, max(1, E_PAD // 256)),
    )
    return out, residual


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


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [T, H, D], rotated in place
    k_ptr,  # [T, K, D], rotated in place
    v_ptr,  # [T, K, D]
    cos_ptr,  # [T, D]
    sin_ptr,
    slots_ptr,  # [T] flat pool slot, -1: do not write
    k_cache_ptr,  # [pages * block_size, K, D] (flat slots)
    v_cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    d_mask = offs < HALF
    cos1 = tl.load(cos_ptr + t * stride_ct + offs, mask=d_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t * stride_ct + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t * stride_st + offs, mask=d_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t * stride_st + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)

    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < NUM_HEADS)[:, None] & d_mask[None, :]
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs[None, :]
    x1 = tl.load(q_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_row + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_row, (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(q_row + HALF, (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty), mask=mask)

    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & d_mask[None, :]
    k_row = k_ptr + t * stride_kt + kv_heads[:, None] * stride_kh + offs[None, :]
    x1 = tl.load(k_row, mask=kv_mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    k1 = (x1 * cos1 - x2 * sin1).to(k_ptr.dtype.element_ty)
    k2 = (x2 * cos2 + x1 * sin2).to(k_ptr.dtype.element_ty)
    tl.store(k_row, k1, mask=kv_mask)
    tl.store(k_row + HALF, k2, mask=kv_mask)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    write_mask = kv_mask & (slot >= 0)
    cache_off = slot * stride_cache_slot + kv_heads[:, None] * stride_cache_head + offs[None, :]
    tl.store(k_cache_ptr + cache_off, k1.to(k_cache_ptr.dtype.element_ty), mask=write_mask)
    tl.store(k_cache_ptr + cache_off + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=write_mask)
    v_row = v_ptr + t * stride_vt + kv_heads[:, None] * stride_vh + offs[None, :]
    v1 = tl.load(v_row, mask=kv_mask, other=0.0)
    v2 = tl.load(v_row + HALF, mask=kv_mask, other=0.0)
    tl.store(v_cache_ptr + cache_off, v1.to(v_cache_ptr.dtype.element_ty), mask=write_mask)
    tl.store(v_cache_ptr + cache_off + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=write_mask)


def rope_write_kv(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    cos_TD: torch.Tensor,
    sin_TD: torch.Tensor,
    k_cache: torch.Tensor,  # [pages, block_size, K, D]
    v_cache: torch.Tensor,
    slot_mapping_T: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (transformers' rotate-half convention) on q and k in place, then K/V into the pool."""
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    assert D % 2 == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q_THD.stride(-1) == k_TKD.stride(-1) == v_TKD.stride(-1) == 1
    assert cos_TD.stride(-1) == sin_TD.stride(-1) == 1
    if T == 0:
        return q_THD, k_TKD
    k_flat = k_cache.view(-1, K, D)
    v_flat = v_cache.view(-1, K, D)
    _rope_write_kv_kernel[(T,)](
        q_THD,
        k_TKD,
        v_TKD,
        cos_TD,
        sin_TD,
        slot_mapping_T,
        k_flat,
        v_flat,
        q_THD.stride(0),
        q_THD.stride(1),
        k_TKD.stride(0),
        k_TKD.stride(1),
        v_TKD.stride(0),
        v_TKD.stride(1),
        cos_TD.stride(0),
        sin_TD.stride(0),
        k_flat.stride(0),
        k_flat.stride(1),
        NUM_HEADS=H,
        NUM_KV_HEADS=K,
        HEADS_PAD=triton.next_power_of_2(H),
        KV_HEADS_PAD=triton.next_power_of_2(K),
        HALF=D // 2,
        HALF_PAD=triton.next_power_of_2(D // 2),
        num_warps=2 if H * D <= 2048 else 4,
    )
    return q_THD, k_TKD


# CTAs of the host-rows gather: each waits on the bus most of the time, so few (each with several
# rows in flight) reach the bus's bandwidth while leaving the SMs to the compute beside it
GATHER_CTAS = int(os.environ.get("REINFORGE_GATHER_CTAS", "32"))
GATHER_ROWS = 4  # rows a CTA reads at once


@triton.jit
def _gather_host_rows_kernel(
    table_ptr,  # [chunks] int64: each chunk's address (pinned host memory, mapped)
    rows_ptr,  # [L] int64: a global row per output row
    out_ptr,  # [L, E]
    L,
    chunk_rows,
    row_stride,  # elements of one row: layers x E
    layer_offset,  # elements before this layer within a row
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    cols = tl.arange(0, E_PAD)
    col_mask = cols < E
    for start in range(tl.program_id(0) * ROWS, L, tl.num_programs(0) * ROWS):
        i = start + tl.arange(0, ROWS)
        row_mask = i < L
        row = tl.load(rows_ptr + i, mask=row_mask, other=0)
        chunk = row // chunk_rows
        base = tl.load(table_ptr + chunk, mask=row_mask, other=0)
        offset = (row - chunk * chunk_rows) * row_stride + layer_offset
        src = (base + offset * out_ptr.dtype.element_ty.primitive_bitwidth // 8).to(
            tl.pointer_type(out_ptr.dtype.element_ty)
        )
        mask = row_mask[:, None] & col_mask[None, :]
        values = tl.load(src[:, None] + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + i.to(tl.int64)[:, None] * E + cols[None, :], values, mask=mask)


def gather_host_rows(
    table: torch.Tensor,
    rows_L: torch.Tensor,
    chunk_rows: int,
    row_shape: tuple[int, int],
    layer: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[i] = the `layer` slice of global row rows_L[i] of a chunked host arena
    ([chunk_rows, layers, E] per chunk, addresses in `table`), read by the device over the bus
    (pinned memory is mapped into the device's address space) by `GATHER_CTAS` CTAs."""
    L = rows_L.shape[0]
    num_layers, E = row_shape
    assert out.shape == (L, E) and out.is_contiguous() and rows_L.dtype == torch.int64
    if L == 0:
        return out
    grid = (max(1, min(GATHER_CTAS, triton.cdiv(L, GATHER_ROWS))),)
    _gather_host_rows_kernel[grid](
        table,
        rows_L,
        out,
        L,
        chunk_rows,
        num_layers * E,
        layer * E,
        E=E,
        E_PAD=triton.next_power_of_2(E),
        ROWS=GATHER_ROWS,
        num_warps=4,
    )
    return out


@triton.jit
def _row_slots_kernel(
    rows_ptr, tables_ptr, n, row_stride, table_stride, block_size,
    POSITIONS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    position = tl.load(rows_ptr + POSITIONS * row_stride + offs, mask=mask, other=0)
    slot = tl.load(rows_ptr + SLOTS * row_stride + offs, mask=mask, other=-1)
    live = mask & (slot >= 0)
    page = tl.load(tables_ptr + offs * table_stride + position // block_size, mask=live, other=0)
    new = tl.where(slot >= 0, page.to(tl.int64) * block_size + position % block_size, slot)
    tl.store(rows_ptr + SLOTS * row_stride + offs, new, mask=mask)


def row_slots(rows: torch.Tensor, tables: torch.Tensor, n: int, block_size: int, fields) -> None:
    """In place, for the first `n` rows of the decode graphs' inputs (`graph_rows`: [fields,
    rows] int64): each live row's KV slot from its position and its page table ([rows, pages]
    int32); a padding row's (-1) is kept. One kernel where torch took eight."""
    positions, slots = fields
    assert rows.dtype == torch.int64 and rows.stride(1) == 1 and tables.stride(1) == 1
    BLOCK = 256
    _row_slots_kernel[(triton.cdiv(n, BLOCK),)](
        rows, tables, n, rows.stride(0), tables.stride(0), block_size,
        POSITIONS=positions, SLOTS=slots, BLOCK=BLOCK, num_warps=1,
    )  # fmt: skip


@triton.jit
def _advance_rows_kernel(
    rows_ptr, ids_ptr, n, row_stride,
    IDS: tl.constexpr, SLOTS: tl.constexpr, POSITIONS: tl.constexpr,
    CONTEXT_LENS: tl.constexpr, OUTPUT_POSITIONS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    slot = tl.load(rows_ptr + SLOTS * row_stride + offs, mask=mask, other=-1)
    one = (slot >= 0).to(tl.int64)
    tl.store(rows_ptr + IDS * row_stride + offs, tl.load(ids_ptr + offs, mask=mask), mask=mask)
    position = tl.load(rows_ptr + POSITIONS * row_stride + offs, mask=mask, other=0)
    tl.store(rows_ptr + POSITIONS * row_stride + offs, position + one, mask=mask)
    context = tl.load(rows_ptr + CONTEXT_LENS * row_stride + offs, mask=mask, other=0)
    tl.store(rows_ptr + CONTEXT_LENS * row_stride + offs, context + one, mask=mask)
    output = tl.load(rows_ptr + OUTPUT_POSITIONS * row_stride + offs, mask=mask, other=0)
    tl.store(rows_ptr + OUTPUT_POSITIONS * row_stride + offs, output + one, mask=mask)


def advance_rows_on_device(rows: torch.Tensor, ids: torch.Tensor, n: int, fields) -> None:
    """In place, for the first `n` rows: the sampled `ids` in as the next inputs, and each live
    row's position, context length and output position one on (padding rows, slot -1, stay).
    `fields`: (IDS, SLOTS, POSITIONS, CONTEXT_LENS, OUTPUT_POSITIONS). One kernel."""
    ids_f, slots_f, positions_f, context_f, outputs_f = fields
    assert rows.dtype == torch.int64 and rows.stride(1) == 1 and ids.is_contiguous()
    BLOCK = 256
    _advance_rows_kernel[(triton.cdiv(n, BLOCK),)](
        rows, ids, n, rows.stride(0),
        IDS=ids_f, SLOTS=slots_f, POSITIONS=positions_f, CONTEXT_LENS=context_f,
        OUTPUT_POSITIONS=outputs_f, BLOCK=BLOCK, num_warps=1,
    )  # fmt: skip
