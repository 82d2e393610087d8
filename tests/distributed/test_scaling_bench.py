"""bench/grpo_bench.py's scaling logic on the CPU (no GPU, no training): which runs a `--nproc`
list makes, the per-GPU figures and scaling efficiency of synthetic metrics rows against
hand-computed values, and the runner stopping a real subprocess once its last step is logged,
or at its timeout, with its process group."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import grpo_bench
        import scaling
        import stoppable
    finally:
        sys.path.remove(str(REPO / "bench"))
    grpo_bench.stoppable = stoppable
    return grpo_bench, scaling


def test_an_nproc_list_makes_the_strong_weak_and_disaggregated_runs(bench):
    grpo_bench, scaling = bench
    g1 = grpo_bench.WORKLOADS["G1"]  # 32 prompts
    layouts, skipped = scaling.plan_layouts("G1", g1, [1, 2, 4, 8], 4, weak=True, disagg=True)
    got = [(x.label, x.nproc, x.generators, x.prompts, x.scaling) for x in layouts]
    assert got == [
        ("1 GPU", 1, 0, 32, "strong"),
        ("2 GPUs", 2, 0, 32, "strong"),
        ("2 GPUs, weak (64 prompts)", 2, 0, 64, "weak"),
        ("2 GPUs, disaggregated 1+1", 2, 1, 32, "strong"),
        ("4 GPUs", 4, 0, 32, "strong"),
        ("4 GPUs, weak (128 prompts)", 4, 0, 128, "weak"),
        ("4 GPUs, disaggregated 1+3 (33 prompts)", 4, 1, 33, "strong"),  # 32 over 3 trainers
        ("4 GPUs, disaggregated 2+2", 4, 2, 32, "strong"),
    ]
    assert skipped == ["G1 on 8 GPUs: skipped, the machine has 4"]
    assert "distributed.generators=2" in layouts[-1].overrides
    assert "rollout.prompts_per_step=33" in layouts[-2].overrides
    only, _ = scaling.plan_layouts("G1", g1, [1, 4], 4, disagg=True, skip_strong=True)
    assert [x.label for x in only] == ["1 GPU", *(x.label for x in layouts[-2:])]


def test_the_8b_fine_tune_starts_at_two_gpus_and_says_so(bench):
    grpo_bench, scaling = bench
    f8 = grpo_bench.WORKLOADS["F8"]  # 16 prompts
    layouts, skipped = scaling.plan_layouts("F8", f8, [1, 2, 4], 8, weak=True, disagg=True)
    assert [(x.label, x.prompts) for x in layouts] == [
        ("2 GPUs", 16),
        ("4 GPUs", 16),
        ("4 GPUs, weak (32 prompts)", 32),  # the baseline's batch per GPU: 8 prompts
        ("4 GPUs, disaggregated 1+3 (18 prompts)", 18),
        ("4 GPUs, disaggregated 2+2", 16),
    ]
    assert skipped[0].startswith("F8 on 1 GPU(s): skipped, the 8B full fine-tune")
    assert skipped[1] == "F8: the efficiency baseline is 2 GPUs (the smallest N that runs)"
    assert skipped[2].startswith("F8 disaggregated 1+1 on 2 GPUs: skipped")


# a synthetic shape: per layer 32*128*4096*2 + 8*128*4096*2 (attention) + 3*4096*12288 (MLP)
# = 192,937,984; 10 layers, plus 100,000 x 4096 embeddings and an LM head: 2,748,579,840
SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 10,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 100_000,
    "tie_word_embeddings": False,
}
PARAMS = 2_748_579_840


def rows(step_s, generate_s, train_s, peak=5.0) -> list[dict]:
    return [
        {
            "step": i + 1,
            "phase": "rl",
            "step_s": s,
            "generate_s": g,
            "train_s": t,
            "gpu_peak_gib": peak,
        }
        for i, (s, g, t) in enumerate(zip(step_s, generate_s, train_s))
    ]


def test_per_gpu_figures_and_efficiency_against_hand_computed_values(bench, tmp_path):
    grpo_bench, scaling = bench
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps(SHAPE))
    assert grpo_bench.model_params(SHAPE) == PARAMS
    w = dict(shape=str(shape), prompts=32, group=8, prompt_len=128, new_tokens=512, lora_rank=0)
    generated = 32 * 8 * 512  # per step; the trainer computes each prompt once for its group
    flops = 6 * PARAMS * (32 * 128 + generated)
    # one GPU: steady step = median of steps 2..3 = 3.0 s, train 1.5 s
    one = grpo_bench.summarise(rows([20, 2.8, 3.2], [9, 1.4, 1.6], [11, 1.4, 1.6]), w, 60)
    assert one["steady_step_s"] == 3.0 and one["train_s"] == 1.5
    assert (
        one["generated_tok_per_s_total"]
        == one["generated_tok_per_s_per_gpu"]
        == round(generated / 3.0)
    )
    assert one["train_mfu_per_training_gpu"] == round(flops / 1.5 / 796e12, 3)
    # two GPUs, the same batch: 2.0 s a step, train 0.8 s on each GPU
    two = scaling.colocated(2, 32, "strong")
    strong = grpo_bench.summarise(rows([30, 2, 2], [9, 1.2, 1.2], [20, 0.8, 0.8]), w, 60, 0, two)
    assert strong["generated_tok_per_s_total"] == round(generated / 2.0)
    assert strong["generated_tok_per_s_per_gpu"] == round(generated / 2.0 / 2)
    assert strong["train_mfu_per_training_gpu"] == round(flops / 0.8 / (2 * 796e12), 3)
    assert scaling.efficiency(strong, one) == round(3.0 / (2 * 2.0), 3)  # t1 / (N tN)
    # two GPUs, twice the prompts: 3.3 s a step
    wide = scaling.colocated(2, 64, "weak")
    weak = grpo_bench.summarise(
        rows([30, 3.3, 3.3], [9, 1.5, 1.5], [20, 1.7, 1.7]), {**w, "prompts": 64}, 60, 0, wide
    )
    assert weak["generated_tok_per_s_total"] == round(2 * generated / 3.3)
    assert scaling.efficiency(weak, one) == round(3.0 / 3.3, 3)  # t1 / tN
    # disaggregated 1 + 3 on four GPUs: MFU over the three that train, tokens over all four
    split = scaling.disaggregated(4, 1, 32)
    dis = grpo_bench.summarise(
        rows([30, 1.0, 1.0], [9, 0.1, 0.1], [20, 0.9, 0.9]), {**w, "prompts": 33}, 60, 0, split
    )
    assert (dis["trainers"], dis["generators"], dis["prompts"]) == (3, 1, 33)
    flops_33 = 6 * PARAMS * (33 * 128 + 33 * 8 * 512)
    assert dis["train_mfu_per_training_gpu"] == round(flops_33 / 0.9 / (3 * 796e12), 3)
    assert dis["train_mfu_per_gpu"] == round(flops_33 / 0.9 / (4 * 796e12), 3)
    assert dis["generated_tok_per_s_per_gpu"] == round(33 * 8 * 512 / 1.0 / 4)
    assert "3+1" not in scaling.table_row(
        "G1", split.label, {**dis, "efficiency": 0.5, "efficiency_vs": "1 GPU"}
    )
    assert "| 1+3 | 33 |" in scaling.table_row(
        "G1", split.label, {**dis, "efficiency": 0.5, "efficiency_vs": "1 GPU"}
    )


WRITER = """
import json, subprocess, sys, time
# a worker in a session of its own, as torchrun starts them
sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
worker = subprocess.Popen(sleep, start_new_session=True)
print("worker", worker.pid, flush=True)
with open(sys.argv[1], "w") as f:
    for step in (1, 2, 3):
        row = {"step": step, "phase": "rl", "step_s": 1.0, "generate_s": 0.5, "train_s": 0.5}
        f.write(json.dumps(row) + "\\n")
        f.flush()
        time.sleep(0.2)
print("steps logged; now the final checkpoint", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(("steps", "timeout", "status"), [(3, 60, "logged"), (4, 2, "timeout")])
def test_a_run_is_stopped_once_its_last_step_is_logged_or_at_its_timeout(
    bench, tmp_path, steps, timeout, status
):
    stoppable = bench[0].stoppable
    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "run.log"
    cmd = [sys.executable, "-c", WRITER, str(metrics)]
    got, seconds = stoppable.run_until_logged(cmd, metrics, steps, log, timeout, 0)
    assert got == status and seconds < 30
    assert len(stoppable.step_rows(metrics)) == 3
    output = log.read_text()
    assert "steps logged" in output
    worker = int(output.split("worker ")[1].split()[0])
    assert not stoppable.alive(worker)  # killed with the run, not left holding its GPU
