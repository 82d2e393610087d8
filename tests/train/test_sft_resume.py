"""`reinforge sft` keeps RL's run contract on a multi-turn chat dataset: periodic checkpoints
pruned to checkpoint.keep_last, and a run stopped by a signal and resumed ends with the same
weights and logged losses (training and validation) as one that never stopped."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from reinforge.checkpoint import TrainerState, save_checkpoint
from reinforge.checkpoint.files import Saved, checkpoints_dir
from reinforge.config import SFTConfig, load_config, to_toml
from reinforge.run import RunContext, Stopped
from reinforge.train.loop.sft_run import run_sft

from ..data.conftest import write_jsonl
from ..data.test_cli_runs import conversation

SETTINGS = [
    "model.path=builtin:micro",
    "run.num_threads=1",
    "log.tensorboard=false",
    "log.plot=false",
    "task.name=dataset",
    "task.eval_fraction=0.2",
    "sft.steps=4",
    "sft.batch_size=4",
    "eval.every=2",
]


def sft_config(tmp_path, name: str, *extra: str) -> SFTConfig:
    data = write_jsonl(tmp_path / "chats.jsonl", [conversation(i) for i in range(10)])
    return load_config(
        SFTConfig,
        None,
        [*SETTINGS, f"task.path={data}", f"run.output_dir={tmp_path}", f"run.name={name}", *extra],
    )


def losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[k]) for r in rows for k in ("loss", "eval_loss") if k in r]


def test_stopped_and_resumed_sft_equals_an_uninterrupted_one(tmp_path):
    cfg = sft_config(tmp_path, "straight", "checkpoint.every=1", "checkpoint.keep_last=2")
    straight = RunContext(tmp_path / "straight", False, False, to_toml(cfg))
    assert run_sft(cfg, straight).steps_trained == 4

    cfg = sft_config(tmp_path, "stopped")
    ctx = RunContext(tmp_path / "stopped", False, False, to_toml(cfg))
    ctx.stop_signal = "SIGTERM"  # as the handler sets it: stop after the first step
    with pytest.raises(Stopped) as stop:
        run_sft(cfg, ctx)
    assert stop.value.checkpoint.name == "sft_step_000001"

    cfg = sft_config(tmp_path, "stopped")
    resumed = RunContext(tmp_path / "stopped", True, False, to_toml(cfg))
    assert run_sft(cfg, resumed).steps_trained == 3

    weights = [
        load_file(tmp_path / run / "checkpoints" / "sft_final" / "model.safetensors")
        for run in ("straight", "stopped")
    ]
    for name, tensor in weights[0].items():
        assert tensor.equal(weights[1][name]), name
    assert losses(tmp_path / "stopped") == pytest.approx(losses(tmp_path / "straight"))


def test_periodic_sft_checkpoints_keep_the_last_ones_and_leave_rl_steps_alone(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reinforge.models.tiny import builtin_path

    model = AutoModelForCausalLM.from_pretrained(builtin_path("micro", 0))
    tok = AutoTokenizer.from_pretrained(builtin_path("micro", 0))
    save_checkpoint(tmp_path, "step_000001", Saved(model, tok, TrainerState("rl", 1, 4)))
    for step in (1, 2, 3):
        state = TrainerState("sft", step, 4 * step)
        save_checkpoint(tmp_path, f"sft_step_{step:06d}", Saved(model, tok, state), 2)
    names = sorted(p.name for p in checkpoints_dir(tmp_path).iterdir() if p.is_dir())
    assert names == ["sft_step_000002", "sft_step_000003", "step_000001"]
