"""G1 / G2 / G3 of shared/BENCHMARKS.md and F8 (the qwen3-8b shape's full fine-tune, FSDP2): a
GRPO step through `reinforge train`, on one GPU or several of one host, and through TRL's
GRPOTrainer (bench/peers/trl_grpo.py, a copy of shared/peers/) with the same numbers, in one job.

    python bench/grpo_bench.py --workload G1 [--workload G2] [--steps 5] [--peer-steps 4] --out DIR
    python bench/grpo_bench.py --workload G1 --nproc 1,2,4,8 --weak --disagg --skip-peer --steps 3

reinforge runs as a user runs it (`reinforge train configs/bench/g1.toml`, a subprocess; torchrun
for N GPUs), and its figures come from the run's metrics.jsonl: steady step seconds (median of
steps 2..N), the generation and training phases apart, generated tokens/s end to end (total and
per GPU), training tokens/s and model FLOPs utilisation per training GPU, peak GPU memory, and
with several GPU counts the scaling efficiency against the baseline (`scaling.py` says which
runs a `--nproc` list makes and how efficiency is computed). Each run is stopped once its last
step is logged (the final evaluation and checkpoint are no part of a step) or killed after
`--run-timeout` seconds. The peer prints one JSON line. Results print (and grpo_bench.json is
rewritten) as each run finishes; the tables come last, also when the bench itself is stopped
(SIGTERM, e.g. run_gpu.sh's BENCH_TIMEOUT: the current run's processes are killed first). Not
a timed test: nothing here fails for being slow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from scaling import HEADER, Layout, colocated, efficiency, per_gpu, plan_layouts, table_row
from stoppable import run_until_logged, step_rows

ROOT = Path(__file__).resolve().parent.parent
RUNS = Path("/tmp/reinforge-bench")
WORKLOADS = {
    "G1": dict(
        config="configs/bench/g1.toml",
        shape="bench/shapes/qwen2.5-0.5b.json",
        prompts=32,
        group=8,
        prompt_len=128,
        new_tokens=512,
        lora_rank=0,
        peer_micro_batch=64,
    ),
    "G2": dict(
        config="configs/bench/g2.toml",
        shape="bench/shapes/qwen2.5-7b.json",
        prompts=32,
        group=8,
        prompt_len=256,
        new_tokens=1024,
        lora_rank=32,
        peer_micro_batch=16,
    ),
    # issue 27: GSPO on the Qwen3-30B-A3B shape, one H200, no peer (--skip-peer)
    "G3": dict(
        config="configs/bench/g3.toml",
        shape="bench/shapes/qwen3-30b-a3b.json",
        prompts=64,
        group=8,
        prompt_len=256,
        new_tokens=1024,
        lora_rank=32,
        peer_micro_batch=16,
    ),
    # issue 29: the qwen3-8b shape's full fine-tune with AdamW under FSDP2; no peer
    "F8": dict(
        config="configs/bench/fsdp_8b.toml",
        shape="bench/shapes/qwen3-8b.json",
        prompts=16,
        group=4,
        prompt_len=128,
        new_tokens=256,
        lora_rank=0,
        peer_micro_batch=0,
        min_gpus=2,
        why_min_gpus="the 8B full fine-tune with AdamW needs two GPUs to train (98 GB of "
        "weights and moments; 99 GiB measured on one H200, over an H100's 80)",
        why_no_peer="it does not fit one GPU with AdamW",
    ),
}


def run_reinforge(
    name: str,
    w: dict,
    steps: int,
    out: Path,
    profile_step: int = 0,
    overrides=(),
    layout: Layout | None = None,
    timeout: float = 0,
) -> dict:
    """One `reinforge train` of the workload, in its own run directory; its figures from the
    run's metrics.jsonl. Stopped (its process group killed) once the last step is logged: the
    final evaluation and checkpoint are no part of a step (the 8B checkpoint alone is ~100 GB)
    and would only cost time; after `timeout` seconds it is killed and reported as such, with
    the figures of the steps it logged."""
    tag = layout.label if layout else " ".join(["1 GPU", *overrides])
    layout = layout or colocated(1, w["prompts"], "strong")
    slug = re.sub(r"[^a-z0-9]+", "-", f"{name} {tag}".lower()).strip("-")[:100]
    run_dir = RUNS / slug
    shutil.rmtree(run_dir, ignore_errors=True)  # never read an earlier run's metrics
    cmd = [sys.executable, "-m", "reinforge.cli"]
    if layout.nproc > 1:  # torchrun: the same config on nproc GPUs
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*torchrun, f"--nproc-per-node={layout.nproc}", "-m", "reinforge.cli"]
    if profile_step:  # same run, one update under torch.profiler (it slows that step only)
        cmd = [sys.executable, "bench/profile_train.py", str(profile_step)]
        cmd.append(str((out / f"train_profile_{name}.txt").resolve()))
    cmd += ["train", w["config"], f"run.max_steps={steps}", f"run.name={slug}"]
    cmd += [f"run.output_dir={RUNS}", *overrides]
    print("$", " ".join(cmd), flush=True)
    log = out / f"reinforge_{slug}.log"
    status, wall = run_until_logged(
        cmd, run_dir / "metrics.jsonl", steps, log, timeout, profile_step
    )
    rows = step_rows(run_dir / "metrics.jsonl")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    complete = status == "logged" or (status == "exit 0" and len(rows) >= steps)
    if not complete and (status != "timeout" or len(rows) < 2):
        print(log.read_text()[-3000:])
        return {
            "error": f"{status} after {wall:.0f} s, {len(rows)} steps",
            "wall_s": round(wall, 1),
        }
    result = summarise(rows, {**w, "prompts": layout.prompts}, wall, profile_step, layout)
    if not complete:
        result["note"] = f"timed out after {wall:.0f} s at step {len(rows)} of {steps}"
    return result


def summarise(
    rows: list[dict], w: dict, wall: float, profile_step: int = 0, layout: Layout | None = None
) -> dict:
    """The steady figures (median of steps 2..N) of one run, totals and per GPU."""
    layout = layout or colocated(1, w["prompts"], "strong")
    steady = [r for r in rows[1:] if r["step"] != profile_step] or rows

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    completions = w["prompts"] * w["group"]
    generated = completions * w["new_tokens"]
    trained = completions * (w["prompt_len"] + w["new_tokens"])
    # what the trainer computes: each prompt once for its group (`train.packing`, shared prompts)
    computed = w["prompts"] * w["prompt_len"] + generated
    params = model_params(json.loads((ROOT / w["shape"]).read_text()))
    # Forward + backward = 6 flops per parameter per token (LoRA: the frozen base still runs the
    # forward and the input-gradient backward, 4 of the 6); checkpointing's recompute not counted.
    flops_per_token = (4 if w["lora_rank"] else 6) * params
    summary = {
        "step_s": [round(r["step_s"], 2) for r in rows],
        "steady_step_s": round(med("step_s"), 3),
        "generate_s": round(med("generate_s"), 3),
        "train_s": round(med("train_s"), 3),
        "generated_tok_per_s_total": round(generated / med("step_s")),
        "rollout_tok_per_s_total": round(generated / med("generate_s")),
        "train_tok_per_s_total": round(trained / med("train_s")),
        "peak_gib": round(max(r.get("gpu_peak_gib", 0.0) for r in rows), 2),
        # which phase sets the peak (rows of reinforge before session 17 lack them: 0)
        "peak_generate_gib": round(max(r.get("gpu_peak_generate_gib", 0.0) for r in rows), 2),
        "peak_train_gib": round(max(r.get("gpu_peak_train_gib", 0.0) for r in rows), 2),
        "wall_s": round(wall, 1),
    }
    if all("iteration_s" in r for r in steady):
        # step end to step end, what the peer's timer measures (its logging and the work
        # between steps included); `step_s` is the step's own
        summary["steady_iteration_s"] = round(med("iteration_s"), 3)
    summary.update(per_gpu(summary, layout, flops_per_token * computed))
    summary.update(numerics(rows))
    if "rollout_staleness" in rows[0]:
        summary["staleness"] = [r["rollout_staleness"] for r in rows]
    return summary


# on policy the engine's sampler and the trainer compute the same logprobs up to bf16 rounding
# (G1: kl_sampler ~1e-9); above this the figures come from a run whose numbers are broken
KL_SAMPLER_LIMIT = 0.05


def numerics(rows: list[dict]) -> dict:
    """The run's largest `kl_sampler`, and a `numerics` message where a step's is not finite or
    over `KL_SAMPLER_LIMIT` (s30c-d: a LoRA run's NaN was seen only by a GPU test)."""
    kls = [(r["step"], r["kl_sampler"]) for r in rows if "kl_sampler" in r]
    if not kls:
        return {}
    bad = [(step, kl) for step, kl in kls if not math.isfinite(kl) or abs(kl) > KL_SAMPLER_LIMIT]
    if not bad:
        return {"kl_sampler_max": max(abs(kl) for _, kl in kls)}
    step, kl = bad[0]
    return {
        "numerics": f"kl_sampler {kl} at step {step} ({len(bad)} of {len(kls)} steps not finite "
        f"or over {KL_SAMPLER_LIMIT}): the sampler and the trainer disagree, the figures are "
        "a broken run's"
    }


def model_params(shape: dict) -> int:
    """Parameters of a Qwen2-style decoder from its config fields (MoE: those a token reads)."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    if shape.get("num_experts"):
        i = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape.get("num_key_value_heads", 0)
    d = shape.get("head_dim") or h // heads
    attn = h * heads * d * 2 + h * (kv or heads) * d * 2
    embed = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    return layers * (attn + 3 * h * i) + embed


def run_peer(name: str, w: dict, steps: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        "bench/peers/trl_grpo.py",
        "--shape",
        w["shape"],
        "--prompts",
        str(w["prompts"]),
        "--group",
        str(w["group"]),
        "--prompt-len",
        str(w["prompt_len"]),
        "--new-tokens",
        str(w["new_tokens"]),
        "--steps",
        str(steps),
        "--micro-batch",
        str(w["peer_micro_batch"]),
    ]
    if w["lora_rank"]:
        cmd += ["--lora-rank", str(w["lora_rank"])]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / f"peer_{name}.log").write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr[-2000:]
        fit = "does not fit" if "OutOfMemory" in tail or "out of memory" in tail else "failed"
        print(tail)
        return {"error": f"{fit} (exit {proc.returncode})"}
    return json.loads(lines[-1])


def print_table(results: dict) -> None:
    print("\n" + HEADER)
    for name, runs in results.items():
        for label, r in runs.items():
            if label != "peer":
                print(table_row(name, label, r))
    peers = [(name, runs["peer"], runs) for name, runs in results.items() if "peer" in runs]
    if peers:
        print(
            "\n| workload | system (1 GPU) | steady step s | gen tok/s total | peak GiB | vs reinforge, 1 GPU |"
        )
        print("|---|---|---|---|---|---|")
    for name, peer, runs in peers:
        if "error" in peer:
            print(f"| {name} | TRL GRPOTrainer | {peer['error']} | | | |")
            continue
        ours = runs.get("1 GPU", {})
        ratio = ""
        if "steady_step_s" in ours:
            speed = peer["steady_step_s"] / ours["steady_step_s"]
            memory = 1 - ours["peak_gib"] / peer["peak_gib"]
            ratio = f"reinforge **{speed:.1f}x faster**, {memory:+.0%} less memory"
            if "steady_iteration_s" in ours:  # the peer's own measure: step end to step end
                it = ours["steady_iteration_s"]
                ratio += f" (step end to step end: {it} s, {peer['steady_step_s'] / it:.1f}x)"
        print(
            f"| {name} | {peer['peer']} | {peer['steady_step_s']} | "
            f"{peer['generated_tok_per_s']:,} | {peer['peak_gib']} | {ratio} |"
        )


def run_workload(name: str, a, num_gpus: int, out: Path, results: dict) -> None:
    """Every layout of one workload, baseline first, into `results[name]`; each printed, and
    the JSON rewritten, as it finishes."""
    w = WORKLOADS[name]
    nprocs = [int(n) for n in a.nproc.split(",")]
    staleness = [k for k in a.staleness.split(",") if k]
    layouts, skipped = plan_layouts(
        name, w, nprocs, num_gpus, a.weak, a.disagg, a.skip_strong, staleness
    )
    for line in skipped:
        print(line, flush=True)
    runs: dict[str, dict] = results.setdefault(name, {})
    base, base_label = None, ""
    for layout in layouts:
        profile = a.profile_step if layout.nproc == 1 and layout.scaling == "strong" else 0
        r = run_reinforge(name, w, a.steps, out, profile, layout.overrides, layout, a.run_timeout)
        if (
            "error" not in r
            and base is None
            and layout.scaling == "strong"
            and not layout.generators
        ):
            base, base_label = r, layout.label  # the same-batch run on the fewest GPUs that ran
        elif layout is layouts[0]:
            print(f"{name}: the baseline failed; efficiency vs the next same-batch run", flush=True)
        if "error" not in r and base is not None:
            r["efficiency"], r["efficiency_vs"] = efficiency(r, base), base_label
        runs[layout.label] = r
        (out / "grpo_bench.json").write_text(json.dumps(results, indent=1))
        print(name, layout.label, json.dumps(r), flush=True)
        if "numerics" in r:
            print(f"{name} {layout.label}: NUMERICS: {r['numerics']}", flush=True)
        print(HEADER.splitlines()[0] + "\n" + table_row(name, layout.label, r), flush=True)
        for also in a.also if layout.nproc == 1 else []:
            variant = run_reinforge(name, w, a.steps, out, 0, also.split(), None, a.run_timeout)
            runs[f"1 GPU, {also}"] = variant
            print(name, "reinforge", also, json.dumps(variant), flush=True)
    if w.get("peer_micro_batch") and not a.skip_peer:
        runs["peer"] = run_peer(name, w, a.peer_steps, out)
        print(name, "peer", json.dumps(runs["peer"]), flush=True)
    elif not a.skip_peer:
        print(f"{name}: no peer ({w['why_no_peer']})", flush=True)
    (out / "grpo_bench.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--steps", type=int, default=5, help="reinforge RL steps (steady: 2..N)")
    p.add_argument("--peer-steps", type=int, default=4)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument(
        "--also",
        action="append",
        default=[],
        help="run reinforge on one GPU once more with these overrides, e.g. 'train.compile=true' "
        "(repeat it for several variants: one baseline, then each)",
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="profile this RL step's update of the one-GPU run (its steady figures skip it)",
    )
    p.add_argument(
        "--nproc",
        default="1",
        help="comma list of GPU counts, e.g. 1,2,4,8: the workload's global batch on each "
        "(strong scaling; counts above the machine's GPUs are skipped with a line)",
    )
    p.add_argument(
        "--weak",
        action="store_true",
        help="also, for each N above the baseline's, N / N0 times the prompts per step (the "
        "same batch per GPU as the baseline run on N0 GPUs): weak scaling",
    )
    p.add_argument(
        "--disagg",
        action="store_true",
        help="also, for each N > 1, the disaggregated mode with 1 generator + N-1 trainers and "
        "N/2 + N/2 (distributed.generators; algorithm.tis_cap = 2)",
    )
    p.add_argument(
        "--skip-strong",
        action="store_true",
        help="no colocated same-batch runs beyond the baseline (to fit --weak / --disagg runs "
        "in one call)",
    )
    p.add_argument(
        "--staleness",
        default="",
        help="with --disagg: one run per k of this comma list (distributed.rollout_staleness, "
        "e.g. '0,1'); default: the mode's k = 1",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        default=300,
        help="seconds one reinforge run may take before it is killed (its logged steps are "
        "still reported); 0 = none",
    )
    p.add_argument("--gpus", type=int, default=0, help="GPUs of the machine (0: count them)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    num_gpus = a.gpus or gpu_count()
    print(f"{num_gpus} GPU(s); efficiency = per-GPU generated tok/s / the baseline's", flush=True)
    # run_gpu.sh's timeout: end the current run's processes (`run_until_logged`), print the table
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict = {}
    try:
        for name in a.workload:
            run_workload(name, a, num_gpus, out, results)
    finally:
        print_table(results)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    main()
