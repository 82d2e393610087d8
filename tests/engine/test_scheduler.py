"""Continuous batching in plain Python, driven by a deterministic stand-in for the model (the
next token is a hash of the tokens so far), so recomputation after preemption must reproduce
exactly what an unconstrained run produces."""

from __future__ import annotations

from collections import Counter

import pytest

from reinforge.engine.base import SamplingParams
from reinforge.engine.block_manager import BlockManager
from reinforge.engine.scheduler import Scheduler
from reinforge.engine.sequence import Sequence, SequenceStatus


def next_token(seq: Sequence) -> int:
    return (sum((i + 1) * t for i, t in enumerate(seq.token_ids)) * 31 + seq.sample_index) % 97


def finish_at_length(seq: Sequence) -> str | None:
    return "length" if seq.num_output_tokens >= seq.params.max_new_tokens else None


def check_invariants(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    holders = Counter(block for seq in scheduler.running for block in seq.block_table)
    assert all(bm.ref_counts[b] == holders.get(b, 0) for b in range(bm.num_blocks))
    assert bm.num_used_blocks == len(holders)
    assert all(not seq.block_table for group in scheduler.waiting for seq in group)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def run(prompts, params, num_blocks, block_size=4, max_num_seqs=64, max_tokens=64):
    scheduler = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_tokens)
    groups = [
        [Sequence(list(p), params, group_id=g, sample_index=k) for k in range(params.n)]
        for g, p in enumerate(prompts)
    ]
    for group in groups:
        scheduler.add(group)
    num_steps = 0
    while not scheduler.is_finished():
        batch = scheduler.schedule()
        check_invariants(scheduler)
        # every member of a prefilled group is sampled from its leader's (shared) context
        tokens = [next_token(seq) for seq in batch.seqs]
        scheduler.postprocess(batch, tokens, [0.0] * len(tokens), finish_at_length)
        num_steps += 1
        assert num_steps < 10_000, "no progress"
    assert scheduler.block_manager.num_free_blocks == num_blocks
    return groups, scheduler


PROMPTS = [list(range(1, 4)), list(range(10, 27)), list(range(30, 41)), [5] * 8]


def test_all_requests_complete_and_pages_return():
    params = SamplingParams(max_new_tokens=10, n=3)
    groups, scheduler = run(PROMPTS, params, num_blocks=200)
    assert scheduler.num_preemptions == 0
    for group in groups:
        for seq in group:
            assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
            assert seq.num_output_tokens == 10 and seq.block_table == []
    assert scheduler.peak_used_blocks < scheduler.peak_unshared_blocks


def test_preemption_under_tiny_pool_reproduces_unconstrained_run():
    params = SamplingParams(max_new_tokens=12, n=3)
    free_groups, free_sched = run(PROMPTS, params, num_blocks=200)
    # one sequence needs at most ceil((17 + 12 - 1) / 4) = 7 pages: 8 forces preemption
    tight_groups, tight_sched = run(PROMPTS, params, num_blocks=8)
    assert free_sched.num_preemptions == 0 and tight_sched.num_preemptions > 0
    assert [[s.output_ids for s in g] for g in tight_groups] == [
        [s.output_ids for s in g] for g in free_groups
    ]


def test_prefill_respects_sequence_cap_and_token_budget():
    params = SamplingParams(max_new_tokens=2, n=2)
    scheduler = Scheduler(BlockManager(100, 4), max_num_seqs=5, max_num_batched_tokens=20)
    for p in ([1] * 8, [2] * 8, [3] * 8):
        scheduler.add([Sequence(list(p), params, sample_index=k) for k in range(2)])
    batch = scheduler.schedule()
    assert batch.is_prefill and len(batch.groups) == 2  # 16 tokens; a third would make 24
    assert len(batch.seqs) == 4 and scheduler.block_manager.num_used_blocks == 4
    scheduler.postprocess(batch, [0] * 4, [0.0] * 4, finish_at_length)
    batch = scheduler.schedule()  # the third group's 2 samples would make 6 > 5 sequences
    assert not batch.is_prefill and len(batch.seqs) == 4


def test_oversized_first_prompt_still_runs_alone():
    params = SamplingParams(max_new_tokens=2)
    groups, _ = run([[1] * 30, [2] * 3], params, num_blocks=50, max_tokens=16)
    assert all(seq.num_output_tokens == 2 for group in groups for seq in group)


def test_requests_that_cannot_fit_are_refused_at_add():
    scheduler = Scheduler(BlockManager(num_blocks=4, block_size=4), max_num_seqs=4)
    with pytest.raises(ValueError, match=r"needs 5 KV pages .* whole pool has 4"):
        scheduler.add([Sequence([1] * 17, SamplingParams(max_new_tokens=1))])
    scheduler.add([Sequence([1] * 16, SamplingParams(max_new_tokens=1))])  # exactly fits
    with pytest.raises(ValueError, match="max_num_seqs"):
        scheduler.add([Sequence([1], SamplingParams(n=5)) for _ in range(5)])


def test_a_decode_chosen_ahead_names_the_rows_whose_page_tables_changed():
    """The overlapped loop (`PagedEngine.generate`): each decode chosen ahead names the rows
    whose sequence took or copied a page for it; every other row's page table is the one the
    step before ran with (the decode graphs then check and send only the rows named)."""
    params = SamplingParams(max_new_tokens=13, n=3, temperature=1.0)
    scheduler = Scheduler(BlockManager(64, 4), 64, 64)
    for g, prompt in enumerate(PROMPTS):
        scheduler.add(
            [Sequence(list(prompt), params, group_id=g, sample_index=k) for k in range(3)]
        )
    inflight = scheduler.schedule()
    scheduler.launched(inflight)
    tables = [list(seq.block_table) for seq in inflight.seqs]
    named = Counter()
    while True:
        ahead = None if inflight.is_prefill else scheduler.schedule_next_decode()
        if ahead is not None:
            scheduler.launched(ahead)
            assert [s.seq_id for s in ahead.seqs] == [s.seq_id for s in inflight.seqs]
            rows = ahead.grown_rows
            assert rows is not None
            changed = [i for i, seq in enumerate(ahead.seqs) if seq.block_table != tables[i]]
            assert set(changed) <= set(rows), "a table changed in a row not named"
            assert all(
                len(ahead.seqs[i].block_table) > len(tables[i]) or ahead.block_copies for i in rows
            )
            named[bool(rows)] += 1
        tokens = [next_token(seq) for seq in inflight.seqs]
        scheduler.commit(inflight, tokens, [0.0] * len(tokens), finish_at_length)
        if ahead is None:
            if scheduler.is_finished():
                break
            ahead = scheduler.schedule()
            assert ahead.grown_rows is None  # chosen after the commit: not known
            scheduler.launched(ahead)
        inflight = ahead
        tables = [list(seq.block_table) for seq in inflight.seqs]
    assert named[True] > 0 and named[False] > 0  # steps with and without a new page
    assert scheduler.block_manager.num_free_blocks == 64


def test_decode_rows_advanced_from_the_step_before_equal_rows_filled_from_the_sequences():
    """`graph_rows.advance_rows` (what a replay with the same sequences does) against
    `decode_rows` at every decode of an overlapped loop where sequences stop at different steps
    (stop tokens) and cross pages at different steps (prompts of several lengths)."""
    np = pytest.importorskip("numpy")
    from reinforge.engine.graph_rows import (
        IDS,
        NUM_ROW_FIELDS,
        advance_rows,
        decode_rows,
    )

    params = SamplingParams(max_new_tokens=21, n=3, temperature=1.0)
    scheduler = Scheduler(BlockManager(96, 4), 64, 64)
    everyone = []
    for g, prompt in enumerate(PROMPTS):
        group = [Sequence(list(prompt), params, group_id=g, sample_index=k) for k in range(3)]
        scheduler.add(group)
        everyone += group

    def stop_some(seq: Sequence) -> str | None:  # a few sequences stop early, at their own step
        if seq.output_ids[-1] == 7 and seq.num_output_tokens > 8 and seq.sample_index == 1:
            return "stop"
        return finish_at_length(seq)

    inflight = scheduler.schedule()
    scheduler.launched(inflight)
    last_seqs, last_rows, advanced = None, None, 0
    while True:
        ahead = None if inflight.is_prefill else scheduler.schedule_next_decode()
        if ahead is not None:
            seqs = ahead.leaders
            rows = np.empty((NUM_ROW_FIELDS, len(seqs)), dtype=np.int64)
            decode_rows(seqs, 4, rows)
            same = last_seqs is not None and [s.seq_id for s in seqs] == last_seqs
            if same:
                out = np.empty_like(rows)
                advance_rows(last_rows, out, seqs, ahead.grown_rows, 4)
                keep = [f for f in range(NUM_ROW_FIELDS) if f != IDS]
                np.testing.assert_array_equal(out[keep], rows[keep])
                advanced += 1
            last_seqs, last_rows = [s.seq_id for s in seqs], rows
            scheduler.launched(ahead)
        tokens = [next_token(seq) % 9 for seq in inflight.seqs]  # a 7 now and then
        scheduler.commit(inflight, tokens, [0.0] * len(tokens), stop_some)
        if ahead is None:
            if scheduler.is_finished():
                break
            ahead = scheduler.schedule()
            if not ahead.is_prefill:  # a decode after the commit: its rows filled in full
                rows = np.empty((NUM_ROW_FIELDS, len(ahead.leaders)), dtype=np.int64)
                decode_rows(ahead.leaders, 4, rows)
                last_seqs, last_rows = [s.seq_id for s in ahead.leaders], rows
            else:
                last_seqs = None
            scheduler.launched(ahead)
        inflight = ahead
    assert advanced > 10
    reasons = Counter(seq.finish_reason for seq in everyone)
    assert reasons["stop"] > 0 and reasons["length"] > 0, reasons


def test_page_table_updates_leave_the_device_tables_equal_to_the_sequences():
    """`graph_rows.table_update` (applied to a CPU table): through an overlapped loop where
    sequences stop early (rows then hold other sequences), take pages and copy their shared last
    page, the table sent for every row equals its sequence's pages, with the rows checked only
    where a decode chosen ahead names them."""
    import types

    import numpy as np
    import torch

    from reinforge.engine.graph_rows import table_update

    width, rows_cap = 12, 64
    graphs = types.SimpleNamespace(
        table_keys=np.full((3, rows_cap), -1, dtype=np.int64),
        tables=torch.zeros((rows_cap, width), dtype=torch.int32),
    )

    def update(seqs, rows):
        change = table_update(graphs.table_keys, width, seqs, rows)
        if change is not None:
            graphs.tables.view(-1)[torch.from_numpy(change[0])] = torch.from_numpy(change[1]).int()
        for i, seq in enumerate(seqs):
            got = graphs.tables[i, : len(seq.block_table)].tolist()
            assert got == seq.block_table, (i, got, seq.block_table)

    params = SamplingParams(max_new_tokens=23, n=3, temperature=1.0)
    scheduler = Scheduler(BlockManager(96, 4), 64, 64)
    for g, prompt in enumerate(PROMPTS):
        scheduler.add(
            [Sequence(list(prompt), params, group_id=g, sample_index=k) for k in range(3)]
        )

    def stop_some(seq: Sequence) -> str | None:
        if seq.output_ids[-1] == 7 and seq.num_output_tokens > 5 and seq.sample_index == 2:
            return "stop"
        return finish_at_length(seq)

    inflight = scheduler.schedule()
    scheduler.launched(inflight)
    last, named = None, 0
    while True:
        ahead = None if inflight.is_prefill else scheduler.schedule_next_decode()
        if ahead is not None:
            same = last is not None and [s.seq_id for s in ahead.seqs] == last
            update(ahead.seqs, ahead.grown_rows if same else None)
            named += bool(same and ahead.grown_rows)
            last = [s.seq_id for s in ahead.seqs]
            scheduler.launched(ahead)
        tokens = [next_token(seq) % 9 for seq in inflight.seqs]
        scheduler.commit(inflight, tokens, [0.0] * len(tokens), stop_some)
        if ahead is None:
            if scheduler.is_finished():
                break
            ahead = scheduler.schedule()
            if ahead.is_prefill:
                graphs.table_keys[:] = -1  # (`forget_tables`)
                last = None
            else:
                update(ahead.seqs, None)
                last = [s.seq_id for s in ahead.seqs]
            scheduler.launched(ahead)
        inflight = ahead
    assert named > 5
