"""How long a reasoning-gym dataset's items take to build as SFT asks for them (batches of 32,
the next batch submitted with this one), in the trainer's process and with the worker pool of
`reinforge.tasks.reasoning_gym_items`. A bench, not a timed test.

    python3 bench/reasoning_gym_items.py --dataset puzzle24 --batches 12 --workers 2
"""

from __future__ import annotations

import argparse
import time

import reinforge.tasks.reasoning_gym_items as items
import reinforge.tasks.reasoning_gym_task as rg_task
from reinforge.config.tasks import ReasoningGymTaskConfig
from reinforge.tasks.reasoning_gym_task import ReasoningGymTasks


def timed(dataset: str, batches: int, batch: int, workers: int, ahead: bool) -> tuple[float, float]:
    """(seconds to build the task source with 32 held-out items, seconds for the batches)."""
    items.MAX_WORKERS, items._executor = workers, None
    rg_task.SLOW_ITEM_S = 0.0 if ahead else float("inf")
    cfg = ReasoningGymTaskConfig(datasets={dataset: 1.0}, dataset_config={}, num_eval=32)
    start = time.perf_counter()
    tasks = ReasoningGymTasks(cfg)
    built = time.perf_counter() - start
    start = time.perf_counter()
    for b in range(batches):
        tasks.prefetch(range(b * batch, (b + 2) * batch))
        [tasks.train_task(i) for i in range(b * batch, (b + 1) * batch)]
    return built, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="puzzle24")
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=items.workers())
    args = p.parse_args()
    n = args.batches * args.batch
    for label, ahead in (("in-process", False), (f"{args.workers} workers", True)):
        built, took = timed(args.dataset, args.batches, args.batch, args.workers, ahead)
        print(f"{args.dataset} {label}: start {built:.1f} s, {n} items {took:.1f} s")


if __name__ == "__main__":
    main()
