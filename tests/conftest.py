"""Shared test setup: a per-session cache for the built-in models, and tiny run configs.

Everything runs on the CPU with real parts: the built-in Qwen2 models are built with
`save_pretrained` into a temporary cache and loaded with `from_pretrained`.
"""

from __future__ import annotations

import os
import sys

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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cuda_memory(request):
    """Before each GPU test, what earlier tests left in this process goes back to the device:
    an engine sizes its KV pool from the free memory, and one kept alive by a reference cycle
    until the next garbage collection left a later test's subprocess 4.3 of 80 GiB (an H100
    run, session 8)."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session", autouse=True)
def builtin_cache(tmp_path_factory):
    """Built-in models are built once per test session, in a private cache."""
    path = tmp_path_factory.mktemp("reinforge-cache")
    os.environ["REINFORGE_CACHE"] = str(path)
    torch.set_num_threads(min(2, torch.get_num_threads()))
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


def cli(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    env_extra: dict | None = None,
    fresh: bool = False,
):
    """Run `reinforge ARGS` in its own process; returns a CompletedProcess.

    The process is forked from a server that has imported torch and transformers (forkserver.py),
    saving each command about 6.5 s of start; `fresh=True` (or REINFORGE_TEST_FRESH=1 for every
    call) runs a new `python -m reinforge.cli` instead, as a user does."""
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    if fresh or os.environ.get("REINFORGE_TEST_FRESH") == "1":
        return subprocess.run(
            [sys.executable, "-m", "reinforge.cli", *args],
            cwd=cwd or REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    import tempfile

    with tempfile.TemporaryDirectory(prefix="reinforge-cli-") as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        server = _fork_server()
        pid = server.start(list(args), out, err, cwd=cwd or REPO, env=env)
        try:
            returncode = server.wait(timeout)
        except TimeoutError:
            server.kill(pid)
            server.wait()
            raise subprocess.TimeoutExpired(
                ["reinforge", *args], timeout, out.read_text(), err.read_text()
            ) from None
        return subprocess.CompletedProcess(
            ["reinforge", *args], returncode, out.read_text(), err.read_text()
        )


_SERVER = None


def _fork_server():
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        from .forkserver import ForkServer

        _SERVER = ForkServer(cwd=REPO)
    return _SERVER


def pytest_sessionfinish(session, exitstatus):
    if _SERVER is not None and _SERVER.proc.poll() is None:
        _SERVER.close()


# A tiny mixture-of-experts shape (8 experts of width 32, 2 routed per token) for the MoE tests;
# with transformers' Qwen3MoeConfig / Qwen2MoeConfig and random weights.
TINY_MOE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
