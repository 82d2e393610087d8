"""The residual stream the engine computed, kept for the trainer's update (issue 26).

A checkpointed update runs each micro-batch's layers forward once without keeping activations,
then again in the backward: about a fifth of G1's update. On policy, with one update per rollout,
the engine already ran that first forward during generation, on the same weights (it reads the
trainer's in place). With a `HiddenStore` attached (`ModelRunner.record_hidden`), every step also
writes each layer's output for every token it computes ([T, layers, hidden], the residual
stream after layer i: `qwen_forward.forward`'s `records_out`, no extra kernel) and the store
copies it to host memory: rows of an arena of chunks (pinned on CUDA, copied on a side stream so
the decode never waits; a decode graph's buffer, which the next replay overwrites, is staged on
the device and sent every few steps in one transfer). Each sequence keeps which row holds each
of its positions (`HiddenRows`, as routing replay keeps routes); a completion carries them
(`Completion.hidden`) and the trainer reads a micro-batch's rows layer by layer in its packed
order (`read_layer`: on CUDA a kernel reads the pinned host rows directly, no host gather and no
device copy of the micro-batch) to run its update from them (`train.packing.records`).

A rollout's rows are valid until the store is reset (the trainer does, before each rollout) or
the weights change (`invalidate`, after each optimizer step): a `HiddenRows` of an older
generation is not used. Past `max_bytes` of rows a rollout stops recording (its micro-batches
then run as before).

Beside each row the store keeps the LM head's statistics at that position when a step sampled
from it: the log-sum-exp and entropy of the temperature-scaled distribution (`stats_of`; NaN
where no step sampled, e.g. a prompt's inner positions). A sampled token's logprob, entropy and
the gradient of both need nothing else of the forward's logits, so the trainer's LM head skips
its forward too (`train.packing.logprobs`). A decode graph's fused sampler writes them (one more
sum per logit); other steps take `sampling.row_stats`. A position recomputed after a preemption
keeps the row (and statistics) it was first sampled with.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from reinforge.engine.record_positions import HiddenRows, PositionsTable

CHUNK_BYTES = 1 << 30  # one host allocation of the arena
STAGE_STEPS = 4  # decode steps' records staged on the device per transfer to the host
MAX_CHUNKS = 1024  # of the device's table of chunk addresses (1 TiB of rows)


class HiddenStore:
    """Host rows of [layers, hidden] residual streams, written by the engine's steps."""

    def __init__(self, num_layers: int, hidden: int, dtype: torch.dtype, device, max_bytes: int):
        self.row_shape = (num_layers, hidden)
        self.dtype = dtype
        self.device = torch.device(device)
        self.row_bytes = num_layers * hidden * dtype.itemsize
        self.chunk_rows = max(CHUNK_BYTES // self.row_bytes, 1)
        self.max_rows = max(max_bytes // self.row_bytes, 0)
        self.chunks: list[torch.Tensor] = []  # host [chunk_rows, layers, hidden]
        self.stats_chunks: list[torch.Tensor] = []  # host [chunk_rows, 2] float32 (`stats_of`)
        # the temperature this generation's statistics are at (None: none yet); `stats_mixed`:
        # steps sampled at more than one, so none serve
        self.stats_temperature: float | None = None
        self.stats_mixed = False
        # the temperature the trainer's logprobs take (its owner sets it): others do not serve
        self.trainer_temperature: float | None = None
        self.pending = False  # rows written since the last `wait` (not on the host yet)
        self.cursor = 1  # row 0 is zeros: positions never computed (a completion's last token)
        self.generation = 0
        self.overflowed = False  # this generation ran past max_rows: its rows are not used
        # whether steps record now: a trainer records its rollouts only (not an evaluation's
        # generations between steps: `reset` starts, `invalidate` stops)
        self.active = True
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # decode steps' records staged on the device (`_stage`): two halves in turn, the rows
        # staged in the current one and the arena row of its first
        self.halves: list[torch.Tensor] = []
        self.stat_halves: list[torch.Tensor] = []
        self.half_events: list[torch.cuda.Event | None] = [None, None]
        self.half = 0
        self.staged = 0
        self.staged_base = 0
        self.last_event: torch.cuda.Event | None = None
        self.table: torch.Tensor | None = None  # (`pointer_table`)
        self.table_len = 0
        self.positions = PositionsTable()  # the live `HiddenRows` of this generation

    @property
    def num_rows(self) -> int:
        return self.cursor

    def reset(self) -> None:
        """A new generation: rows written from now on, over the old ones."""
        self.generation += 1
        self.positions.reset()
        self.cursor = 1
        self.overflowed = False
        self.active = True
        self.stats_temperature = None
        self.stats_mixed = False

    def invalidate(self) -> None:
        """The weights changed: rows written so far are stale, and none are written until the
        next `reset`."""
        self.generation += 1
        self.positions.reset()
        self.overflowed = False
        self.active = False

    def new_rows(self, capacity: int) -> HiddenRows:
        return HiddenRows(self, capacity)

    def _room(self, n: int) -> bool:
        end = self.cursor + n
        if end > self.max_rows:
            self.overflowed = True
            return False
        while len(self.chunks) * self.chunk_rows < end:
            shape = (self.chunk_rows, *self.row_shape)
            chunk = torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda)
            if not self.chunks:
                chunk[0].zero_()
            self.chunks.append(chunk)
            stats = torch.empty((self.chunk_rows, 2), dtype=torch.float32, pin_memory=self.cuda)
            self.stats_chunks.append(stats.fill_(float("nan")))
        return True

    def write(
        self,
        records_TNH: torch.Tensor,
        groups: list[list[Any]],
        reused: bool = False,
        stats_G2: torch.Tensor | None = None,
        temperature: float | None = None,
        seqs: list[Any] | None = None,
    ):
        """A step's records (on the device) into fresh rows, and each group's sequences told
        which rows hold the positions the step computed (from each leader's cached tokens on:
        called before the scheduler counts the step's tokens as cached; a prefill's rows go to
        every member of the group, whose prompt they are). `reused`: a buffer the next step
        overwrites (a decode graph's): staged on the device and sent to the host in batches
        (`_stage`). `stats_G2`: the log-sum-exp and entropy each group sampled its next token
        from (at its last position this step), at `temperature`. `seqs`: the groups' sequences
        in order, where the caller has them (`Batch.seqs`). Queued, not waited for."""
        T = records_TNH.shape[0]
        if not self.active or self.overflowed or T == 0 or not self._room(T):
            return
        base = self.cursor
        self.cursor += T
        self.pending = True
        stats_T2 = self._stats_rows(T, groups, stats_G2, temperature)
        if reused:
            self._stage(records_TNH, base, stats_T2)
        else:
            self.flush()  # (staged rows stay one contiguous run of the arena)
            self._to_host(records_TNH, base, stats_T2)
            if self.cuda:  # the step's own tensors: their memory waits for the copy
                records_TNH.record_stream(self.stream)
                stats_T2.record_stream(self.stream)
        if len(groups) == T:  # one position per group: a decode (the hot path)
            if seqs is None:
                seqs = [seq for group in groups for seq in group]
            if len(seqs) == T:
                self.positions.write_decode(seqs, base, self._rows_of)
                return
            for i, group in enumerate(groups):
                start = group[0].num_cached_tokens
                for seq in group:
                    self._rows_of(seq).write(start, np.array([base + i]))
            return
        offset = 0
        for group in groups:
            start, end = group[0].num_cached_tokens, group[0].num_tokens
            rows = np.arange(base + offset, base + offset + end - start, dtype=np.int64)
            offset += end - start
            for seq in group:
                self._rows_of(seq).write(start, rows, keep=True)
        assert offset == T, "one record row per computed token"

    def _stats_rows(self, T: int, groups, stats_G2, temperature) -> torch.Tensor:
        """[T, 2] on the device: each group's statistics at the row of its last position this
        step, NaN elsewhere (a decode: one row per group)."""
        if stats_G2 is None:
            return torch.full((T, 2), float("nan"), device=self.device)
        assert stats_G2.shape == (len(groups), 2), (stats_G2.shape, len(groups))
        temperature = float(temperature or 1.0)
        if self.stats_temperature is None:
            self.stats_temperature = temperature
        elif self.stats_temperature != temperature:
            self.stats_mixed = True
        if len(groups) == T:
            return stats_G2
        ends = np.cumsum([g[0].num_tokens - g[0].num_cached_tokens for g in groups]) - 1
        index = torch.from_numpy(ends)
        if self.cuda:
            index = index.pin_memory().to(self.device, non_blocking=True)
        out = torch.full((T, 2), float("nan"), device=self.device)
        return out.index_copy_(0, index, stats_G2)

    def _rows_of(self, seq) -> HiddenRows:
        """`seq`'s rows of this generation (fresh ones when it has none or stale ones)."""
        if seq.hidden is None or not seq.hidden.valid:
            seq.hidden = self.new_rows(seq.num_prompt_tokens + seq.params.max_new_tokens)
        return seq.hidden

    def _stage(self, records_TNH: torch.Tensor, base: int, stats_T2: torch.Tensor) -> None:
        """A decode step's records into the device's staging half in use (one copy on the
        compute stream), which goes to the host as one transfer when full: a step then queues
        one copy, not a transfer, events and stream switches (the decode loop's host work is
        on its critical path on some hosts). Two halves in turn: one fills while the other's
        transfer runs."""
        T = records_TNH.shape[0]
        if not self.halves or self.halves[0].shape[0] < STAGE_STEPS * T:
            self.flush()
            shape = (STAGE_STEPS * T, *self.row_shape)
            self.halves = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in "ab"]
            rows = (STAGE_STEPS * T, 2)
            self.stat_halves = [torch.empty(rows, device=self.device) for _ in "ab"]
            self.half_events = [None, None]
            self.staged = 0
        half = self.halves[self.half]
        if self.staged + T > half.shape[0]:
            self.flush()
            half = self.halves[self.half]
        if self.staged == 0:
            event = self.half_events[self.half]
            if event is not None:  # its last transfer is done before it is written again
                torch.cuda.current_stream(self.device).wait_event(event)
            self.staged_base = base
        half[self.staged : self.staged + T].copy_(records_TNH)
        self.stat_halves[self.half][self.staged : self.staged + T].copy_(stats_T2)
        self.staged += T

    def flush(self) -> None:
        """The staged rows to the host (queued); the other half is filled next."""
        if not self.staged:
            return
        half = self.halves[self.half][: self.staged]
        stats = self.stat_halves[self.half][: self.staged]
        self.half_events[self.half] = self._to_host(half, self.staged_base, stats)
        self.half = 1 - self.half
        self.staged = 0

    def _to_host(
        self, records_TNH: torch.Tensor, base: int, stats_T2: torch.Tensor
    ) -> torch.cuda.Event | None:
        """Rows base .. base + T - 1 (and their statistics) from the device (a stream of their
        own on CUDA, after the compute stream's work so far), split where they cross a chunk;
        the transfer's event."""
        T = records_TNH.shape[0]
        if not self.cuda:
            for dst, stats, lo, hi in self._pieces(base, T):
                dst.copy_(records_TNH[lo:hi])
                stats.copy_(stats_T2[lo:hi])
            return None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, stats, lo, hi in self._pieces(base, T):
                dst.copy_(records_TNH[lo:hi], non_blocking=True)
                stats.copy_(stats_T2[lo:hi], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.last_event = done
        return done

    def _pieces(self, base: int, n: int):
        """(host rows, their statistics, lo, hi): where rows base .. base + n - 1 lie, chunk
        by chunk."""
        lo = 0
        while lo < n:
            row = base + lo
            chunk, r = divmod(row, self.chunk_rows)
            hi = min(n, lo + self.chunk_rows - r)
            yield (
                self.chunks[chunk][r : r + hi - lo],
                self.stats_chunks[chunk][r : r + hi - lo],
                lo,
                hi,
            )
            lo = hi

    def stats_of(self, rows: np.ndarray) -> np.ndarray:
        """[n, 2] float32: the log-sum-exp and entropy a step sampled from at each row's
        position (NaN: none did; row 0: NaN). On the host, after `wait`."""
        assert not self.pending, "statistics read before the store's `wait`"
        out = np.full((len(rows), 2), np.nan, dtype=np.float32)
        chunk, local = np.divmod(rows, self.chunk_rows)
        for c, stats in enumerate(self.stats_chunks):
            where = np.flatnonzero(chunk == c)
            if len(where):
                out[where] = stats.numpy()[local[where]]
        return out

    def stats_serve(self) -> bool:
        """Whether this generation's statistics are all at the trainer's temperature."""
        t = self.stats_temperature
        return not self.stats_mixed and t is not None and t == self.trainer_temperature

    def wait(self) -> None:
        """Every row on the host: the staged ones sent, every transfer done (before the trainer
        reads them: its reads, inside a captured graph too, cannot wait for a stream outside
        it)."""
        self.flush()
        if self.last_event is not None:
            self.last_event.synchronize()
        self.pending = False
        self.halves = []  # (the update gets their memory; the next rollout stages anew)
        self.stat_halves = []
        self.half_events = [None, None]

    def read_layer(self, rows_L: torch.Tensor, layer: int, out: torch.Tensor | None = None):
        """Layer `layer`'s records of rows `rows_L` (0: zeros), [L, hidden], on the device
        `rows_L` is on. On CUDA a kernel reads them straight from the pinned host rows (mapped
        into the device's address space: no copy on the host, no buffer on the device but the
        result); elsewhere an index over the host rows. `out`: where to write them."""
        L = rows_L.shape[0]
        if out is None:
            out = torch.empty((L, self.row_shape[1]), dtype=self.dtype, device=rows_L.device)
        if rows_L.is_cuda:
            from reinforge.engine.triton_ops import gather_host_rows

            table = self.pointer_table(rows_L.device)
            gather_host_rows(table, rows_L, self.chunk_rows, self.row_shape, layer, out)
            return out
        chunk_L = rows_L // self.chunk_rows
        local_L = rows_L - chunk_L * self.chunk_rows
        for c, chunk in enumerate(self.chunks):
            where = (chunk_L == c).nonzero().squeeze(1)
            if where.numel():
                out[where] = chunk[local_L[where], layer]
        return out

    def pointer_table(self, device) -> torch.Tensor:
        """Each host chunk's address, [MAX_CHUNKS] int64 on the device: one tensor whose
        contents grow with the arena (a captured graph reads the new ones)."""
        if self.table is None:
            self.table = torch.zeros(MAX_CHUNKS, dtype=torch.int64, device=device)
            self.table_len = 0
        if self.table_len < len(self.chunks):
            assert len(self.chunks) <= MAX_CHUNKS, "more record chunks than the table holds"
            ptrs = [c.data_ptr() for c in self.chunks[self.table_len :]]
            self.table[self.table_len : len(self.chunks)] = torch.tensor(ptrs, dtype=torch.int64)
            self.table_len = len(self.chunks)
        return self.table
