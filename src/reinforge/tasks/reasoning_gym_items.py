"""reasoning-gym items built ahead, in worker processes, for datasets whose generator is slow.

Why: many reasoning-gym generators search for a puzzle with a solution, item by item, in Python
(measured on this project's 2-core CPU at their default settings, ms per item: knight_swap 554,
sokoban 127, futoshiki 102, zebra_puzzles 88, puzzle24 54, intermediate_integration 47,
quantum_lock 32, sudoku 19). A step needs one item per prompt: SFT's 300 steps of 32 items took
puzzle24 12 minutes on an H200 host (0.3 s of it on the GPU per step), and the held-out split
(200 items) is built before the model loads.

How: the task computes, for each task index it will need, which (dataset, item index) its first
draw asks for (a pure function of the seed and the index, `ReasoningGymTasks._first_draw`), and
`ItemsAhead.submit` hands those to a pool of worker processes; `take` returns a finished item (or
waits for it). The tasks are exactly those built without the pool: the same draws, the same
redraws (a held-out collision or a generator failure draws again, in the trainer's process).
What the pool adds is parallelism (a worker per CPU core but one, at most 8) and overlap: the callers
submit the next step's items with this step's (`rollout.sources`, `train.sft`).

Only datasets slower than `SLOW_ITEM_S` per item use it: a fast generator (chain_sum: 0.01 ms)
costs less than the pickling. A worker that dies or an item that cannot be pickled costs that
item: it is built in the trainer's process instead.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor

SLOW_ITEM_S = 0.005  # a generator slower than this per item builds its items ahead
MAX_WORKERS = 8
MAX_PENDING = 4096  # items submitted and not yet taken; the oldest are dropped past it

_executor: ProcessPoolExecutor | None = None


def workers() -> int:
    # one core left to the trainer's own thread (on a 2-core CPU a tiny puzzle24 run's RL steps
    # took 11.6-14.6 s in-process, with one worker or with two: within the machine's noise)
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))


def _pool() -> ProcessPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ProcessPoolExecutor(
            max_workers=workers(), mp_context=multiprocessing.get_context("spawn")
        )
        atexit.register(_executor.shutdown, wait=False, cancel_futures=True)
    return _executor


class ItemsAhead:
    """Items of one task source's datasets, submitted ahead and taken when a task is made."""

    def __init__(self, settings_json: dict[str, str], seed: int):
        self.settings_json, self.seed = settings_json, seed
        self.pending: OrderedDict[tuple[str, int], Future] = OrderedDict()
        self.taken = 0  # items that came from a worker (for tests and the curious)

    def submit(self, keys) -> None:
        """Start building these (dataset, item index) pairs, those not already under way."""
        global _executor
        for key in keys:
            if key in self.pending:
                continue
            name, index = key
            try:
                future = _pool().submit(generate, name, self.settings_json[name], self.seed, index)
            except RuntimeError:  # a broken pool (a worker died): build in-process from now on
                _executor = None
                return
            self.pending[key] = future
            if len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)[1].cancel()

    def take(self, key: tuple[str, int]) -> tuple[bool, object] | None:
        """(True, entry) or (False, the generator's error text) for a submitted item, or None
        when it was not submitted or could not come back (built in-process then)."""
        future = self.pending.pop(key, None)
        if future is None:
            return None
        try:
            ok, value = future.result()
        except Exception:  # a dead worker, an entry that did not pickle, a cancelled item
            return None
        self.taken += 1
        return ok, value


# ---- the worker side

_datasets: dict[tuple[str, str, int], object] = {}


def generate(name: str, settings_json: str, seed: int, index: int) -> tuple[bool, object]:
    """(True, item) or (False, "Type: message") when the library's generator raises on it."""
    from reinforge.tasks.reasoning_gym_scoring import create_dataset

    key = (name, settings_json, seed)
    if key not in _datasets:
        _datasets[key] = create_dataset(name, json.loads(settings_json), seed)
    try:
        return True, _datasets[key][index]
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e)[:200]}"
