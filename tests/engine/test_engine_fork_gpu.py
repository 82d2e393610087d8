"""Forks and continuations on CUDA: decode steps from CUDA graphs, the Triton attention, the
boundary page copied on the device, prefills over cached prefixes."""

from __future__ import annotations

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.engine.session import EngineSession

from .conftest import build_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def run_to_end(session):
    while session.has_work():
        session.step()


@pytest.mark.parametrize("dtype", [torch.float32])  # bf16: kernels differ in rounding
def test_forks_and_extensions_on_cuda_graphs_match_fresh_sequences(micro_dir, tokenizer, dtype):
    model = build_model("qwen2", micro_dir, tokenizer).to("cuda", dtype)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=256)
    assert engine.runner.graphs is not None, "the decode graphs are in use"
    session = EngineSession(engine, GREEDY, max_len=128)
    prompts = [list(range(30 + 7 * i, 41 + 7 * i)) for i in range(6)]
    parents = [session.add(p, [i, i + 100], max_new_tokens=20) for i, p in enumerate(prompts)]
    for _ in range(9):  # mid-decode: fork running sequences, steps in flight
        session.step()
    while any(seq.num_pending for group in parents for seq in group):
        session.step()
    forks = [(g[0], len(g[0].token_ids) - 2) for g in parents]
    children = [session.fork(seq, at, 7, 8) for seq, at in forks]
    run_to_end(session)
    replies = [[5, 6, 7 + i] for i in range(6)]
    extended = [session.extend(g[1], r, 0, 6) for g, r in zip(parents, replies)]
    run_to_end(session)
    fresh_params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=8)
    fresh = engine.generate([seq.token_ids[:at] for seq, at in forks], fresh_params)
    assert [c.output_ids for c in children] == [f[0].token_ids for f in fresh]
    fresh_params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=6)
    histories = [g[1].token_ids + r for g, r in zip(parents, replies)]
    fresh = engine.generate(histories, fresh_params)
    assert [e.output_ids for e in extended] == [f[0].token_ids for f in fresh]
