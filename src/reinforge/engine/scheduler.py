"""Continuous batching over the paged KV pool. Plain Python.

Each step is either a prefill or a decode. A prefill takes waiting groups in order under a token
budget and a sequence cap; a group's prompt is computed once (by its first sequence, the leader)
and its pages forked to the other samples, each of which is sampled from the leader's logits. A
decode appends one token to every running sequence. Finished sequences free their pages at once,
so waiting groups take their place on the next step.

When pages run out during a decode, the newest running sequence is preempted: its pages are
freed and it goes back to the front of the queue, to be recomputed (prompt and tokens generated
so far) by a later prefill. A request that could not fit even in an empty pool is refused by
`add`, so every step makes progress and `generate` always ends.

A step's tokens are recorded in two halves, so the engine can run one decode step ahead of the
host: `launched` when the step is sent to the device (each sequence gets a `PENDING` token, so
lengths and pages are right for the next step), `commit` when its sampled ids are read back
(pending tokens get their values; finish rules run; finished sequences free their pages).
`schedule_next_decode` picks the next decode before the step in flight is committed, when nothing
the commit could reveal would change it.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from reinforge.engine.block_manager import BlockManager
from reinforge.engine.sequence import PENDING, Sequence, SequenceStatus, num_blocks_for


@dataclass
class Batch:
    """What one step computes. In a prefill, each group's leader (`group[0]`) has its uncached
    tokens computed and every member of the group gets a token sampled from the leader's last
    logits; in a decode every group is one sequence."""

    is_prefill: bool
    groups: list[list[Sequence]]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, dest) pages
    # a decode chosen ahead (`schedule_next_decode`): the rows (indices into `groups`) of the
    # sequences that took or copied a page for this step; every other sequence's page table is
    # as the step before left it (`cuda_graphs.DecodeGraphs.run` then sends only these rows).
    # None: not known (check every row).
    grown_rows: list[int] | None = None

    @functools.cached_property
    def leaders(self) -> list[Sequence]:
        return [group[0] for group in self.groups]

    @functools.cached_property
    def seqs(self) -> list[Sequence]:
        """Every sequence that receives a token this step, in sampling order."""
        return [seq for group in self.groups for seq in group]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
    ):
        assert max_num_seqs >= 1 and max_num_batched_tokens >= 1
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[list[Sequence]] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.peak_used_blocks = 0
        self.peak_unshared_blocks = 0  # pages the same batches would hold with no sharing
        self.num_prefill_steps = 0
        self.num_prefill_tokens = 0  # tokens computed by prefills (a shared prompt once)
        self.num_decode_steps = 0
        self.num_overlapped_steps = 0  # decodes chosen by `schedule_next_decode`
        self._steady: _SteadyRun | None = None  # (`schedule_next_decode`)

    def add(self, group: list[Sequence]) -> None:
        """Queue the samples of one prompt (all with the same tokens so far)."""
        leader = group[0]
        assert all(seq.token_ids == leader.token_ids for seq in group)
        assert all(seq.status is SequenceStatus.WAITING for seq in group)
        assert len(group) == 1 or not leader.block_table, "a group's pages are forked at prefill"
        bm = self.block_manager
        # the last sampled token is never written to the pool
        max_kv_tokens = leader.num_prompt_tokens + leader.params.max_new_tokens - 1
        if num_blocks_for(max_kv_tokens, bm.block_size) > bm.num_blocks:
            raise ValueError(
                f"a prompt of {leader.num_prompt_tokens} tokens with max_new_tokens="
                f"{leader.params.max_new_tokens} needs "
                f"{num_blocks_for(max_kv_tokens, bm.block_size)} KV pages of {bm.block_size} "
                f"tokens, but the whole pool has {bm.num_blocks}; raise the engine's "
                "num_blocks / kv_cache_bytes, or shorten the prompt or max_new_tokens"
            )
        if len(group) > self.max_num_seqs:
            raise ValueError(
                f"n={len(group)} samples per prompt exceed max_num_seqs={self.max_num_seqs}; "
                "raise the engine's max_num_seqs or lower n"
            )
        self.waiting.append(group)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Batch:
        self._steady = None  # (the running sequences may change here)
        batch = self._schedule_prefill() or self._schedule_decode()
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        self.peak_unshared_blocks = max(
            self.peak_unshared_blocks, sum(len(seq.block_table) for seq in self.running)
        )
        return batch

    def schedule_next_decode(self) -> Batch | None:
        """The decode after the one in flight, chosen before that one is committed: the running
        sequences, each of them in the step in flight, in the same order. None when the commit
        could change the next step (a sequence reaches max_new_tokens, a waiting group could be
        admitted, pages would run short for some sequence); the caller then commits and calls
        `schedule`. A sequence that stops at a stop token is only found at the commit: its token
        from this step is dropped then. The caller launches the batch it gets (`launched`).

        Steps in a row over the same running sequences (nothing finished, admitted or preempted
        since: `_steady`) read their lengths and pages from arrays moved on by one token a step,
        not from every sequence (a slow GPU host spent 0.1-0.17 ms a G1 step in that loop)."""
        bm = self.block_manager
        running = self.running
        if not running or (self.waiting and self._can_admit(self.waiting[0])):
            self._steady = None
            return None
        steady = self._steady
        if steady is None:
            steady = _SteadyRun.of(running, bm)
        else:
            steady.num_tokens += 1  # the batch it gave last was launched: one token each
        seqs = steady.seqs
        first = seqs[0]
        assert steady.num_tokens[0] == len(first.prompt_ids) + len(first.output_ids), "steady run"
        if (steady.num_tokens >= steady.limits).any():  # one reaches its length in flight
            self._steady = None
            return None
        index = (steady.num_tokens - 1) // bm.block_size
        growing = np.flatnonzero((index == steady.table_lens) | steady.shared)
        if len(growing) > bm.num_free_blocks:
            self._steady = None
            return None
        copies: list[tuple[int, int]] = []
        rows = growing.tolist()
        for row in rows:
            copies += bm.append_slot(seqs[row])
        steady.table_lens[growing] = [len(seqs[row].block_table) for row in rows]
        steady.num_pages = int(steady.table_lens.sum()) if rows else steady.num_pages
        steady.shared[:] = False  # (a copy-on-write happens once, after the prefill's fork)
        self._steady = steady
        self.num_decode_steps += 1
        self.num_overlapped_steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, bm.num_used_blocks)
        self.peak_unshared_blocks = max(self.peak_unshared_blocks, steady.num_pages)
        batch = Batch(is_prefill=False, groups=steady.groups, block_copies=copies, grown_rows=rows)
        batch.__dict__["seqs"] = batch.__dict__["leaders"] = seqs  # (the cached properties)
        return batch

    def postprocess(
        self,
        batch: Batch,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: Callable[[Sequence], str | None],
    ) -> None:
        """Record the step's sampled tokens; finished sequences give their pages back now."""
        self.launched(batch)
        self.commit(batch, token_ids, logprobs, finish_reason)

    def launched(self, batch: Batch) -> None:
        """The step is on the device: the K/V of every current token will be in the pool, and
        each sequence has one more (pending) token."""
        nan = float("nan")
        for seq in batch.seqs:
            outputs = seq.output_ids
            seq.num_cached_tokens = len(seq.prompt_ids) + len(outputs)
            outputs.append(PENDING)
            seq.logprobs.append(nan)
            seq.num_pending += 1

    def commit(
        self,
        batch: Batch,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: Callable[[Sequence], str | None],
        entropies: list[float] | None = None,
    ) -> None:
        """The step's sampled tokens are known: fill them in, in order; `finish_reason` sees each
        sequence up to its new token. Finished sequences give their pages back now (unless they
        `keep_pages`), and drop the token a step launched after this one computed for them.
        `entropies`: the sampler's entropy per sequence, when the step computed them."""
        seqs = batch.seqs
        assert len(seqs) == len(token_ids) == len(logprobs)
        if entropies is not None:
            _record_entropies(seqs, entropies)
        any_finished = False
        finished = SequenceStatus.FINISHED
        stop_ids = getattr(finish_reason, "stop_ids", None)
        if stop_ids is not None and not getattr(finish_reason, "stop_strings", True):
            self._commit_plain(seqs, token_ids, logprobs, stop_ids)
            return
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            if seq.status is finished:  # stopped at an earlier step
                continue
            outputs, seq_logprobs = seq.output_ids, seq.logprobs
            ahead = seq.num_pending - 1  # a later step's token, at most one
            assert 0 <= ahead <= 1
            if ahead:  # out of the way while the finish rule looks at the sequence
                next_id, next_logprob = outputs.pop(), seq_logprobs.pop()
            outputs[-1] = token_id
            seq_logprobs[-1] = logprob
            seq.num_pending = ahead
            reason = finish_reason(seq)
            if reason is not None:
                self._finish(seq, reason)
                any_finished = True
            elif ahead:
                outputs.append(next_id)
                seq_logprobs.append(next_logprob)
        if any_finished:
            self._drop_finished()

    def _commit_plain(self, seqs, token_ids, logprobs, stop_ids) -> None:
        """`commit` under the plain finish rule (a stop id, else the length; `PagedEngine`'s
        without stop strings, which says so by its `stop_ids` and `stop_strings`): the token
        is written in its place, before the later step's pending one, with no pops and no call
        per sequence (a slow GPU host spent 0.2 ms a G1 step in the general loop)."""
        any_finished = False
        finished = SequenceStatus.FINISHED
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            if seq.status is finished:  # stopped at an earlier step
                continue
            ahead = seq.num_pending - 1  # a later step's token, at most one
            outputs = seq.output_ids
            outputs[-1 - ahead] = token_id
            seq.logprobs[-1 - ahead] = logprob
            seq.num_pending = ahead
            if token_id in stop_ids:
                reason = "stop"
            elif len(outputs) - ahead >= seq.params.max_new_tokens:
                reason = "length"
            else:
                continue
            if ahead:  # the later step's token is dropped
                del outputs[-1], seq.logprobs[-1]
            self._finish(seq, reason)
            any_finished = True
        if any_finished:
            self._drop_finished()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """`seq` is done: its pages back now (unless it `keep_pages`)."""
        seq.num_pending = 0
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if not seq.keep_pages:
            self.block_manager.free(seq)

    def _drop_finished(self) -> None:
        self.running = deque(seq for seq in self.running if not seq.is_finished)
        self._steady = None

    def _can_admit(self, group: list[Sequence]) -> bool:
        return len(self.running) + len(group) <= self.max_num_seqs and (
            self.block_manager.can_prefill(group[0])
        )

    def _schedule_prefill(self) -> Batch | None:
        bm = self.block_manager
        groups: list[list[Sequence]] = []
        copies: list[tuple[int, int]] = []
        num_tokens = num_seqs = 0
        while self.waiting:
            group = self.waiting[0]
            leader = group[0]
            is_first = not groups
            # a continued or forked sequence computes only the tokens past its cached prefix
            num_new = leader.num_tokens - leader.num_cached_tokens
            if not is_first and num_tokens + num_new > self.max_num_batched_tokens:
                break  # the first group may exceed the budget alone, or it could never run
            if len(self.running) + num_seqs + len(group) > self.max_num_seqs:
                break
            if not bm.can_prefill(leader):
                break
            self.waiting.popleft()
            copies += bm.allocate(leader)
            for seq in group[1:]:
                bm.fork(leader, seq)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            groups.append(group)
            num_tokens += num_new
            num_seqs += len(group)
        if not groups:
            # an empty pool always fits the first waiting group (checked by `add`)
            assert self.running, "scheduler stalled: nothing running and nothing fits"
            return None
        self.running.extend(seq for group in groups for seq in group)
        self.num_prefill_steps += 1
        self.num_prefill_tokens += num_tokens
        return Batch(is_prefill=True, groups=groups, block_copies=copies)

    def _schedule_decode(self) -> Batch:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        while self.running:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                self._preempt(self.running.pop() if self.running else seq)
                if seq.status is SequenceStatus.WAITING:
                    break
            else:
                copies += bm.append_slot(seq, checked=True)
                scheduled.append(seq)
        # alone in the pool, any admitted sequence can grow to its last token
        assert scheduled, "scheduler stalled: no running sequence can append a token"
        self.running.extend(scheduled)
        self.num_decode_steps += 1
        return Batch(is_prefill=False, groups=[[seq] for seq in scheduled], block_copies=copies)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft([seq])
        self.num_preemptions += 1


def _record_entropies(seqs: list[Sequence], entropies: list[float]) -> None:
    """Each sequence's entropy at the position this step fills, within its window (a step
    launched ahead may have appended one more pending token after it)."""
    finished = SequenceStatus.FINISHED
    for seq, entropy in zip(seqs, entropies):
        position = len(seq.output_ids) - seq.num_pending
        if seq.status is not finished and position < seq.entropy_window:
            assert position == len(seq.entropies), "entropies are recorded in order"
            seq.entropies.append(entropy)


@dataclass
class _SteadyRun:
    """The running sequences of decodes chosen ahead in a row, as arrays by row: tokens so far
    (pending ones counted), the length each stops at, pages held, whether the last page is
    shared (copied on its next write), the pages of all, and the batch's groups (one list for
    every step of the run)."""

    seqs: list[Sequence]
    groups: list[list[Sequence]]
    num_tokens: np.ndarray
    limits: np.ndarray
    table_lens: np.ndarray
    shared: np.ndarray
    num_pages: int

    @classmethod
    def of(cls, running, bm: BlockManager) -> _SteadyRun:
        seqs = list(running)
        prompt = np.array([len(seq.prompt_ids) for seq in seqs], dtype=np.int64)
        tokens = prompt + np.array([len(seq.output_ids) for seq in seqs], dtype=np.int64)
        limits = prompt + np.array([seq.params.max_new_tokens for seq in seqs], dtype=np.int64)
        table_lens = np.array([len(seq.block_table) for seq in seqs], dtype=np.int64)
        index = (tokens - 1) // bm.block_size
        refs = bm.ref_counts
        shared = np.array(
            [i < n and refs[seq.block_table[i]] > 1 for seq, i, n in zip(seqs, index, table_lens)],
            dtype=bool,
        )
        groups = [[seq] for seq in seqs]
        return cls(seqs, groups, tokens, limits, table_lens, shared, int(table_lens.sum()))
