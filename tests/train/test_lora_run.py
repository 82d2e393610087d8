"""LoRA through the command line: a run trains an adapter (SFT merged, RL on a fresh adapter,
the KL reference with the adapter disabled), its checkpoints hold the adapter in PEFT's format,
and an adapter that binds no module is refused before anything loads."""

import json

from safetensors.torch import load_file

from reinforge.errors import ExitCode

from ..conftest import TINY_RUN, cli

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def test_lora_run_trains_an_adapter_end_to_end(tmp_path):
    out = cli(
        "train",
        *TINY_RUN,
        *LORA,
        f"run.output_dir={tmp_path}",
        "run.name=lora",
        "run.max_steps=3",
        "sft.steps=2",
        "algorithm.kl_coef=0.05",
        "algorithm.entropy_coef=0.01",  # a gradient even when every reward is 0
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "LoRA bound to 14 modules" in out.stdout and "trainable" in out.stdout
    run = tmp_path / "lora"
    final = run / "checkpoints" / "step_000003"
    assert (final / "adapter_config.json").exists() and not (final / "model.safetensors").exists()
    adapter = load_file(final / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # it trained
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
    # SFT's adapter was merged into full weights; RL's adapter applies on top of them
    assert (run / "checkpoints" / "sft_final" / "model.safetensors").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert next(r["kl_ref"] for r in rows if "kl_ref" in r) == 0.0  # adapter-disabled reference
    assert all(r["nonfinite_skipped"] == 0.0 for r in rows if "nonfinite_skipped" in r)


def test_adapter_binding_no_module_is_refused_before_loading(tmp_path):
    out = cli(
        "train",
        *TINY_RUN,
        *LORA,
        f"run.output_dir={tmp_path}",
        'model.lora.target_modules=["qkv"]',
    )
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stdout + out.stderr
    assert "model.lora.target_modules = ['qkv'] binds the adapter to 0 modules" in out.stderr
    assert "use model.lora.target_modules = 'all-linear'" in out.stderr
    assert not any(tmp_path.iterdir())  # refused in preflight: no run directory, no load
