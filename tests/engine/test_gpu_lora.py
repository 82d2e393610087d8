"""PEFT LoRA through the CUDA path (Triton kernels, CUDA graphs; float32 micro models): equal to
the merged weights, an optimizer step on the adapter seen by the next replay with no recapture,
and `disable_adapter()` honoured (the graphs are captured again for it). Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import FAMILIES, build_model
from .test_gpu_engine import hf_greedy_cuda
from .test_lora_engine import with_adapter

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37)), list(range(40, 73))]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)


def adapted_on_cuda(family, micro_dir, tokenizer, seed=0, std=0.3):
    return with_adapter(build_model(family, micro_dir, tokenizer, seed=seed), std=std).to(CUDA)


def engine_for(model, tokenizer, **kwargs) -> PagedEngine:
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=256, **kwargs)
    assert engine.fallback is None and engine.runner.backend.name == "triton-paged"
    return engine


def run(engine):
    outputs = engine.generate(PROMPTS, GREEDY)
    return [[c.token_ids for c in g] for g in outputs], outputs


def merged(peft_model):
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def base_of(peft_model):
    return copy.deepcopy(peft_model).unload().eval()


def assert_logprobs_close(got, expected, atol=1e-3):
    for got_group, expected_group in zip(got, expected):
        for a, b in zip(got_group, expected_group):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_merged_with_graphs(micro_dir, tokenizer, family):
    model = adapted_on_cuda(family, micro_dir, tokenizer)
    engine = engine_for(model, tokenizer)
    ids, outputs = run(engine)
    assert engine.runner.graphs.graphs, "decode should have replayed CUDA graphs"
    reference = merged(model)
    ref_ids, ref_outputs = run(engine_for(reference, tokenizer))
    assert ids == ref_ids
    assert_logprobs_close(outputs, ref_outputs)
    for prompt, group in zip(PROMPTS, ids):
        assert group == [hf_greedy_cuda(reference, prompt, GREEDY.max_new_tokens)] * 2
    eager_ids, _ = run(engine_for(model, tokenizer, use_cuda_graphs=False))
    assert eager_ids == ids


def test_lora_step_is_seen_by_the_graphs_and_disable_adapter_recaptures(micro_dir, tokenizer):
    model = adapted_on_cuda("qwen2", micro_dir, tokenizer, seed=2, std=0.1)
    engine = engine_for(model, tokenizer)
    before, _ = run(engine)
    captured = dict(engine.runner.graphs.graphs)
    assert captured

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05)
    ids = torch.tensor([PROMPTS[2] + before[2][0]], device=CUDA)
    for _ in range(3):  # push away from what it generated
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.neg().backward()
        optimizer.step()

    after, after_outputs = run(engine)  # nothing called in between
    assert engine.runner.graphs.graphs == captured, "in-place updates need no recapture"
    assert after != before
    reference = merged(model)
    for prompt, group in zip(PROMPTS, after):
        assert group[0] == hf_greedy_cuda(reference, prompt, GREEDY.max_new_tokens)
    _, ref_outputs = run(engine_for(reference, tokenizer))
    assert_logprobs_close(after_outputs, ref_outputs)

    base = base_of(model)
    with model.disable_adapter():
        disabled, _ = run(engine)
    assert engine.runner.graphs.graphs != captured, "the adapter's state is part of a graph"
    for prompt, group in zip(PROMPTS, disabled):
        assert group[0] == hf_greedy_cuda(base, prompt, GREEDY.max_new_tokens)
    assert disabled != after
    again, _ = run(engine)  # enabled again: captured again, the adapter applies
    assert again == after
