"""Mixture-of-experts (transformers' qwen3_moe and qwen2_moe) on tiny random models, CPU float32:
the grouped experts equal transformers' loop over experts in values and gradients (native grouped
kernel and the padded fallback, LoRA on the experts through its factors equal to PEFT's own
forward), the paged engine's greedy output equals HF generate, and with PEFT LoRA on attention,
router and experts it equals the merged weights."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from reinforge.engine import moe
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.errors import ConfigError
from reinforge.train.policy.lora import apply_lora
from reinforge.train.policy.moe import begin_micro_batch, install_grouped_moe, router_aux_loss

from ..conftest import TINY_MOE
from .conftest import hf_greedy, hf_logprobs, scramble

PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37))]
FAMILIES = ("qwen3_moe", "qwen2_moe")


def tiny_moe(family: str, tokenizer, seed: int = 0):
    common = dict(
        **TINY_MOE,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(norm_topk_prob=True, **common))
    else:  # a shared expert beside the routed ones, top-k weights not renormalised
        config = Qwen2MoeConfig(shared_expert_intermediate_size=48, norm_topk_prob=False, **common)
        model = Qwen2MoeForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return scramble(model, seed)


def with_adapter(model, seed: int = 0):
    """PEFT LoRA ("all-linear": attention, router, experts) with non-zero B."""
    peft_model, _ = apply_lora(model, rank=4, alpha=8.0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return peft_model


def greedy(model, tokenizer, n: int = 1):
    engine = PagedEngine(model, tokenizer, block_size=4)
    assert engine.fallback is None, "a MoE model takes the paged forward"
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0, n=n))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_hf_generate(tokenizer, family):
    model = tiny_moe(family, tokenizer)
    outputs = greedy(model, tokenizer, n=2)
    for prompt, group in zip(PROMPTS, outputs):
        expected = hf_greedy(model, prompt, 12)
        for completion in group:
            assert completion.token_ids == expected
            torch.testing.assert_close(
                torch.tensor(completion.logprobs),
                hf_logprobs(model, prompt, expected),
                atol=1e-4,
                rtol=0,
            )


def test_engine_lora_on_experts_equals_merged_weights(tokenizer):
    peft_model = with_adapter(tiny_moe("qwen3_moe", tokenizer)).eval()
    bound = {name.rsplit(".", 1)[-1] for name in _lora_names(peft_model)}
    assert {"q_proj", "experts", "gate"} <= bound, bound  # attention, experts, router
    got = greedy(peft_model, tokenizer)
    merged = greedy(copy.deepcopy(peft_model).merge_and_unload(), tokenizer)
    base = greedy(tiny_moe("qwen3_moe", tokenizer), tokenizer)
    tokens = [g[0].token_ids for g in got]
    assert tokens == [g[0].token_ids for g in merged]
    assert tokens != [g[0].token_ids for g in base]  # the adapter changes the output


def test_lora_targets_name_the_experts_and_a_wrong_name_is_refused(tokenizer):
    model = tiny_moe("qwen3_moe", tokenizer)
    experts_only = apply_lora(model, rank=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    assert {n.rsplit(".", 1)[-1] for n in experts_only[1].bound_modules} == {
        "experts",
        "base_layer",
    }
    with pytest.raises(ConfigError, match=r"binds the adapter to 0 modules.*'gate_proj'"):
        apply_lora(tiny_moe("qwen3_moe", tokenizer), rank=4, target_modules=["qkv"])
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout = 0\.1"):
        apply_lora(tiny_moe("qwen3_moe", tokenizer), rank=4, dropout=0.1)


def _lora_names(peft_model):
    return [n for n, m in peft_model.named_modules() if moe.is_lora_layer(m)]


def loop_experts(experts, x_TH, ids_TK, weights_TK):
    """The reference: one expert at a time over the tokens that chose it."""
    out = torch.zeros_like(x_TH)
    for e in range(experts.gate_up_proj.shape[0]):
        token, slot = torch.where(ids_TK == e)
        gate, up = (x_TH[token] @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T
        out = out.index_add(0, token, y * weights_TK[token, slot, None])
    return out


@pytest.mark.parametrize("native", [True, False])
def test_grouped_experts_equal_the_loop_in_values_and_gradients(tokenizer, native, monkeypatch):
    experts = tiny_moe("qwen3_moe", tokenizer).model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(11, 64, generator=generator, requires_grad=True)
    # every token picks expert 3 (a crowded segment) and one of 0, 1, 2, 4, 5: 6 and 7 get none
    other = torch.randint(0, 5, (11,), generator=generator)
    ids = torch.stack([torch.full((11,), 3), other + (other >= 3).long()], dim=1)
    weights = torch.rand(11, 2, generator=generator, requires_grad=True)
    if not native:
        monkeypatch.setattr(moe, "has_grouped_mm", lambda weight: False)
    grad_out = torch.randn(11, 64, generator=generator)
    params = (x, weights, experts.gate_up_proj, experts.down_proj)
    got = moe.experts_forward(experts, x, ids, weights)
    want = loop_experts(experts, x, ids, weights)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got_grads = torch.autograd.grad(got, params, grad_out)
    want_grads = torch.autograd.grad(want, params, grad_out)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_trainer_forward_with_lora_equals_peft_and_collects_router_loss(tokenizer):
    """The trainer's grouped blocks (LoRA through the factors) against PEFT's own forward
    (the adapted weight materialised): logits, the adapters' gradients, and transformers'
    load-balancing loss from the same router logits."""
    reference = with_adapter(tiny_moe("qwen3_moe", tokenizer))
    model = copy.deepcopy(reference)
    assert install_grouped_moe(model) is not None
    ids = torch.tensor([PROMPTS[2]])
    want = reference(ids, output_router_logits=True)
    begin_micro_batch(model, 0.5)
    got = model(ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    aux = router_aux_loss(model, 0.5)
    torch.testing.assert_close(aux, 0.5 * want.aux_loss)
    (got.logits.square().mean() + aux).backward()
    (want.logits.square().mean() + 0.5 * want.aux_loss).backward()
    got_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for name, param in reference.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(got_grads[name], param.grad, atol=1e-5, rtol=1e-4)
    begin_micro_batch(model, 0.0)  # router_aux_coef = 0: nothing kept, no loss
    model(ids)
    assert router_aux_loss(model, 0.0) is None
