"""Env tasks: a task source, the env that plays its tasks, and how an episode becomes a reward.

Every task the rollout plays is an `EnvTasks`: the env variants of `[task]` build one
(`envs/sources.py`), and a task source without an env of its own plays as `single_turn_tasks`
of it, an env of one assistant turn.

An episode's reward is `EpisodeScorer`'s weighted sum of named components (`task.rewards`):
"env" is the env's own score (`StepResult.rewards["reward"]`, or a single turn's task reward),
other names the env reports are its further components (a game's "outcome" and "legal_moves"),
"tool_called" comes from the episode's counters, and anything else is a text reward
(`rewards.BUILTIN_REWARDS` or "module:function") scored on the episode's last assistant
message. Every name is resolved when the task source is built, so a typo fails before any model
loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reinforge.envs.base import Env, EnvState, SingleTurnEnv
from reinforge.errors import ConfigError
from reinforge.faults import RewardErrors, guard_reward
from reinforge.rewards import BUILTIN_REWARDS
from reinforge.rewards.mix import RewardFn, RewardMix, RewardSpec, load_callable
from reinforge.types import Task

ENV_REWARD = "env"  # the config's name for the env's own score, StepResult.rewards["reward"]

# A scripted reference policy: the next assistant message in this episode (SFT demonstrations).
DemoPolicy = Callable[[EnvState], str]


# Components computed from how the episode went, not from its text: name -> (counter, test).
EPISODE_COMPONENTS: dict[str, str] = {"tool_called": "tool_calls"}


class EpisodeScorer:
    """Weighted reward components of a finished episode. `env_components`: what the env reports
    besides its own score (it always has "env"). A component that raises or returns something
    that is not a finite number scores 0 and is counted in `errors` (`faults.RewardErrors`)."""

    def __init__(
        self,
        specs,
        env_components: tuple[str, ...],
        setting: str = "task.rewards",
        verdict: RewardFn | None = None,
    ):
        # `verdict`: the task's own check of the last message, scored here as "env" (guarded)
        # for an env that leaves scoring to its task source (single turn)
        self.verdict = verdict
        self.weights = {s.name: float(s.weight) for s in specs}
        if not self.weights:
            raise ConfigError(f'{setting} is empty; list at least one, e.g. [{{name = "env"}}]')
        self.env_names = [n for n in self.weights if n in (ENV_REWARD, *env_components)]
        self.episode_names = [n for n in self.weights if n in EPISODE_COMPONENTS]
        taken = {*self.env_names, *self.episode_names}
        text_specs = [RewardSpec(n, w) for n, w in self.weights.items() if n not in taken]
        registry = dict(BUILTIN_REWARDS)
        for i, spec in enumerate(specs):
            function = getattr(spec, "function", None)
            if function is not None:  # the label `name` for a function found elsewhere
                where = f"{setting}[{i}].function"
                registry[spec.name] = BUILTIN_REWARDS.get(function) or load_callable(
                    function, setting=where
                )
        try:
            self.text = RewardMix(text_specs, registry, setting) if text_specs else None
        except ConfigError as e:
            known = ", ".join([ENV_REWARD, *env_components, *EPISODE_COMPONENTS, *BUILTIN_REWARDS])
            raise ConfigError(f"{e} (this task's components: {known})") from None

    def score(
        self,
        env_rewards: Mapping[str, float],
        last_message: str,
        task: Task,
        counters: Mapping[str, float] | None = None,
        errors: RewardErrors | None = None,
    ) -> tuple[float, dict[str, float]]:
        """(the weighted total, each component's raw value). An episode that ended without the
        env's verdict (context or turn limit, an env error) scores 0 on the env's components."""
        errors = errors if errors is not None else RewardErrors()
        components = {
            name: _as_reward(env_rewards.get("reward" if name == ENV_REWARD else name, 0.0))
            for name in self.env_names
        }
        if self.verdict is not None and ENV_REWARD in components:
            components[ENV_REWARD] = guard_reward(self.verdict, errors)(last_message, task)
        for name in self.episode_names:
            components[name] = float((counters or {}).get(EPISODE_COMPONENTS[name], 0.0) > 0)
        if self.text is not None:
            for spec, fn in zip(self.text.specs, self.text.fns):
                components[spec.name] = guard_reward(fn, errors)(last_message, task)
        total = sum(self.weights[name] * value for name, value in components.items())
        return total, components


def _as_reward(value) -> float:
    """An env's reported score as a float; an env reporting something else is the env's bug."""
    assert not isinstance(value, (bool, str)), f"an env reported the reward {value!r}"
    return float(value)


@dataclass
class EnvTasks:
    """A task source (train_task / eval_tasks / reward) whose tasks are played as episodes of
    `env`, with the episode limits of its `[task]` section. Every task the rollout plays is one:
    a single-turn task is `single_turn_tasks` of its source (an env of one assistant turn)."""

    name: str
    source: Any  # the TaskSource that generates the tasks
    env: Env
    scorer: EpisodeScorer
    counters: tuple[str, ...]  # the env's episode counters, reported (as 0 too) every step
    demonstration: DemoPolicy | None = None
    max_turns: int = 1
    max_context: int | None = None  # the episode's tokens; None: the model's context
    render_tools: bool = True

    def train_task(self, index: int) -> Task:
        return self.source.train_task(index)

    def eval_tasks(self) -> list[Task]:
        return self.source.eval_tasks()

    def prefetch(self, indices) -> None:
        """Let the source start building these training tasks (a source with slow items has
        `prefetch`, e.g. reasoning-gym's; the others build on demand)."""
        # (reinforge.tasks.prefetch's two lines: envs may not import tasks, tasks imports envs)
        method = getattr(self.source, "prefetch", None)
        if method is not None:
            method(indices)

    def reward(self, completion: str, task: Task) -> float:
        """A single completion's score (the first turn alone), for single-turn uses."""
        return self.source.reward(completion, task)

    @property
    def can_score(self) -> bool:
        """An env scores its own episodes; a single turn is scored by its source's reward."""
        return not self.is_single_turn or getattr(self.source, "can_score", True)

    @property
    def is_single_turn(self) -> bool:
        return isinstance(self.env, SingleTurnEnv)

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The env's tools (None for an env without tools, such as a game)."""
        return getattr(self.env, "tool_schemas", None)

    @property
    def uses_tools(self) -> bool:
        return self.tool_schemas is not None


def env_tasks_of(cfg, **fields_) -> dict[str, Any]:
    """The `EnvTasks` settings every env task's `[task]` section (EnvTaskConfig) holds."""
    return {
        "max_turns": cfg.max_turns,
        "max_context": cfg.max_context,
        "render_tools": cfg.render_tools,
        **fields_,
    }


def single_turn_tasks(source, rewards=None) -> EnvTasks:
    """A task source without an env of its own (generated tasks, a dataset) as an env of one
    assistant turn, scored by `rewards` (`[[task.rewards]]`; default: the source's own reward,
    "env"). An `EnvTasks` is returned as it is."""
    if isinstance(source, EnvTasks):
        return source
    specs = rewards if rewards is not None else [RewardSpec(ENV_REWARD)]
    scorer = EpisodeScorer(specs, (), verdict=source.reward)
    return EnvTasks(source.name, source, SingleTurnEnv(), scorer, ())
