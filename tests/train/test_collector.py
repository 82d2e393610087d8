"""The garbage collector's pauses counted per step (`gc_s`) and, after a run's first step, its
long-lived objects frozen out of later collections, and given back at the run's end."""

import gc
import json

from reinforge.errors import ExitCode
from reinforge.train.loop.collector import HELD_THRESHOLD, Collector

from ..conftest import TINY_RUN, cli


class Node:
    def __init__(self):
        self.other = self


def test_collections_are_timed_and_settle_freezes_until_close():
    before = gc.get_freeze_count()
    collector = Collector()
    try:
        for _ in range(20_000):
            Node()  # cycles: only the collector frees them
        gc.collect()
        assert collector.take() > 0.0
        assert collector.take() == 0.0  # taken
        collector.settle()
        assert gc.get_freeze_count() > before
        assert collector.take() == 0.0  # the settling collection is not a step's
        garbage = [Node() for _ in range(1000)]
        del garbage
        assert gc.collect() >= 1000  # new cycles are still collected
    finally:
        collector.close()
    assert gc.get_freeze_count() == before
    assert collector._on_collection not in gc.callbacks
    collector.take()
    gc.collect()
    assert collector.take() == 0.0  # closed: no longer counting


def test_a_run_logs_each_steps_collector_seconds(tmp_path):
    args = [f"run.output_dir={tmp_path}", "run.name=gc", "run.max_steps=3", "sft.steps=2"]
    run = cli("train", *args, *TINY_RUN)
    assert run.returncode == ExitCode.OK, run.stderr
    rows = [json.loads(x) for x in (tmp_path / "gc" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase", "rl") == "rl" and "step_s" in r]
    sft = [r for r in rows if r.get("phase") == "sft"]
    assert len(rl) == 3 and all(0.0 <= r["gc_s"] < r["step_s"] for r in rl), rl
    assert len(sft) == 2 and all(r["gc_s"] >= 0.0 for r in sft), sft
    # from one RL step's log to the next (what a peer's step timer measures): the step and the
    # work between steps; none for the first
    assert "iteration_s" not in rl[0]
    assert all(r["step_s"] <= r["iteration_s"] < r["step_s"] + 5.0 for r in rl[1:]), rl


def test_held_makes_no_automatic_collection_and_collect_runs_one():
    """An RL step runs `held` (automatic collections rare) and collects once (`collect`) where
    the device is busy; an allocation-heavy step still collects; afterwards the collector's
    thresholds are as they were."""
    starts = []

    def count(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    collector = Collector()
    gc.callbacks.append(count)
    before = gc.get_threshold()
    try:
        gc.collect()
        starts.clear()
        with collector.held():
            garbage = [Node() for _ in range(50_000)]  # gen 0's default threshold: 70 times
            del garbage
            assert starts == []
            collector.collect()
            assert starts == [2]
            garbage = [Node() for _ in range(2 * HELD_THRESHOLD)]
            del garbage
            assert 0 in starts[1:], "millions of allocations still collect"
        assert gc.get_threshold() == before
    finally:
        gc.callbacks.remove(count)
        collector.close()
