"""`[[task.rewards]]`: the weighted reward components every `[task]` variant takes.

A task's training reward is the weighted sum of named components, each logged on its own
(`reward_<name>` per step and in evaluation, `rewards` in samples.jsonl), so a mix such as
1.0 x verify + 0.5 x format + 0.5 x reflection can be trained, ablated and compared.
"""

from __future__ import annotations

from pydantic import model_validator

from reinforge.config.base import Section


class RewardWeight(Section):
    name: str
    """A reward component: "env" (the task's own verdict: the env's score, or for a dataset and
    the generated tasks their reward, `task.reward`), a component the env reports (a game's
    "outcome" and "legal_moves"), "tool_called" (1 when the episode called a tool), "format" or
    "math" (scored on the last assistant message), or your own `(completion, task) -> float` as
    "module:function" or "path/to/file.py:function"."""
    weight: float = 1.0
    """Its weight in the training reward (0 logs it without training on it)."""
    function: str | None = None
    """Where the component's function is, when `name` is only its label: a built-in reward
    name or "module:function" / "path/to/file.py:function", e.g. {name = "reflection",
    function = "my_rewards.py:reflection"} logs `reward_reflection`."""


class ScoredTask(Section):
    """The reward settings of a `[task]` variant."""

    rewards: list[RewardWeight] = [RewardWeight(name="env")]
    """The training reward: the weighted sum of these components, each logged as
    `reward_<name>`, e.g. [{name = "env", weight = 1.0}, {name = "format", weight = 0.5},
    {name = "my_rewards.py:reflection", weight = 0.5}]. A component that raises or is not a
    finite number scores 0 and is counted (`reward_errors`)."""

    @model_validator(mode="after")
    def _distinct_rewards(self):
        names = [r.name for r in self.rewards]
        if not names:
            raise ValueError('task.rewards is empty; list at least one, e.g. [{name = "env"}]')
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"task.rewards lists {twice} more than once; list each name once")
        return self
