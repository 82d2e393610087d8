"""The paged engine's loop driven one step at a time, with sequences added, continued and forked
between steps: what an episode loop needs to overlap tool calls with generation.

`PagedEngine.generate` runs a fixed batch to its end. A session keeps its scheduler and KV pool
open: `step` runs one engine step and returns the sequences that finished in it, and between
steps the caller may

- `add` a prompt with n samples (prefilled once, pages shared, as in `generate`);
- `extend` a finished sequence with more ids (an env's reply): the new sequence takes over the
  old one's pages and its prefill computes only the appended ids, never the history again;
- `fork` a sequence at a position: the child shares the parent's pages of that prefix by
  reference; the page the prefix ends in is copied on write (by whichever writes first), so a
  fork costs no prefill of its prefix and no copy of it beyond one page;
- `release` a finished sequence's pages.

Sequences of a session keep their pages when they finish (`keep_pages`), until continued,
forked from and released. When waiting work cannot get pages and nothing runs, the session
frees the pages of finished sequences first (oldest first), then those held by waiting ones
(which are then recomputed in full): never a stall, at worst a recompute.

A sequence may ask for the sampler's entropy over its first `entropy_window` output positions
(`Sequence.entropies`), computed from the logits the sampler reads.

Engine time (`seconds_busy`) is the wall time inside `step` or with a step queued between
calls (as `generate`'s wall time is for a batch); the rest of a caller's wall time the device
idles (tool waits, host work outside the engine).
"""

from __future__ import annotations

import dataclasses
import time

from reinforge.engine.base import SamplingParams
from reinforge.engine.block_manager import BlockManager
from reinforge.engine.paged import PagedEngine, StepTimers
from reinforge.engine.pool_size import CPU_KV_GROWTH_LIMIT_BYTES, kv_bytes_per_block
from reinforge.engine.scheduler import Scheduler
from reinforge.engine.sequence import PENDING, Sequence, SequenceStatus
from reinforge.watchdog import beat


class EngineSession:
    def __init__(self, engine: PagedEngine, params: SamplingParams, max_len: int, num_blocks=0):
        """`params`: the sampler's settings for every request (`max_new_tokens` is per
        request); `max_len`: the longest sequence any request reaches; `num_blocks`: on a pool
        that grows (off CUDA with no size given), the pages to grow it to."""
        assert engine.fallback is None, "a session needs the paged forward"
        self.engine, self.params = engine, params
        runner = engine.runner
        runner.restore()
        if engine.pool_grows and num_blocks:
            limit = CPU_KV_GROWTH_LIMIT_BYTES // kv_bytes_per_block(engine.model, engine.block_size)
            runner.grow_pool(min(num_blocks, limit))
        runner.ensure_max_len(max_len)
        runner.begin_generate()
        self.scheduler = Scheduler(
            BlockManager(engine.num_blocks, engine.block_size),
            engine.max_num_seqs,
            engine.max_num_batched_tokens,
        )
        self.finish_reason = engine._finish_rule(params)
        self.timers = StepTimers()
        self.inflight = None
        self.parked: dict[int, Sequence] = {}  # finished sequences holding pages, oldest first
        self.seconds_busy = 0.0
        self._busy_since: float | None = None
        self.num_generated_tokens = 0
        self.num_reclaimed = 0  # parked or waiting sequences whose pages were taken back

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def has_work(self) -> bool:
        return self.inflight is not None or not self.scheduler.is_finished()

    def add(self, prompt_ids: list[int], seeds: list[int], max_new_tokens: int, entropy_window=0):
        """One prompt, `len(seeds)` samples (their noise keys), sharing its prefill."""
        group = [
            self._new_sequence(list(prompt_ids), seed, max_new_tokens, entropy_window)
            for seed in seeds
        ]
        self.scheduler.add(group)
        return group

    def extend(
        self, seq: Sequence, ids: list[int], seed: int, max_new_tokens: int, entropy_window=0
    ) -> Sequence:
        """A new sequence: `seq`'s tokens and `ids`, on `seq`'s pages (which it takes over)."""
        assert seq.is_finished and seq.num_pending == 0
        new = self._new_sequence(seq.token_ids + list(ids), seed, max_new_tokens, entropy_window)
        self.parked.pop(seq.seq_id, None)
        new.block_table, seq.block_table = seq.block_table, []
        # the history's recorded routes (routing replay), shared: a step launched ahead before
        # `seq` finished may still write its last position
        new.routes = seq.routes
        new.hidden = seq.hidden
        # at least one id is computed: its logits give the first sample
        new.num_cached_tokens = min(seq.num_cached_tokens, new.num_tokens - 1)
        seq.num_cached_tokens = 0
        self.scheduler.add([new])
        return new

    def fork(
        self, seq: Sequence, position: int, seed: int, max_new_tokens: int, entropy_window=0
    ) -> Sequence:
        """A new sequence sampling on from `seq`'s first `position` tokens, sharing their pages."""
        prefix = seq.token_ids[:position]
        assert 1 <= position <= seq.num_tokens and PENDING not in prefix
        child = self._new_sequence(prefix, seed, max_new_tokens, entropy_window)
        if seq.block_table:
            cached = min(position - 1, seq.num_cached_tokens)
            self.block_manager.share_prefix(seq, child, cached)
            if seq.routes is not None:
                child.routes = seq.routes.fork(cached)
            if seq.hidden is not None:
                child.hidden = seq.hidden.fork(cached)
        self.scheduler.add([child])
        return child

    def release(self, seq: Sequence) -> None:
        assert seq.is_finished
        self.parked.pop(seq.seq_id, None)
        if seq.block_table:
            self.block_manager.free(seq)

    def step(self) -> list[Sequence]:
        """Run one engine step (overlapped with the next as `generate` does); the sequences that
        finished in it, in batch order."""
        engine, timers = self.engine, self.timers
        if self._busy_since is None:
            self._busy_since = time.perf_counter()
        if self.inflight is None:
            self._make_room()
        ahead = engine._launch_ahead(self.scheduler, self.inflight, self.params, timers)
        finished: list[Sequence] = []
        if self.inflight is not None:
            running = [seq for seq in self.inflight.batch.seqs if not seq.is_finished]
            engine._commit(self.scheduler, self.inflight, self.finish_reason, timers)
            self.num_generated_tokens += len(running)
            finished = [seq for seq in running if seq.is_finished]
            for seq in finished:  # reclaimable from now on
                self.parked[seq.seq_id] = seq
            beat()
        if ahead is None and not self.scheduler.is_finished():
            self._make_room()
        self.inflight = ahead or engine._launch_next(self.scheduler, self.params, timers)
        self._track_busy()
        return finished

    def close(self) -> None:
        """Free every parked sequence's pages; the pool must then be empty."""
        assert not self.has_work(), "close() with steps still to run"
        for seq in list(self.parked.values()):
            self.release(seq)
        assert self.block_manager.num_used_blocks == 0, "a sequence still holds pages"
        self._track_busy()

    def _new_sequence(self, prompt_ids, seed: int, max_new_tokens: int, entropy_window: int):
        params = dataclasses.replace(self.params, max_new_tokens=max_new_tokens, n=1)
        if entropy_window > 0:  # (the runner checks every sequence's window from now on)
            self.engine.runner.entropy_requested = True
        return Sequence(
            prompt_ids,
            params,
            sample_seed=seed,
            keep_pages=True,
            entropy_window=entropy_window,
        )

    def _track_busy(self) -> None:
        """A busy stretch runs from a `step` with nothing in flight until no step is queued."""
        if self.inflight is None and self._busy_since is not None:
            self.seconds_busy += time.perf_counter() - self._busy_since
            self._busy_since = None

    def _make_room(self) -> None:
        """Pages for the next step, taken back from parked sequences (oldest first) before the
        scheduler would preempt a running one for them; with nothing running, the first waiting
        request must fit: then from waiting ones too (recomputed in full)."""
        scheduler, bm = self.scheduler, self.block_manager
        running, waiting = scheduler.running, scheduler.waiting
        if running and bm.num_free_blocks < len(running):  # cheap test first
            need = sum(bm.num_blocks_to_append(seq) for seq in running)
            while bm.num_free_blocks < need and self.parked:
                self._reclaim_oldest()
        if running or not waiting:
            return
        first = waiting[0][0]
        while not bm.can_prefill(first) and self.parked:
            self._reclaim_oldest()
        for group in waiting:
            if bm.can_prefill(first):
                return
            for seq in group:
                if seq.block_table:
                    bm.free(seq)
                    self.num_reclaimed += 1
            assert all(seq.status is SequenceStatus.WAITING for seq in group)

    def _reclaim_oldest(self) -> None:
        self.release(next(iter(self.parked.values())))
        self.num_reclaimed += 1
