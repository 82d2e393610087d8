"""A tiny Qwen3-MoE checkpoint (built here with Qwen3MoeConfig + save_pretrained, random weights,
the built-in micro tokenizer) through the command line: GSPO with LoRA on attention, router and
experts trains, logs the router's load-balancing loss, saves the adapter in PEFT's format, and
the merged export reloads and reproduces the trainer's logits (export's own check)."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from reinforge.errors import ExitCode
from reinforge.export import export
from reinforge.models.tiny import build_builtin

from ..conftest import TINY_MOE, TINY_RUN, cli


def save_tiny_moe(path):
    build_builtin("micro", 0, path / "micro")
    tokenizer = AutoTokenizer.from_pretrained(path / "micro")
    config = Qwen3MoeConfig(
        **TINY_MOE,
        router_aux_loss_coef=0.01,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.save_pretrained(path / "moe")
    tokenizer.save_pretrained(path / "moe")
    return path / "moe"


def test_gspo_with_lora_on_experts_trains_saves_and_exports(tmp_path):
    source = save_tiny_moe(tmp_path / "models")
    out = cli(
        "train",
        *TINY_RUN,
        f"model.path={source}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "algorithm.name=gspo",
        "algorithm.entropy_coef=0.01",  # a gradient even when every reward is 0
        "rollout.prompts_per_step=2",
        "task.num_eval=4",
        "eval.before_train=false",
        "run.max_steps=2",
        f"run.output_dir={tmp_path / 'runs'}",
        "run.name=moe",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "LoRA bound to 14 modules" in out.stdout  # per layer: q, k, v, o, router, 2 experts
    run = tmp_path / "runs" / "moe"
    adapter = load_file(run / "checkpoints" / "step_000002" / "adapter_model.safetensors")
    expert_keys = [k for k in adapter if ".experts." in k and "lora_B" in k]
    assert expert_keys and any(adapter[k].abs().sum() > 0 for k in expert_keys)  # experts trained
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    aux = [r["router_aux_loss"] for r in rows if "router_aux_loss" in r]
    assert len(aux) == 2 and all(a > 0 for a in aux)  # the checkpoint's coefficient, 0.01
    report = export(run, tmp_path / "merged")  # reloads it and checks its logits, else raises
    assert (tmp_path / "merged" / "model.safetensors").exists(), report.summary()


def test_planner_counts_every_expert_and_the_active_width():
    """Weights: every expert (Qwen3-30B-A3B: 30.5B parameters, 3.3B active, as published);
    LoRA: exactly what PEFT binds on a MoE model (gate_up_proj at rank 2r)."""
    from pathlib import Path

    from reinforge.train.planner.sizes import ModelShape, lora_trainable_params
    from reinforge.train.policy.lora import apply_lora

    shape = json.loads((Path(__file__).parents[2] / "bench/shapes/qwen3-30b-a3b.json").read_text())
    big = ModelShape.from_hf_config(shape)
    assert round(big.num_params / 1e9, 1) == 30.5 and round(big.num_active_params / 1e9, 1) == 3.4
    config = Qwen3MoeConfig(
        **TINY_MOE,
    )
    model = Qwen3MoeForCausalLM(config)
    tiny = ModelShape.from_hf_config(config.to_dict(), dtype_bytes=4)
    assert tiny.num_params == sum(p.numel() for p in model.parameters())
    report = apply_lora(model, rank=4, alpha=8.0)[1]
    assert lora_trainable_params(tiny, 4) == report.num_trainable_params
