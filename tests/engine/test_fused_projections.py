"""q/k/v and gate/up laid out back to back (`engine.layout`): the parameters become views of one
tensor each, values and training unchanged, and the paged engine runs each group as one product
with the same output as three (two) products, reading the weights in place after an optimizer
step; where the layout is gone (a parameter replaced, LoRA on a module) it runs them one by one."""

from __future__ import annotations

import copy

import pytest
import torch

from reinforge.engine import layout
from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine

from .conftest import FAMILIES, build_model

PROMPTS = [[5, 6, 7], list(range(10, 18)), list(range(20, 37))]


def fused_pair(family, micro_dir, tokenizer):
    plain = build_model(family, micro_dir, tokenizer)
    laid = copy.deepcopy(plain)
    assert layout.fuse_projections(laid) == 2 * len(laid.model.layers)
    return plain, laid


def decode(model, tokenizer, n=2):
    engine = PagedEngine(model, tokenizer, block_size=4, num_blocks=128)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=n)
    out = engine.generate(PROMPTS, params)
    return [[c.token_ids for c in g] for g in out], [[c.logprobs for c in g] for g in out]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_groups_are_views_with_the_same_values_and_the_same_generation(
    micro_dir, tokenizer, family, monkeypatch
):
    plain, laid = fused_pair(family, micro_dir, tokenizer)
    for (name, a), (_, b) in zip(plain.state_dict().items(), laid.state_dict().items()):
        assert torch.equal(a, b), name
    attn, mlp = laid.model.layers[0].self_attn, laid.model.layers[0].mlp
    qkv = layout.fused_weight([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = layout.fused_weight([mlp.gate_proj, mlp.up_proj])
    assert qkv is not None and gate_up is not None
    assert qkv[0].data_ptr() == attn.q_proj.weight.data_ptr()
    torch.testing.assert_close(
        qkv[0], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    )
    assert (qkv[1] is not None) == (attn.q_proj.bias is not None)  # Qwen2's q/k/v biases
    assert layout.fused_weight([plain.model.layers[0].mlp.gate_proj, mlp.up_proj]) is None
    ids = torch.tensor([list(range(3, 40))])
    torch.testing.assert_close(laid(ids).logits, plain(ids).logits, atol=0, rtol=0)
    # the engine takes the one-product path on the laid-out model (and not on the plain one)
    calls = []
    real = layout.fused_weight

    def counting(mods):
        out = real(mods)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("reinforge.engine.qwen_forward.fused_weight", counting)
    tokens, logprobs = decode(laid, tokenizer)
    assert calls and all(calls)
    calls.clear()
    plain_tokens, plain_logprobs = decode(plain, tokenizer)
    assert calls and not any(calls)
    assert tokens == plain_tokens
    torch.testing.assert_close(
        torch.tensor(logprobs), torch.tensor(plain_logprobs), atol=1e-5, rtol=0
    )


def test_training_is_unchanged_and_the_engine_reads_the_step_in_place(micro_dir, tokenizer):
    """The same gradients and the same AdamW step on both layouts; after the step the fused
    weight the engine reads holds the stepped values (no copy to refresh)."""
    plain, laid = fused_pair("qwen2", micro_dir, tokenizer)
    ids = torch.tensor([list(range(3, 30)), list(range(40, 67))])
    for model in (plain, laid):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    for (name, a), (_, b) in zip(plain.named_parameters(), laid.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    mlp = laid.model.layers[1].mlp
    weight, _ = layout.fused_weight([mlp.gate_proj, mlp.up_proj])
    assert torch.equal(weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    assert decode(laid.eval(), tokenizer)[0] == decode(plain.eval(), tokenizer)[0]


def test_a_replaced_parameter_or_a_lora_module_runs_the_products_one_by_one(micro_dir, tokenizer):
    from peft import LoraConfig, get_peft_model

    plain, laid = fused_pair("qwen2", micro_dir, tokenizer)
    attn = laid.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
    assert layout.fused_weight([attn.q_proj, attn.k_proj, attn.v_proj]) is None
    assert decode(laid, tokenizer)[0] == decode(plain, tokenizer)[0]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft = get_peft_model(fused_pair("qwen2", micro_dir, tokenizer)[1], config)
    layer = peft.base_model.model.model.layers[1]
    assert layout.fused_weight([layer.self_attn.q_proj, layer.self_attn.k_proj]) is None
    assert layout.fused_weight([layer.mlp.gate_proj, layer.mlp.up_proj]) is not None
    assert decode(peft, tokenizer)[0] == decode(plain, tokenizer)[0]  # B = 0: the base model


def test_a_fused_model_saves_and_loads_as_the_plain_one(micro_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    plain, laid = fused_pair("qwen2", micro_dir, tokenizer)
    laid.save_pretrained(tmp_path / "fused", safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", dtype=torch.float32)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_load_model_lays_the_groups_out(micro_dir):
    from reinforge.models.loading import load_model

    model = load_model(str(micro_dir), torch.device("cpu"), torch.float32)
    mlp = model.model.layers[0].mlp
    assert layout.fused_weight([mlp.gate_proj, mlp.up_proj]) is not None


def test_fused_weight_answers_again_from_its_cache_until_a_parameter_changes(micro_dir, tokenizer):
    """Asked again, the spans are the same views (made anew, no tensor kept by the cache); a
    parameter replaced, moved or laid out anew changes the answer."""
    plain, laid = fused_pair("qwen2", micro_dir, tokenizer)
    attn = laid.model.layers[0].self_attn
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    first, again = layout.fused_weight(mods), layout.fused_weight(mods)
    for a, b in zip(first, again):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    assert not any(isinstance(v[1], torch.Tensor) for v in layout._SPANS.values())
    # k's weight replaced by a copy elsewhere: no longer back to back
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
    assert layout.fused_weight(mods) is None
    assert layout.fuse_projections(laid) > 0  # laid out again: one tensor once more
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    again = layout.fused_weight(mods)
    assert again is not None and again[0].data_ptr() == attn.q_proj.weight.data_ptr()
    torch.testing.assert_close(
        again[0], torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    )
    plain_attn = plain.model.layers[0].self_attn
    assert layout.fused_weight([plain_attn.q_proj, plain_attn.k_proj, plain_attn.v_proj]) is None


def test_separate_tensors_at_a_spans_addresses_are_no_span(micro_dir, tokenizer):
    """q, k and v given storages of their own that sit back to back at the laid-out tensor's very
    addresses (as a move away and back can place them), in the same parameter objects: no span
    (a cached span would be a view past the first one's storage)."""
    _, laid = fused_pair("qwen2", micro_dir, tokenizer)
    attn = laid.model.layers[0].self_attn
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    span = layout.fused_weight(mods)
    assert span is not None  # cached as a span
    memory = span[0].detach().numpy()  # the laid-out tensor's memory, kept alive by `span`
    start = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight.data = torch.from_numpy(memory[start : start + rows])  # a storage of its own
        start += rows
    offsets = [0, attn.q_proj.out_features, attn.q_proj.out_features + attn.k_proj.out_features]
    assert [m.weight.data_ptr() for m in mods] == [span[0][r].data_ptr() for r in offsets]
    assert layout.fused_weight(mods) is None
