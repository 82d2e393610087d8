"""Never stuck, never silent, through the real `reinforge train` in a subprocess: the time from
SIGTERM to a durable checkpoint, an injected hang caught by the watchdog, injected NaN steps
skipped with parameters and optimizer state untouched (and the abort after K in a row), a run
with 5% of its reward calls failing that completes and counts them. Each test prints its figure."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from reinforge.checkpoint import TrainerState
from reinforge.cli import main
from reinforge.config import TrainSection
from reinforge.errors import ExitCode, RunFailure
from reinforge.metrics import read_metrics
from reinforge.models.tiny import builtin_path
from reinforge.report import build_report
from reinforge.train.loop.nonfinite import enforce_non_finite_policy

from ..conftest import REPO, TINY_RUN, cli

ENTROPY = "algorithm.entropy_coef=0.01"  # a gradient even at reward 0, so steps move weights


def popen_train(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "reinforge.cli", "train", *TINY_RUN, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rl_rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward_mean" in r]


def test_sigterm_to_durable_checkpoint(tmp_path):
    run = tmp_path / "r"
    proc = popen_train(f"run.output_dir={tmp_path}", "run.name=r", "run.max_steps=500")
    pointer = run / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while len(rl_rows(run)) < 2:  # in the middle of RL
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    before = pointer.read_text() if pointer.exists() else None  # sft is off: no checkpoint yet
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while not pointer.exists() or pointer.read_text() == before:
        assert proc.poll() is None or pointer.exists(), proc.communicate()
        time.sleep(0.002)
    durable = time.monotonic() - sent
    out, err = proc.communicate(timeout=120)
    exited = time.monotonic() - sent
    step_s = sum(r["step_s"] for r in rl_rows(run)) / len(rl_rows(run))
    print(
        f"\nSIGTERM to durable checkpoint: {durable:.2f}s (finish the step, then save; mean step "
        f"{step_s:.2f}s); process exited with code {proc.returncode} after {exited:.2f}s"
    )
    assert proc.returncode == ExitCode.STOPPED_AFTER_SAVE, err
    assert f"--resume {run}" in out
    state = json.loads(
        (run / "checkpoints" / pointer.read_text() / "trainer_state.json").read_text()
    )
    assert state["step"] >= 2 and durable < 60


class StderrClock(threading.Thread):
    """Reads a process's stderr, remembering when a line containing `marker` first arrived."""

    def __init__(self, proc: subprocess.Popen, marker: str):
        super().__init__(daemon=True)
        self.proc, self.marker = proc, marker
        self.lines: list[str] = []
        self.marker_at: float | None = None
        self.start()

    def run(self) -> None:
        for line in self.proc.stderr:
            if self.marker in line and self.marker_at is None:
                self.marker_at = time.monotonic()
            self.lines.append(line)


def test_injected_hang_is_caught_with_stacks_a_checkpoint_and_the_hang_exit_code(tmp_path):
    timeout_s = 4.0
    run = tmp_path / "r"
    # generation faults at rate 0.5 with seed 0: steps 1 and 3 draw no fault, step 2 hangs
    proc = popen_train(
        f"run.output_dir={tmp_path}",
        "run.name=r",
        "run.max_steps=4",
        "checkpoint.every=0",
        "faults.generation=0.5",
        "faults.kinds=['hang']",
        "faults.seed=0",
        f"watchdog.timeout_s={timeout_s}",
    )
    clock = StderrClock(proc, "injected hang")
    proc.wait(timeout=300)
    ended = time.monotonic()
    clock.join(timeout=10)
    stderr = "".join(clock.lines)
    assert proc.returncode == ExitCode.HANG, stderr
    assert clock.marker_at is not None, stderr
    caught_s = ended - clock.marker_at
    print(
        f"\ninjected hang caught {caught_s:.1f}s after it began (watchdog.timeout_s = {timeout_s}); "
        f"exit code {proc.returncode}, stacks in hang.txt, checkpoint saved by the watchdog"
    )
    assert caught_s < timeout_s + 5
    assert "phase 'generation'" in stderr and "in rollout" in stderr  # the stack of the hang
    assert "in rollout" in (run / "hang.txt").read_text()
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"  # the last whole step
    assert build_report(run).status.startswith("hung")
    # the saved settings, less the drill (a listed change)
    resumed = cli("train", "--resume", str(run), "faults.generation=0", "--allow-changes")
    assert resumed.returncode == ExitCode.OK, resumed.stderr
    assert [r["step"] for r in rl_rows(run)] == [1, 2, 3, 4]


def tensors_equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a.keys() & b.keys())


def test_injected_nan_steps_are_skipped_with_parameters_and_optimizer_unchanged(tmp_path):
    run = tmp_path / "r"
    # training faults at rate 0.4 with seed 7 poison steps 1, 3, 5 and 6: never 3 in a row
    out = cli(
        "train",
        *TINY_RUN,
        ENTROPY,
        f"run.output_dir={tmp_path}",
        "run.name=r",
        "run.max_steps=6",
        "checkpoint.every=1",
        "checkpoint.keep_last=10",
        "faults.training=0.4",
        "faults.kinds=['nan']",
        "faults.seed=7",
    )
    assert out.returncode == ExitCode.OK, out.stderr
    skipped = {r["step"] for r in rl_rows(run) if r["nonfinite_skipped"]}
    ckpt = {s: run / "checkpoints" / f"step_{s:06d}" for s in range(1, 7)}
    weights = {s: load_file(ckpt[s] / "model.safetensors") for s in ckpt}
    weights[0] = load_file(builtin_path("micro", 0) / "model.safetensors")
    moments = {
        s: torch.load(ckpt[s] / "optimizer.pt", weights_only=False)["optimizer"]["state"]
        for s in ckpt
    }
    moments[0] = {}
    unchanged = [s for s in skipped if tensors_equal(weights[s], weights[s - 1])]
    same_moments = [
        s
        for s in skipped
        if moments[s].keys() == moments[s - 1].keys()
        and all(
            torch.equal(moments[s][k][m], moments[s - 1][k][m])
            for k in moments[s]
            for m in ("exp_avg", "exp_avg_sq", "step")
        )
    ]
    moved = [s for s in set(ckpt) - skipped if not tensors_equal(weights[s], weights[s - 1])]
    print(
        f"\ninjected NaN: steps {sorted(skipped)} of 6 skipped; parameters unchanged on "
        f"{len(unchanged)}/{len(skipped)}, optimizer state unchanged on "
        f"{len(same_moments)}/{len(skipped)}; the other steps moved the weights: "
        f"{len(moved)}/{6 - len(skipped)}"
    )
    assert 2 <= len(skipped) <= 4
    assert len(unchanged) == len(same_moments) == len(skipped)
    assert len(moved) == 6 - len(skipped)
    assert "nonfinite_skipped" in out.stdout  # in the summary's failure counters


def test_consecutive_nan_steps_abort_without_checkpointing_them(tmp_path):
    run = tmp_path / "r"
    out = cli(
        "train",
        *TINY_RUN,
        f"run.output_dir={tmp_path}",
        "run.name=r",
        "run.max_steps=5",
        "checkpoint.every=1",
        "faults.training=1.0",
        "faults.kinds=['nan']",
        "train.max_consecutive_non_finite=2",
    )
    print(f"\nNaN every step, train.max_consecutive_non_finite = 2: exit code {out.returncode}")
    assert out.returncode == ExitCode.RUNTIME_FAILURE, out.stderr
    assert "2 steps in a row had a non-finite gradient" in out.stderr
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"  # step 2 never saved
    initial = load_file(builtin_path("micro", 0) / "model.safetensors")
    saved = load_file(run / "checkpoints" / "step_000001" / "model.safetensors")
    assert tensors_equal(saved, initial)
    assert build_report(run).status.startswith("failed: RunFailure: 2 steps in a row")


def test_non_finite_policy_crash_and_streak():
    metrics_nan, metrics_ok = {"nonfinite_skipped": 1.0, "grad_norm": float("nan")}, {}
    state = TrainerState("rl", 1, 0)
    with pytest.raises(RunFailure, match=r"train\.non_finite = 'crash'"):
        enforce_non_finite_policy(TrainSection(non_finite="crash"), state, metrics_nan, "RL")
    skip = TrainSection(max_consecutive_non_finite=3)
    state = TrainerState("rl", 0, 0)
    for step, metrics in enumerate([metrics_nan, metrics_nan, metrics_ok, metrics_nan], 1):
        state.step = step
        enforce_non_finite_policy(skip, state, metrics, "RL")  # never 3 in a row: goes on
    assert state.non_finite_streak == 1
    state.step = 5
    enforce_non_finite_policy(skip, state, metrics_nan, "RL")
    state.step = 6
    with pytest.raises(RunFailure, match="parameters are still those of RL step 3"):
        enforce_non_finite_policy(skip, state, metrics_nan, "RL")


def test_five_percent_reward_faults_complete_with_counters(tmp_path, capsys):
    run = tmp_path / "r"
    out = cli(
        "train",
        *TINY_RUN,
        f"run.output_dir={tmp_path}",
        "run.name=r",
        "run.max_steps=10",
        "faults.reward=0.05",
        "faults.kinds=['exception', 'nan']",
    )
    assert out.returncode == ExitCode.OK, out.stderr
    rows = rl_rows(run)
    num_calls = 10 * 4 * 4  # steps x prompts x samples
    errors = sum(r["reward_errors"] for r in rows)
    nonfinite = sum(r["reward_nonfinite"] for r in rows)
    injected = sum(r["faults_injected"] for r in rows)
    with capsys.disabled():
        print(
            f"\n5% reward faults: {injected:g} of {num_calls} reward calls faulted ({errors:g} "
            f"exceptions, {nonfinite:g} NaN), each scored 0 and counted; run finished (exit "
            f"{out.returncode})"
        )
    assert injected == errors + nonfinite and 0 < injected < 0.15 * num_calls
    assert errors > 0 and nonfinite > 0
    assert "failures counted" in out.stdout and "reward_errors" in out.stdout
    capsys.readouterr()
    assert main(["report", str(run)]) == ExitCode.OK
    printed = capsys.readouterr().out
    assert "finished" in printed and f"reward_errors {errors:g}" in printed
