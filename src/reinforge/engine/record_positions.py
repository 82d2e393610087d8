"""Which arena row of a `HiddenStore` holds each position of each sequence (`engine.records`).

A sequence's `HiddenRows` says it position by position. While the sequence generates, its rows
are a row of the store's `PositionsTable` (one int64 array [sequences, positions] a generation),
so a decode step records every sequence's new row in one indexed assignment; a completion carries
a copy of its own, which outlives the table's next generation.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


class PositionsTable:
    """The live `HiddenRows` of a store's generation: slot s's arena row at each position
    (`positions_SP`, -1 where none) and its length (`lengths_S`)."""

    def __init__(self) -> None:
        self.positions_SP = np.full((0, 0), -1, dtype=np.int64)
        self.lengths_S = np.zeros(0, dtype=np.int64)
        self.num_slots = 0
        # the last decode step's sequences and their slots (the next step's are mostly the same)
        self._decode_seqs: list[Any] = []
        self._decode_slots = np.zeros(0, dtype=np.int64)
        self._decode_starts = np.zeros(0, dtype=np.int64)

    def reset(self) -> None:
        """A new generation: every slot free again."""
        self.num_slots = 0
        self._decode_seqs = []

    def take_slot(self, capacity: int) -> int:
        """A fresh row of the positions table (every position -1) for a live `HiddenRows` of
        `capacity` positions."""
        self.widen(capacity)
        slot = self.num_slots
        if slot == self.positions_SP.shape[0]:
            rows = max(64, 2 * slot)
            grown = np.full((rows, self.positions_SP.shape[1]), -1, dtype=np.int64)
            grown[:slot] = self.positions_SP
            self.positions_SP = grown
            self.lengths_S = np.concatenate([self.lengths_S, np.zeros(rows - slot, np.int64)])
        self.positions_SP[slot] = -1
        self.lengths_S[slot] = 0
        self.num_slots += 1
        return slot

    def widen(self, capacity: int) -> None:
        """Room for `capacity` positions in every slot."""
        width = self.positions_SP.shape[1]
        if capacity <= width:
            return
        grown = np.full((self.positions_SP.shape[0], max(capacity, 2 * width)), -1, np.int64)
        grown[:, :width] = self.positions_SP
        self.positions_SP = grown

    def write_decode(self, seqs: list[Any], base: int, rows_of) -> None:
        """Sequence i's next position (`num_cached_tokens`) is in row base + i (`rows_of(seq)`:
        its live `HiddenRows`, made where it has none of this generation): one indexed
        assignment into the positions table (a loop over G1's 256 sequences took 0.33 ms of
        each decode step's host time on an H200 host, s29a; the loop's host paces the decode
        there)."""
        T = len(seqs)
        last = self._decode_seqs
        if len(last) == T and all(map(operator.is_, seqs, last)):
            # the same sequences as the last decode written: each computed one position since
            # (a slow host took 0.18 ms a step to read 256 positions from the sequences, s29c)
            starts = self._decode_starts + 1
            assert starts[0] == seqs[0].num_cached_tokens, "a decode's positions moved by one"
        else:
            slots = [rows_of(seq).slot for seq in seqs]
            assert None not in slots, "a generating sequence's rows are live ones"
            self._decode_seqs, self._decode_slots = seqs, np.array(slots, dtype=np.int64)
            starts = np.array([seq.num_cached_tokens for seq in seqs], dtype=np.int64)
        self._decode_starts = starts
        slots = self._decode_slots
        self.widen(int(starts.max()) + 1)
        self.positions_SP[slots, starts] = np.arange(base, base + T, dtype=np.int64)
        lengths = self.lengths_S[slots]
        self.lengths_S[slots] = np.maximum(lengths, starts + 1)


class HiddenRows:
    """Which arena row holds each position of one sequence (-1: not computed in this
    generation), for positions 0 .. length - 1. A live one (a sequence's while it generates) is
    a row of its store's table (`PositionsTable`), so a decode step records all its
    sequences' rows in one indexed assignment; a completion's (`prefix`, `completed`) is a copy
    of its own, kept after the store's next generation reuses the table."""

    def __init__(self, store: Any, capacity: int = 0, live: bool = True):
        """`store`: the `records.HiddenStore` whose arena rows these are (not imported here:
        it imports this module)."""
        self.store = store
        self.generation = store.generation
        self.slot: int | None = store.positions.take_slot(capacity) if live else None
        self._rows_P = None if live else np.full(max(capacity, 1), -1, dtype=np.int64)
        self._length = 0
        self.token_ids: list[int] | None = None  # (`completed`)

    @property
    def _stale(self) -> bool:
        """A live one of an older generation: its slot may hold another sequence's rows now."""
        return self.slot is not None and self.generation != self.store.generation

    @property
    def rows_P(self) -> np.ndarray:
        if self.slot is None:
            return self._rows_P
        if self._stale:
            return np.full(1, -1, dtype=np.int64)
        return self.store.positions.positions_SP[self.slot]

    @property
    def length(self) -> int:
        if self.slot is None:
            return self._length
        return 0 if self._stale else int(self.store.positions.lengths_S[self.slot])

    @length.setter
    def length(self, value: int) -> None:
        if self.slot is None:
            self._length = value
        else:
            assert not self._stale, "a stale sequence's rows written"
            self.store.positions.lengths_S[self.slot] = value

    def write(self, start: int, rows: np.ndarray, keep: bool = False) -> None:
        """Positions start .. start + len(rows) - 1 are in `rows`. `keep`: a position that has
        a row already keeps it (recomputed after a preemption: the same weights and ids, and
        its first row has the statistics its token was sampled with)."""
        end = start + len(rows)
        length = self.length
        if end > len(self.rows_P):
            if self.slot is not None:
                self.store.positions.widen(end)
            else:
                grown = np.full(max(end, 2 * len(self._rows_P)), -1, dtype=np.int64)
                grown[:length] = self._rows_P[:length]
                self._rows_P = grown
        rows_P = self.rows_P
        if keep and start < length:
            old = rows_P[start : min(end, length)]
            rows = rows.copy()
            rows[: len(old)] = np.where(old > 0, old, rows[: len(old)])
        rows_P[start:end] = rows
        self.length = max(length, end)

    def prefix(self, num_positions: int, live: bool = False) -> HiddenRows:
        """A copy holding the first `num_positions` positions (what a completion carries;
        `live`: a row of the store's table, for a sequence that goes on generating)."""
        live = live and not self._stale  # (a stale one's copy is stale too: never used)
        out = HiddenRows(self.store, num_positions, live=live)
        out.generation = self.generation
        n = min(num_positions, self.length)
        out.rows_P[:n] = self.rows_P[:n]
        out.length = num_positions
        return out

    def fork(self, num_positions: int) -> HiddenRows:
        """A session's child: its parent's first positions, and its own from there."""
        return self.prefix(num_positions, live=True)

    def completed(self, token_ids: list[int]) -> HiddenRows:
        """What a finished sequence's completion carries: the rows of every position but the
        last (whose output predicts nothing) and the ids the engine computed them from, which
        the trainer checks against the ids it trains on."""
        out = self.prefix(len(token_ids) - 1)
        out.token_ids = token_ids
        return out

    @property
    def valid(self) -> bool:
        """Rows of the store's current generation (the weights that computed them)."""
        return self.generation == self.store.generation and not self.store.overflowed
