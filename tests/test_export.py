"""Export round trips on the micro model: a full checkpoint, a LoRA adapter merged or alone, and
the silent failures the check must catch (a merge that returns the base, an untrained adapter)."""

from __future__ import annotations

import pytest
import torch

from reinforge.checkpoint import TrainerState, save_checkpoint
from reinforge.checkpoint.files import Saved
from reinforge.errors import ConfigError
from reinforge.export import ExportError, export
from reinforge.models.tiny import builtin_path
from reinforge.train.policy.lora import apply_lora

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1, 2]])


def micro_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(builtin_path("micro", 0), dtype=torch.float32)


def micro_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path("micro", 0))


@torch.no_grad()
def logits(model) -> torch.Tensor:
    model.eval()
    return model(input_ids=IDS).logits


def save_run(run_dir, model) -> None:
    saved = Saved(model, micro_tokenizer(), TrainerState("rl", 1, 4))
    save_checkpoint(run_dir, "step_000001", saved)


def lora_run(run_dir, perturb: bool = True):
    """A run whose latest checkpoint is a LoRA adapter on the micro model; returns the model."""
    model, _ = apply_lora(micro_model(), rank=4, alpha=8)
    if perturb:  # B starts at zero: make the adapter matter
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    save_run(run_dir, model)
    return model


def test_full_checkpoint_exports_weights_config_and_chat_template_only(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = micro_model()
    with torch.no_grad():  # a "trained" model, not the one in the cache
        source.model.norm.weight.mul_(1.5)
    save_run(tmp_path / "run", source)

    report = export(tmp_path / "run", tmp_path / "out", mode="full")

    out = tmp_path / "out"
    assert report.out_dir == out and report.max_kl < 1e-6
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(exported), logits(source))
    assert AutoTokenizer.from_pretrained(out).chat_template
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    assert not names & {"optimizer.pt", "rng.pt", "trainer_state.json"}
    assert not list(tmp_path.glob(".tmp-export-*"))


def test_full_export_in_bfloat16_passes_its_tolerance(tmp_path):
    save_run(tmp_path / "run", micro_model())
    report = export(tmp_path / "run/checkpoints/step_000001", tmp_path / "out", dtype="bfloat16")
    assert report.dtype == "bfloat16" and 0 < report.max_kl < report.tolerance


def test_lora_merged_export_matches_base_plus_adapter_and_differs_from_base(tmp_path):
    from transformers import AutoModelForCausalLM

    trained = lora_run(tmp_path / "run")

    report = export(tmp_path / "run", tmp_path / "merged")

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    torch.testing.assert_close(logits(merged), logits(trained), atol=1e-4, rtol=1e-4)
    assert (logits(merged) - logits(micro_model())).abs().max() > 1e-2
    assert report.mode == "merged" and report.base == str(builtin_path("micro", 0))
    assert report.adapter_effect_kl > 1e3 * report.max_kl


def test_adapter_only_export_loads_with_peft(tmp_path):
    from peft import PeftModel

    trained = lora_run(tmp_path / "run")

    export(tmp_path / "run", tmp_path / "adapter", mode="adapter")

    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    reloaded = PeftModel.from_pretrained(micro_model(), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded), logits(trained))


def test_a_merge_that_returns_the_base_fails_loudly_and_leaves_nothing(tmp_path, monkeypatch):
    from peft.tuners.lora import LoraModel

    lora_run(tmp_path / "run")
    monkeypatch.setattr(LoraModel, "merge_and_unload", lambda self, **kw: self.unload())

    with pytest.raises(ExportError, match="lost the adapter"):
        export(tmp_path / "run", tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert not list(tmp_path.glob(".tmp-export-*"))


def test_an_untrained_adapter_with_zero_b_is_refused(tmp_path):
    lora_run(tmp_path / "run", perturb=False)
    with pytest.raises(ExportError, match="all-zero LoRA B"):
        export(tmp_path / "run", tmp_path / "merged")


def test_mode_must_fit_the_checkpoint_and_sources_must_exist(tmp_path):
    lora_run(tmp_path / "lora")
    save_run(tmp_path / "full", micro_model())
    with pytest.raises(ConfigError, match="mode 'merged' or 'adapter'"):
        export(tmp_path / "lora", tmp_path / "a", mode="full")
    with pytest.raises(ConfigError, match="mode 'full'"):
        export(tmp_path / "full", tmp_path / "b", mode="adapter")
    with pytest.raises(ConfigError, match="neither a run directory"):
        export(tmp_path, tmp_path / "c")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConfigError, match="not empty"):
        export(tmp_path / "full", tmp_path / "taken")
