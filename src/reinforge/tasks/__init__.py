"""Built-in procedural tasks with verifiable answers and held-out evaluation splits.

A task source is indexable: `train_task(i)` is a pure function of (seed, i), so the data position
of a run is one integer and resuming it repeats or skips nothing. Evaluation tasks are drawn from
their own stream and never appear in training.
"""

from __future__ import annotations

from typing import Protocol

from reinforge.types import Task


class TaskSource(Protocol):
    name: str

    def train_task(self, index: int) -> Task: ...

    def eval_tasks(self) -> list[Task]: ...

    def reward(self, completion: str, task: Task) -> float:
        """1.0 for a correct answer, 0.0 otherwise (partial credit where the task defines it)."""
        ...


def build_task_source(cfg) -> TaskSource:
    from reinforge.tasks.arithmetic import ArithmeticTasks
    from reinforge.tasks.countdown import CountdownTasks

    sources = {"arithmetic": ArithmeticTasks, "countdown": CountdownTasks}
    return sources[cfg.name](cfg)
