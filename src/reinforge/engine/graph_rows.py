"""The decode graphs' per-row inputs on the host: each row's token, position, KV slot, context
length, sampling seed and output position (`decode_rows`, filled from the sequences, or
`advance_rows`, one token on from the step before), and the page-table entries a step changed
(`table_update`). Plain numpy; `cuda_graphs.DecodeGraphs` sends them.
"""

from __future__ import annotations

import numpy as np

from reinforge.engine.sequence import Sequence

# rows of the static per-sequence inputs
IDS, POSITIONS, SLOTS, CONTEXT_LENS, SEEDS, OUTPUT_POSITIONS = range(6)
NUM_ROW_FIELDS = 6
PAD_ROW = (0, 0, -1, 1, 0, 0)


def decode_rows(seqs: list[Sequence], block_size: int, out: np.ndarray) -> None:
    """Fill out[:, :len(seqs)] with each sequence's decode inputs (the `*_ROW` fields)."""
    n = len(seqs)
    context_lens = [len(seq.prompt_ids) + len(seq.output_ids) for seq in seqs]
    out[CONTEXT_LENS, :n] = context_lens
    out[POSITIONS, :n] = out[CONTEXT_LENS, :n] - 1
    out[IDS, :n] = [seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1] for seq in seqs]
    out[SLOTS, :n] = [
        seq.block_table[(c - 1) // block_size] * block_size + (c - 1) % block_size
        for seq, c in zip(seqs, context_lens)
    ]
    out[SEEDS, :n] = [seq.sample_seed for seq in seqs]
    out[OUTPUT_POSITIONS, :n] = [len(seq.output_ids) for seq in seqs]


def advance_rows(
    previous: np.ndarray,
    out: np.ndarray,
    seqs: list[Sequence],
    grown_rows: list[int],
    block_size: int,
) -> None:
    """`decode_rows` of `seqs` from `previous` (their rows one step before: the same sequences in
    the same columns, each one token shorter), except the input ids (left as they were: the
    replay takes them from the device). Positions, context and output lengths move on by one,
    and so does each slot, but in `grown_rows` (a sequence that took a page or copied its last
    one, `Batch.grown_rows`), which are filled from their sequences."""
    n = len(seqs)
    out[:, :n] = previous[:, :n]
    for field in (POSITIONS, SLOTS, CONTEXT_LENS, OUTPUT_POSITIONS):
        out[field, :n] += 1
    if grown_rows:
        grown = [seqs[i] for i in grown_rows]
        part = np.empty((NUM_ROW_FIELDS, len(grown)), dtype=out.dtype)
        decode_rows(grown, block_size, part)
        out[SLOTS, grown_rows] = part[SLOTS]


def table_update(
    keys: np.ndarray, width: int, seqs: list[Sequence], rows: list[int] | None = None
) -> np.ndarray | None:
    """The page-table entries that changed since the last step, [2, n] (flat index in a
    [rows, `width`] table, page), or None: a new page, a copy-on-write of the last page, or a
    row now holding another sequence. `keys` ([3, rows]: sequence, pages, last page; -1 where
    unknown) say what each row of the device's table holds, and are brought up to date. `rows`:
    the only rows that may have changed (None: any). The keys are compared in numpy; a row of
    the same sequence sends from its old last page on, any other its whole table (G1: every
    16th step all 256 rows take a page, and a loop over them took a slow host ~2 ms of that
    step, s29c)."""
    picked = range(len(seqs)) if rows is None else rows
    if not picked:
        return None
    tables = [seqs[i].block_table for i in picked]
    row_R = np.fromiter(picked, np.int64, len(tables))
    seq_R = np.array([seqs[i].seq_id for i in picked], dtype=np.int64)
    len_R = np.array([len(t) for t in tables], dtype=np.int64)
    last_R = np.array([t[-1] for t in tables], dtype=np.int64)
    old_seq, old_len, old_last = keys[0, row_R], keys[1, row_R], keys[2, row_R]
    changed = (old_seq != seq_R) | (old_len != len_R) | (old_last != last_R)
    if not changed.any():
        return None
    # from the old last page on (its copy-on-write is among the changes), or from 0
    first_R = np.where(old_seq == seq_R, np.clip(old_len - 1, 0, len_R - 1), 0)
    count_R = len_R - first_R
    # one or two entries (a page taken or copied): in numpy; longer runs row by row
    short = changed & (count_R <= 2)
    k2 = np.flatnonzero(short)
    second = np.array([tables[k][-2] if len(tables[k]) > 1 else -1 for k in k2.tolist()])
    second = second.astype(np.int64).reshape(-1)
    two = count_R[k2] == 2
    base = row_R[k2] * width + first_R[k2]
    index_parts = [base, base[two] + 1]
    value_parts = [np.where(two, second, last_R[k2]), last_R[k2][two]]
    for k in np.flatnonzero(changed & ~short).tolist():
        table, first, i = tables[k], int(first_R[k]), int(row_R[k])
        index_parts.append(np.arange(i * width + first, i * width + len(table)))
        value_parts.append(np.asarray(table[first:], dtype=np.int64))
    keys[:, row_R[changed]] = np.stack([seq_R, len_R, last_R])[:, changed]
    assert len(seqs[0].block_table) <= width
    return np.stack([np.concatenate(index_parts), np.concatenate(value_parts)])
