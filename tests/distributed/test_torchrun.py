"""`reinforge train` under torchrun on the CPU (gloo), in real subprocesses: two processes give
the single-process run's numbers on the same global batch, replicated (the planner's choice for
a micro model) and under FSDP2 both ways; checkpoints of two processes resume on one and
checkpoints of one resume on two (launched as two single-process "nodes" meeting through a c10d
rendezvous on localhost), continuing exactly; the same for LoRA (2 -> 1).

The workload is the benchmark's random-token task on a micro Qwen2 shape with tied embeddings:
its reward (completion length in characters mod 7) varies from sample to sample, so every step
has advantages and a gradient. Four steps, a checkpoint at step 2: steps 3 and 4 of a resumed
run must match the uninterrupted run's (step 4 also checks the restored optimizer state).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO

SHAPE = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
RUN = [
    "task.name=random_tokens",
    "task.prompt_tokens=6",
    "task.vocab_words=500",
    "task.num_eval=4",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "train.micro_batch_tokens=64",  # several micro-batches a step, unequal across ranks
    "optim.lr=0.01",
    "run.num_threads=1",
    "run.max_steps=4",
    "checkpoint.every=2",
    "checkpoint.keep_last=4",
    "eval.before_train=false",
    "log.tensorboard=false",
    "log.plot=false",
    "watchdog.timeout_s=0",
]
# What must agree between runs: the loss and its terms, the gradient, the samples' rewards and
# lengths (the same samples), the KL to the reference, the data position.
COMPARED = (
    "loss",
    "pg_loss",
    "entropy",
    "kl_ref",
    "grad_norm",
    "reward_mean",
    "response_len",
    "advantage_abs_mean",
    "data_position",
)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def launch(*commands: list[str], timeout: float = 240) -> list[str]:
    """Start the commands together (several torchrun "nodes"), wait for all; each must exit 0.
    Returns their outputs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for c in commands
    ]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return outputs


def reinforge(run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "reinforge", "train", *run_args(run_dir), *extra]


def run_args(run_dir: Path) -> list[str]:
    return [f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["phase"] == "rl" and "loss" in r}


def assert_same_steps(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for step in steps:
        for key in COMPARED:
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), (
                step,
                key,
            )


def interrupted_copy(run_dir: Path, to: Path) -> Path:
    """`run_dir` as a run stopped after its step-2 checkpoint: `latest` names step 2 (the resume
    removes the later step folders, as after a crash between a save and the pointer)."""
    shutil.copytree(run_dir, to)
    (to / "checkpoints" / "latest").write_text("step_000002")
    return to


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and two processes (torchrun), four steps each."""
    root = tmp_path_factory.mktemp("distributed")
    shape = root / "micro_shape.json"
    shape.write_text(json.dumps(SHAPE))
    common = [*RUN, f"model.path=shape:{shape}"]
    one, two = root / "one", root / "two"
    launch([sys.executable, *reinforge(one, *common)])
    (output,) = launch(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *reinforge(two, *common)]
    )
    (root / "two.out").write_text(output)
    return root, common, one, two


def test_two_processes_train_as_one_on_the_same_global_batch(runs):
    root, _, one, two = runs
    # a micro model: each process holds a replica ("auto"), gradients averaged once a step
    assert "replicated on 2 processes" in (root / "two.out").read_text()
    assert_same_steps(rl_metrics(two), rl_metrics(one), steps=(1, 2, 3, 4))
    # rank 0 alone writes the run's files: one line per step, no second rank's error file
    rows = (two / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in row for row in rows) == 4
    assert not list(two.glob("error*.txt"))
    step2 = two / "checkpoints" / "step_000002"
    assert (step2 / "dcp" / ".metadata").is_file()  # DCP shards, resumable on any count
    assert (step2 / "rng_rank1.pt").is_file()
    assert (step2 / "model.safetensors").is_file()  # HF weights gathered by rank 0


@pytest.mark.parametrize("unsharded", [True, False])
def test_two_processes_under_fsdp_train_as_one_too(runs, unsharded):
    """FSDP2 (`distributed.strategy = "fsdp"`) gives the single process's steps both ways of
    accumulating a step's micro-batches: gathered layers and unsharded sums, and FSDP's default
    (gather and reduce at every micro-batch); its checkpoint resumes on one process."""
    root, common, one, _ = runs
    run_dir = root / f"fsdp_unsharded_{unsharded}"
    extra = [
        *common,
        "distributed.strategy=fsdp",
        f"distributed.accumulate_unsharded={str(unsharded).lower()}",
    ]
    torchrun = [*TORCHRUN, "--standalone", "--nproc-per-node", "2"]
    (output,) = launch([*torchrun, *reinforge(run_dir, *extra)])
    how = "unsharded" if unsharded else "reduced every micro-batch"
    assert f"FSDP over 2 processes, gradients {how}" in output
    assert_same_steps(rl_metrics(run_dir), rl_metrics(one), steps=(1, 2, 3, 4))
    if unsharded:  # FSDP's DCP shards resume on one process
        resumed = interrupted_copy(run_dir, root / "fsdp_then_one")
        launch([sys.executable, "-m", "reinforge", "train", *common, "--resume", str(resumed)])
        assert_same_steps(rl_metrics(resumed), rl_metrics(one), steps=(3, 4))


def test_checkpoint_of_two_processes_resumes_on_one(runs):
    root, common, one, two = runs
    resumed = interrupted_copy(two, root / "two_then_one")
    launch([sys.executable, "-m", "reinforge", "train", *common, "--resume", str(resumed)])
    assert_same_steps(rl_metrics(resumed), rl_metrics(one), steps=(3, 4))


def test_checkpoint_of_one_process_resumes_on_two_nodes(runs):
    root, common, one, _ = runs
    resumed = interrupted_copy(one, root / "one_then_two")
    endpoint = f"127.0.0.1:{free_port()}"
    # two launchers of one process each, as on two machines; c10d numbers the nodes itself
    node = [
        *TORCHRUN,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "reinforge-test",
        "-m",
        "reinforge",
        "train",
        *common,
        "--resume",
        str(resumed),
    ]
    launch(node, node)
    assert_same_steps(rl_metrics(resumed), rl_metrics(one), steps=(3, 4))
    assert (resumed / "checkpoints" / "step_000004" / "dcp").is_dir()


def test_lora_on_two_processes_trains_and_resumes_as_on_one(runs):
    root, common, _, _ = runs
    lora = [*common, "model.lora.rank=4"]
    one, two = root / "lora_one", root / "lora_two"
    launch([sys.executable, *reinforge(one, *lora)])
    launch([*TORCHRUN, "--standalone", "--nproc-per-node", "2", *reinforge(two, *lora)])
    assert_same_steps(rl_metrics(two), rl_metrics(one), steps=(1, 2, 3, 4))
    step2 = two / "checkpoints" / "step_000002"
    assert (step2 / "adapter_model.safetensors").is_file()  # the adapter, gathered by rank 0
    resumed = interrupted_copy(two, root / "lora_two_then_one")
    launch([sys.executable, "-m", "reinforge", "train", *lora, "--resume", str(resumed)])
    assert_same_steps(rl_metrics(resumed), rl_metrics(one), steps=(3, 4))


def test_disaggregated_generator_and_trainer_overlap_one_step_apart(runs):
    """Two processes, `distributed.mode = "disaggregated"`: the last rank generates, rank 0
    trains. The first rollout comes from the initial weights (the single-process run's step 1);
    later ones from weights one optimizer step old (the default rollout_staleness, 1), which the
    mismatch KL sees and TIS weighs."""
    root, common, one, _ = runs
    run_dir = root / "disaggregated"
    if not (run_dir / "metrics.jsonl").is_file():  # the staleness-2 test may have run it
        launch(
            [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *reinforge(run_dir, *common, *K1)]
        )
    got = rl_metrics(run_dir)
    assert_same_steps(got, rl_metrics(one), steps=(1,))
    assert [got[s]["rollout_staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [got[s]["rollout_weights_step"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert [got[s]["data_position"] for s in (1, 2, 3)] == [4.0, 8.0, 12.0]
    for step in (2, 3):
        assert got[step]["kl_sampler"] > 1e-4  # sampled by the weights before the last step
        assert got[step]["tis_weight_mean"] != pytest.approx(1.0, abs=1e-4)
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").is_file()


K1 = ["distributed.mode=disaggregated", "algorithm.tis_cap=2.0", "run.max_steps=3"]


def test_staleness_0_is_the_on_policy_run_exactly(runs):
    """`distributed.rollout_staleness = 0`: the generator waits for each step's weights before
    sampling, so every step equals the single-process (colocated, on-policy) run's: the same
    samples, losses, gradient norms; the sampler's logprobs are the trainer's (kl_sampler 0)."""
    root, common, one, _ = runs
    run_dir = root / "staleness_0"
    extra = [*K1, "distributed.rollout_staleness=0"]
    launch(
        [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *reinforge(run_dir, *common, *extra)]
    )
    got, want = rl_metrics(run_dir), rl_metrics(one)
    assert_same_steps(got, want, steps=(1, 2, 3))
    assert [got[s]["rollout_weights_step"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    for step in (1, 2, 3):
        assert got[step]["rollout_staleness"] == 0.0
        assert got[step]["kl_sampler"] == pytest.approx(want[step]["kl_sampler"], abs=1e-6)
        assert abs(got[step]["kl_sampler"]) < 1e-6


def test_staleness_2_lags_two_steps_and_a_resume_drops_the_queue(runs):
    """The k = 1 run above resumed from its step-2 checkpoint with rollout_staleness = 2 and two
    more steps. At the save the generator had rollout(3) queued, sampled by the weights of step
    1: the resume drops it and samples step 3 again from the checkpoint's weights (staleness 0,
    kl_sampler 0, the same prompts: the data position continues with no gap), then runs ahead:
    rollout(4) comes from the same weights (1 step behind), rollout(5) from them or, when the
    trainer's step 3 arrived first, from its weights (2 or 1 steps behind; never more)."""
    root, common, _, _ = runs
    k1 = root / "disaggregated"
    if not (k1 / "checkpoints" / "step_000002").is_dir():  # this test run alone
        launch([*TORCHRUN, "--standalone", "--nproc-per-node", "2", *reinforge(k1, *common, *K1)])
    resumed = interrupted_copy(k1, root / "staleness_2")
    changes = ["distributed.rollout_staleness=2", "run.max_steps=5"]
    torchrun = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "reinforge", "train"]
    launch([*torchrun, *common, *K1, *changes, "--resume", str(resumed), "--allow-changes"])
    got = rl_metrics(resumed)
    assert [got[s]["rollout_staleness"] for s in (3, 4)] == [0.0, 1.0]
    assert [got[s]["rollout_weights_step"] for s in (3, 4)] == [2.0, 2.0]
    assert got[5]["rollout_weights_step"] in (2.0, 3.0)
    assert got[5]["rollout_staleness"] == 4.0 - got[5]["rollout_weights_step"]
    assert [got[s]["data_position"] for s in (3, 4, 5)] == [12.0, 16.0, 20.0]
    assert abs(got[3]["kl_sampler"]) < 1e-6  # fresh: sampled by the checkpoint's weights
    for step in (4, 5):
        assert got[step]["kl_sampler"] > 1e-4
        assert np.isfinite(got[step]["loss"])
