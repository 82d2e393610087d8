"""The shared shape of procedurally generated tasks: a held-out split drawn from its own stream,
and a training stream that never repeats a held-out task.

Subclasses give `_make(rng, task_id)` (one random task, with `info["key"]` identifying it) and
`reward(completion, task)`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod

from reinforge.types import Task

MAX_REDRAWS = 1000


class ProceduralTasks(ABC):
    name = "procedural"

    def __init__(self, cfg):
        self.cfg = cfg
        self._eval = [
            self._make(random.Random(f"{cfg.seed}/eval/{i}"), f"eval-{i}")
            for i in range(cfg.num_eval)
        ]
        self._eval_keys = {t.info["key"] for t in self._eval}

    @abstractmethod
    def _make(self, rng: random.Random, task_id: str) -> Task:
        """One random task of this family, with `info["key"]` identifying the problem."""

    def train_task(self, index: int) -> Task:
        """Task `index` of the training stream: a pure function of (seed, index). The rare draw
        that collides with a held-out task is redrawn, deterministically."""
        for attempt in range(MAX_REDRAWS):
            task = self._make(
                random.Random(f"{self.cfg.seed}/train/{index}/{attempt}"), f"train-{index}"
            )
            if task.info["key"] not in self._eval_keys:
                return task
        raise AssertionError("the eval split covers the whole task space")

    def eval_tasks(self) -> list[Task]:
        return list(self._eval)
