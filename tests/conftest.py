"""Shared test setup: a per-session cache for the built-in models, and tiny run configs.

Everything runs on the CPU with real parts: the built-in Qwen2 models are built with
`save_pretrained` into a temporary cache and loaded with `from_pretrained`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# the README's demo: its RL steps, read from the config it runs
QUICKSTART_STEPS = tomllib.loads((REPO / "configs" / "quickstart.toml").read_text())["run"][
    "max_steps"
]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA")


def pytest_collection_modifyitems(config, items):
    # The quickstart test waits for the README's demo, which runs beside the other tests (see
    # `pytest_collection_finish`): it goes last, so nothing waits behind it.
    items.sort(key=lambda item: item.nodeid == QUICKSTART_TEST)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------------
# The README's demo in the background
#
# The quickstart test runs the demo exactly as a user does (12 minutes on 2 cores), half of the
# suite's time when run in line. When other tests are selected too, the demo starts as soon as
# collection ends, in its own process with one thread, and every other test runs on the other
# core (one thread each: two OpenMP threads per op beside a busy core wait on each other); the
# quickstart test, last, collects its result. One thread or two give the demo bit-identical
# numbers (its matmuls split over rows, not over the summed dimension).

QUICKSTART_TEST = "tests/test_quickstart.py::test_quickstart_rl_raises_held_out_accuracy"


@dataclass
class BackgroundRun:
    process: subprocess.Popen
    output_dir: Path
    log: Path
    started: float


BACKGROUND: dict[str, BackgroundRun] = {}


def quickstart_command(output_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "reinforge.cli",
        "train",
        "configs/quickstart.toml",
        f"run.output_dir={output_dir}",
    ]


def pytest_collection_finish(session):
    nodeids = [item.nodeid for item in session.items]
    if QUICKSTART_TEST not in nodeids or len(nodeids) == 1 or session.config.option.collectonly:
        return
    os.environ["OMP_NUM_THREADS"] = "1"  # for every test and subprocess from here on
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="reinforge-quickstart-"))
    log = root / "output.txt"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "REINFORGE_CACHE": str(root / "cache"),
    }
    with log.open("w") as out:
        process = subprocess.Popen(
            quickstart_command(root / "runs"), cwd=REPO, env=env, stdout=out, stderr=out, text=True
        )
    BACKGROUND["quickstart"] = BackgroundRun(process, root / "runs", log, time.perf_counter())


def pytest_sessionfinish(session):
    for run in BACKGROUND.values():
        if run.process.poll() is None:  # the session stopped early (-x, Ctrl-C)
            run.process.kill()
            run.process.wait()
        shutil.rmtree(run.output_dir.parent, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def builtin_cache(tmp_path_factory):
    """Built-in models are built once per test session, in a private cache."""
    path = tmp_path_factory.mktemp("reinforge-cache")
    os.environ["REINFORGE_CACHE"] = str(path)
    torch.set_num_threads(1 if BACKGROUND else min(2, torch.get_num_threads()))
    return path


# Small and fast: the micro model, a few prompts, short answers, two packed micro-batches a step.
# One thread: beside other processes on a small machine, two OpenMP threads per op wait on each
# other whenever one is descheduled (the same 8-step run: 5 s with one thread, 45 s with two).
TINY_RUN = [
    "model.path=builtin:micro",
    "task.max_digits=1",
    "task.num_eval=16",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "train.micro_batch_tokens=256",
    "run.num_threads=1",
    "log.tensorboard=false",
    "log.plot=false",
]


def cli(*args: str, cwd: Path | None = None, timeout: float = 300, env_extra: dict | None = None):
    """Run `python -m reinforge.cli ARGS` in a real subprocess; returns CompletedProcess."""
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "reinforge.cli", *args],
        cwd=cwd or REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
