"""The engine's records of its residual streams (`engine.records`; tiny random models, CPU
float32): with a store attached every completion carries the host row of each position before
its last token, and each row is transformers' own output of every decoder layer at that position
(its forward over prompt + completion); a group's samples share their prompt's rows; preempted
and continued sequences keep aligned rows; a reset makes old rows stale; past its room a store
stops recording and says so. Beside each row, the log-sum-exp and entropy of the distribution a
step sampled the next token from at that position (transformers' logits at the temperature;
NaN where nothing was sampled), kept through preemption and continuation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import FAMILIES, build_model, continued_after_stop

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8], [4, 4, 6, 1, 9, 12, 30]]


def hf_layer_outputs(model, ids: list[int]) -> torch.Tensor:
    """[positions, layers, hidden]: each decoder layer's output in transformers' forward."""
    outs = []
    hooks = [
        layer.register_forward_hook(
            lambda _m, _a, out: outs.append(out[0] if isinstance(out, tuple) else out)
        )
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([o[0] for o in outs], dim=1)


def recorded(completion) -> torch.Tensor:
    hidden = completion.hidden
    store = hidden.store
    assert hidden.valid and hidden.length == len(hidden.token_ids) - 1
    rows = torch.from_numpy(hidden.rows_P[: hidden.length])
    layers = range(store.row_shape[0])
    return torch.stack([store.read_layer(rows, k) for k in layers], dim=1)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def assert_stats(completion, model, first_sampled: int, temperature: float) -> None:
    """The statistics at every position from `first_sampled` on (each predicts a sampled
    token) are `row_stats` of transformers' logits there; the positions before are NaN."""
    from reinforge.engine.sampling import row_stats

    hidden = completion.hidden
    hidden.store.wait()
    stats = torch.from_numpy(hidden.store.stats_of(hidden.rows_P[: hidden.length]))
    ids = hidden.token_ids
    want = row_stats(hf_logits(model, ids)[first_sampled : len(ids) - 1], temperature)
    torch.testing.assert_close(stats[first_sampled:], want, atol=2e-5, rtol=2e-5)
    assert torch.isnan(stats[:first_sampled]).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_records_are_every_layers_output(micro_dir, tokenizer, family, monkeypatch):
    model = build_model(family, micro_dir, tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4)
    if family == "qwen2":  # host chunks of 7 rows: steps and gathers cross chunks
        from reinforge.engine import records

        row = model.config.num_hidden_layers * model.config.hidden_size * 4
        monkeypatch.setattr(records, "CHUNK_BYTES", 7 * row)
    store = engine.runner.record_hidden(1 << 30)
    params = SamplingParams(max_new_tokens=9, temperature=1.0, n=2, seed=3, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    for prompt, group in zip(PROMPTS, outputs):
        for completion in group:
            ids = prompt + completion.token_ids
            assert completion.hidden.token_ids == ids
            torch.testing.assert_close(
                recorded(completion), hf_layer_outputs(model, ids)[:-1], atol=2e-5, rtol=2e-5
            )
            assert_stats(completion, model, len(prompt) - 1, 1.0)
        first, second = group  # the prompt computed once, for both
        n = len(prompt)
        np.testing.assert_array_equal(first.hidden.rows_P[:n], second.hidden.rows_P[:n])
        assert first.hidden.rows_P[n] != second.hidden.rows_P[n]
    # every computed token has one row: prompts once per group, each sample's tokens but the last
    computed = sum(len(p) + 2 * (9 - 1) for p in PROMPTS)
    assert store.num_rows == 1 + computed
    assert len(store.chunks) == (-(-store.num_rows // 7) if family == "qwen2" else 1)
    store.reset()  # a new rollout: the old completions' rows are stale
    assert not outputs[0][0].hidden.valid
    plain = PagedEngine(model, tokenizer, block_size=4).generate(PROMPTS, params)
    assert plain[0][0].hidden is None
    assert [c.token_ids for g in plain for c in g] == [c.token_ids for g in outputs for c in g]


def test_preempted_and_continued_sequences_keep_aligned_records(micro_dir, tokenizer):
    """A pool too small for every sequence at once (preemption recomputes a sequence), and a
    session that continues a finished sequence with more ids (only those are prefilled)."""
    model = build_model("qwen2", micro_dir, tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=12)
    engine.runner.record_hidden(1 << 30)
    params = SamplingParams(max_new_tokens=14, temperature=0.7, n=3, seed=1, ignore_eos=True)
    outputs = engine.generate(PROMPTS[:2], params)
    assert engine.stats.extra["num_preemptions"] > 0
    for prompt, group in zip(PROMPTS, outputs):
        for completion in group:
            ids = prompt + completion.token_ids
            torch.testing.assert_close(
                recorded(completion), hf_layer_outputs(model, ids)[:-1], atol=2e-5, rtol=2e-5
            )
            # a recomputed position keeps the row its token was sampled from
            assert_stats(completion, model, len(prompt) - 1, 0.7)
    longer = continued_after_stop(engine, PROMPTS[1])
    completion = engine._completion(longer)
    torch.testing.assert_close(
        recorded(completion), hf_layer_outputs(model, longer.token_ids)[:-1], atol=2e-5, rtol=2e-5
    )
    # greedy steps: at temperature 1; the three ids the session appended were not sampled
    completion.hidden.store.wait()
    stats = completion.hidden.store.stats_of(completion.hidden.rows_P[: completion.hidden.length])
    n, total = len(PROMPTS[1]), len(longer.token_ids)
    appended = range(total - 4 - 3, total - 4 - 1)  # the ids before the last appended one
    assert np.isfinite(stats[n - 1 : total - 4 - 3]).all()
    assert np.isnan(stats[list(appended)]).all()
    assert np.isfinite(stats[total - 4 - 1 :]).all()
    want = row_stats_of(model, longer.token_ids, total - 4 - 1)
    torch.testing.assert_close(torch.from_numpy(stats[total - 4 - 1 :]), want, atol=2e-5, rtol=2e-5)


def row_stats_of(model, ids: list[int], first: int) -> torch.Tensor:
    from reinforge.engine.sampling import row_stats

    return row_stats(hf_logits(model, ids)[first : len(ids) - 1], 1.0)


def test_a_store_past_its_room_stops_recording(micro_dir, tokenizer):
    model = build_model("qwen2", micro_dir, tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4)
    row = model.config.num_hidden_layers * model.config.hidden_size * 4
    store = engine.runner.record_hidden(40 * row)  # room for 40 rows: fewer than a rollout
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=4, seed=2, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    assert store.overflowed and store.num_rows <= 40
    assert not any(c.hidden.valid for g in outputs for c in g)
    store.reset()  # the next rollout records again
    small = engine.generate(PROMPTS[1:2], SamplingParams(max_new_tokens=3, seed=2))
    assert small[0][0].hidden.valid


def test_staged_steps_reach_their_rows_across_halves_and_chunks(monkeypatch):
    """Decode steps' records staged on the device (`HiddenStore._stage`, a graph's buffer that
    the next step overwrites) reach the host rows each sequence was told, through both staging
    halves in turn, a step that does not fit the half's room, a prefill between (sent at once,
    after the staged ones) and host chunks of 5 rows."""
    from types import SimpleNamespace

    from reinforge.engine import records

    monkeypatch.setattr(records, "CHUNK_BYTES", 5 * 2 * 3 * 4)
    store = records.HiddenStore(2, 3, torch.float32, "cpu", 1 << 20)
    params = SimpleNamespace(max_new_tokens=40)
    seqs = [
        SimpleNamespace(
            hidden=None, num_prompt_tokens=2, num_cached_tokens=0, num_tokens=2, params=params
        )
        for _ in range(3)
    ]
    expected = {}  # (sequence, position) -> its record
    generator = torch.Generator().manual_seed(0)

    def step(members, prefill=False):
        groups = [[s] for s in members]
        new = [s.num_tokens - s.num_cached_tokens if prefill else 1 for s in members]
        T = sum(new)
        values = torch.randn(T, 2, 3, generator=generator)
        store.write(values, groups, reused=not prefill)
        row = 0
        for s, n in zip(members, new):
            for p in range(s.num_cached_tokens, s.num_cached_tokens + n):
                expected[id(s), p] = values[row]
                row += 1
            s.num_cached_tokens += n
            s.num_tokens = s.num_cached_tokens + 1

    step(seqs, prefill=True)
    for _ in range(6):
        step(seqs)
    step(seqs[:2])  # a finished sequence leaves the batch: a smaller step
    seqs[2].num_tokens = seqs[2].num_cached_tokens + 3  # a continued sequence's prefill
    step([seqs[2]], prefill=True)
    for _ in range(5):
        step(seqs)
    store.wait()
    assert len(store.chunks) > 3
    for (key, position), value in expected.items():
        seq = next(s for s in seqs if id(s) == key)
        row = torch.tensor([int(seq.hidden.rows_P[position])])
        got = torch.stack([store.read_layer(row, k)[0] for k in range(2)])
        torch.testing.assert_close(got, value, atol=0, rtol=0)


def test_a_decode_steps_rows_go_to_each_sequences_positions():
    """The store's decode path (one indexed assignment into its positions table): sequences
    joining and leaving between steps, positions past the table's width, a session's fork, and
    rows made stale by a reset, against a plain dict of what each step wrote."""
    from types import SimpleNamespace

    from reinforge.engine.records import HiddenStore

    store = HiddenStore(2, 4, torch.float32, "cpu", max_bytes=1 << 24)
    records = torch.zeros((0, 2, 4))

    def seq(prompt: int, max_new: int):
        params = SimpleNamespace(max_new_tokens=max_new)
        return SimpleNamespace(
            hidden=None, num_cached_tokens=prompt, num_prompt_tokens=prompt, params=params
        )

    seqs = [seq(3, 4), seq(5, 2), seq(1, 40)]
    want: dict[int, dict[int, int]] = {id(s): {} for s in seqs}
    rng = np.random.default_rng(0)
    for step in range(30):
        batch = [s for s in seqs if rng.random() < 0.8] or seqs[:1]
        base = store.num_rows
        store.write(records.new_zeros((len(batch), 2, 4)), [[s] for s in batch])
        for i, s in enumerate(batch):
            want[id(s)][s.num_cached_tokens] = base + i
            s.num_cached_tokens += 1  # past 3 + 4 and 5 + 2 positions: the table widens
        if step == 10:
            child = seq(0, 4)
            child.hidden = batch[0].hidden.fork(batch[0].num_cached_tokens)
            child.num_cached_tokens = batch[0].num_cached_tokens
            want[id(child)] = dict(want[id(batch[0])])
            seqs.append(child)
    for s in seqs:
        got = {p: int(r) for p, r in enumerate(s.hidden.rows_P[: s.hidden.length]) if r >= 0}
        assert got == want[id(s)]
        assert s.hidden.length == max(want[id(s)]) + 1
    done = seqs[0].hidden.completed(list(range(seqs[0].num_cached_tokens + 1)))
    store.reset()  # a new generation takes the table: old live rows read as empty
    assert not seqs[0].hidden.valid and seqs[0].hidden.length == 0
    fresh = seq(2, 3)
    store.write(records.new_zeros((1, 2, 4)), [[fresh]])
    assert fresh.hidden.rows_P[2] == store.num_rows - 1
    assert done.slot is None and done.length == seqs[0].num_cached_tokens  # its own copy
    assert {p: int(r) for p, r in enumerate(done.rows_P[: done.length]) if r >= 0} == want[
        id(seqs[0])
    ]
    stale_copy = seqs[0].hidden.completed([1, 2, 3])
    assert not stale_copy.valid and (stale_copy.rows_P[: stale_copy.length] < 0).all()
