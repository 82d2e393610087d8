"""Accounting of the paged KV pool: which pages are free, and how many sequences hold each.

A page holds `block_size` consecutive tokens of one sequence's K/V. Sequences of one group share
their prompt's pages by reference (`fork`); a page returns to the free list exactly once, when
its last holder lets go. A shared page is only ever written at the group's first partial page,
so `append_slot` copies that page on write and returns the (source, destination) pair for the
runner to copy the K/V it already holds. Plain Python: the runner owns the tensors.
"""

from __future__ import annotations

from collections import deque

from reinforge.engine.sequence import Sequence, num_blocks_for


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def can_allocate(self, num_tokens: int) -> bool:
        return num_blocks_for(num_tokens, self.block_size) <= len(self.free_blocks)

    def num_blocks_to_prefill(self, seq: Sequence) -> int:
        """Pages a prefill of `seq`'s uncached tokens takes: those past its page table, and a
        copy of each page it holds that the prefill writes into while others share it."""
        first = seq.num_cached_tokens // self.block_size
        copies = sum(self.ref_counts[b] > 1 for b in seq.block_table[first:])
        return num_blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table) + copies

    def can_prefill(self, seq: Sequence) -> bool:
        return self.num_blocks_to_prefill(seq) <= len(self.free_blocks)

    def allocate(self, seq: Sequence) -> list[tuple[int, int]]:
        """Pages for the tokens of `seq` its prefill writes (from `num_cached_tokens` on): fresh
        ones past its table, and its own copy of any page in the written range that it shares
        (a fork's boundary page). Returns the copies (source, destination) for the runner."""
        assert self.can_prefill(seq)
        first = seq.num_cached_tokens // self.block_size
        copies = []
        for index in range(first, len(seq.block_table)):
            shared = seq.block_table[index]
            if self.ref_counts[shared] > 1:
                own = self._take()
                self._release(shared)
                seq.block_table[index] = own
                copies.append((shared, own))
        missing = num_blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table)
        seq.block_table += [self._take() for _ in range(missing)]
        return copies

    def share_prefix(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """`child` (holding no pages) shares the pages of `parent`'s first `num_tokens` tokens,
        whose K/V `parent` holds; the page they end in is copied when either writes to it."""
        assert not child.block_table and num_tokens <= parent.num_cached_tokens
        assert child.token_ids[:num_tokens] == parent.token_ids[:num_tokens]
        pages = parent.block_table[: num_blocks_for(num_tokens, self.block_size)]
        for block in pages:
            assert self.ref_counts[block] >= 1
            self.ref_counts[block] += 1
        child.block_table = list(pages)
        child.num_cached_tokens = num_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every page of `parent` (same tokens so far)."""
        assert not child.block_table and child.token_ids == parent.token_ids
        for block in parent.block_table:
            assert self.ref_counts[block] >= 1
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def num_blocks_to_append(self, seq: Sequence) -> int:
        """Pages the next decode step of `seq` needs: it writes the K/V of its last token."""
        position = seq.num_tokens - 1
        index = position // self.block_size
        assert index <= len(seq.block_table), "a sequence grows one token per step"
        if index == len(seq.block_table):
            return 1
        return 1 if self.ref_counts[seq.block_table[index]] > 1 else 0

    def can_append(self, seq: Sequence) -> bool:
        return self.num_blocks_to_append(seq) <= len(self.free_blocks)

    def append_slot(self, seq: Sequence, checked: bool = False) -> list[tuple[int, int]]:
        """Make the page that receives `seq`'s last token its own; returns the page copies
        (source, destination) the runner must do before the step, at most one. `checked`: the
        caller already knows `can_append(seq)`."""
        assert checked or self.can_append(seq)
        index = (seq.num_tokens - 1) // self.block_size
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return []
        shared = seq.block_table[index]
        if self.ref_counts[shared] == 1:
            return []
        own = self._take()
        self._release(shared)
        seq.block_table[index] = own
        return [(shared, own)]

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        assert self.ref_counts[block] >= 1, f"page {block} freed more than once"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


def pages_to_run_at_once(
    prompt_lens: list[int], max_new_tokens: int, n: int, block_size: int, max_num_seqs: int
) -> int:
    """Pages that hold at full length as many groups as can run at once (`max_num_seqs`
    sequences; the longest prompts counted): each prompt's full pages once (shared by its n
    samples), and per sample its copy of the partial prompt page and its response pages (the
    last sampled token is never written)."""
    pages = []
    for prompt_len in prompt_lens:
        shared = prompt_len // block_size
        own = num_blocks_for(prompt_len + max_new_tokens - 1, block_size) - shared
        pages.append(shared + n * own)
    return sum(sorted(pages, reverse=True)[: max(max_num_seqs // n, 1)])
