"""The environment protocol: environments speak chat messages.

`reset(task)` returns the opening messages and a state; `step(state, assistant_message)` returns
what the environment says back (tool results, a game board, nothing), whether the episode is
over, and the reward components earned. State is a dataclass, never a free-form dict.

Token-in/token-out lives above this layer: the rollout renders messages with the model's chat
template, records the exact ids, and masks environment tokens out of the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from reinforge.types import Message, Task


@dataclass
class EnvState:
    task: Task
    messages: list[Message] = field(default_factory=list)
    turn: int = 0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # per-env extras (board, tool counters)


@dataclass
class StepResult:
    messages: list[Message]  # environment replies to append (role "tool" or "user")
    done: bool
    rewards: dict[str, float] = field(
        default_factory=dict
    )  # named components; the env's weights combine them
    metrics: dict[str, float] = field(
        default_factory=dict
    )  # counters: tool calls, malformed calls, timeouts


class Env(Protocol):
    name: str

    def reset(self, task: Task) -> EnvState: ...

    def step(self, state: EnvState, assistant: Message) -> StepResult: ...


class SingleTurnEnv:
    """Any dataset of prompts with checkable answers: one assistant turn, then the reward.

    Without `reward_fn` the env reports no score of its own: its task source's reward scores the
    turn (`envs.sources.single_turn_tasks`), guarded and counted like every reward component."""

    name = "single_turn"

    def __init__(self, reward_fn: Callable[[str, Task], float] | None = None):
        self.reward_fn = reward_fn  # (completion_text, task) -> float

    def reset(self, task: Task) -> EnvState:
        return EnvState(task=task, messages=list(task.messages))

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        state.messages.append(assistant)
        state.turn += 1
        state.done = True
        rewards = {}
        if self.reward_fn is not None:
            rewards["reward"] = self.reward_fn(assistant.content, state.task)
        return StepResult(messages=[], done=True, rewards=rewards)
