"""Routing replay, the engine's side (tiny random Qwen3-MoE / Qwen2-MoE, CPU float32): with
`record_routes` every completion carries the experts each position before its last token was
routed to, and they are the top-k of the model's own router on the same tokens (transformers'
forward over prompt + completion); a group's samples share their prompt's rows; a multi-turn
session's continued sequence keeps its history's routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import continued_after_stop
from .test_moe import FAMILIES, PROMPTS, tiny_moe


def hf_routes(model, ids: list[int]) -> np.ndarray:
    """[positions, sparse layers, k]: transformers' own router's top-k sets (sorted)."""
    with torch.no_grad():
        out = model(torch.tensor([ids], device=model.device), output_router_logits=True)
    k = model.config.num_experts_per_tok
    layers = [logits.reshape(len(ids), -1).topk(k, dim=-1).indices for logits in out.router_logits]
    return torch.stack(layers, dim=1).sort(-1).values.cpu().numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routes_are_the_models_top_k(tokenizer, family):
    model = tiny_moe(family, tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4, record_routes=True)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=3)
    outputs = engine.generate(PROMPTS, params)
    for prompt, group in zip(PROMPTS, outputs):
        for completion in group:
            ids = prompt + completion.token_ids
            routes = completion.routes
            assert routes.dtype == np.uint8 and routes.shape == (len(ids) - 1, 2, 2)
            np.testing.assert_array_equal(np.sort(routes, -1), hf_routes(model, ids)[:-1])
        first, second = group
        np.testing.assert_array_equal(first.routes[: len(prompt)], second.routes[: len(prompt)])
    plain = PagedEngine(model, tokenizer, block_size=4).generate(PROMPTS, params)
    assert plain[0][0].routes is None
    assert [c.token_ids for g in plain for c in g] == [c.token_ids for g in outputs for c in g]


def test_preempted_and_continued_sequences_keep_aligned_routes(tokenizer):
    """A pool too small for every sequence at once (preemption recomputes a sequence), and a
    session that continues a finished sequence with more ids (only those are prefilled)."""
    model = tiny_moe("qwen3_moe", tokenizer)
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=12, record_routes=True)
    params = SamplingParams(max_new_tokens=14, temperature=1.0, n=3, seed=1, ignore_eos=True)
    outputs = engine.generate(PROMPTS[:2], params)
    assert engine.stats.extra["num_preemptions"] > 0
    for prompt, group in zip(PROMPTS, outputs):
        for completion in group:
            ids = prompt + completion.token_ids
            np.testing.assert_array_equal(
                np.sort(completion.routes, -1), hf_routes(model, ids)[:-1]
            )
    longer = continued_after_stop(engine, PROMPTS[1])
    routes = engine._completion(longer).routes
    assert routes.shape[0] == longer.num_tokens - 1
    np.testing.assert_array_equal(np.sort(routes, -1), hf_routes(model, longer.token_ids)[:-1])


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_routes_recorded_under_cuda_graphs_are_the_models_top_k(tokenizer, graphs):
    """Decode replayed from CUDA graphs writes its routes into the graphs' buffer, copied to
    pinned host memory behind the step (float32: no bfloat16 ties)."""
    model = tiny_moe("qwen3_moe", tokenizer).to("cuda")
    engine = PagedEngine(
        model, tokenizer, block_size=4, num_blocks=256, use_cuda_graphs=graphs, record_routes=True
    )
    assert (engine.runner.graphs is not None) == graphs
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=4, ignore_eos=True)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params)):
        for completion in group:
            ids = prompt + completion.token_ids
            want = hf_routes(model, ids)[:-1]
            np.testing.assert_array_equal(np.sort(completion.routes, -1), want)
