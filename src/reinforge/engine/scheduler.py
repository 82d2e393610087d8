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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reinforge.engine.block_manager import BlockManager
from reinforge.engine.sequence import Sequence, SequenceStatus, num_blocks_for


@dataclass
class Batch:
    """What one step computes. In a prefill, each group's leader (`group[0]`) has its uncached
    tokens computed and every member of the group gets a token sampled from the leader's last
    logits; in a decode every group is one sequence."""

    is_prefill: bool
    groups: list[list[Sequence]]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, dest) pages

    @property
    def leaders(self) -> list[Sequence]:
        return [group[0] for group in self.groups]

    @property
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

    def add(self, group: list[Sequence]) -> None:
        """Queue the samples of one prompt (all with the same tokens so far)."""
        leader = group[0]
        assert all(seq.token_ids == leader.token_ids for seq in group)
        assert all(seq.status is SequenceStatus.WAITING for seq in group)
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
        batch = self._schedule_prefill() or self._schedule_decode()
        self.peak_used_blocks = max(self.peak_used_blocks, self.block_manager.num_used_blocks)
        self.peak_unshared_blocks = max(
            self.peak_unshared_blocks, sum(len(seq.block_table) for seq in self.running)
        )
        return batch

    def postprocess(
        self,
        batch: Batch,
        token_ids: list[int],
        logprobs: list[float],
        finish_reason: Callable[[Sequence], str | None],
    ) -> None:
        """Record the step's sampled tokens; finished sequences give their pages back now."""
        seqs = batch.seqs
        assert len(seqs) == len(token_ids) == len(logprobs)
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            seq.num_cached_tokens = seq.num_tokens
            seq.append(token_id, logprob)
            reason = finish_reason(seq)
            if reason is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
                self.block_manager.free(seq)
        if any(seq.is_finished for seq in seqs):
            self.running = deque(seq for seq in self.running if not seq.is_finished)

    def _schedule_prefill(self) -> Batch | None:
        bm = self.block_manager
        groups: list[list[Sequence]] = []
        num_tokens = num_seqs = 0
        while self.waiting:
            group = self.waiting[0]
            leader = group[0]
            is_first = not groups
            if not is_first and num_tokens + leader.num_tokens > self.max_num_batched_tokens:
                break  # the first group may exceed the budget alone, or it could never run
            if len(self.running) + num_seqs + len(group) > self.max_num_seqs:
                break
            if not bm.can_allocate(leader.num_tokens):
                break
            self.waiting.popleft()
            bm.allocate(leader)
            for seq in group[1:]:
                bm.fork(leader, seq)
            for seq in group:
                seq.status = SequenceStatus.RUNNING
            groups.append(group)
            num_tokens += leader.num_tokens
            num_seqs += len(group)
        if not groups:
            # an empty pool always fits the first waiting group (checked by `add`)
            assert self.running, "scheduler stalled: nothing running and nothing fits"
            return None
        self.running.extend(seq for group in groups for seq in group)
        return Batch(is_prefill=True, groups=groups)

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
                copies += bm.append_slot(seq)
                scheduled.append(seq)
        # alone in the pool, any admitted sequence can grow to its last token
        assert scheduled, "scheduler stalled: no running sequence can append a token"
        self.running.extend(scheduled)
        return Batch(is_prefill=False, groups=[[seq] for seq in scheduled], block_copies=copies)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft([seq])
        self.num_preemptions += 1
