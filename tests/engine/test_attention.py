"""The reference paged attention against plain SDPA on contiguous K/V: the oracle a GPU
backend (Triton paged decode, varlen prefill) must also match."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reinforge.engine.attention import SDPA_BACKEND, AttentionMetadata

H, K, D, BLOCK, PAGES = 4, 2, 8, 4, 16


def reference(q_HQD, k_KSD, v_KSD, causal_offset: int) -> torch.Tensor:
    """Query j sees keys 0..causal_offset + j."""
    mask = (
        torch.arange(k_KSD.shape[1])[None, :]
        <= causal_offset + torch.arange(q_HQD.shape[1])[:, None]
    )
    return F.scaled_dot_product_attention(
        q_HQD[None], k_KSD[None], v_KSD[None], attn_mask=mask, enable_gqa=True
    )[0]


def scattered_tables(lengths: list[int]) -> list[list[int]]:
    """Pages of each sequence, deliberately out of order in the pool."""
    order = torch.randperm(PAGES).tolist()
    tables = []
    for n in lengths:
        num_pages = (n + BLOCK - 1) // BLOCK
        tables.append([order.pop() for _ in range(num_pages)])
    return tables


def test_paged_decode_and_prefix_prefill_match_contiguous_sdpa():
    torch.manual_seed(0)
    lengths = [3, 9, 16]  # context lengths, this step's tokens included
    num_new = [1, 4, 2]  # tokens computed this step: a decode-like one and two cached prefixes
    tables = scattered_tables(lengths)
    k_cache = torch.zeros(PAGES, BLOCK, K, D)
    v_cache = torch.zeros(PAGES, BLOCK, K, D)
    keys = [torch.randn(n, K, D) for n in lengths]
    values = [torch.randn(n, K, D) for n in lengths]
    queries = [torch.randn(m, H, D) for m in num_new]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, n in zip(tables, lengths) for p in range(n)]
    SDPA_BACKEND.write_kv(k_cache, v_cache, torch.cat(keys), torch.cat(values), torch.tensor(slots))

    width = max(map(len, tables))
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.tensor([], dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor(lengths),
        query_lens=num_new,
        context_lens_host=lengths,
    )
    q = torch.cat(queries)
    new_k = torch.cat([k[-m:] for k, m in zip(keys, num_new)])
    new_v = torch.cat([v[-m:] for v, m in zip(values, num_new)])
    out = SDPA_BACKEND.prefill(q, new_k, new_v, k_cache, v_cache, meta, D**-0.5)
    expected = torch.cat(
        [
            reference(qs.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), n - m).transpose(
                0, 1
            )
            for qs, k, v, n, m in zip(queries, keys, values, lengths, num_new)
        ]
    )
    torch.testing.assert_close(out, expected)

    meta.is_prefill, meta.query_lens = False, [1] * len(lengths)
    last_q = torch.stack([qs[-1] for qs in queries])
    decoded = SDPA_BACKEND.decode(last_q, k_cache, v_cache, meta, D**-0.5)
    torch.testing.assert_close(decoded, expected[torch.tensor(num_new).cumsum(0) - 1])
