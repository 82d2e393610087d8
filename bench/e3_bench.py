"""E3: multi-turn tool episodes on one device, through the rollout code itself. Four modes:
`barrier-full` (the turn-by-turn loop as of session 10: a barrier per turn, every later turn's
history prefilled again, the env reply's delta from two renders of the whole conversation),
`barrier` (the same with the delta from a stand-in history, rollout/delta.py), `continuous`
(episodes on their own: tools overlap generation, history kept in the KV pool) and `branching`
(ARPO's branching over continuous episodes at the same budget).

    python bench/e3_bench.py [--shapes qwen2.5-0.5b,qwen2.5-7b] [--prompts 64] [--samples 8]
        [--turns 3] [--tool-latency 0.05] [--turn-tokens 128] [--prompt-len 256]
    BENCH=e3 bash bench/run_gpu.sh --shapes qwen2.5-0.5b,qwen2.5-7b      # on the GPU machine

Random weights of each shape (bf16 on a GPU); every turn forced to full length (EOS ignored);
the env (`episodes_bench.ToolTurnsEnv`) answers `--turns` turns with a 32-word tool result after
`--tool-latency` seconds, then ends. Per shape, each mode runs once on 8 prompts (warm-up: pool,
graphs), then measured on `--prompts`. Printed per mode: seconds, generated tokens/s (sampled by the
engine: a branch's shared prefix once), trajectory tokens (what the trainer gets), device idle
share (wall time outside the engine: not in a generate or session step, no step queued), peak KV pages,
prefill tokens computed, branches and filled episodes. JSON in $OUT (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from episodes_bench import ToolTurnsEnv, add_workload_args, load_shape, tasks_of  # noqa: E402

from reinforge.rollout import episodes  # noqa: E402
from reinforge.rollout.branching import Branching  # noqa: E402
from reinforge.rollout.continuous import LoopStats, run_continuous  # noqa: E402
from reinforge.rollout.delta import DeltaRenderer, environment_delta  # noqa: E402
from reinforge.rollout.sampling import sampling_params  # noqa: E402

# barrier-full: the loop as it was (session 10): every env reply's delta from two renders of the
# whole conversation; barrier: the same loop with the delta from a stand-in history
MODES = ("barrier-full", "barrier", "continuous", "branching")


def full_render(self, tokenizer, conversation, env_messages, tools, ended_with_stop):
    return environment_delta(tokenizer, conversation, env_messages, tools, ended_with_stop), True


def run_barrier(engine, tok, env, tasks, params, limits, args) -> dict:
    """The turn-by-turn loop; the engine's busy time is the time inside `generate`."""
    generate = engine.generate
    totals = {"busy": 0.0, "prefill": 0.0, "peak": 0.0, "generated": 0}

    def timed(prompts, p):
        start = time.perf_counter()
        out = generate(prompts, p)
        totals["busy"] += time.perf_counter() - start
        extra = engine.stats.extra
        totals["prefill"] += extra.get("num_prefill_tokens", 0.0)
        totals["generated"] += engine.stats.num_generated_tokens
        totals["peak"] = max(totals["peak"], extra.get("kv_blocks_peak", 0.0))
        return out

    engine.generate = timed
    start = time.perf_counter()
    try:
        groups = episodes.run_episodes(
            engine, tok, env, tasks, args.samples, params, limits, False, True, args.env_workers
        )
    finally:
        engine.generate = generate
    seconds = time.perf_counter() - start
    return summary(
        groups, seconds, totals["generated"], totals["busy"], totals["peak"], totals["prefill"]
    )


def run_loop(engine, tok, env, tasks, params, limits, args, branching) -> dict:
    stats = LoopStats()
    groups = run_continuous(
        engine, tok, env, tasks, args.samples, params, limits, False, args.env_workers,
        branching=branching, stats=stats,
    )  # fmt: skip
    return summary(
        groups,
        stats.seconds,
        stats.num_generated_tokens,
        stats.seconds_busy,
        stats.kv_blocks_peak,
        stats.num_prefill_tokens,
        stats.num_branches,
        stats.num_filled,
    )


def summary(groups, seconds, generated, busy, peak, prefill, branches=0, filled=0) -> dict:
    """`generated`: tokens the engine sampled (a branch's shared prefix not again)."""
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        # what the trainer gets: sampled tokens of every episode, shared prefixes counted per
        # branch
        "trajectory_tokens": sum(sum(e.loss_mask) for g in groups for e in g),
        "tokens_per_s": generated / seconds,
        "idle_share": max(0.0, 1.0 - busy / seconds),
        "kv_blocks_peak": peak,
        "prefill_tokens": prefill,
        "episodes": sum(len(g) for g in groups),
        "branches": branches,
        "filled": filled,
    }


def bench_shape(shape: str, args, device, dtype) -> dict:
    tok, model, engine = load_shape(shape, device, dtype, args.kv_gib)
    env = ToolTurnsEnv(args.turns, args.tool_latency)
    params = sampling_params(
        tok, max_new_tokens=args.turn_tokens, temperature=1.0, n=args.samples, ignore_eos=True
    )
    limits = episodes.EpisodeLimits(args.turns + 1, args.turn_tokens, 1 << 20)
    branching = Branching(
        initial_samples=args.initial, branch_size=args.branch_size, entropy_window=16
    )
    results = {}
    with torch.inference_mode():
        for prompts, label in ((min(8, args.prompts), "warm-up"), (args.prompts, "measured")):
            tasks = tasks_of(prompts, args.prompt_len, model.config.vocab_size)
            for mode in MODES:
                if mode.startswith("barrier"):
                    stand_in = DeltaRenderer.delta
                    if mode == "barrier-full":
                        DeltaRenderer.delta = full_render
                    try:
                        r = run_barrier(engine, tok, env, tasks, params, limits, args)
                    finally:
                        DeltaRenderer.delta = stand_in
                else:
                    chosen = branching if mode == "branching" else None
                    r = run_loop(engine, tok, env, tasks, params, limits, args, chosen)
                print(json.dumps({"shape": shape, "run": label, "mode": mode, **r}), flush=True)
                if label == "measured":
                    results[mode] = r
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def print_table(shape: str, results: dict, args, device_name: str) -> None:
    print(
        f"\nE3 {shape}, {device_name}: {args.prompts} prompts x {args.samples} samples, "
        f"{args.turns} tool turns of {args.turn_tokens} tokens, prompt {args.prompt_len}, "
        f"tool latency {args.tool_latency * 1000:.0f} ms; branching {args.initial} initial, "
        f"branch size {args.branch_size}"
    )
    print(
        f"{'mode':<13} {'seconds':>8} {'tokens/s':>9} {'traj tok':>9} {'idle':>6} "
        f"{'KV peak':>8} {'prefill':>9} {'episodes':>8} {'branches':>8} {'filled':>6}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<13} {r['seconds']:>8.2f} {r['tokens_per_s']:>9.0f} "
            f"{r['trajectory_tokens']:>9} {r['idle_share']:>6.1%} {r['kv_blocks_peak']:>8.0f} {r['prefill_tokens']:>9.0f} "
            f"{r['episodes']:>8} {r['branches']:>8} {r['filled']:>6}"
        )
    base = results["barrier-full"]
    for mode in ("barrier", "continuous", "branching"):
        r = results[mode]
        print(
            f"{mode} / barrier-full: {base['seconds'] / r['seconds']:.2f}x faster, "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    add_workload_args(parser, prompts=64, kv_gib=40.0)
    parser.add_argument("--initial", type=int, default=4, help="branching: initial samples")
    parser.add_argument("--branch-size", type=int, default=2)
    parser.add_argument("--env-workers", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = {"device": device_name, "args": vars(args), "shapes": {}}
    for shape in args.shapes.split(","):
        out["shapes"][shape] = bench_shape(shape, args, device, dtype)
        print_table(shape, out["shapes"][shape], args, device_name)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "e3_bench.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
