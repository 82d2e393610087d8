"""The host's cost of one decode step's CUDA graph launch (E1's shape), against the device's time
for it: if launching the graph takes a large part of a step's device time, a slow host makes the
decode loop host-bound (s25c, H100: 176 of 512 steps waited 0.27 ms on average for the graph's
first kernel after the host had queued the step's inputs).

    python bench/replay_cost.py [--workload E1] [--repeats 200]

Prints: host microseconds inside `CUDAGraph.replay()` with the device idle and with the device
busy (replays queued back to back), the device's time per replay, and the same for a graph of
one tiny kernel (the launch's fixed cost).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from engine_bench import WORKLOADS, NullTokenizer, build_model, random_prompts

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine


def host_us(graph: torch.cuda.CUDAGraph, repeats: int, idle: bool) -> float:
    """Median host microseconds of `graph.replay()`; `idle`: the device drained before each."""
    times = []
    for _ in range(repeats):
        if idle:
            torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        times.append(1e6 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return statistics.median(times)


def device_us(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / repeats


def tiny_graph() -> torch.cuda.CUDAGraph:
    x = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the graph
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        x.add_(1)
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="E1", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    w = WORKLOADS[args.workload]
    model, config = build_model(w.shape)
    engine = PagedEngine(
        model, NullTokenizer(config.eos_token_id), max_num_seqs=w.num_prompts * w.n
    )
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=w.n, seed=0, ignore_eos=True)
    engine.generate(random_prompts(config, w), params)  # captures the decode graphs
    graphs = engine.runner.graphs.graphs
    bucket = max(graphs)
    rows = [
        ("tiny graph (one kernel)", tiny_graph()),
        (f"decode step, {bucket} rows", graphs[bucket]),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| graph | host us, device idle | host us, device busy | device us a replay |")
    print("|---|---|---|---|")
    for label, graph in rows:
        host_us(graph, 10, idle=True)  # warm
        idle = host_us(graph, args.repeats, idle=True)
        busy = host_us(graph, args.repeats, idle=False)
        device = device_us(graph, args.repeats)
        print(f"| {label} | {idle:.1f} | {busy:.1f} | {device:.1f} |")


if __name__ == "__main__":
    main()
