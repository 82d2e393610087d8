"""LoRA generation from the merged copy on CUDA in bfloat16, through the Triton kernels and CUDA
graphs: the adapters path's tokens and logprobs within bf16 noise; a fused AdamW step on A/B
(which bumps no version counter) rebuilds the copy in place and the captured graphs read it with
no recapture; `disable_adapter()` generates from the base. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import build_model
from .test_lora_engine import with_adapter

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37)), list(range(40, 73))]
SAMPLED = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=5, ignore_eos=True)


def bf16_adapted(micro_dir, tokenizer):
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer, seed=2), std=0.1)
    # the trainer's layout: bf16 base weights, float32 A/B
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(torch.bfloat16)
    return model.to(CUDA)


def engine_for(model, tokenizer, mode: str) -> PagedEngine:
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=256, lora_generation=mode)
    assert engine.fallback is None and engine.runner.backend.name == "triton-paged"
    assert engine.lora_generation == mode
    return engine


def error_vs_float32(engine, reference, stat: str = "max") -> float:
    """Sample in bf16; the gap between the sampler's logprobs and the float32 model's
    (teacher-forced on the same tokens): the largest ("max") or the mean ("mean") over the
    sampled tokens. The micro model's logits are large (scrambled weights), so bf16 alone costs
    about 0.1 at the largest (measured on a CPU: adapters 0.13, merged 0.13); the two paths are
    compared by the mean, which one unlucky token does not decide (an H100 once gave merged
    0.100 against the adapters' max under 0.054)."""
    gaps = []
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, SAMPLED)):
        for completion in group:
            ids = torch.tensor([prompt + completion.token_ids], device=CUDA)
            with torch.no_grad():
                logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])
            got = torch.tensor(completion.logprobs, device=CUDA)
            gaps.append((got - expected[:, 0]).abs())
    gap = torch.cat(gaps)
    return (gap.max() if stat == "max" else gap.mean()).item()


def as_close_as_the_adapters(merged, adapters, reference) -> None:
    mean_merged = error_vs_float32(merged, reference, "mean")
    mean_adapters = error_vs_float32(adapters, reference, "mean")
    assert mean_merged <= 1.5 * mean_adapters + 0.005, (mean_merged, mean_adapters)


def float32_copy(model):
    return copy.deepcopy(model).float().eval()


def test_merged_bf16_with_graphs_is_as_close_as_the_adapters(micro_dir, tokenizer):
    model = bf16_adapted(micro_dir, tokenizer)
    merged = engine_for(model, tokenizer, "merged")
    adapters = engine_for(model, tokenizer, "adapters")
    reference = float32_copy(model)
    merged_error = error_vs_float32(merged, reference)
    assert merged.runner.graphs.graphs, "decode should have replayed CUDA graphs"
    as_close_as_the_adapters(merged, adapters, reference)
    assert merged_error < 0.3
    captured, capture_s = dict(merged.runner.graphs.graphs), merged.runner.graph_capture_seconds

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.05, fused=True)  # bumps no version counter
    ids = torch.tensor([PROMPTS[2] + list(range(100, 116))], device=CUDA)
    for _ in range(3):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.neg().backward()
        optimizer.step()
    stale = reference
    reference = float32_copy(model)
    merged_error = error_vs_float32(merged, reference)  # nothing called in between
    assert merged.runner.merged.num_builds == 2
    assert merged.runner.graphs.graphs == captured, "rebuilt in place: no recapture"
    assert merged.runner.graph_capture_seconds == capture_s
    as_close_as_the_adapters(merged, adapters, reference)
    assert error_vs_float32(merged, stale) > 2 * merged_error + 0.1, "the step should matter"

    with model.disable_adapter():  # the KL reference's path: the base weights alone
        base = float32_copy(model)
        as_close_as_the_adapters(merged, adapters, base)
