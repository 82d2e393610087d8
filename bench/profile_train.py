"""`reinforge train` with one RL step's policy update under a profiler (a bench tool; the trainer
itself carries no profiling code).

    python bench/profile_train.py STEP OUT_FILE train CONFIG [k=v ...]
    python bench/profile_train.py --memory STEP OUT_FILE train CONFIG [k=v ...]
    python bench/profile_train.py --fsdp1 STEP OUT_FILE train CONFIG [k=v ...]
    python bench/profile_train.py --sections OUT_FILE train CONFIG [k=v ...]

Without --memory: the update's device time by operator (sorted by CUDA time) to OUT_FILE.
With --memory: the CUDA caching allocator's history over the update (`torch.cuda.memory`):
the memory held when the update starts, the update's peak, and the blocks alive at that peak
that the update allocated, largest first, each with the Python frames that allocated it, then
each memory pool besides the default (CUDA graphs', a shared MemPool) with what it still holds, to
OUT_FILE (and the raw snapshot beside it, OUT_FILE.pickle, for `torch.cuda._memory_viz`).
With --sections: every step's train phase split into its parts (`SECTIONS`), each between two
device synchronizations, one line per step to OUT_FILE.
With --no-gc-freeze CONFIG-ARGS: the run as it is, except that the collector's settling after
the first step (`train.loop.collector`) does nothing: every step's `gc_s` then shows the full
collections a run pays without it.
With --fsdp1 (before either): the trainer takes its distributed path over a world of one
process: FSDP2 sharding, so FSDP's own cost (hooks, casts, copies, the optimizer on DTensor
shards) shows on one GPU, apart from any communication; or, with `distributed.strategy=replicate`,
the replica's (its once-a-step gradient all-reduce).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import pickle
import shutil
import sys
import time
import traceback
import warnings
from collections import defaultdict

import torch

import reinforge.train.loop.rl as rl
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


@contextlib.contextmanager
def synchronizations():
    """Counts the host-device synchronizations made inside (torch's sync debug mode), by the
    Python stack that made them: each one drains the GPU's queue, so the host's per-layer work
    after it is not hidden behind queued kernels."""
    counts: dict[str, int] = defaultdict(int)
    if not torch.cuda.is_available():
        yield counts
        return
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        counts["".join(traceback.format_list(frames[-7:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown


def profiled(out_file: str):
    """The update under torch.profiler: its wall time, the device's busy time (kernels summed),
    the operators by device time and by host time; with PROFILE_TRACE=1 also a gzipped Chrome
    trace beside OUT_FILE."""

    def measured(update, args, kwargs):
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            with synchronizations() as syncs:
                result = update(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        wall = time.perf_counter() - start
        averages = prof.key_averages()
        busy = sum(getattr(e, "self_device_time_total", 0.0) for e in averages) / 1e6
        with open(out_file, "w") as f:
            f.write(f"update wall {wall:.3f} s (profiled), device kernels {busy:.3f} s\n\n")
            f.write(
                averages.table(
                    sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=90
                )
            )
            if cuda:
                f.write("\n\nby device time (self: the kernels themselves):\n")
                f.write(averages.table(sort_by="self_cuda_time_total", row_limit=60))
            f.write("\n\nby host time (self):\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=45))
            f.write(f"\n\nsynchronizing calls in the update: {sum(syncs.values())}\n")
            for stack, count in sorted(syncs.items(), key=lambda kv: -kv[1])[:12]:
                f.write(f"\n{count} x\n{stack}")
        if os.environ.get("PROFILE_TRACE") == "1":
            prof.export_chrome_trace(out_file + ".trace.json")
            with (
                open(out_file + ".trace.json", "rb") as raw,
                gzip.open(out_file + ".trace.json.gz", "wb") as z,
            ):
                shutil.copyfileobj(raw, z)
            os.remove(out_file + ".trace.json")
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


def pools_report(snapshot: dict) -> str:
    """The memory pools other than the allocator's default (CUDA graphs' private pools, a shared
    `torch.cuda.MemPool`): each pool's segments, reserved and allocated bytes, and its blocks
    still allocated (largest first, with the frames that allocated them where recorded)."""
    pools: dict[tuple, list[dict]] = defaultdict(list)
    for segment in snapshot["segments"]:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        if pool != (0, 0):
            pools[pool].append(segment)
    lines = ["", "memory pools besides the default one:"]
    for pool, segments in sorted(pools.items()):
        reserved = sum(s["total_size"] for s in segments)
        allocated = sum(s["allocated_size"] for s in segments)
        sizes = sorted((s["total_size"] for s in segments), reverse=True)
        lines.append(
            f"pool {pool}: {len(segments)} segments, reserved {reserved / GiB:.3f} GiB, "
            f"allocated {allocated / GiB:.3f} GiB; largest segments (MiB): "
            + ", ".join(f"{n / 2**20:.0f}" for n in sizes[:6])
        )
        blocks = [
            b for s in segments for b in s.get("blocks", []) if b["state"] == "active_allocated"
        ]
        for b in sorted(blocks, key=lambda b: -b["size"])[:8]:
            lines.append(f"    {b['size'] / 2**20:9.1f} MiB  {where(b.get('frames', []))}")
    return "\n".join(lines)


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
        report = peak_report(snapshot, held) + "\n" + pools_report(snapshot)
        with open(out_file, "w") as f:
            f.write(report + "\n")
        print(report, flush=True)
        return result

    return measured


# The train phase's parts (`rl.rl_step` after the rollout), each timed between two device
# synchronizations by `--sections`: (module, attribute) -> label.
SECTIONS = {
    ("rl", "build_step_batch"): "build the step's batch",
    ("rl", "score_with_models"): "reward / reference models",
    ("rl", "assign_advantages"): "advantages",
    ("update", "start_grads"): "gradient buffer",
    ("update", "to_floats"): "micro-batches (left in the queue at the metrics' read)",
    ("update", "optimizer_step"): "clip + optimizer step",
    ("update", "measure_policy_change"): "policy-change probe",
    ("rl", "update_policy"): "the whole update",
}


def sectioned(out_file: str) -> None:
    """Each of SECTIONS in every step wrapped: synchronize, time, synchronize; each step's
    seconds per part (and the train phase's rest) appended to OUT_FILE and printed. The
    synchronizations remove the overlap between parts, so the parts add up to a little more
    than an unsynchronized step's `train_s`."""
    import reinforge.train.loop.update as update_module

    modules = {"rl": rl, "update": update_module}
    times: dict[str, float] = defaultdict(float)

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[label] += time.perf_counter() - start

        return wrapper

    for (module, name), label in SECTIONS.items():
        setattr(modules[module], name, timed(getattr(modules[module], name), label))
    real_metrics = rl.train_memory_metrics
    steps = {"n": 0}

    def report(*args, **kwargs):  # called once per step, after the update
        steps["n"] += 1
        whole = times.pop("the whole update", 0.0)
        inside = sum(v for k, v in times.items() if k in INSIDE_UPDATE)
        line = f"step {steps['n']}: update {whole:.3f} s = " + ", ".join(
            f"{k} {v:.3f}" for k, v in times.items()
        )
        line += f"; the update's rest (packing, copies, launches) {whole - inside:.3f}"
        print(line, flush=True)
        with open(out_file, "a") as f:
            f.write(line + "\n")
        times.clear()
        return real_metrics(*args, **kwargs)

    rl.train_memory_metrics = report


INSIDE_UPDATE = {
    "gradient buffer",
    "micro-batches (left in the queue at the metrics' read)",
    "clip + optimizer step",
    "policy-change probe",
}


def shard_over_one_process() -> None:
    """A process group of one and `is_distributed()` true: the trainer then takes its torchrun
    path (FSDP2 or a replica, `distributed.strategy`) exactly as under torchrun."""
    import reinforge.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        backend = "cuda:nccl,cpu:gloo"
    torch.distributed.init_process_group(backend, rank=0, world_size=1)
    dist.is_distributed.__code__ = (lambda: True).__code__  # every importer's reference


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[0] == "--fsdp1":
        shard_over_one_process()
        argv = argv[1:]
    if argv[0] == "--no-gc-freeze":  # the baseline of `train.loop.collector`: nothing frozen
        import reinforge.train.loop.collector as collector

        collector.Collector.settle = lambda self: None
        sys.exit(main(argv[1:]))
    if argv[0] == "--sections":
        sectioned(argv[1])
        sys.exit(main(argv[2:]))
    memory = argv[0] == "--memory"
    argv = argv[1:] if memory else argv
    step, out_file, argv = int(argv[0]), argv[1], argv[2:]
    measured = (memory_profiled if memory else profiled)(out_file)
    rl.update_policy = at_step(rl.update_policy, step, measured)
    sys.exit(main(argv))
