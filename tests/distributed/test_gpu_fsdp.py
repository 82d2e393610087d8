"""FSDP2 and replicas on several GPUs of one host (marker `gpu`): at N = 2 and, where the machine
has more, at N = all of its GPUs (4 or 8); a size with fewer GPUs than it needs is skipped with
the reason. The same configs as on one GPU, launched with torchrun, bf16 weights and float32
gradient reduction. The quickstart learns; the qwen2.5-0.5b shape trains full (FSDP2, and a
replica per GPU) and LoRA steps that agree with one GPU's on the same global batch (bf16: within
a few percent, not bit for bit), in less memory per GPU when the optimizer states are sharded;
the disaggregated mode runs one generator GPU, or N/2 of them, beside the trainer GPUs. Every
run prints a line as it finishes and has its own timeout (`RUN_TIMEOUT_S`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import QUICKSTART_STEPS, REPO
from tests.train.test_gpu_train import SHAPE_RUN as ONE_GPU_RUN

NUM_GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NUM_GPUS < 2, reason="needs two GPUs")]
# two GPUs, and all of the machine's when it has more
SIZES = [
    pytest.param(n, marks=pytest.mark.skipif(n > NUM_GPUS, reason=f"needs {n} GPUs"))
    for n in sorted({2, max(NUM_GPUS, 2)})
]
RUN_TIMEOUT_S = 300  # one training subprocess (the 0.5b shape's runs take about a minute)

# the one-GPU tests' run, checkpointing every 2 steps, for 3 steps
SHAPE_RUN = [
    *(arg for arg in ONE_GPU_RUN if not arg.startswith("checkpoint.every=")),
    "checkpoint.every=2",
    "run.max_steps=3",
]
_ONE_GPU: dict[tuple, list[dict]] = {}  # the one-GPU reference runs, made once per variant


def train(*args: str, nproc: int, label: str, timeout: float = RUN_TIMEOUT_S) -> None:
    launcher = [sys.executable, "-m", "reinforge"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += [f"--nproc-per-node={nproc}", "-m", "reinforge"]
    start = time.perf_counter()
    proc = subprocess.run(
        [*launcher, "train", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(
        f"  {label} on {nproc} GPU(s): exit {proc.returncode}, {time.perf_counter() - start:.0f} s"
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def rl_rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl" and "step_s" in r]


def prompts_for(trainers: int) -> int:
    """The smallest multiple of `trainers` of at least the shape run's 8 prompts a step."""
    return -(-8 // trainers) * trainers


@pytest.mark.parametrize("nproc", SIZES)
def test_quickstart_learns_on_several_gpus(tmp_path, nproc):
    args = ("configs/quickstart.toml", f"run.output_dir={tmp_path}", "run.name=qs")
    train(*args, nproc=nproc, label="quickstart")
    rows = [json.loads(x) for x in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_accuracy"] for r in rows if r.get("phase") == "rl" and "eval_accuracy" in r]
    print(f"quickstart on {nproc} GPUs: held-out accuracy {evals[0]:.2f} -> {evals[-1]:.2f}")
    assert evals[-1] > evals[0] + 0.15
    assert (tmp_path / "qs" / "checkpoints" / f"step_{QUICKSTART_STEPS:06d}" / "dcp").is_dir()


@pytest.mark.parametrize("nproc", SIZES)
@pytest.mark.parametrize(
    ("lora", "strategy"), [(False, "fsdp"), (False, "replicate"), (True, "auto")]
)
def test_shape_model_on_several_gpus_agrees_with_one(tmp_path_factory, lora, strategy, nproc):
    extra = [f"distributed.strategy={strategy}", *(["model.lora.rank=16"] if lora else [])]
    root = tmp_path_factory.mktemp(f"shape_{strategy}_{lora}")
    if (lora, strategy) not in _ONE_GPU:
        train(*SHAPE_RUN, *extra, f"run.output_dir={root}", "run.name=n1", nproc=1, label="shape")
        _ONE_GPU[(lora, strategy)] = rl_rows(root / "n1")
    args = (*SHAPE_RUN, *extra, f"run.output_dir={root}", f"run.name=n{nproc}")
    train(*args, nproc=nproc, label=f"shape, {strategy}, lora {lora}")
    one, many = _ONE_GPU[(lora, strategy)], rl_rows(root / f"n{nproc}")
    assert len(one) == len(many) == 3
    print("1 GPU  ", [(r["step_s"], r["grad_norm"], r["gpu_peak_gib"]) for r in one])
    print(f"{nproc} GPUs", [(r["step_s"], r["grad_norm"], r["gpu_peak_gib"]) for r in many])
    # step 1: the same weights and (keyed sampling) the same samples, up to bf16 batch effects
    assert many[0]["reward_mean"] == pytest.approx(one[0]["reward_mean"], rel=0.05)
    assert many[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=0.05)
    if strategy == "fsdp":  # weights, gradients and AdamW states are split over the GPUs
        assert max(r["gpu_peak_gib"] for r in many) < max(r["gpu_peak_gib"] for r in one)
    checkpoint = root / f"n{nproc}" / "checkpoints" / "step_000002"
    assert (checkpoint / "dcp" / ".metadata").is_file()


def disaggregated_sizes() -> list:
    """(processes, generators): one generator beside one trainer, and on a larger machine one
    generator beside N - 1 trainers and N/2 beside N/2."""
    sizes = [pytest.param(2, 1, id="2-g1")]
    for param in SIZES[1:]:
        n = param.values[0]
        sizes += [
            pytest.param(n, g, marks=param.marks, id=f"{n}-g{g}") for g in sorted({1, n // 2})
        ]
    return sizes


@pytest.mark.parametrize(("nproc", "generators"), disaggregated_sizes())
def test_disaggregated_generators_and_trainers(tmp_path, nproc, generators):
    """The last `generators` GPUs generate (their own weights, CUDA graphs), the others train;
    weights broadcast over NCCL to every generator after each step, rollouts one step stale."""
    trainers = nproc - generators
    extra = ["distributed.mode=disaggregated", "algorithm.tis_cap=2.0"]
    extra += [f"distributed.generators={generators}"]
    extra += [f"rollout.prompts_per_step={prompts_for(trainers)}"]
    args = (*SHAPE_RUN, *extra, f"run.output_dir={tmp_path}", "run.name=d")
    train(*args, nproc=nproc, label=f"disaggregated, {generators} generator(s)")
    rows = rl_rows(tmp_path / "d")
    print("disaggregated", [(r["step_s"], r["kl_sampler"], r["gpu_peak_gib"]) for r in rows])
    assert [r["rollout_staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["kl_sampler"] > 0 for r in rows[1:])


@pytest.mark.parametrize("nproc", SIZES)
@pytest.mark.parametrize("k", [0, 2])
def test_disaggregated_staleness_on_several_gpus(tmp_path, k, nproc):
    """distributed.rollout_staleness = 0 (each generator waits for each step's weights, which
    land in its model) and 2 (the link thread receives them into a staging copy over NCCL while
    the sampling thread samples and captures CUDA graphs): the lag stays within k. N/2
    generators."""
    generators = nproc // 2
    extra = ["distributed.mode=disaggregated", "algorithm.tis_cap=2.0"]
    extra += [f"distributed.rollout_staleness={k}", "run.max_steps=4"]
    extra += [f"distributed.generators={generators}"]
    extra += [f"rollout.prompts_per_step={prompts_for(nproc - generators)}"]
    args = (*SHAPE_RUN, *extra, f"run.output_dir={tmp_path}", f"run.name=k{k}")
    train(*args, nproc=nproc, label=f"disaggregated k={k}, {generators} generator(s)")
    rows = rl_rows(tmp_path / f"k{k}")
    print(f"k={k}", [(r["step_s"], r["rollout_staleness"], r["kl_sampler"]) for r in rows])
    assert len(rows) == 4
    assert [r["rollout_staleness"] for r in rows[:2]] == [0.0, min(k, 1)]
    assert all(0 <= r["rollout_staleness"] <= k for r in rows)
