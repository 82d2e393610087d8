"""Crash safety: SIGKILL a run at random moments (during steps and during saves) 20 times,
resuming each time; the final weights must equal those of a run that was never killed.

Run with `python -m pytest -m drill tests/train/test_kill9.py -s`. Left out of the default run
until the hang watchdog is wired into the loop: in one run on a heavily loaded machine the final
resume did not finish within 300 s, and the watchdog is what will say where it stood."""

import hashlib
import os
import random
import signal
import subprocess
import sys

import pytest

from reinforge.errors import ExitCode

from ..conftest import REPO, TINY_RUN, cli

NUM_KILLS = 20
MAX_STEPS = 150


def weights_hash(run_dir) -> str:
    return hashlib.sha256(
        (run_dir / "checkpoints" / f"step_{MAX_STEPS:06d}" / "model.safetensors").read_bytes()
    ).hexdigest()


@pytest.mark.drill  # not in the default run yet: one run's final resume stalled under heavy load
def test_twenty_kill9_resumes_reach_the_same_weights(tmp_path):
    args = [
        "train",
        *TINY_RUN,
        f"run.output_dir={tmp_path}",
        f"run.max_steps={MAX_STEPS}",
        "sft.steps=2",
        "checkpoint.every=1",
        "checkpoint.keep_last=2",
    ]
    straight = cli(*args, "run.name=straight", timeout=900)
    assert straight.returncode == ExitCode.OK, straight.stderr
    run = tmp_path / "killed"
    rng = random.Random(0)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kills = kills_during_save = 0
    while kills < NUM_KILLS:
        resume = (
            ["--resume", str(run)]
            if (run / "checkpoints" / "latest").exists()
            else ["run.overwrite=true"]
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "reinforge.cli", *args, "run.name=killed", *resume],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            proc.wait(
                timeout=rng.uniform(4.0, 10.0)
            )  # startup takes a few seconds; steps and saves follow
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            kills_during_save += any((run / "checkpoints").glob(".tmp-*"))
            continue
        raise AssertionError(
            f"the run finished after {kills} kills; raise MAX_STEPS: {proc.stderr.read()[-2000:]}"
        )
    resumed = cli(*args, "run.name=killed", "--resume", str(run), timeout=900)
    assert resumed.returncode == ExitCode.OK, resumed.stderr
    same = weights_hash(run) == weights_hash(tmp_path / "straight")
    print(
        f"{kills} kill -9s ({kills_during_save} during a save), resumed each time; final weights equal: {same}"
    )
    assert same
