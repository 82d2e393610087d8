"""`[task] name = "env"`: the user's own environment, by path, module or entry point.

The factory (`task.env`) is called once with `task.env_args` and returns an object that speaks
the Env protocol (envs/base.py). Optional attributes widen what reinforge does with it:

- `tool_schemas`: OpenAI tool schemas the chat template shows the model (`envs.tools.make_tools`
  builds them from typed functions with docstrings);
- `reward_components`: names of the components its `StepResult.rewards` reports besides
  "reward", so `[[task.rewards]]` can weigh them;
- `counters`: names of the counters its `StepResult.metrics` reports (logged every step);
- `demonstration(state) -> str`: a scripted next assistant message, for an SFT warm start.

Rows come from `task.path` (read as the dataset task reads files) or from a `rows(seed)`
generator beside the factory. Everything is checked here, before any model loads: the factory
resolves and returns an env, `reset` of the first task returns an `EnvState`, the tool schemas
and names are well formed; each failure is a `ConfigError` naming the file and the fix.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from reinforge.envs.base import EnvState
from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer, env_tasks_of
from reinforge.errors import ConfigError
from reinforge.rewards.mix import load_callable

ENTRY_POINT_GROUP = "reinforge.envs"


def build_user_env(cfg) -> EnvTasks:
    from reinforge.tasks.dataset import load_dataset_source

    env = make_env(cfg.env, cfg.env_args)
    require_answer = cfg.require_answer if cfg.require_answer is not None else False
    rows = cfg.model_copy(update={"path": cfg.rows_path(), "require_answer": require_answer})
    source = load_dataset_source(
        rows, None, needs_answers=False, needs_solutions=False, scored_by=f"the env {cfg.env}"
    )
    check_reset(env, source.train_task(0), cfg.env)
    components = _names(env, "reward_components", cfg.env)
    scorer = EpisodeScorer(cfg.rewards, components)
    demo = getattr(env, "demonstration", None)
    return EnvTasks(
        cfg.name,
        source,
        env,
        scorer,
        _names(env, "counters", cfg.env),
        demo if callable(demo) else None,
        **env_tasks_of(cfg),
    )


def resolve_factory(ref: str):
    """The callable `task.env` names: "file.py:function", "module:function", or an entry point
    of the group `reinforge.envs`."""
    if ":" in ref:
        return load_callable(ref, setting="task.env")
    found = entry_points(group=ENTRY_POINT_GROUP, name=ref)
    if not found:
        installed = sorted(e.name for e in entry_points(group=ENTRY_POINT_GROUP))
        raise ConfigError(
            f"task.env = {ref!r} is neither a path nor an installed env: give "
            '"path/to/file.py:make_env" or "package.module:make_env"; entry points in group '
            f"{ENTRY_POINT_GROUP!r}: {', '.join(installed) or 'none installed'}"
        )
    return next(iter(found)).load()


def make_env(ref: str, env_args: dict[str, Any]):
    factory = resolve_factory(ref)
    try:
        env = factory(**env_args)
    except TypeError as e:
        raise ConfigError(
            f"task.env = {ref!r} could not be called with task.env_args = {env_args!r}: {e}; "
            "make env_args match the factory's parameters"
        ) from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(
            f"task.env = {ref!r} returned {type(env).__name__} {env!r:.60}, which has no "
            f"{' or '.join(m + '()' for m in missing)}; the factory must return an env with reset(task) -> "
            "EnvState and step(state, assistant) -> StepResult (docs/environments.md)"
        )
    schemas = getattr(env, "tool_schemas", None)
    if schemas is not None and not _are_tool_schemas(schemas):
        raise ConfigError(
            f"task.env = {ref!r}: its tool_schemas must be a list of OpenAI tool schemas "
            '({"type": "function", "function": {"name": ..., "parameters": {...}}}); build them '
            "with reinforge.envs.make_tools(functions)"
        )
    if not isinstance(getattr(env, "name", None), str):
        env.name = ref.rpartition(":")[2] or ref
    return env


def check_reset(env, task, ref: str) -> None:
    try:
        state = env.reset(task)
    except Exception as e:
        raise ConfigError(
            f"task.env = {ref!r}: reset() of the first task ({task.id}) raised "
            f"{type(e).__name__}: {e}; fix the env or the rows"
        ) from e
    if not isinstance(state, EnvState):
        raise ConfigError(
            f"task.env = {ref!r}: reset() returned {type(state).__name__}, not an EnvState; "
            "return reinforge.envs.EnvState(task=task, messages=[...])"
        )
    if not state.messages:
        raise ConfigError(
            f"task.env = {ref!r}: reset() of task {task.id} opened with no messages; give the "
            "model at least one (the task's own: list(task.messages))"
        )


def _names(env, attribute: str, ref: str) -> tuple[str, ...]:
    names = getattr(env, attribute, ())
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            f"task.env = {ref!r}: {attribute} must be a tuple of names, got {names!r}"
        )
    return tuple(names)


def _are_tool_schemas(schemas) -> bool:
    if not isinstance(schemas, list):
        return False
    return all(
        isinstance(s, dict)
        and s.get("type") == "function"
        and isinstance(s.get("function"), dict)
        and isinstance(s["function"].get("name"), str)
        for s in schemas
    )
