"""Real training steps on CUDA (marker `gpu`; skipped without CUDA): the same CLI, the same
configs, no memory setting. The tiny built-in model learns; the qwen2.5-0.5b shape (transformers'
Qwen2 class, random weights) runs full fine-tuning and LoRA steps with packed micro-batches,
varlen attention and the chunked LM head, within the memory the planner promised."""

import json

import pytest

from tests.conftest import REPO, cli

pytestmark = pytest.mark.gpu

SHAPE_RUN = [
    "model.path=shape:bench/shapes/qwen2.5-0.5b.json",
    "task.name=random_tokens",
    "task.prompt_tokens=64",
    "task.num_eval=2",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=48",
    "rollout.ignore_eos=true",
    "eval.before_train=false",
    "log.tensorboard=false",
    "log.plot=false",
    "checkpoint.every=0",
]


def rl_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "rl" and "step_s" in r]


def test_quickstart_learns_on_cuda(tmp_path):
    proc = cli(
        "train",
        "configs/quickstart.toml",
        f"run.output_dir={tmp_path}",
        "run.name=qs",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_accuracy"] for r in rows if r.get("phase") == "rl" and "eval_accuracy" in r]
    print(f"quickstart on CUDA: held-out accuracy {evals[0]:.2f} -> {evals[-1]:.2f}")
    assert evals[-1] > evals[0] + 0.15


@pytest.mark.parametrize("lora", [False, True])
def test_shape_model_trains_on_cuda(tmp_path, lora):
    extra = ["model.lora.rank=16"] if lora else []
    steps = shape_steps(tmp_path, extra)
    print(f"0.5b shape lora={lora}: " + ", ".join(f"{r['step_s']:.2f}s" for r in steps))


def test_a_kept_update_graph_and_generation_take_turns_on_one_memory_pool(tmp_path):
    """The update replayed from a kept graph captured in the mempool the KV pool lives in
    (`graphs.share_memory`): later steps only replay, the engine keeps its decode graphs across
    the update (no capture after the first steps), the sampler's logprobs still agree with the
    trainer's (the KV pool, refilled after the update wrote over its memory, is right), and the
    peaks count the memory the pools hold."""
    graphs = ["train.cuda_graphs=run", "train.micro_batch_tokens=512"]
    steps = shape_steps(tmp_path, graphs, max_steps=4)
    assert steps[0]["graph_capture"] == 1 and steps[0]["gen_graph_capture_s"] > 0
    for r in steps[1:]:
        assert r["graph_replay"] >= 2 and "graph_capture" not in r, r
    assert all(r["gen_graph_capture_s"] == 0 for r in steps[2:]), steps
    print(
        "kept graph: " + ", ".join(f"{r['step_s']:.2f}s {r['gpu_peak_gib']:.2f} GiB" for r in steps)
    )


def shape_steps(tmp_path, extra: list[str], max_steps: int = 3) -> list[dict]:
    proc = cli(
        "train",
        *SHAPE_RUN,
        *extra,
        f"run.max_steps={max_steps}",
        f"run.output_dir={tmp_path}",
        "run.name=shape",
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = rl_rows(tmp_path / "shape")
    assert len(steps) == max_steps
    for r in steps:
        assert r["response_len"] == 48
        assert abs(r["kl_sampler"]) < 0.05, "sampler and trainer disagree on bf16 logprobs"
        assert r["gpu_peak_gib"] > 0.5
        # each phase's peak, the step's the larger (the update starts without the KV pool)
        assert r["gpu_peak_gib"] == max(r["gpu_peak_generate_gib"], r["gpu_peak_train_gib"])
        assert r["gpu_peak_train_gib"] > 0.5 and r["gpu_peak_generate_gib"] > 0.5
    return steps
