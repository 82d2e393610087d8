"""An eager step's inputs on the device: a prefill's, or a decode's that no CUDA graph replays
(`ModelRunner.run`). A replayed decode fills the graphs' own rows instead
(`cuda_graphs.DecodeGraphs.run`), from the same `decode_rows`."""

from __future__ import annotations

import numpy as np
import torch

from reinforge.engine.attention import AttentionMetadata
from reinforge.engine.graph_rows import (
    CONTEXT_LENS,
    IDS,
    NUM_ROW_FIELDS,
    POSITIONS,
    SLOTS,
    decode_rows,
)
from reinforge.engine.sequence import Sequence


def prefill(seqs: list[Sequence], block_size: int, device, with_cu_seqlens: bool):
    """(input ids, positions, attention metadata, logits indices) of a prefill: each sequence's
    uncached tokens; `with_cu_seqlens`: the packed kernels' cumulative lengths too. The ids,
    positions and slots go over in one copy, built in numpy (G1's 4096 prompt tokens: a Python
    call per slot and three list conversions were ~2 ms of host time with the device idle)."""
    query_lens = [seq.num_tokens - seq.num_cached_tokens for seq in seqs]
    rows = np.empty((3, sum(query_lens)), dtype=np.int64)  # ids, positions, slots
    at = 0
    for seq, n in zip(seqs, query_lens):
        start = seq.num_cached_tokens
        positions = np.arange(start, start + n, dtype=np.int64)
        pages = np.asarray(seq.block_table, dtype=np.int64)[positions // block_size]
        rows[0, at : at + n] = seq.token_ids[start:]
        rows[1, at : at + n] = positions
        rows[2, at : at + n] = pages * block_size + positions % block_size
        at += n
    rows_dev = torch.from_numpy(rows).to(device, non_blocking=True)
    cu_seqlens = None
    if with_cu_seqlens:
        cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_seqlens = cu.to(device, non_blocking=True)
    context_lens = [seq.num_tokens for seq in seqs]
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=rows_dev[2],
        block_tables=page_tables(seqs, device),
        context_lens=longs(context_lens, device),
        query_lens=query_lens,
        context_lens_host=context_lens,
        cu_seqlens=cu_seqlens,
    )
    logits_indices = longs(np.cumsum(query_lens) - 1, device)
    return rows_dev[0], rows_dev[1], meta, logits_indices


def decode(seqs: list[Sequence], block_size: int, device):
    """The graphs' per-sequence rows (one pass over the sequences, one host-to-device copy),
    for an eager decode: (input ids, positions, attention metadata, None)."""
    n = len(seqs)
    rows = np.empty((NUM_ROW_FIELDS, n), dtype=np.int64)
    decode_rows(seqs, block_size, rows)
    cached = [seq.num_cached_tokens for seq in seqs]
    assert cached == rows[POSITIONS].tolist(), "decode writes one token"
    rows_dev = torch.from_numpy(rows).to(device, non_blocking=True)
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=rows_dev[SLOTS],
        block_tables=page_tables(seqs, device),
        context_lens=rows_dev[CONTEXT_LENS],
        query_lens=[1] * n,
        context_lens_host=rows[CONTEXT_LENS].tolist(),
    )
    return rows_dev[IDS], rows_dev[POSITIONS], meta, None


def page_tables(seqs: list[Sequence], device) -> torch.Tensor:
    """[B, max pages] page tables, 0-padded."""
    tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), dtype=np.int64)
    for row, seq in zip(tables, seqs):
        row[: len(seq.block_table)] = seq.block_table
    return torch.from_numpy(tables).to(device, non_blocking=True)


def longs(values, device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).to(device, non_blocking=True)
