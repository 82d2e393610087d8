"""G1 / G2 of shared/BENCHMARKS.md: a GRPO step through `reinforge train` and through TRL's
GRPOTrainer (bench/peers/trl_grpo.py, a copy of shared/peers/) with the same numbers, in one job.

    python bench/grpo_bench.py --workload G1 [--workload G2] [--steps 5] [--peer-steps 4] --out DIR

reinforge runs as a user runs it (`reinforge train configs/bench/g1.toml`, a subprocess), and its
figures come from the run's metrics.jsonl: steady step seconds (median of steps 2..N), the
generation and training phases apart, generated tokens/s end to end, training tokens/s and model
FLOPs utilisation, peak GPU memory. The peer prints one JSON line. The table compares the two.
Not a timed test: nothing here fails for being slow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
}


def run_reinforge(
    name: str, w: dict, steps: int, out: Path, profile_step: int = 0, overrides=(), nproc: int = 1
) -> dict:
    run_dir = Path("/tmp/reinforge-bench") / name.lower()
    cmd = [sys.executable, "-m", "reinforge.cli"]
    if nproc > 1:  # the same config on nproc GPUs: torchrun, FSDP2, the same global batch
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*torchrun, f"--nproc-per-node={nproc}", "-m", "reinforge.cli"]
    if profile_step:  # same run, one update under torch.profiler (it slows that step only)
        cmd = [sys.executable, "bench/profile_train.py", str(profile_step)]
        cmd.append(str((out / f"train_profile_{name}.txt").resolve()))
    cmd += ["train", w["config"], f"run.max_steps={steps}", *overrides]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    label = "_".join(["", *overrides, *([f"{nproc}gpu"] if nproc > 1 else [])])
    (out / f"reinforge_{name}{label}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        return {"error": f"exit {proc.returncode}", "wall_s": wall}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r.get("phase") == "rl" and "step_s" in r]
    return summarise(steps_rows, w, wall, profile_step)


def summarise(rows: list[dict], w: dict, wall: float, profile_step: int = 0) -> dict:
    steady = [r for r in rows[1:] if r["step"] != profile_step] or rows

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    completions = w["prompts"] * w["group"]
    generated = completions * w["new_tokens"]
    trained = completions * (w["prompt_len"] + w["new_tokens"])
    # what the trainer computes: each prompt once for its group (`train.packing`, shared prompts)
    computed = w["prompts"] * w["prompt_len"] + generated
    shape = json.loads((ROOT / w["shape"]).read_text())
    params = model_params(shape)
    train_s = med("train_s")
    # Forward + backward = 6 flops per parameter per token (LoRA: the frozen base still runs the
    # forward and the input-gradient backward, 4 of the 6); checkpointing's recompute not counted.
    flops_per_token = (4 if w["lora_rank"] else 6) * params
    return {
        "step_s": [round(r["step_s"], 2) for r in rows],
        "steady_step_s": round(med("step_s"), 3),
        "generate_s": round(med("generate_s"), 3),
        "train_s": round(train_s, 3),
        "generated_tok_per_s": round(generated / med("step_s")),
        "rollout_tok_per_s": round(generated / med("generate_s")),
        "train_tok_per_s": round(trained / train_s),
        "train_mfu_vs_796tflops": round(flops_per_token * computed / train_s / 796e12, 3),
        "peak_gib": round(max(r.get("gpu_peak_gib", 0.0) for r in rows), 2),
        "wall_s": round(wall, 1),
        **(
            {"staleness": [r["rollout_staleness"] for r in rows]}
            if "rollout_staleness" in rows[0]
            else {}
        ),
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
    print(
        "\n| workload | system | steady step s | generate s | train s | gen tok/s (end to end) "
        "| train tok/s | train MFU | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ours, peer = r["reinforge"], r.get("peer", {})
        if "error" not in ours:
            print(
                f"| {name} | reinforge | {ours['steady_step_s']} | {ours['generate_s']} | "
                f"{ours['train_s']} | {ours['generated_tok_per_s']:,} | "
                f"{ours['train_tok_per_s']:,} | {ours['train_mfu_vs_796tflops']:.1%} | "
                f"{ours['peak_gib']} |"
            )
        else:
            print(f"| {name} | reinforge | {ours['error']} | | | | | | |")
        for label, variant in r.items():
            if label.startswith("reinforge ") and "error" not in variant:
                print(
                    f"| {name} | {label} | {variant['steady_step_s']} | {variant['generate_s']} | "
                    f"{variant['train_s']} | {variant['generated_tok_per_s']:,} | "
                    f"{variant['train_tok_per_s']:,} | {variant['train_mfu_vs_796tflops']:.1%} | "
                    f"{variant['peak_gib']} |"
                )
            elif label.startswith("reinforge "):
                print(f"| {name} | {label} | {variant['error']} | | | | | | |")
        if peer and "error" not in peer:
            print(
                f"| {name} | {peer['peer']} | {peer['steady_step_s']} | | | "
                f"{peer['generated_tok_per_s']:,} | | | {peer['peak_gib']} |"
            )
        elif peer:
            print(f"| {name} | TRL GRPOTrainer | {peer['error']} | | | | | | |")
        for label, variant in r.items():
            if "GPUs" in label and "error" not in variant and "error" not in ours:
                scale = variant["generated_tok_per_s"] / ours["generated_tok_per_s"]
                print(
                    f"| {name} | scaling: {label} vs 1 GPU | **{scale:.2f}x** generated tok/s | | | | | | |"
                )
        if "error" not in ours and peer and "error" not in peer:
            speed = peer["steady_step_s"] / ours["steady_step_s"]
            memory = 1 - ours["peak_gib"] / peer["peak_gib"]
            print(f"| {name} | ratio | **{speed:.1f}x faster** | | | | | | {memory:+.0%} less |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), required=True)
    p.add_argument("--steps", type=int, default=5, help="reinforge RL steps (steady: 2..N)")
    p.add_argument("--peer-steps", type=int, default=4)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument(
        "--also",
        default="",
        help="run reinforge once more with these overrides, e.g. 'train.compile=true'",
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="profile this RL step's update (reported steady figures then skip that step)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="also run reinforge on this many GPUs of the machine (torchrun + FSDP2, the same "
        "config and global batch): one more row, 'reinforge N GPUs'",
    )
    p.add_argument(
        "--weak",
        action="store_true",
        help="with --nproc N: one more N-GPU run with N times the prompts per step (the same "
        "batch per GPU as the one-GPU run): throughput scaling at a fixed per-GPU batch",
    )
    p.add_argument(
        "--staleness",
        default="",
        help="with --nproc N: one more N-GPU run in the disaggregated mode for each k of this "
        "comma list (distributed.rollout_staleness, e.g. '0,1,2'; algorithm.tis_cap = 2)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in a.workload:
        w = WORKLOADS[name]
        results[name] = {"reinforge": run_reinforge(name, w, a.steps, out, a.profile_step)}
        print(name, "reinforge", json.dumps(results[name]["reinforge"]), flush=True)
        if a.also:
            variant = run_reinforge(name, w, a.steps, out, 0, a.also.split())
            results[name][f"reinforge {a.also}"] = variant
            print(name, "reinforge", a.also, json.dumps(variant), flush=True)
        if a.nproc > 1:
            variant = run_reinforge(name, w, a.steps, out, nproc=a.nproc)
            results[name][f"reinforge {a.nproc} GPUs"] = variant
            print(name, "reinforge", a.nproc, "GPUs", json.dumps(variant), flush=True)
        if a.nproc > 1 and a.weak:  # the same batch per GPU: N times the prompts per step
            wide = {**w, "prompts": w["prompts"] * a.nproc}
            grow = [f"rollout.prompts_per_step={wide['prompts']}"]
            variant = run_reinforge(name, wide, a.steps, out, overrides=grow, nproc=a.nproc)
            results[name][f"reinforge {a.nproc} GPUs, {a.nproc}x prompts"] = variant
            print(name, "reinforge", a.nproc, "GPUs weak", json.dumps(variant), flush=True)
        for k in filter(None, a.staleness.split(",") if a.nproc > 1 else []):
            disaggregated = ["distributed.mode=disaggregated", "algorithm.tis_cap=2.0"]
            extra = [*disaggregated, f"distributed.rollout_staleness={k}"]
            variant = run_reinforge(name, w, a.steps, out, overrides=extra, nproc=a.nproc)
            results[name][f"reinforge {a.nproc} GPUs disaggregated k={k}"] = variant
            print(name, "reinforge disaggregated k", k, json.dumps(variant), flush=True)
        if not a.skip_peer:
            results[name]["peer"] = run_peer(name, w, a.peer_steps, out)
            print(name, "peer", json.dumps(results[name]["peer"]), flush=True)
    (out / "grpo_bench.json").write_text(json.dumps(results, indent=1))
    print_table(results)


if __name__ == "__main__":
    main()
