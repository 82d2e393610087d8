"""Where the GPU waits during one whole RL step: `reinforge train` with its STEP-th step under
the profiler (device activity only; kernels from CUDA graph replays included), then the device's busy time (the union of
its kernels and copies) against the step's wall time, per phase (rollout, update), and the idle
gaps by what ran before and after them (a bench tool; the trainer carries no profiling code).

    python bench/timeline.py STEP OUT_FILE train CONFIG [k=v ...]
    python bench/timeline.py --cprofile STEP OUT_FILE train CONFIG [k=v ...]

With --cprofile: the step's host work instead, under cProfile (functions by cumulative and by own
time) and torch's sync debug mode (the calls that wait for the device, by stack), to find what
the host does in the gaps; cProfile slows the host, so not both at once.

A gap of the device between two kernels is host work the queue did not cover: a
synchronization, a launch slower than the kernels it queues, or work on the host alone (reward,
packing). The table names the gaps' neighbours, so the host code behind each can be found.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
from profile_train import at_step, synchronizations

import reinforge.rollout.episodes as episodes
import reinforge.rollout.sources as sources
import reinforge.rollout.trajectories as trajectories
import reinforge.train.loop.rl as rl
from reinforge.cli import main
from reinforge.engine.paged import PagedEngine

TOP_KERNELS = 25
MIN_GAP_US = 20.0  # shorter gaps are the launch latency between graph nodes / queued kernels


def device_intervals(prof) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every kernel and copy the device ran, sorted by start."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        start = e.start_ns()
        out.append((start, start + e.duration_ns(), e.name()))
    return sorted(out)


WINDOWS: dict[str, tuple[int, int]] = {}  # label -> (start ns, end ns), the host's clock


def marked(fn, label: str):
    """`fn`, its last call's span recorded in WINDOWS (wall-clock ns: kineto's clock)."""

    def wrapper(*args, **kwargs):
        start = time.time_ns()
        try:
            return fn(*args, **kwargs)
        finally:  # a function called many times in the step: from its first start to last end
            first = WINDOWS.get(label, (start, 0))[0]
            WINDOWS[label] = (first, time.time_ns())

    return wrapper


def busy_and_gaps(intervals, lo: int, hi: int):
    """Busy ns (union of intervals inside [lo, hi]) and the gaps between them (ns, before, after)."""
    busy, gaps, end, before = 0, [], lo, "(window start)"
    for start, stop, name in intervals:
        start, stop = max(start, lo), min(stop, hi)
        if stop <= start:
            continue
        if start > end:
            gaps.append((start - end, before, name))
        if stop > end:
            busy += stop - max(start, end)
            end, before = stop, name
    if hi > end:
        gaps.append((hi - end, before, "(window end)"))
    return busy, gaps


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def report(prof, wall: float, out_file: str) -> None:
    intervals = device_intervals(prof)
    windows = dict(WINDOWS)
    lines = [f"step wall {wall:.3f} s (profiled); device events {len(intervals)}"]
    for phase, (lo, hi) in windows.items():
        busy, gaps = busy_and_gaps(intervals, lo, hi)
        span = (hi - lo) / 1e9
        idle = [g for g in gaps if g[0] >= MIN_GAP_US * 1e3]
        idle_s = sum(g[0] for g in idle) / 1e9
        lines.append(
            f"\n{phase}: {span:.3f} s, device busy {busy / 1e9:.3f} s ({100 * busy / (hi - lo):.1f}%),"
            f" {len(idle)} gaps >= {MIN_GAP_US:.0f} us = {idle_s:.3f} s"
        )
        by_pair: dict[tuple[str, str], list[int]] = defaultdict(list)
        for ns, before, after in idle:
            by_pair[(short(before), short(after))].append(ns)
        kernels: dict[str, list[int]] = defaultdict(list)
        for start, stop, name in intervals:
            if lo <= start < hi:
                kernels[short(name)].append(stop - start)
        lines.append("  kernels: ms | calls | us a call | name")
        for name, values in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]:
            total = sum(values)
            lines.append(
                f"  {total / 1e6:8.2f} | {len(values):6d} | {total / 1e3 / len(values):7.1f} | {name}"
            )
        ranked = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:15]
        lines.append("  idle ms | gaps | max us | after -> before")
        for (before, after), values in ranked:
            lines.append(
                f"  {sum(values) / 1e6:7.2f} | {len(values):4d} | {max(values) / 1e3:6.0f} |"
                f" {before} -> {after}"
            )
    text = "\n".join(lines)
    print(text, flush=True)
    with open(out_file, "w") as f:
        f.write(text + "\n")


def measured(out_file: str):
    def run(step_fn, args, kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        WINDOWS.clear()
        # device activity only: tracing every host operator would slow the host and widen the
        # very gaps measured here
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            result = marked(step_fn, "whole step")(*args, **kwargs)
            torch.cuda.synchronize()
        report(prof, time.perf_counter() - start, out_file)
        return result

    return run


def host_profiled(out_file: str):
    def run(step_fn, args, kwargs):
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        with synchronizations() as syncs:
            result = profiler.runcall(step_fn, *args, **kwargs)
        text = io.StringIO()
        text.write(f"synchronizing calls in the step: {sum(syncs.values())}\n")
        for stack, count in sorted(syncs.items(), key=lambda kv: -kv[1])[:15]:
            text.write(f"\n{count} x\n{stack}")
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(70)
        stats.sort_stats("tottime").print_stats(40)
        with open(out_file, "w") as f:
            f.write(text.getvalue())
        return result

    return run


if __name__ == "__main__":
    host = sys.argv[1] == "--cprofile"
    argv = sys.argv[2:] if host else sys.argv[1:]
    step, out_file, argv = int(argv[0]), argv[1], argv[2:]
    if host:
        rl.rl_step = at_step(rl.rl_step, step, host_profiled(out_file))
        sys.exit(main(argv))
    rl.update_policy = marked(rl.update_policy, "update")
    rl.build_step_batch = marked(rl.build_step_batch, "step batch")
    sources.LocalRollouts.sample = marked(sources.LocalRollouts.sample, "rollout")
    # the rollout's parts, to place its gaps (each from its first call's start to its last end)
    PagedEngine.generate = marked(PagedEngine.generate, "rollout: engine.generate")
    PagedEngine._completions = marked(PagedEngine._completions, "rollout: completions' texts")
    episodes._open = marked(episodes._open, "rollout: episodes opened")
    episodes._run_env_steps = marked(episodes._run_env_steps, "rollout: env steps")
    episodes._take_step = marked(episodes._take_step, "rollout: steps taken")
    trajectories.to_trajectory = marked(trajectories.to_trajectory, "rollout: trajectories")
    rl.rl_step = at_step(rl.rl_step, step, measured(out_file))
    sys.exit(main(argv))
