"""Mixture of experts on CUDA: the native grouped kernel (bfloat16) equals the per-expert loop in
values and gradients, and decode replayed from CUDA graphs equals the eager decode (float32 tiny
Qwen3-MoE, the padded fallback's path; bfloat16, the grouped kernel's; and bfloat16 with LoRA on
attention, router and experts). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from reinforge.engine import moe
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .test_moe import PROMPTS, loop_experts, tiny_moe, with_adapter

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def test_grouped_kernel_equals_the_loop_on_cuda(tokenizer):
    experts = tiny_moe("qwen3_moe", tokenizer).model.layers[0].mlp.experts
    experts = experts.to(CUDA, torch.bfloat16)
    assert moe.has_grouped_mm(experts.gate_up_proj), "torch._grouped_mm on this GPU"
    generator = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(64, 64, device=CUDA, dtype=torch.bfloat16, generator=generator)
    x.requires_grad_(True)
    scores = torch.randn(64, 8, device=CUDA, generator=generator)
    weights, ids = torch.topk(scores.softmax(-1), 2, dim=-1)
    weights = weights.to(torch.bfloat16).requires_grad_(True)
    params = (x, weights, experts.gate_up_proj, experts.down_proj)
    grad_out = torch.randn(64, 64, device=CUDA, dtype=torch.bfloat16, generator=generator)
    got = moe.experts_forward(experts, x, ids, weights)
    want = loop_experts(experts, x, ids, weights)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    for a, b in zip(
        torch.autograd.grad(got, params, grad_out), torch.autograd.grad(want, params, grad_out)
    ):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(
    "dtype, lora", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_cuda_graph_decode_equals_eager(tokenizer, dtype, lora):
    model = tiny_moe("qwen3_moe", tokenizer).to(CUDA, dtype)
    if lora:  # attention, router and experts adapted (PEFT's "all-linear")
        model = with_adapter(model).eval()
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    outputs = {}
    for graphs in (True, False):
        engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=256, use_cuda_graphs=graphs)
        assert engine.fallback is None and (engine.runner.graphs is not None) == graphs
        outputs[graphs] = engine.generate(PROMPTS, params)
        if graphs:
            assert engine.runner.graphs.graphs, "decode replayed from captured graphs"
    got, want = outputs[True], outputs[False]
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
