"""Built-in procedural tasks with verifiable answers and held-out evaluation splits.

A task source is indexable: `train_task(i)` is a pure function of (seed, i), so the data position
of a run is one integer and resuming it repeats or skips nothing. Evaluation tasks are drawn from
their own stream and never appear in training.
"""

from __future__ import annotations

from typing import Protocol

from reinforge.types import Task


class TaskSource(Protocol):
    """Optionally also `can_score: bool`: False for a source whose tasks have no reward (SFT
    conversations without answers); absent means True."""

    name: str

    def train_task(self, index: int) -> Task: ...

    def eval_tasks(self) -> list[Task]: ...

    def reward(self, completion: str, task: Task) -> float:
        """1.0 for a correct answer, 0.0 otherwise (partial credit where the task defines it)."""
        ...


def prefetch(source, indices) -> None:
    """Ask `source` to start building training tasks `indices` ahead of `train_task`, where it
    can (an optional `prefetch(indices)` method: reasoning-gym's slow generators); a no-op
    elsewhere. The tasks are the same either way."""
    method = getattr(source, "prefetch", None)
    if method is not None:
        method(indices)


def task_source_for(cfg, tokenizer=None) -> TaskSource:
    """The task source of a command's config `cfg` (a root): RL and evaluation score answers
    (the root's `needs_task_answers`), an SFT stage (`sft.steps > 0`) trains on solutions."""
    sft = getattr(cfg, "sft", None)
    return build_task_source(
        cfg.task,
        tokenizer,
        needs_answers=getattr(type(cfg), "needs_task_answers", True),
        needs_solutions=sft is not None and sft.steps > 0,
    )


def build_task_source(
    cfg, tokenizer=None, *, needs_answers: bool = True, needs_solutions: bool = False
) -> TaskSource:
    """The task source `cfg` (a `[task]` variant) names. Data read from files also gets the
    tokenizer (for the prompt token budget) and what the command needs of each row; generated
    tasks have an answer, and a solution unless their source says at build time that SFT cannot
    have one (`require_solutions`)."""
    from reinforge.tasks.dataset import load_dataset_source

    loaders = {"dataset": load_dataset_source}
    if cfg.name in loaders:
        return loaders[cfg.name](cfg, tokenizer, needs_answers, needs_solutions)
    from reinforge.envs.sources import ENV_TASKS
    from reinforge.tasks.arithmetic import ArithmeticTasks
    from reinforge.tasks.countdown import CountdownTasks
    from reinforge.tasks.random_tokens import RandomTokensTasks
    from reinforge.tasks.reasoning_gym_task import ReasoningGymTasks

    sources = {
        "arithmetic": ArithmeticTasks,
        "countdown": CountdownTasks,
        "random_tokens": RandomTokensTasks,
        "reasoning_gym": ReasoningGymTasks,
        **ENV_TASKS,  # played as multi-turn episodes (envs/sources.py)
    }
    source = sources[cfg.name](cfg)
    if needs_solutions and hasattr(source, "require_solutions"):
        source.require_solutions()
    return source
