"""Env tasks: a task source, the env that plays its tasks, and how an episode becomes a reward.

`ENV_TASKS` maps each env variant of `[task]` (config_envs.py) to the builder of its `EnvTasks`;
`tasks.build_task_source` merges it into its table, so `[task] name = "game"` is one dict lookup
like `name = "arithmetic"`. The trainer runs an `EnvTasks` through multi-turn episodes
(train/env_rollout.py) instead of single completions.

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

from reinforge.envs.base import Env, EnvState
from reinforge.envs.tools_task import build_tools_task
from reinforge.errors import ConfigError
from reinforge.rewards import BUILTIN_REWARDS
from reinforge.rewards.mix import RewardMix, RewardSpec
from reinforge.types import Task

ENV_REWARD = "env"  # the config's name for the env's own score, StepResult.rewards["reward"]

# A scripted reference policy: the next assistant message in this episode (SFT demonstrations).
DemoPolicy = Callable[[EnvState], str]


class EpisodeScorer:
    """Weighted reward components of a finished episode. `env_components`: what the env reports
    besides its own score (it always has "env")."""

    def __init__(self, specs, env_components: tuple[str, ...], setting: str = "task.rewards"):
        self.weights = {s.name: float(s.weight) for s in specs}
        if not self.weights:
            raise ConfigError(f'{setting} is empty; list at least one, e.g. [{{name = "env"}}]')
        self.env_names = [n for n in self.weights if n in (ENV_REWARD, *env_components)]
        text_specs = [RewardSpec(n, w) for n, w in self.weights.items() if n not in self.env_names]
        try:
            self.text = RewardMix(text_specs, BUILTIN_REWARDS, setting) if text_specs else None
        except ConfigError as e:
            known = ", ".join([ENV_REWARD, *env_components, *BUILTIN_REWARDS])
            raise ConfigError(f"{e} (this task's components: {known})") from None

    def score(
        self, env_rewards: Mapping[str, float], last_message: str, task: Task
    ) -> tuple[float, dict[str, float]]:
        """(the weighted total, each component's raw value). An episode that ended without the
        env's verdict (context or turn limit) scores 0 on the env's components."""
        components = {
            name: float(env_rewards.get("reward" if name == ENV_REWARD else name, 0.0))
            for name in self.env_names
        }
        if self.text is not None:
            components.update(self.text.score(last_message, task).components)
        total = sum(self.weights[name] * value for name, value in components.items())
        return total, components


@dataclass
class EnvTasks:
    """A task source (train_task / eval_tasks / reward) whose tasks are played as episodes of
    `env`; `cfg` is its `[task]` section (turn and context limits, rewards)."""

    name: str
    source: Any  # the TaskSource that generates the tasks
    env: Env
    cfg: Any
    scorer: EpisodeScorer
    counters: tuple[str, ...]  # the env's episode counters, reported (as 0 too) every step
    demonstration: DemoPolicy | None = None

    def train_task(self, index: int) -> Task:
        return self.source.train_task(index)

    def eval_tasks(self) -> list[Task]:
        return self.source.eval_tasks()

    def reward(self, completion: str, task: Task) -> float:
        """A single completion's score (the first turn alone), for single-turn uses."""
        return self.source.reward(completion, task)

    @property
    def tool_schemas(self) -> list[dict] | None:
        """The env's tools (None for an env without tools, such as a game)."""
        return getattr(self.env, "tool_schemas", None)

    @property
    def uses_tools(self) -> bool:
        return self.tool_schemas is not None


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
    return EnvTasks(cfg.name, tasks, env, cfg, scorer, _tool_counters(), tasks.demonstration)


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
    return EnvTasks(cfg.name, tasks, env, cfg, EpisodeScorer(cfg.rewards, ()), _tool_counters())


def build_search(cfg) -> EnvTasks:
    from reinforge.envs.search_env import SearchTasks, make_search_env

    tasks = SearchTasks(
        seed=cfg.seed, num_companies=cfg.num_companies, num_eval_companies=cfg.num_eval // 3
    )
    env = make_search_env(tasks.backend, parser=cfg.parser, max_turns=cfg.max_turns)
    return EnvTasks(cfg.name, tasks, env, cfg, EpisodeScorer(cfg.rewards, ()), _tool_counters())


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
    return EnvTasks(cfg.name, tasks, env, cfg, scorer, counters, tasks.demonstration)


ENV_TASKS: dict[str, Callable[[Any], EnvTasks]] = {
    "tool_arithmetic": build_tool_arithmetic,
    "html": build_html,
    "search": build_search,
    "game": build_game,
    "tools": build_tools_task,
}
