"""The env variants of `[task]` (config/envs.py): each name's builder of its `EnvTasks`.

`ENV_TASKS` maps each env variant to its builder; `tasks.build_task_source` merges it into its
table, so `[task] name = "game"` is one dict lookup like `name = "arithmetic"`. Each builder
imports its env when called, so choosing one task loads no other's code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer, env_tasks_of
from reinforge.envs.tools_task import build_tools_task, python_tool

# ----------------------------------------------------------------------------------- builders


def build_tool_arithmetic(cfg) -> EnvTasks:
    from reinforge.envs.calculator import (
        ArithmeticToolEnv,
        ToolArithmeticTasks,
        calculator,
        python_with_values,
    )

    tasks = ToolArithmeticTasks(cfg)
    tool = calculator if cfg.tool == "calculator" else python_with_values(python_tool(cfg.sandbox))
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


def build_agent(cfg) -> EnvTasks:
    from reinforge.envs.agent_task import build_agent_task

    return build_agent_task(cfg)


def build_user_env(cfg) -> EnvTasks:
    from reinforge.envs.user_env import build_user_env as build

    return build(cfg)


def build_verifiers(cfg) -> EnvTasks:
    from reinforge.envs.verifiers_env import build_verifiers as build

    return build(cfg)


ENV_TASKS: dict[str, Callable[[Any], EnvTasks]] = {
    "tool_arithmetic": build_tool_arithmetic,
    "html": build_html,
    "search": build_search,
    "game": build_game,
    "env": build_user_env,
    "tools": build_tools_task,
    "agent": build_agent,
    "verifiers": build_verifiers,
}
