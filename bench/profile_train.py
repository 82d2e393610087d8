"""`reinforge train` with one RL step's policy update under a profiler (a bench tool; the trainer
itself carries no profiling code).

    python bench/profile_train.py STEP OUT_FILE train CONFIG [k=v ...]
    python bench/profile_train.py --memory STEP OUT_FILE train CONFIG [k=v ...]

Without --memory: the update's device time by operator (sorted by CUDA time) to OUT_FILE.
With --memory: the CUDA caching allocator's history over the update (`torch.cuda.memory`):
the memory held when the update starts, the update's peak, and the blocks alive at that peak
that the update allocated, largest first, each with the Python frames that allocated it, to
OUT_FILE (and the raw snapshot beside it, OUT_FILE.pickle, for `torch.cuda._memory_viz`).
"""

from __future__ import annotations

import pickle
import sys
from collections import defaultdict

import torch

import reinforge.train.rl as rl
from reinforge.cli import main

GiB = 2**30


def at_step(update, step: int, measured):
    """`update`, except that its `step`-th call runs through `measured(update, args, kwargs)`."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != step:
            return update(*args, **kwargs)
        return measured(update, args, kwargs)

    return wrapper


def profiled(out_file: str):
    def measured(update, args, kwargs):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            result = update(*args, **kwargs)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45)
        with open(out_file, "w") as f:
            f.write(table)
        return result

    return measured


def where(frames: list[dict], depth: int = 4) -> str:
    """The innermost frames of an allocation that are reinforge's or transformers' own code."""
    ours = [
        f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
        for f in frames
        if "reinforge" in f["filename"] or "transformers" in f["filename"]
    ]
    return " < ".join(ours[:depth]) or " < ".join(
        f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:depth]
    )


def peak_report(snapshot: dict, held_at_start: int) -> str:
    """Replays the allocator's trace: the peak over the window and what the window had
    allocated and not yet freed at that moment."""
    events = snapshot["device_traces"][0]
    live: dict[int, dict] = {}
    current = peak = 0
    at_peak: dict[int, dict] = {}
    for event in events:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif action == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
        if current > peak:
            peak, at_peak = current, dict(live)
    groups: dict[str, list[int]] = defaultdict(list)
    for event in at_peak.values():
        groups[where(event.get("frames", []))].append(event["size"])
    lines = [
        f"held when the update starts: {held_at_start / GiB:.3f} GiB",
        f"allocated by the update, at its peak: {peak / GiB:.3f} GiB",
        f"peak: {(held_at_start + peak) / GiB:.3f} GiB "
        f"(max_memory_allocated {torch.cuda.max_memory_allocated() / GiB:.3f} GiB)",
        "",
        "alive at the peak, by allocating site (GiB, blocks):",
    ]
    for site, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(sizes) / GiB:8.3f} {len(sizes):5d}  {site}")
    return "\n".join(lines[:80])


def memory_profiled(out_file: str):
    def measured(update, args, kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        result = update(*args, **kwargs)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(out_file + ".pickle", "wb") as f:
            pickle.dump(snapshot, f)
        report = peak_report(snapshot, held)
        with open(out_file, "w") as f:
            f.write(report + "\n")
        print(report, flush=True)
        return result

    return measured


if __name__ == "__main__":
    argv = sys.argv[1:]
    memory = argv[0] == "--memory"
    argv = argv[1:] if memory else argv
    step, out_file, argv = int(argv[0]), argv[1], argv[2:]
    measured = (memory_profiled if memory else profiled)(out_file)
    rl.update_policy = at_step(rl.update_policy, step, measured)
    sys.exit(main(argv))
