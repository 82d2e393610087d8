"""The "cuda" attention backend: Triton kernels over the paged KV pool, and packed prefill.

Decode is one query token per sequence. `paged_decode` runs one program per (sequence, KV head,
split): the program loads all query heads of its GQA group at once (padded to 16 rows for the
tensor cores), walks its share of the sequence's pages reading each K/V page exactly once, and
keeps an online softmax in float32. With more than one split, each split writes its partial output
and log-sum-exp and a second kernel combines them; the split count grows as the batch shrinks, so
small batches still fill the GPU. A split covers whole pages of `cdiv(pages, splits)`, computed
per sequence from its context length inside the kernel: one launch configuration serves any
lengths, which is what CUDA graphs need.

`rope_write_kv` (`triton_ops`) applies RoPE to q and k in place and writes the new K/V into the
pool by slot (slot -1: skip), one launch per layer. A decode step with heads up to 64 wide
(`rope_fits`) folds it into the attention kernel (`paged_decode_rope`, the backend's
`decode_rope`): each program rotates its q heads in registers, and the program whose split holds
the sequence's last position rotates the new key, writes the new K/V to the pool for the later
steps and takes that key into its softmax from registers, so no kernel reads the pool before the
write is done. Prefill keeps the two.

Prefill goes through `engine.varlen.prefill_varlen` (torch's packed flash kernel where it can).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from reinforge.engine.attention import AttentionBackend, AttentionMetadata, write_kv_index_copy
from reinforge.engine.triton_ops import rope_write_kv
from reinforge.engine.varlen import prefill_varlen

# Tunables of the decode kernel (the bench may override them): tokens per inner iteration,
# warps per program, software-pipelining depth, and how many programs per SM the split count aims
# for.
# Measured on an H200 (graph replay, bf16): tile 64 / 4 warps / 3 stages is within 3% of the best
# of 15 configurations at both the 0.5B (25 us, 2.0 TB/s) and the 7B (207 us, 3.9 TB/s) decode
# shapes; splitting the KV of 256 x 2 heads in two was 15% slower (bench/RESULTS.md).
DECODE_CONFIG = {"tile": 64, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2}
MAX_SPLITS = 32


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, H, D]
    k_ptr,  # [pages, block_size, K, D]
    v_ptr,
    tables_ptr,  # [B, max_pages] int
    context_lens_ptr,  # [B] int
    out_ptr,  # [B, H, D]
    part_out_ptr,  # [B, H, num_splits, D] float32
    part_lse_ptr,  # [B, H, num_splits] float32
    scale_log2,
    num_splits,  # a runtime value: one compiled kernel serves every split count
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    # ROPE only: this step's q, k, v before RoPE (q_ptr then holds them too), the rotation's
    # cos / sin rows [B, D] and the new token's flat slot (-1: not written)
    k_new_ptr,
    v_new_ptr,
    cos_ptr,
    sin_ptr,
    slots_ptr,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cb,
    stride_sb,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for `_combine_splits_kernel`
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models: no tf32 rounding
    ROPE: tl.constexpr,  # rotate q and the new k here, write the new K/V (`paged_decode_rope`)
    HALF: tl.constexpr,  # HEAD_DIM // 2
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    num_pages = (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    pages_per_split = (num_pages + num_splits - 1) // num_splits
    tok_start = split * pages_per_split * BLOCK_SIZE
    tok_end = tl.minimum(tok_start + pages_per_split * BLOCK_SIZE, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    if ROPE:
        # RoPE (transformers' rotate-half: x * cos + [-x2, x1] * sin) in registers, rounded to
        # q's dtype as `rope_write_kv` rounds it. The new token's K/V enter the softmax after
        # the pool's keys (in the split that holds the last position).
        partner = (offs_d + HALF) % HEAD_DIM
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * stride_cb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_sb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q = q.to(tl.float32) * cos[None, :] + (sign * sin)[None, :] * q_partner
        q = q.to(q_ptr.dtype.element_ty)
        last = context_len - 1
        owner = (last >= tok_start) & (last < tok_end)
        tok_end = tl.minimum(tok_end, last)  # the pool's keys: all but the new one
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = tables_ptr + b * stride_tb
    for start in range(tok_start, tok_end, TILE):
        tok = start + offs_t
        valid = tok < tok_end
        page = tl.load(table_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_page = tok % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr
            + (page * stride_kp + in_page * stride_kt + kv_head * stride_kh)[:, None]
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        v = tl.load(
            v_ptr
            + (page * stride_vp + in_page * stride_vt + kv_head * stride_vh)[:, None]
            + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if ROPE:  # (loaded here, not before the loop: nothing more stays live through it)
        partner = (offs_d + HALF) % HEAD_DIM
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * stride_cb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * stride_sb + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        k_row = k_new_ptr + b * stride_knb + kv_head * stride_knh
        k_new = tl.load(k_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        k_partner = tl.load(k_row + partner, mask=d_mask, other=0.0).to(tl.float32)
        k_new = (k_new * cos + sign * sin * k_partner).to(k_ptr.dtype.element_ty)
        v_row = v_new_ptr + b * stride_vnb + kv_head * stride_vnh
        v_new = tl.load(v_row + offs_d, mask=d_mask, other=0.0).to(v_ptr.dtype.element_ty)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        if owner & (slot >= 0):  # for the later steps
            page = slot // BLOCK_SIZE
            in_page = slot % BLOCK_SIZE
            k_dst = k_ptr + page * stride_kp + in_page * stride_kt + kv_head * stride_kh
            v_dst = v_ptr + page * stride_vp + in_page * stride_vt + kv_head * stride_vh
            tl.store(k_dst + offs_d, k_new, mask=d_mask)
            tl.store(v_dst + offs_d, v_new, mask=d_mask)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale_log2
        # only the owner takes it (another split may hold no key at all: m = -inf)
        m_new = tl.where(owner, tl.maximum(m, s_new), m)
        alpha = tl.where(owner, tl.exp2(m - m_new), 1.0)
        p_new = tl.where(owner, tl.exp2(s_new - m_new), 0.0)
        l = l * alpha + p_new  # noqa: E741
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        o = acc / l[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        has_keys = l > 0.0  # a split past the end of a short sequence saw no key
        safe_l = tl.where(has_keys, l, 1.0)
        lse = tl.where(has_keys, m + tl.log2(safe_l), float("-inf"))
        part = (b * NUM_HEADS + heads) * num_splits + split
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            acc / safe_l[:, None],
            mask=out_mask,
        )


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,  # [B, H, num_splits, D] float32
    part_lse_ptr,  # [B, H, num_splits]
    out_ptr,  # [B, H, D]
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    s_mask = offs_s < num_splits
    base = (b * NUM_HEADS + h) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds keys, so the max is finite
    weight = weight / tl.sum(weight, 0)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_decode_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) so the grid has about `programs_per_sm` programs per SM.
    Depends on the batch size alone, so a CUDA graph captured per batch size fixes it."""
    if device.type != "cuda":
        return 1 if batch_size * num_kv_heads >= 8 else 4  # interpreter tests: exercise both
    target = DECODE_CONFIG["programs_per_sm"] * _num_sms(device.index or 0)
    splits = target // max(1, batch_size * num_kv_heads)
    return max(1, min(MAX_SPLITS, splits))


def paged_decode(
    q_BHD: torch.Tensor,
    k_cache: torch.Tensor,  # [pages, block_size, K, D]
    v_cache: torch.Tensor,
    block_tables_BP: torch.Tensor,
    context_lens_B: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its pages; returns [B, H, D] in q's dtype."""
    return _decode(q_BHD, k_cache, v_cache, block_tables_BP, context_lens_B, scale, num_splits)


def rope_fits(head_dim: int) -> bool:
    """Heads `paged_decode_rope` takes: even (rotate-half RoPE) and at most 64 wide. Measured on
    an H200 (graph replay, bench/RESULTS.md session 24): at E1's shape (256 x 14/2 heads of 64,
    384 keys) one kernel 26.0-26.1 us against 28.1-28.5 for the two; at E2's (512 x 28/4 heads of
    128, 768 keys) 235-241 against 212-216, so heads of 128 keep the two kernels."""
    return head_dim % 2 == 0 and head_dim <= 64


def paged_decode_rope(
    q_BHD: torch.Tensor,  # before RoPE
    k_BKD: torch.Tensor,  # this step's keys, before RoPE
    v_BKD: torch.Tensor,
    cos_BD: torch.Tensor,
    sin_BD: torch.Tensor,
    k_cache: torch.Tensor,  # [pages, block_size, K, D]
    v_cache: torch.Tensor,
    block_tables_BP: torch.Tensor,
    context_lens_B: torch.Tensor,
    slots_B: torch.Tensor,  # each new token's flat pool slot (-1: not written)
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`rope_write_kv` and `paged_decode` in one kernel: RoPE on q and the new k in registers,
    the new K/V written to the pool, attention over the pool's keys plus the new one (one launch
    a layer fewer; q and k are left as they came). Heads `rope_fits` does not take run the two
    kernels."""
    D = q_BHD.shape[-1]
    if not rope_fits(D):
        rope_write_kv(q_BHD, k_BKD, v_BKD, cos_BD, sin_BD, k_cache, v_cache, slots_B)
        return paged_decode(
            q_BHD, k_cache, v_cache, block_tables_BP, context_lens_B, scale, num_splits
        )
    assert k_BKD.stride(-1) == v_BKD.stride(-1) == cos_BD.stride(-1) == sin_BD.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    rope = (k_BKD, v_BKD, cos_BD, sin_BD, slots_B)
    return _decode(
        q_BHD, k_cache, v_cache, block_tables_BP, context_lens_B, scale, num_splits, rope
    )


def _decode(q_BHD, k_cache, v_cache, block_tables_BP, context_lens_B, scale, num_splits, rope=None):
    B, H, D = q_BHD.shape
    _, block_size, K, Dk = k_cache.shape
    assert Dk == D and H % K == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert q_BHD.stride(-1) == 1 and block_tables_BP.stride(-1) == 1
    group = H // K
    if num_splits is None:
        num_splits = num_decode_splits(B, K, q_BHD.device)
    assert 1 <= num_splits <= MAX_SPLITS
    out = torch.empty((B, H, D), dtype=q_BHD.dtype, device=q_BHD.device)
    if num_splits > 1:
        part_out = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q_BHD.device)
        part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q_BHD.device)
    else:
        part_out = part_lse = out  # unused
    if rope is None:  # the ROPE arguments are not read: any tensor, stride 0
        k_new = v_new = cos = sin = slots = context_lens_B
        rope_strides = (0,) * 6
    else:
        k_new, v_new, cos, sin, slots = rope
        rope_strides = (
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            cos.stride(0), sin.stride(0),
        )  # fmt: skip
    cfg = DECODE_CONFIG
    _paged_decode_kernel[(B, K, num_splits)](
        q_BHD,
        k_cache,
        v_cache,
        block_tables_BP,
        context_lens_B,
        out,
        part_out,
        part_lse,
        scale * math.log2(math.e),
        num_splits,
        q_BHD.stride(0),
        q_BHD.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables_BP.stride(0),
        out.stride(0),
        out.stride(1),
        k_new,
        v_new,
        cos,
        sin,
        slots,
        *rope_strides,
        NUM_HEADS=H,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=D,
        DIM_PAD=max(16, triton.next_power_of_2(D)),
        BLOCK_SIZE=block_size,
        TILE=max(16, cfg["tile"]),
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q_BHD.dtype == torch.float32 else "tf32",
        ROPE=rope is not None,
        HALF=D // 2,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _combine_splits_kernel[(B, H)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=H,
            HEAD_DIM=D,
            DIM_PAD=max(16, triton.next_power_of_2(D)),
            SPLITS_PAD=triton.next_power_of_2(MAX_SPLITS),
            num_warps=1 if D <= 64 else 2,
        )
    return out


def decode_triton(q_BHD, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    return paged_decode(q_BHD, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)


def decode_rope_triton(q, k, v, cos, sin, k_cache, v_cache, meta: AttentionMetadata, scale):
    return paged_decode_rope(
        q, k, v, cos, sin, k_cache, v_cache, meta.block_tables, meta.context_lens,
        meta.slot_mapping, scale,
    )  # fmt: skip


TRITON_BACKEND = AttentionBackend(
    name="triton-paged",
    write_kv=write_kv_index_copy,
    prefill=prefill_varlen,
    decode=decode_triton,
    rope_write_kv=rope_write_kv,
    decode_rope=decode_rope_triton,
)
