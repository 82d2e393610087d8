"""LoRA through PEFT on the micro model: what binds, exact trainable counts, the zero-binding
refusal, PEFT-format save/load, and the adapter-disabled base model."""

from __future__ import annotations

import pytest
import torch

from reinforge.errors import ConfigError
from reinforge.models.tiny import SPECS, builtin_path
from reinforge.train.policy.lora import (
    adapter_disabled,
    apply_lora,
    linear_layer_names,
    load_adapter,
    save_adapter,
)

MICRO = SPECS["micro"]
HIDDEN, INTER, LAYERS = MICRO["hidden_size"], MICRO["intermediate_size"], MICRO["num_hidden_layers"]
HEAD_DIM = HIDDEN // MICRO["num_attention_heads"]
Q, KV = HIDDEN, MICRO["num_key_value_heads"] * HEAD_DIM
# in + out features of each linear layer of one decoder layer
IN_PLUS_OUT = {
    "q_proj": HIDDEN + Q,
    "k_proj": HIDDEN + KV,
    "v_proj": HIDDEN + KV,
    "o_proj": Q + HIDDEN,
    "gate_proj": HIDDEN + INTER,
    "up_proj": HIDDEN + INTER,
    "down_proj": INTER + HIDDEN,
}
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7]])


def micro_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(builtin_path("micro", 0), dtype=torch.float32)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def randomize_adapter(peft_model, seed: int = 0) -> None:
    """B starts at zero (adapter == base); make it matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_all_linear_binds_every_decoder_linear_with_exact_counts():
    base_total = sum(p.numel() for p in micro_model().parameters())
    model, report = apply_lora(micro_model(), rank=4, alpha=8, target_modules="all-linear")
    assert report.num_bound_modules == 7 * LAYERS
    assert {name.rsplit(".", 1)[-1] for name in report.bound_modules} == set(IN_PLUS_OUT)
    assert report.num_trainable_params == 4 * LAYERS * sum(IN_PLUS_OUT.values())  # 8192
    assert report.num_total_params == base_total + report.num_trainable_params
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    assert "14 modules" in report.summary()


def test_named_targets_bind_only_those():
    _, report = apply_lora(micro_model(), rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    assert report.num_bound_modules == 2 * LAYERS
    expected = 8 * LAYERS * (IN_PLUS_OUT["q_proj"] + IN_PLUS_OUT["v_proj"])
    assert report.num_trainable_params == expected


def test_zero_binding_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        apply_lora(micro_model(), rank=4, target_modules=["query_key_value"])
    message = str(err.value)
    assert "model.lora.target_modules = ['query_key_value']" in message
    assert "0 modules" in message
    assert "'q_proj'" in message and "'down_proj'" in message  # what exists
    assert "lm_head" not in message
    assert "'all-linear'" in message


def test_bad_rank_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.lora\.rank = 0"):
        apply_lora(micro_model(), rank=0)


def test_linear_layer_names_exclude_the_head():
    assert linear_layer_names(micro_model()) == sorted(IN_PLUS_OUT)


def test_save_and_load_reproduce_logits(tmp_path):
    model, _ = apply_lora(micro_model(), rank=4, alpha=8, dropout=0.1)
    randomize_adapter(model)
    model.eval()
    expected = logits(model)
    path = save_adapter(model, tmp_path / "adapter")
    assert (path / "adapter_config.json").exists()
    assert (path / "adapter_model.safetensors").exists()
    loaded = load_adapter(micro_model(), path).eval()
    torch.testing.assert_close(logits(loaded), expected, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(logits(micro_model()), expected, atol=1e-3)


def test_load_from_a_folder_without_adapter_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"adapter_config\.json"):
        load_adapter(micro_model(), tmp_path)


def test_adapter_disabled_is_the_base_model():
    base_logits = logits(micro_model())
    model, _ = apply_lora(micro_model(), rank=4, alpha=8)
    randomize_adapter(model)
    with_adapter = logits(model)
    assert not torch.allclose(with_adapter, base_logits, atol=1e-3)
    with adapter_disabled(model) as reference:
        torch.testing.assert_close(logits(reference), base_logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits(model), with_adapter)


def test_packed_forward_runs_through_the_adapter_and_the_disabled_reference():
    """The RL path: policy logprobs include the adapter; the KL reference is the same model with
    the adapter disabled, equal to the base model's."""
    from reinforge.train.packing import PackSequence, pack
    from reinforge.train.packing.forward import packed_logprobs

    [batch] = pack([PackSequence([5, 17, 42], [99, 3]), PackSequence([250], [7, 8, 9])], 64)
    _, base_K, _ = packed_logprobs(micro_model(), batch)
    model, _ = apply_lora(micro_model(), rank=4, alpha=8)
    randomize_adapter(model)
    _, policy_K, _ = packed_logprobs(model, batch)
    policy_K.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    assert not torch.allclose(policy_K, base_K, atol=1e-3)
    with torch.no_grad(), adapter_disabled(model):
        _, reference_K, _ = packed_logprobs(model, batch)
    torch.testing.assert_close(reference_K, base_K.detach(), atol=1e-6, rtol=1e-6)


def test_adapters_compute_in_a_bf16_base_dtype_with_float32_weights_and_gradients():
    """On a bf16 base the adapter's matmuls take bf16 inputs (no float32 copy of each
    projection's input), the weights and their gradients stay float32, and logits and
    gradients match PEFT's float32 adapter path within bf16 rounding; a float32 base is left
    alone; a deep copy computes with its own weights."""
    import copy

    from transformers import AutoModelForCausalLM

    from reinforge.train.policy.lora import adapters_in_base_dtype

    def bf16_peft():
        base = AutoModelForCausalLM.from_pretrained(builtin_path("micro", 0), dtype=torch.bfloat16)
        peft_model, _ = apply_lora(base, rank=4, alpha=8)
        randomize_adapter(peft_model)
        return peft_model

    def run(model):
        seen = set()
        hooks = [
            m.register_forward_hook(lambda mod, args, out: seen.add(args[0].dtype))
            for name, m in model.named_modules()
            if name.endswith("lora_A.default")
        ]
        model.zero_grad(set_to_none=True)
        out = model(input_ids=IDS).logits.float()
        targets = IDS[:, 1:, None]
        out[:, :-1].log_softmax(-1).gather(-1, targets).sum().backward()  # a policy's logprobs
        for h in hooks:
            h.remove()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return out.detach(), grads, seen

    reference = bf16_peft()  # PEFT draws A at random: copies share it
    patched, exact = copy.deepcopy(reference), copy.deepcopy(reference).float()
    assert adapters_in_base_dtype(patched) == LAYERS * 7
    ref_out, ref_grads, ref_seen = run(reference)
    out, grads, seen = run(patched)
    exact_out, exact_grads, _ = run(exact)  # the same weights, all in float32
    assert ref_seen == {torch.float32} and seen == {torch.bfloat16}
    # bf16 noise: the patched path is as far from float32 as PEFT's own path on a bf16 base
    ref_err, err = (ref_out - exact_out).norm(), (out - exact_out).norm()
    assert err <= 2 * ref_err and err <= 0.02 * exact_out.norm(), (err, ref_err)
    assert grads.keys() == ref_grads.keys() and all(
        g.dtype == torch.float32 for g in grads.values()
    )

    def flat(g):
        return torch.cat([g[n].flatten() for n in sorted(g)])

    want = flat(exact_grads)
    ref_gerr, gerr = (flat(ref_grads) - want).norm(), (flat(grads) - want).norm()
    assert gerr <= 2 * ref_gerr and gerr <= 0.02 * want.norm(), (gerr, ref_gerr, want.norm())
    twin = copy.deepcopy(patched)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_B" in name:
                p.zero_()
        base_out = twin.get_base_model()(input_ids=IDS).logits
    with adapter_disabled(twin), torch.no_grad():
        torch.testing.assert_close(twin(input_ids=IDS).logits, base_out)
    torch.testing.assert_close(logits(twin).float(), base_out.float())  # its own zero B
    assert adapters_in_base_dtype(apply_lora(micro_model(), rank=4, alpha=8)[0]) == 0
