"""Paged KV accounting: exact page counts through allocate, fork, copy on write and free."""

from __future__ import annotations

import pytest

from reinforge.engine.base import SamplingParams
from reinforge.engine.block_manager import BlockManager
from reinforge.engine.sequence import Sequence

PARAMS = SamplingParams(max_new_tokens=8)


def make_group(num_prompt_tokens: int, n: int) -> list[Sequence]:
    prompt = list(range(1, num_prompt_tokens + 1))
    return [Sequence(list(prompt), PARAMS, sample_index=k) for k in range(n)]


def grow(bm: BlockManager, seq: Sequence, token_id: int = 7) -> list[tuple[int, int]]:
    """One decode step's accounting: the sampled token is appended, then its slot reserved."""
    seq.num_cached_tokens = seq.num_tokens
    seq.append(token_id, 0.0)
    return bm.append_slot(seq)


def test_allocate_and_free_exact_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    (seq,) = make_group(9, 1)
    assert bm.can_allocate(9)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    assert [bm.ref_counts[b] for b in seq.block_table] == [1, 1, 1]
    # tokens 9..11 fill the third page; token 12 opens a fourth
    for expected_used in (3, 3, 3, 4):
        assert grow(bm, seq) == []
        assert bm.num_used_blocks == expected_used
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 10 and set(bm.ref_counts) == {0}
    assert not bm.can_allocate(41) and bm.can_allocate(40)


def test_fork_shares_pages_and_copies_partial_page_on_write():
    bm = BlockManager(num_blocks=10, block_size=4)
    group = make_group(6, 3)  # one full page and one partial page of 2 tokens
    leader = group[0]
    bm.allocate(leader)
    for seq in group[1:]:
        bm.fork(leader, seq)
    full, partial = leader.block_table
    assert bm.num_used_blocks == 2 and bm.ref_counts[full] == bm.ref_counts[partial] == 3
    assert all(seq.block_table == [full, partial] for seq in group)

    # first two writers copy the shared partial page; the last one writes it in place
    copies = [grow(bm, seq) for seq in group]
    assert copies[0] == [(partial, group[0].block_table[1])]
    assert copies[1] == [(partial, group[1].block_table[1])]
    assert copies[2] == [] and group[2].block_table == [full, partial]
    assert bm.num_used_blocks == 4
    assert bm.ref_counts[full] == 3 and bm.ref_counts[partial] == 1
    assert len({seq.block_table[1] for seq in group}) == 3

    # the shared full page outlives every holder but the last
    for i, seq in enumerate(group):
        bm.free(seq)
        assert bm.ref_counts[full] == 2 - i
        assert (full in bm.free_blocks) == (i == 2)
    assert bm.num_free_blocks == 10 and sorted(bm.free_blocks) == list(range(10))


def test_full_shared_prompt_needs_no_copy():
    bm = BlockManager(num_blocks=10, block_size=4)
    group = make_group(8, 4)
    bm.allocate(group[0])
    for seq in group[1:]:
        bm.fork(group[0], seq)
    assert bm.num_used_blocks == 2
    for seq in group:  # position 8 starts a third page: one fresh page each, no copy
        assert grow(bm, seq) == []
    assert bm.num_used_blocks == 2 + 4
    for seq in group:
        bm.free(seq)
    assert bm.num_free_blocks == 10


def test_shared_page_freed_exactly_once():
    bm = BlockManager(num_blocks=4, block_size=4)
    group = make_group(5, 2)
    bm.allocate(group[0])
    bm.fork(group[0], group[1])
    stale = list(group[0].block_table)
    bm.free(group[0])
    bm.free(group[1])
    assert bm.num_free_blocks == 4 and len(set(bm.free_blocks)) == 4
    ghost = make_group(5, 1)[0]
    ghost.block_table = stale
    with pytest.raises(AssertionError, match="freed more than once"):
        bm.free(ghost)


def test_can_append_counts_copy_on_write_and_new_pages():
    bm = BlockManager(num_blocks=3, block_size=4)
    group = make_group(6, 2)
    bm.allocate(group[0])
    bm.fork(group[0], group[1])
    group[0].append(9, 0.0)
    group[1].append(9, 0.0)
    assert bm.num_blocks_to_append(group[0]) == 1  # shared partial page: copy
    grow_seq = group[0]
    grow_seq.num_cached_tokens = grow_seq.num_tokens - 1
    assert bm.append_slot(grow_seq) != []
    assert bm.num_free_blocks == 0
    assert bm.num_blocks_to_append(group[1]) == 0  # now the sole holder: writes in place
    assert bm.can_append(group[1])
    group[1].append(9, 0.0)
    group[1].append(9, 0.0)  # position 8: needs a fresh page, none left
    assert bm.num_blocks_to_append(group[1]) == 1 and not bm.can_append(group[1])
