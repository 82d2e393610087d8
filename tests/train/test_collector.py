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


class Box:
    pass


def test_deferred_objects_live_until_the_next_collect():
    """`defer` keeps a step's objects past the step, to free them in the next step's `collect`
    (while the device runs the update), not where their last reference goes."""
    import weakref

    collector = Collector()
    try:
        box = Box()
        ref = weakref.ref(box)
        collector.defer(box, [1, 2, 3])
        del box
        assert ref() is not None
        collector.collect()
        assert ref() is None
        kept = Box()
        ref = weakref.ref(kept)
        collector.defer(kept)
        del kept
        boxes = [Box() for _ in range(3)]
        refs = [weakref.ref(b) for b in boxes]
        for b in boxes:  # three steps with no `collect` between: only the last two are kept
            collector.defer(b)
        del boxes, b
        assert [r() is None for r in refs] == [True, False, False]
        collector.close()  # a run's end frees them too
        assert ref() is None and all(r() is None for r in refs)
    finally:
        collector.close()


def test_an_rl_step_hands_its_rollout_to_defer(tmp_path):
    """The step's groups and trajectories (host objects: the batch's device tensors are not
    kept) go to `defer` after the update: alive after `rl_step` returns, freed by the
    collector's next `collect`."""
    import weakref

    from reinforge.checkpoint import TrainerState
    from reinforge.train.loop import rl

    from .test_rl_loop import DigitTasks, NullLogger, make_learner, micro_step_config

    cfg = micro_step_config("algorithm.kl_coef=0", "train.micro_batch_tokens=64")
    learner = make_learner(cfg, tmp_path)
    collector = Collector()
    try:
        rl.rl_step(
            cfg,
            learner,
            DigitTasks(cfg.task),
            TrainerState("rl", 0, 0),
            1,
            NullLogger(),
            while_busy=collector.collect,
            defer=collector.defer,
        )
        [(sampled, groups)] = collector._deferred
        trajectory = groups[0].trajectories[0]
        assert len(sampled) == 4
        refs = [weakref.ref(trajectory), weakref.ref(groups[-1])]
        del sampled, groups, trajectory
        assert all(r() is not None for r in refs)
        collector.collect()
        assert all(r() is None for r in refs)
    finally:
        collector.close()
