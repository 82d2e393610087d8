"""LoRA generation from a merged copy (`engine.lora_merge`, CPU, float32): the same tokens and
logprobs as the adapters path, rebuilt after any optimizer step (fused AdamW included, which
bumps no version counter) and after other writes to the weights, never stale, never touching the
base; `disable_adapter()` generates from the base."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.lora_merge import (
    mergeable_layers,
    mergeable_params,
    merged_bytes,
    note_weights_changed,
    resolve_mode,
)
from reinforge.engine.paged import PagedEngine

from .conftest import build_model
from .test_lora_engine import PROMPTS, assert_same_outputs, merged_copy_base, with_adapter

SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, n=2, seed=3, ignore_eos=True)


def engines(model, tokenizer):
    merged = PagedEngine(model, tokenizer, block_size=4, lora_generation="merged")
    adapters = PagedEngine(model, tokenizer, block_size=4, lora_generation="adapters")
    assert merged.runner.merged is not None and adapters.runner.merged is None
    return merged, adapters


def test_merged_copy_holds_every_adapted_projection(micro_dir, tokenizer):
    """The engine's copy is what the memory planner counts for "all-linear"."""
    from reinforge.train.planner import ModelShape, lora_mergeable_params

    model = with_adapter(build_model("qwen2", micro_dir, tokenizer))
    assert (
        len(mergeable_layers(model)) == 7 * model.config.num_hidden_layers
    )  # q k v o gate up down
    shape = ModelShape.from_hf_config(model.config.to_dict(), dtype_bytes=4)
    assert mergeable_params(model) == lora_mergeable_params(shape) > 0
    assert merged_bytes(model) == 4 * mergeable_params(model)  # float32 here


def test_merged_copies_of_a_group_run_as_one_product(micro_dir, tokenizer):
    """Each layer's q/k/v copies (and gate/up) are row views of one buffer, so the decode runs a
    group as one product, as it does for plain weights (`engine.layout`): only o/down and the
    head go through `linear`, and the tokens and logprobs are the adapters path's."""
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer, seed=2), std=0.1)
    merged, adapters = engines(model, tokenizer)
    copy, runner = merged.runner.merged, merged.runner
    through_linear = set()

    def counting(x, proj):
        through_linear.add(id(proj))
        return copy.linear(x, proj)

    runner.ops = replace(runner.ops, linear=counting)
    out = merged.generate(PROMPTS, SAMPLED)
    assert_same_outputs(out, adapters.generate(PROMPTS, SAMPLED), atol=5e-5)
    for layer in model.base_model.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for group in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            assert not through_linear & {id(m) for m in group}
            weight, bias = copy.fused(group)
            torch.testing.assert_close(weight, torch.cat([copy.reading[id(m)] for m in group]))
            if group[0].base_layer.bias is not None:
                torch.testing.assert_close(bias, torch.cat([m.base_layer.bias for m in group]))
        assert {id(attn.o_proj), id(mlp.down_proj)} <= through_linear
    with model.disable_adapter():  # read from the base, one by one: no merged group
        copy.refresh()
        assert copy.fused([attn.q_proj, attn.k_proj, attn.v_proj]) is None


def test_merged_equals_adapters_and_sees_every_write(micro_dir, tokenizer):
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer, seed=2), std=0.1)
    merged, adapters = engines(model, tokenizer)
    copy = merged.runner.merged
    first = merged.generate(PROMPTS, SAMPLED)
    assert_same_outputs(first, adapters.generate(PROMPTS, SAMPLED), atol=5e-5)
    assert copy.num_builds == 1
    merged.generate(PROMPTS, SAMPLED)
    assert copy.num_builds == 1, "no write to the weights: the copy is reused"
    buffers = copy.graph_key()

    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora_params = [p for p in model.parameters() if p.requires_grad]
    # fused AdamW updates A/B in place without bumping their version counters
    optimizer = torch.optim.AdamW(lora_params, lr=0.05, fused=True)
    ids = torch.tensor([PROMPTS[2] + first[2][0].token_ids])
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.neg().backward()
        optimizer.step()
    after = merged.generate(PROMPTS, SAMPLED)  # nothing called in between
    assert copy.num_builds == 2 and copy.graph_key() == buffers, "rebuilt in place"
    assert [c.token_ids for c in after[2]] != [c.token_ids for c in first[2]]
    assert_same_outputs(after, adapters.generate(PROMPTS, SAMPLED), atol=5e-5)
    for name, param in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, base_before[name]), f"{name}: the base must stay untouched"

    # a plain in-place write (version counter), then one through `.data` (told explicitly)
    b = next(p for n, p in model.named_parameters() if "lora_B" in n and "q_proj" in n)
    with torch.no_grad():
        b.mul_(-1.0)
    assert_same_outputs(merged.generate(PROMPTS, SAMPLED), adapters.generate(PROMPTS, SAMPLED))
    b.data.mul_(3.0)
    note_weights_changed()
    assert_same_outputs(merged.generate(PROMPTS, SAMPLED), adapters.generate(PROMPTS, SAMPLED))
    assert copy.num_builds == 4


def test_disabled_adapter_generates_from_the_base(micro_dir, tokenizer):
    model = with_adapter(build_model("llama", micro_dir, tokenizer))
    merged, adapters = engines(model, tokenizer)
    base_out = PagedEngine(merged_copy_base(model), tokenizer, block_size=4).generate(
        PROMPTS, SAMPLED
    )
    with model.disable_adapter():  # the KL reference's path
        assert_same_outputs(merged.generate(PROMPTS, SAMPLED), base_out)
    assert merged.runner.merged.num_builds == 0, "nothing to merge while the adapter is off"
    enabled = merged.generate(PROMPTS, SAMPLED)
    assert_same_outputs(enabled, adapters.generate(PROMPTS, SAMPLED), atol=5e-5)
    assert [[c.token_ids for c in g] for g in enabled] != [
        [c.token_ids for c in g] for g in base_out
    ]


def test_release_frees_the_copy_and_the_next_generate_rebuilds_it(micro_dir, tokenizer):
    model = with_adapter(build_model("qwen3", micro_dir, tokenizer))
    merged, adapters = engines(model, tokenizer)
    merged.generate(PROMPTS[:1], SAMPLED)
    merged.release_memory()
    assert merged.runner.merged.num_bytes == 0
    assert_same_outputs(
        merged.generate(PROMPTS, SAMPLED), adapters.generate(PROMPTS, SAMPLED), atol=5e-5
    )
    assert merged.runner.merged.num_bytes == merged_bytes(model)


def test_auto_mode_and_bad_values(micro_dir, tokenizer):
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer))
    need = merged_bytes(model)
    assert PagedEngine(model, tokenizer, block_size=4).lora_generation == "merged"  # a CPU
    assert resolve_mode("auto", model, None, None, 0) == "merged"
    assert resolve_mode("auto", model, 10 * need, 11 * need + 5, 5) == "merged"
    assert resolve_mode("auto", model, 10 * need, 11 * need - 1, 0) == "adapters"
    assert resolve_mode("auto", model, None, 2 * need, 0) == "merged"  # the pool takes the rest
    assert resolve_mode("auto", model, None, 2 * need - 1, 0) == "adapters"
    assert resolve_mode("adapters", model, None, None, 0) == "adapters"
    plain = build_model("qwen2", micro_dir, tokenizer)
    assert resolve_mode("merged", plain, None, None, 0) == "adapters", "nothing to merge"
    with pytest.raises(ValueError, match=r"lora_generation = 'fused' is unknown.*'merged'"):
        PagedEngine(model, tokenizer, block_size=4, lora_generation="fused")


def test_the_graph_key_holds_every_buffer_a_graph_reads(micro_dir, tokenizer):
    """Released and built again (between generates), the copy's weights may come back at their
    addresses and a group's joined bias elsewhere: the key (what `DecodeGraphs.check_params`
    compares) must change then, or kept graphs read the freed bias."""
    model = with_adapter(build_model("qwen2", micro_dir, tokenizer, seed=2), std=0.1)
    merged, _ = engines(model, tokenizer)
    copy = merged.runner.merged
    merged.generate(PROMPTS, SAMPLED)
    assert copy.group_biases, "Qwen2's q/k/v biases are joined"
    key = copy.graph_key()
    assert len(key) == len(copy.weights) + len(copy.group_biases)
    first = next(iter(copy.group_biases))
    copy.group_biases[first] = copy.group_biases[first].clone()  # the same values, elsewhere
    assert copy.graph_key() != key
