"""Env tasks: a task source, the env that plays its tasks, and how an episode becomes a reward.

`ENV_TASKS` maps each env variant of `[task]` (config_envs.py) to the builder of its `EnvTasks`;
`tasks.build_task_source` merges it into its table, so `[task] name = "game"` is one dict lookup
like `name = "arithmetic"`. The trainer runs an `EnvTasks` through multi-turn episodes
(rollout/) as every task is: a task source without an env plays as `single_turn_tasks`.

An episode's reward is `EpisodeScorer`'s weighted sum of named components (`task.rewards`):
"env" is the env's own score (`StepResult.rewards["reward"]`), other names the env reports are
its further components (a game's "outcome" and "legal_moves"), and anything else is a text
reward (`rewards.BUILTIN_REWARDS` or "module:function") scored on the episode's last assistant
message. Every name is resolved when the task source is built, so a typo fails before any model
loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from reinforge.envs.base import Env, EnvState, SingleTurnEnv
from reinforge.errors import ConfigError
from reinforge.faults import RewardErrors, guard_reward
from reinforge.rewards import BUILTIN_REWARDS
from reinforge.rewards.mix import RewardFn, RewardMix, RewardSpec
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
        try:
            self.text = RewardMix(text_specs, BUILTIN_REWARDS, setting) if text_specs else None
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

    def reward(self, completion: str, task: Task) -> float:
        """A single completion's score (the first turn alone), for single-turn uses."""
        return self.source.reward(completion, task)

    @property
    def can_score(self) -> bool:
        return getattr(self.source, "can_score", True)

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


# ----------------------------------------------------------------------------------- builders


def build_tool_arithmetic(cfg) -> EnvTasks:
    from reinforge.envs.calculator import (
        ArithmeticToolEnv,
        ToolArithmeticTasks,
        calculator,
        python_with_values,
    )

    tasks = ToolArithmeticTasks(cfg)
    tool = calculator if cfg.tool == "calculator" else python_with_values(_python_tool(cfg.sandbox))
    env = ArithmeticToolEnv(
        [tool],
        tasks.reward,
        parser=cfg.parser,
        max_turns=cfg.max_turns,
        max_calls_per_turn=cfg.max_calls_per_turn,
    )
    scorer = EpisodeScorer(cfg.rewards, ())
    return EnvTasks(
        cfg.name, tasks, env, scorer, _tool_counters(), tasks.demonstration, **env_tasks_of(cfg)
    )


def _tool_counters() -> tuple[str, ...]:
    from reinforge.envs.tool_env import ToolCounters

    return tuple(f.name for f in fields(ToolCounters))


def _python_tool(s) -> Callable[..., Any]:
    from reinforge.envs.sandbox import Sandbox, SandboxLimits, make_python_tool

    limits = SandboxLimits(
        cpu_seconds=s.cpu_seconds,
        wall_seconds=s.wall_seconds,
        memory_mb=s.memory_mb,
        max_output_bytes=s.max_output_bytes,
        max_file_mb=s.max_file_mb,
        max_processes=s.max_processes,
    )
    return make_python_tool(Sandbox(s.backend, limits))


def build_html(cfg) -> EnvTasks:
    from reinforge.envs.html_env import HtmlEnv, HtmlTasks

    tasks = HtmlTasks(seed=cfg.seed, num_eval=cfg.num_eval, show_page=cfg.show_page)
    env = HtmlEnv(parser=cfg.parser, max_turns=cfg.max_turns)
    scorer = EpisodeScorer(cfg.rewards, ())
    return EnvTasks(cfg.name, tasks, env, scorer, _tool_counters(), **env_tasks_of(cfg))


def build_search(cfg) -> EnvTasks:
    from reinforge.envs.search_env import SearchTasks, make_search_env

    tasks = SearchTasks(
        seed=cfg.seed, num_companies=cfg.num_companies, num_eval_companies=cfg.num_eval // 3
    )
    env = make_search_env(tasks.backend, parser=cfg.parser, max_turns=cfg.max_turns)
    scorer = EpisodeScorer(cfg.rewards, ())
    return EnvTasks(cfg.name, tasks, env, scorer, _tool_counters(), **env_tasks_of(cfg))


def build_game(cfg) -> EnvTasks:
    from reinforge.envs.games import GameCase, GameCounters, GameEnv, GameTasks
    from reinforge.envs.games.env import OUTCOME_REWARDS

    cases = [GameCase(**case.model_dump()) for case in cfg.cases]
    tasks = GameTasks(
        cases,
        seed=cfg.seed,
        num_eval_per_case=cfg.num_eval // len(cases),
        prompt_style=cfg.prompt_style,
        demo_best_move_fraction=cfg.demo_best_move_fraction,
    )
    env = GameEnv(
        reward_mode=cfg.reward_mode,
        max_illegal_moves=cfg.max_illegal_moves,
        prompt_style=cfg.prompt_style,
    )
    scorer = EpisodeScorer(cfg.rewards, ("outcome", "legal_moves"))
    counters = (*(f.name for f in fields(GameCounters)), *OUTCOME_REWARDS, "forfeit")
    return EnvTasks(
        cfg.name, tasks, env, scorer, counters, tasks.demonstration, **env_tasks_of(cfg)
    )


ENV_TASKS: dict[str, Callable[[Any], EnvTasks]] = {
    "tool_arithmetic": build_tool_arithmetic,
    "html": build_html,
    "search": build_search,
    "game": build_game,
}
