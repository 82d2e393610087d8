"""The paged forward with PEFT LoRA adapters (CPU, float32): it applies base + scaling * B(A(x))
from the live A/B tensors, or reads a merged generation copy (`lora_generation`, "merged" by
default on a CPU), equals the merged weights, follows `disable_adapter()`, and sees an optimizer
step on the adapter with no call in between."""

from __future__ import annotations

import copy

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.train.policy.lora import apply_lora

from .conftest import FAMILIES, build_model, hf_greedy, hf_logprobs

PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37))]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)


def with_adapter(model, seed: int = 0, target_modules="all-linear", std: float = 0.3):
    """`model` wrapped with a rank-4 adapter whose B is non-zero (PEFT starts B at zero, which
    would make every comparison below trivially pass)."""
    peft_model, report = apply_lora(model, rank=4, alpha=8.0, target_modules=target_modules)
    assert report.num_bound_modules > 0
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return peft_model.eval()


def merged_copy(peft_model):
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def greedy_run(engine, prompts=PROMPTS, params=GREEDY):
    outputs = engine.generate(prompts, params)
    return [[c.token_ids for c in g] for g in outputs], outputs


def assert_same_outputs(got, expected, atol=1e-4):
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
    for got_group, expected_group in zip(got, expected):
        for a, b in zip(got_group, expected_group):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_equals_merged_weights(micro_dir, tokenizer, family):
    model = with_adapter(build_model(family, micro_dir, tokenizer))
    engine = PagedEngine(model, tokenizer, block_size=4)
    assert engine.fallback is None, "a PEFT model of a supported family takes the paged forward"
    lora_ids, lora_out = greedy_run(engine)
    merged = merged_copy(model)
    _, merged_out = greedy_run(PagedEngine(merged, tokenizer, block_size=4))
    assert_same_outputs(lora_out, merged_out)
    base_ids, _ = greedy_run(PagedEngine(merged_copy_base(model), tokenizer, block_size=4))
    assert lora_ids != base_ids, "the adapter should change what the model generates"
    for prompt, group in zip(PROMPTS, lora_ids):
        assert group[0] == hf_greedy(merged, prompt, GREEDY.max_new_tokens)


def merged_copy_base(peft_model):
    """The base weights alone: a copy with the adapter removed, not merged."""
    return copy.deepcopy(peft_model).unload().eval()


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_sampled_logprobs_are_the_adapted_policy(micro_dir, tokenizer, mode):
    """Token-in/token-out: the sampler's logprobs are the PEFT model's own (the old policy's
    logprobs in the loss), here at temperature 0.7."""
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer))
    engine = PagedEngine(model, tokenizer, block_size=4, lora_generation=mode)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, n=3, seed=4, ignore_eos=True)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, params)):
        for completion in group:
            expected = hf_logprobs(model, prompt, completion.token_ids, temperature=0.7)
            torch.testing.assert_close(
                torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_disabled_adapter_generates_from_the_base(micro_dir, tokenizer, mode):
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer))
    engine = PagedEngine(model, tokenizer, block_size=4, lora_generation=mode)
    base = merged_copy_base(model)
    _, base_out = greedy_run(PagedEngine(base, tokenizer, block_size=4))
    with model.disable_adapter():
        _, disabled_out = greedy_run(engine)
    assert_same_outputs(disabled_out, base_out)
    _, enabled_out = greedy_run(engine)
    _, merged_out = greedy_run(PagedEngine(merged_copy(model), tokenizer, block_size=4))
    assert_same_outputs(enabled_out, merged_out)


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_optimizer_step_on_the_adapter_is_seen_by_the_next_generate(micro_dir, tokenizer, mode):
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer, seed=2), std=0.1)
    engine = PagedEngine(model, tokenizer, block_size=4, lora_generation=mode)
    assert engine.lora_generation == mode
    before_ids, before = greedy_run(engine)
    lora_params = [p for p in model.parameters() if p.requires_grad]
    assert lora_params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    base_before = {
        n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad
    }

    optimizer = torch.optim.AdamW(lora_params, lr=0.05)
    ids = torch.tensor([PROMPTS[2] + before[2][0].token_ids])
    for _ in range(3):  # push away from what it generated
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.neg().backward()
        optimizer.step()

    after_ids, after = greedy_run(engine)  # nothing called in between
    assert after_ids != before_ids
    _, merged_out = greedy_run(PagedEngine(merged_copy(model), tokenizer, block_size=4))
    assert_same_outputs(after, merged_out)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert torch.equal(param, base_before[name]), f"{name}: the base must stay untouched"


def test_adapter_on_the_lm_head(micro_dir, tokenizer):
    """A LoRA layer on the LM head (named explicitly: "all-linear" leaves it out) applies too."""
    model = with_adapter(
        build_model("llama", micro_dir, tokenizer), target_modules=["q_proj", "lm_head"]
    )
    engine = PagedEngine(model, tokenizer, block_size=4)
    assert engine.fallback is None
    _, got = greedy_run(engine)
    _, expected = greedy_run(PagedEngine(merged_copy(model), tokenizer, block_size=4))
    assert_same_outputs(got, expected)


def test_dora_falls_back_to_the_models_forward(micro_dir, tokenizer):
    from peft import LoraConfig, get_peft_model

    base = build_model("qwen2", micro_dir, tokenizer)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
    model = get_peft_model(base, config).eval()
    with pytest.warns(UserWarning, match="LoRA variant.*falling back"):
        engine = PagedEngine(model, tokenizer, block_size=4)
    assert engine.fallback is not None
    ids, _ = greedy_run(engine, params=SamplingParams(max_new_tokens=6, temperature=0.0))
    for prompt, group in zip(PROMPTS, ids):
        assert group[0] == hf_greedy(model, prompt, 6)
