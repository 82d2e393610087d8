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
    from reinforge.train.packing import PackSequence, pack, packed_logprobs

    [batch] = pack([PackSequence([5, 17, 42], [99, 3]), PackSequence([250], [7, 8, 9])], 64)
    base_K, _ = packed_logprobs(micro_model(), batch)
    model, _ = apply_lora(micro_model(), rank=4, alpha=8)
    randomize_adapter(model)
    policy_K, _ = packed_logprobs(model, batch)
    policy_K.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    assert not torch.allclose(policy_K, base_K, atol=1e-3)
    with torch.no_grad(), adapter_disabled(model):
        reference_K, _ = packed_logprobs(model, batch)
    torch.testing.assert_close(reference_K, base_K.detach(), atol=1e-6, rtol=1e-6)
