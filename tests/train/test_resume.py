"""Exact resume: a run stopped by SIGTERM and resumed logs the same metrics and ends with the
same weights (or LoRA adapter) as a run that was never stopped; a damaged latest checkpoint is
refused, or replaced by the previous intact one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from reinforge.errors import ExitCode

from ..conftest import REPO, TINY_RUN, cli

TIMING = {
    "generate_s",
    "train_s",
    "step_s",
    "tokens_per_s",
    "gen_engine_s",
    "gen_restore_s",
    "gen_graph_capture_s",
    "gc_s",
    "iteration_s",  # (from the last step logged: none right after a resume)
}


def metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


LORA = ["model.lora.rank=4", "algorithm.entropy_coef=0.01"]  # entropy: a gradient at reward 0


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
def test_sigterm_then_resume_equals_uninterrupted(tmp_path, adapter):
    args = [
        "train",
        f"run.output_dir={tmp_path}",
        "run.max_steps=8",
        "sft.steps=3",
        "checkpoint.every=0",
        "algorithm.kl_coef=0.01",
        *TINY_RUN,
        *(LORA if adapter else []),
    ]
    straight = cli(*args, "run.name=straight")
    assert straight.returncode == ExitCode.OK, straight.stderr

    run = tmp_path / "stopped"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reinforge.cli", *args, "run.name=stopped"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        path = run / "metrics.jsonl"
        if path.exists() and any(
            '"phase": "rl", "reward_mean"' in ln or ('"rl"' in ln and '"step": 2,' in ln)
            for ln in path.read_text().splitlines()
        ):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.STOPPED_AFTER_SAVE, out
    assert "checkpoint saved" in out and f"resume with: reinforge train --resume {run}\n" in out
    stopped_at = json.loads(
        (
            run
            / "checkpoints"
            / (run / "checkpoints" / "latest").read_text()
            / "trainer_state.json"
        ).read_text()
    )["step"]
    assert 1 <= stopped_at < 8

    resumed = cli("train", "--resume", str(run))  # the printed command: the run's own settings
    assert resumed.returncode == ExitCode.OK, resumed.stderr
    assert metrics(run) == metrics(tmp_path / "straight")
    weights = "adapter_model.safetensors" if adapter else "model.safetensors"
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_000008" / weights)
    b = load_file(run / "checkpoints" / "step_000008" / weights)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_damaged_latest_checkpoint_is_refused_or_replaced_by_the_previous_one(tmp_path):
    # The latest checkpoint's weights get a flipped bit and its RNG file is cut short: a resume
    # must not load them. With checkpoint.on_damaged=error it stops and names the choice; by
    # default it resumes from the previous checkpoint and reproduces the lost steps exactly.
    run = tmp_path / "damaged"
    args = [
        "train",
        f"run.output_dir={tmp_path}",
        "run.name=damaged",
        "run.max_steps=4",
        "sft.steps=0",
        "checkpoint.every=2",
        *TINY_RUN,
    ]
    first = cli(*args)
    assert first.returncode == ExitCode.OK, first.stderr
    root = run / "checkpoints"
    assert (root / "latest").read_text() == "step_000004"
    weights = root / "step_000004" / "model.safetensors"
    original = {k: v.clone() for k, v in load_file(weights).items()}  # not the file's mmap
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    with open(root / "step_000004" / "rng.pt", "r+b") as f:
        f.truncate(10)

    refused = cli(*args, "checkpoint.on_damaged=error", "--resume", str(run))
    assert refused.returncode == ExitCode.RUNTIME_FAILURE, refused.stderr
    assert "checkpoint step_000004" in refused.stderr and "Traceback" not in refused.stderr
    assert "model.safetensors: its bytes differ" in refused.stderr
    assert "rng.pt: 10 bytes" in refused.stderr
    assert "newest intact checkpoint is step_000002" in refused.stderr
    assert "checkpoint.on_damaged=previous" in refused.stderr

    resumed = cli(*args, "--resume", str(run))
    assert resumed.returncode == ExitCode.OK, resumed.stderr
    assert "resuming from step_000002" in resumed.stderr
    assert (root / "damaged-step_000004" / "model.safetensors").exists()
    again = load_file(root / "step_000004" / "model.safetensors")
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)
