"""`[task] name = "agent"`: the user's agent function, called per row and sample (docs/agents.md).

An agent task is an `EnvTasks` whose episodes are not stepped by reinforge: the agent runs its
own loop against the in-process OpenAI endpoint and the rollout (`rollout/agents.py`) assembles
the episode from the endpoint's token records. Its `env` (`AgentEnv`) only opens episodes, so
what reads an env task's opening prompt (the memory planner's probe) reads the row's messages.

The function is resolved, and its signature checked, when the task is built, before any model
loads: a typo is a `ConfigError` naming `task.agent`.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reinforge.envs.base import EnvState, StepResult
from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer, env_tasks_of
from reinforge.errors import ConfigError
from reinforge.rewards.mix import load_callable
from reinforge.types import Message, Task


class AgentEnv:
    """Opens an agent episode with the row's messages; the agent, not reinforge, plays it."""

    name = "agent"

    def reset(self, task: Task) -> EnvState:
        return EnvState(task=task, messages=list(task.messages))

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        raise AssertionError("an agent task's episodes are played by the agent, not stepped")


@dataclass
class AgentTasks(EnvTasks):
    """An agent task: rows, the agent function and how its failures count."""

    agent: Callable[..., Any] | None = None
    agent_args: dict[str, Any] = field(default_factory=dict)
    agent_ref: str = ""
    timeout_s: float = 300.0
    on_failure: str = "zero"  # "zero" or "drop"
    max_failed_share: float = 0.5

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.agent)


def load_agent(ref: str, agent_args: dict[str, Any]) -> Callable[..., Any]:
    """The function `task.agent` names, checked to take one positional argument (the context)
    and `agent_args` as keywords."""
    fn = load_callable(ref, setting="task.agent")
    if not callable(fn):
        raise ConfigError(f"task.agent = {ref!r} is {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None, **agent_args)
    except TypeError as e:
        raise ConfigError(
            f"task.agent = {ref!r} cannot be called as run(agent, **task.agent_args) with "
            f"agent_args = {agent_args!r}: {e}; define it as `def run(agent, ...)` (or async) "
            "and make agent_args match its keyword parameters"
        ) from None
    return fn


def check_agent_extra() -> None:
    """The endpoint's HTTP layer and the client agents get: the `agent` extra."""
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f'task.name = "agent" serves the policy to the agent over HTTP and gives it an openai '
            f"client, which need {', '.join(missing)}: pip install 'reinforge[agent]'"
        )


def build_agent_task(cfg) -> AgentTasks:
    from reinforge.tasks.dataset import load_dataset_source

    check_agent_extra()
    agent = load_agent(cfg.agent, cfg.agent_args)
    require_answer = cfg.require_answer if cfg.require_answer is not None else False
    rows = cfg.model_copy(update={"require_answer": require_answer})
    source = load_dataset_source(
        rows, None, needs_answers=False, needs_solutions=False, scored_by=f"the agent {cfg.agent}"
    )
    scorer = EpisodeScorer(cfg.rewards, tuple(cfg.reward_components))
    return AgentTasks(
        cfg.name,
        source,
        AgentEnv(),
        scorer,
        (),
        None,
        **env_tasks_of(cfg),
        agent=agent,
        agent_args=dict(cfg.agent_args),
        agent_ref=cfg.agent,
        timeout_s=cfg.agent_timeout_s,
        on_failure=cfg.on_agent_failure,
        max_failed_share=cfg.max_failed_agent_share,
    )
