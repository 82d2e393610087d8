"""Where the GPU waits during one whole RL step: `reinforge train` with its STEP-th step under
the profiler (device activity only; kernels from CUDA graph replays included), then the device's busy time (the union of
its kernels and copies) against the step's wall time, per phase (rollout, update), and the idle
gaps by what ran before and after them (a bench tool; the trainer carries no profiling code).

    python bench/timeline.py STEP OUT_FILE train CONFIG [k=v ...]
    python bench/timeline.py --cprofile STEP OUT_FILE train CONFIG [k=v ...]
    python bench/timeline.py --lines STEP OUT_FILE train CONFIG [k=v ...]

With --cprofile: the step's host work instead, under cProfile (functions by cumulative and by own
time) and torch's sync debug mode (the calls that wait for the device, by stack), to find what
the host does in the gaps; cProfile slows the host, so not both at once. With --lines: the
decode loop's torch-calling functions line by line (line_profiler, a bench wheel), host us per line.

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
SPANS: dict[str, list[tuple[int, int]]] = defaultdict(list)  # label -> every call's (start, end)
TRACING = {"on": False}

# host functions whose every call is timed in the measured step, to charge the device's idle
# gaps to the host work they overlap (nested ones overlap their callers: each is charged alone)
TRACED = [
    "reinforge.engine.model_runner:ModelRunner.restore",
    "reinforge.engine.model_runner:ModelRunner.begin_generate",
    "reinforge.engine.model_runner:pool_block",
    "reinforge.engine.cuda_graphs:DecodeGraphs.check_params",
    "reinforge.engine.cuda_graphs:DecodeGraphs.forget_tables",
    "torch.cuda:empty_cache",
    "reinforge.engine.model_runner:ModelRunner.launch",
    "reinforge.engine.paged:PagedEngine._grow_pool",
    "reinforge.engine.paged:PagedEngine._launch_ahead",
    "reinforge.engine.paged:PagedEngine._launch_next",
    "reinforge.engine.paged:PagedEngine._commit",
    "reinforge.engine.paged:PagedEngine._completions",
    "reinforge.engine.paged:PagedEngine._record_stats",
    "reinforge.engine.cuda_graphs:DecodeGraphs.run",
    "reinforge.engine.cuda_graphs:DecodeGraphs._update_tables",
    "reinforge.engine.scheduler:Scheduler.schedule",
    "reinforge.engine.scheduler:Scheduler.schedule_next_decode",
    "reinforge.engine.scheduler:Scheduler.launched",
    "reinforge.engine.scheduler:Scheduler.commit",
    "reinforge.engine.records:HiddenStore.write",
    "reinforge.engine.records:HiddenStore.flush",
    "reinforge.engine.records:HiddenStore.wait",
    "reinforge.train.loop.rl:begin_rollout",
    "reinforge.train.loop.update:records_ready",
    "reinforge.rollout.trajectories:run_episodes",
    "reinforge.rollout.episodes:open_episodes",
    "reinforge.rollout.episodes:_generate_first_turn",
    "reinforge.rollout.trajectories:to_trajectory",
    "reinforge.train.loop.update:pack_micro_batch",
    "reinforge.train.loop.update:micro_compute",
    "reinforge.train.loop.update:optimizer_step",
]


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


def traced(fn, label: str):
    """`fn`, each call's span kept in SPANS while a step is measured."""

    def wrapper(*args, **kwargs):
        if not TRACING["on"]:
            return fn(*args, **kwargs)
        start = time.time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS[label].append((start, time.time_ns()))

    return wrapper


def trace_all(names: list[str]) -> None:
    """Wraps each `module:Qualified.name` of `names` with `traced` (a missing one is said)."""
    import importlib

    for name in names:
        module_name, _, qual = name.partition(":")
        owner = importlib.import_module(module_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr, None)
        if fn is None:
            print(f"timeline: {name} not found, not traced", flush=True)
            continue
        setattr(owner, attr, traced(fn, qual))


def idle_under_spans(gaps: list[tuple[int, int]]) -> list[str]:
    """Per traced function: calls, host ms inside it, and the device's idle ms (gaps >= the
    minimum) that fall inside its calls."""
    lines = ["\nhost functions: calls | host ms | device idle ms inside | name"]
    rows = []
    for label, spans in SPANS.items():
        host = sum(b - a for a, b in spans)
        idle, k = 0, 0
        for a, b in spans:  # spans and gaps are sorted by start
            while k < len(gaps) and gaps[k][1] <= a:
                k += 1
            j = k
            while j < len(gaps) and gaps[j][0] < b:
                idle += max(0, min(b, gaps[j][1]) - max(a, gaps[j][0]))
                j += 1
        rows.append((idle, host, len(spans), label))
    for idle, host, calls, label in sorted(rows, reverse=True):
        lines.append(f"  {calls:6d} | {host / 1e6:8.2f} | {idle / 1e6:8.2f} | {label}")
    return lines


def idle_gaps(intervals, lo: int, hi: int) -> list[tuple[int, int]]:
    """The device's idle (start, end) ns inside [lo, hi], gaps >= MIN_GAP_US only."""
    out, end = [], lo
    for start, stop, _ in intervals:
        if stop <= lo or start >= hi:
            continue
        if start - end >= MIN_GAP_US * 1e3:
            out.append((end, start))
        end = max(end, stop)
    if hi - end >= MIN_GAP_US * 1e3:
        out.append((end, hi))
    return out


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
    if "whole step" in windows:
        lines += idle_under_spans(idle_gaps(intervals, *windows["whole step"]))
    text = "\n".join(lines)
    print(text, flush=True)
    with open(out_file, "w") as f:
        f.write(text + "\n")


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: (name, CPU seconds so far), from /proc (Linux; {} elsewhere).
    Python threads by their `threading` names, others by their kernel names."""
    import os
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in map(int, tids):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        out[tid] = (names.get(tid, comm), (int(fields[11]) + int(fields[12])) / tick)
    return out


def threads_report(before: dict, after: dict, wall: float) -> str:
    """The step's CPU time by thread (a Python thread busy beside the main one takes the GIL
    from it: the main thread then waits up to the switch interval, 5 ms, each time it lets go)."""
    rows = []
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        if used >= 0.005:
            rows.append((used, tid, name))
    lines = [f"\nthreads: CPU ms in the step ({wall:.3f} s wall), those with >= 5 ms"]
    lines += [f"  {used * 1e3:8.0f} | {tid} | {name}" for used, tid, name in sorted(rows)[::-1]]
    return "\n".join(lines)


def measured(out_file: str):
    def run(step_fn, args, kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        WINDOWS.clear()
        SPANS.clear()
        TRACING["on"] = True
        cpu_before = thread_cpu()
        # device activity only: tracing every host operator would slow the host and widen the
        # very gaps measured here
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            result = marked(step_fn, "whole step")(*args, **kwargs)
            torch.cuda.synchronize()
        TRACING["on"] = False
        cpu_after = thread_cpu()
        wall = time.perf_counter() - start
        report(prof, wall, out_file)
        text = threads_report(cpu_before, cpu_after, wall)
        print(text, flush=True)
        with open(out_file, "a") as f:
            f.write(text + "\n")
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


# the per-step host work of the decode loop that calls torch (line by line: `--lines`); loops over
# every sequence (the scheduler's) are left out, the profiler's cost per line would swamp them
LINE_PROFILED = [
    "reinforge.engine.paged:PagedEngine._launch_ahead",
    "reinforge.engine.paged:PagedEngine._commit",
    "reinforge.engine.model_runner:ModelRunner.launch",
    "reinforge.engine.cuda_graphs:DecodeGraphs.run",
    "reinforge.engine.cuda_graphs:DecodeGraphs._update_tables",
    "reinforge.engine.step_sampling:StepSampling._fetch",
    "reinforge.engine.step_sampling:LaunchedStep.result",
    "reinforge.engine.records:HiddenStore.write",
    "reinforge.engine.record_positions:PositionsTable.write_decode",
    "reinforge.engine.records:HiddenStore._stage",
    "reinforge.engine.records:HiddenStore.flush",
    "reinforge.engine.records:HiddenStore._to_host",
    # the generation's start: the KV pool back, the prompts' prefill (eager, layer by layer)
    "reinforge.engine.paged:PagedEngine.generate",
    "reinforge.engine.model_runner:ModelRunner.restore",
    "reinforge.engine.model_runner:ModelRunner.begin_generate",
    "reinforge.engine.model_runner:ModelRunner.run",
    "reinforge.engine.cuda_graphs:DecodeGraphs.check_params",
    "reinforge.engine.cuda_graphs:DecodeGraphs.forget_tables",
    "reinforge.engine.qwen_forward:forward",
    "reinforge.engine.qwen_forward:attention_block",
    "reinforge.engine.qwen_forward:mlp_block",
    "reinforge.engine.varlen:prefill_varlen",
    "reinforge.engine.varlen:varlen_causal",
    "reinforge.engine.eager_inputs:prefill",
]


def lines_profiled(out_file: str):
    """The step under line_profiler (`LINE_PROFILED`): host microseconds per line."""
    import importlib
    import io

    from line_profiler import LineProfiler

    profiler = LineProfiler()
    for name in LINE_PROFILED:
        module_name, _, qual = name.partition(":")
        owner = importlib.import_module(module_name)
        for part in qual.split("."):
            owner = getattr(owner, part)
        profiler.add_function(getattr(owner, "__wrapped__", owner))

    def run(step_fn, args, kwargs):
        profiler.enable_by_count()
        try:
            return step_fn(*args, **kwargs)
        finally:
            profiler.disable_by_count()
            text = io.StringIO()
            profiler.print_stats(stream=text, output_unit=1e-6, stripzeros=True)
            with open(out_file, "w") as f:
                f.write(text.getvalue())

    return run


if __name__ == "__main__":
    mode = sys.argv[1] if sys.argv[1] in ("--cprofile", "--lines") else None
    argv = sys.argv[2:] if mode else sys.argv[1:]
    step, out_file, argv = int(argv[0]), argv[1], argv[2:]
    if mode == "--cprofile":
        rl.rl_step = at_step(rl.rl_step, step, host_profiled(out_file))
        sys.exit(main(argv))
    if mode == "--lines":
        rl.rl_step = at_step(rl.rl_step, step, lines_profiled(out_file))
        sys.exit(main(argv))
    trace_all(TRACED)
    rl.update_policy = marked(rl.update_policy, "update")
    rl.build_step_batch = marked(rl.build_step_batch, "step batch")
    sources.LocalRollouts.sample = marked(sources.LocalRollouts.sample, "rollout")
    # the rollout's parts, to place its gaps (each from its first call's start to its last end)
    PagedEngine.generate = marked(PagedEngine.generate, "rollout: engine.generate")
    PagedEngine._completions = marked(PagedEngine._completions, "rollout: completions' texts")
    episodes.open_episodes = marked(episodes.open_episodes, "rollout: episodes opened")
    episodes._run_env_steps = marked(episodes._run_env_steps, "rollout: env steps")
    episodes._take_step = marked(episodes._take_step, "rollout: steps taken")
    trajectories.to_trajectory = marked(trajectories.to_trajectory, "rollout: trajectories")
    rl.rl_step = at_step(rl.rl_step, step, measured(out_file))
    sys.exit(main(argv))
