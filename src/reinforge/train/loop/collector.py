"""Python's cyclic garbage collector, kept out of the steps' time.

A full (generation 2) collection walks every object the process tracks, and it runs whenever
enough new long-lived objects have piled up. A training process tracks many: about 0.44 M after a
CPU quickstart (a full collection 0.32 s on a 2-core box), more in a GPU run, where
`torch.compile` and the captured CUDA graphs keep their own bookkeeping. In G1 that showed as a
0.5-0.6 s pause in the rollout of one step in five (bench/RESULTS.md, session 24).

After a run's first step everything long-lived exists (the model, the optimizer, compiled code,
captured graphs, the engine): `Collector.settle` collects once and moves what is alive to the
permanent generation (`gc.freeze`), so later collections walk only what the steps made since.
The run gives it back at its end (`close`: `gc.unfreeze`), so a process that runs several
trainings one after another (the tests) still frees their garbage.

The RL loop (`rl.train`) and the SFT phase (`session.sft_phase`) each settle after their first
step in the process; each step's seconds inside the collector are its `gc_s` metric.

An RL step also runs with automatic collections made rare (`held`) and collects once where the
device is busy (`collect`, called by the update once its micro-batches are queued): a collection that
fell in the step's host-only phases made the device wait for it. G1 (H100 host, s26e): its env
steps took 16-22 ms in the trainer against 1-2 ms alone (`bench/rollout_host.py` on the same
host, s26f), and `gc_s` read 3-24 ms a step (s26a).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

# allocations between two automatic collections of the youngest generation inside `held` (700
# outside: Python's default)
HELD_THRESHOLD = 200_000


class Collector:
    """Counts the seconds spent in collections (every thread's) until `close`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start: float | None = None
        self._settled = False
        self._deferred: list[tuple] = []
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def take(self) -> float:
        """The seconds collected since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @contextmanager
    def held(self) -> Iterator[None]:
        """Automatic collections made rare inside: the youngest generation's threshold raised to
        `HELD_THRESHOLD` allocations (a G1 step makes a few tens of thousands: none; a rollout
        that allocates millions, e.g. agents' loops, still collects every that many, so its
        garbage cycles cannot pile up); `collect` runs one whenever asked. The thresholds before
        are restored after."""
        thresholds = gc.get_threshold()
        gc.set_threshold(max(HELD_THRESHOLD, thresholds[0]), *thresholds[1:])
        try:
            yield
        finally:
            gc.set_threshold(*thresholds)

    def defer(self, *objects) -> None:
        """Keep `objects` (a step's rollout: its trajectories, token and logprob lists) alive
        until the next `collect`, which the next step's update runs while the device is busy:
        freeing them where their last reference died, between steps or as the next generation
        restores its pool, kept the device idle (G1: ~260k ints and floats, 5-11 ms a step on
        an H200 host, s30b)."""
        if len(self._deferred) >= 2:  # (no update ran `collect` since: free the oldest now)
            self._deferred.pop(0)
        self._deferred.append(objects)

    def collect(self) -> None:
        """What `defer` kept freed, then one full collection now: after `settle` it walks only
        what the run made since (a step leaves few survivors), before it everything (the first
        step's update is long anyway)."""
        self._deferred.clear()
        gc.collect()

    def settle(self) -> None:
        """Once a run's long-lived objects exist: one full collection, then freeze what is left
        (later collections skip it). Its own collection's time is not a step's."""
        if self._settled:
            return
        gc.collect()
        gc.freeze()
        self._settled = True
        self.take()

    def close(self) -> None:
        self._deferred.clear()
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)
        if self._settled:
            gc.unfreeze()
            self._settled = False
