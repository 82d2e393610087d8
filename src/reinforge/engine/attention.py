"""Attention over the paged KV pool, one backend per device type.

A backend writes the step's new K/V into the pool by slot and attends: prefill (several query
tokens per sequence, causal, packed back to back) and decode (one query token per sequence).
The reference backend gathers each sequence's pages and calls torch SDPA with grouped-query
heads. The GPU path (`triton_attention`: a Triton paged decode kernel reading each page once per
KV head, a fused RoPE + K/V write, packed varlen prefill) builds on this module; `attention_select`
picks between them and imports it only the first time a CUDA model asks for a backend, so CPU-only
installs never import Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the pool; tensors on the model's device."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] flat pool slot of each computed token's K/V
    block_tables: torch.Tensor  # [B, max_pages] physical pages of each sequence, 0-padded
    context_lens: torch.Tensor  # [B] tokens each sequence attends to, this step's included
    query_lens: list[int]  # tokens computed per sequence (host side: used to split)
    context_lens_host: list[int]
    cu_seqlens: torch.Tensor | None = None  # [B + 1] int32 prefix sums of query_lens (prefill)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    prefill: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    # (q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> (q, k): RoPE and the K/V write in one
    # pass; when None the model code applies RoPE itself and calls `write_kv`
    rope_write_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # (q, k, v, cos, sin, k_cache, v_cache, meta, scale) -> attention output: a decode step's
    # RoPE, K/V write and attention in one pass; when None, decode goes through the two above
    decode_rope: Callable[..., torch.Tensor] | None = None


def write_kv_index_copy(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_TKD, v_TKD, slot_mapping_T: torch.Tensor
) -> None:
    """Caches are [pages, block_size, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping_T, k_TKD)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping_T, v_TKD)


def gather_pages(cache: torch.Tensor, block_tables_BP: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, max_pages * block_size, head_dim] view of each sequence's pages in order.
    One `index_select` over the flat page list: on CPU it copies at about twice the speed of
    indexing with the 2-D table."""
    B, P = block_tables_BP.shape
    _, S, K, D = cache.shape
    pages = cache.index_select(0, block_tables_BP.reshape(-1))  # [B * P, block_size, K, D]
    return pages.view(B, P * S, K, D).transpose(1, 2)


def prefill_sdpa(
    q_THD, k_TKD, v_TKD, k_cache, v_cache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context: a sequence with
    nothing cached attends to its fresh K/V alone; those with a cached prefix (a continued or
    forked sequence) attend over their pages, all of them in one padded call."""
    out_THD = torch.empty_like(q_THD)
    starts = [0]
    for num_q in meta.query_lens:
        starts.append(starts[-1] + num_q)
    cached = []
    for i, (num_q, num_ctx) in enumerate(zip(meta.query_lens, meta.context_lens_host)):
        if num_ctx != num_q:
            cached.append(i)
            continue
        start = starts[i]
        q = q_THD[start : start + num_q].transpose(0, 1)[None]  # [1, H, q, D]
        k = k_TKD[start : start + num_q].transpose(0, 1)[None]
        v = v_TKD[start : start + num_q].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out_THD[start : start + num_q] = o[0].transpose(0, 1)
    if cached:
        _prefill_over_pages(q_THD, out_THD, k_cache, v_cache, meta, scale, cached, starts)
    return out_THD


def _prefill_over_pages(q_THD, out_THD, k_cache, v_cache, meta, scale, rows, starts) -> None:
    """Rows `rows` of the batch, whose K/V (cached prefix and this step's) are in the pool:
    queries padded to the longest, keys to the longest context; query j of a row sees keys up
    to its position (context - queries + j)."""
    device = q_THD.device
    num_qs = [meta.query_lens[i] for i in rows]
    num_ctxs = [meta.context_lens_host[i] for i in rows]
    max_q, max_ctx = max(num_qs), max(num_ctxs)
    offsets_Q = torch.arange(max_q)
    # [B, max_q] index of each row's query in the packed tokens, and which are real
    index_BQ = torch.tensor([starts[i] for i in rows])[:, None] + offsets_Q[None, :]
    real_BQ = offsets_Q[None, :] < torch.tensor(num_qs)[:, None]
    index_BQ = torch.where(real_BQ, index_BQ, 0).to(device)
    real_BQ = real_BQ.to(device)
    tables = meta.block_tables[torch.tensor(rows, device=device)]
    k = gather_pages(k_cache, tables)[:, :, :max_ctx]  # [B, K, L, D]
    v = gather_pages(v_cache, tables)[:, :, :max_ctx]
    q = q_THD[index_BQ].transpose(1, 2)  # [B, H, max_q, D]
    first_BQ = torch.tensor([c - n for c, n in zip(num_ctxs, num_qs)], device=device)[:, None]
    position_BQ = first_BQ + torch.arange(max_q, device=device)[None, :]
    mask_BQL = torch.arange(max_ctx, device=device)[None, None, :] <= position_BQ[:, :, None]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask_BQL[:, None], scale=scale, enable_gqa=True
    )
    out_THD[index_BQ[real_BQ]] = o.transpose(1, 2)[real_BQ]


def decode_sdpa(q_BHD, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence over its pages; padding past each context length is masked."""
    k = gather_pages(k_cache, meta.block_tables)  # [B, K, L, D]
    v = gather_pages(v_cache, meta.block_tables)
    B, H, D = q_BHD.shape
    num_kv_heads = k.shape[1]
    mask = torch.arange(k.shape[2], device=k.device)[None, :] < meta.context_lens[:, None]
    # the query heads of one KV head attend as that head's rows: no K/V expansion per head
    q_BKGD = q_BHD.reshape(B, num_kv_heads, H // num_kv_heads, D)
    o = F.scaled_dot_product_attention(q_BKGD, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(B, H, D)


SDPA_BACKEND = AttentionBackend(
    name="sdpa-gather", write_kv=write_kv_index_copy, prefill=prefill_sdpa, decode=decode_sdpa
)
