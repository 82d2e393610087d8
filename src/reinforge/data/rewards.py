"""Which reward scores a loaded row: one for all rows, or one per `data_source` (verl's way).

`resolve_rewards` runs once at load time over every data source the tasks carry, so a source
without a reward is an error before training, not a zero reward in the middle of it. With
`reward = "auto"` a source finds its reward by, in order: `reward_by_source`, verl's source
names (`SOURCE_REWARDS` and `SOURCE_PREFIX_REWARDS`), the rows' `ability` (`ABILITY_REWARDS`).
Rows that ask for a learned reward model (`reward_model.style = "model"`) need one given
explicitly: reinforge scores rules, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from reinforge.data.spec import SETTING, DatasetSpec
from reinforge.errors import ConfigError
from reinforge.rewards import format_reward, math_reward
from reinforge.rewards.mix import RewardFn, load_callable
from reinforge.types import Task


def exact_match_reward(completion: str, task: Task) -> float:
    """1.0 when the completion is the answer, up to surrounding and repeated whitespace."""
    return 1.0 if " ".join(completion.split()) == " ".join(task.answer.split()) else 0.0


DATA_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "exact_match": exact_match_reward,
    "format": format_reward,
}
# verl's data_source names (verl.utils.reward_score.default_compute_score) that a rule scores.
SOURCE_REWARDS = {
    "openai/gsm8k": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
}
SOURCE_PREFIX_REWARDS = {"aime": "math", "numina_": "math", "math": "math", "gsm8k": "math"}
ABILITY_REWARDS = {"math": "math"}


class RewardRouter:
    """`(completion, task) -> float` that hands each task to its data source's reward."""

    def __init__(self, by_source: Mapping[str, RewardFn], names: Mapping[str, str]):
        self.by_source = dict(by_source)
        self.names = dict(names)  # data_source -> reward name, for reports

    def __call__(self, completion: str, task: Task) -> float:
        source = task.info["data_source"]
        assert source in self.by_source, f"no reward resolved for data_source {source!r}"
        value = self.by_source[source](completion, task)
        if isinstance(value, (bool, str, bytes)):  # float() would take True or "1.0" as 1.0
            raise TypeError(
                f"reward {self.names[source]!r} (data_source {source!r}) returned {value!r:.60} "
                f"(a {type(value).__name__}); a reward returns a float"
            )
        return value


def resolve_rewards(tasks: Sequence[Task], spec: DatasetSpec) -> RewardRouter:
    sources, names, unresolved = _names(tasks, spec)
    if unresolved:
        raise ConfigError(
            f"no reward for data_source {unresolved}: {_why(sources[unresolved[0]])}set "
            f'{SETTING}.reward = "math" (or "exact_match", or "module:function") for all rows, '
            f'or {SETTING}.reward_by_source = {{"{unresolved[0]}" = "exact_match"}}; '
            f"built-in rewards: {sorted(DATA_REWARDS)}"
        )
    return _router(names, spec)


def known_rewards(tasks: Sequence[Task], spec: DatasetSpec) -> RewardRouter | None:
    """The rewards when every data source has one and some row has an answer to check, else
    None: for data that need not be scored (SFT conversations), where an unknown source means
    "no held-out accuracy", not an error."""
    if spec.reward == "auto" and not any(t.answer for t in tasks):
        return None
    _, names, unresolved = _names(tasks, spec)
    return None if unresolved else _router(names, spec)


def _names(
    tasks: Sequence[Task], spec: DatasetSpec
) -> tuple[dict[str, Task], dict[str, str], list[str]]:
    """(an example task per data source, source -> reward name, sources with no reward)."""
    sources: dict[str, Task] = {}
    for task in tasks:
        sources.setdefault(task.info["data_source"], task)
    if spec.reward != "auto":
        return sources, dict.fromkeys(sources, spec.reward), []
    names, unresolved = {}, []
    for source, example in sources.items():
        name = _auto_name(source, example, spec.reward_by_source)
        if name is None:
            unresolved.append(source)
        else:
            names[source] = name
    return sources, names, unresolved


def _router(names: dict[str, str], spec: DatasetSpec) -> RewardRouter:
    if spec.reward != "auto":
        fn = _load(spec.reward, f"{SETTING}.reward", spec.base_dir)
        return RewardRouter(dict.fromkeys(names, fn), names)
    fns = {
        source: _load(name, f"{SETTING}.reward_by_source[{source!r}]", spec.base_dir)
        for source, name in names.items()
    }
    return RewardRouter(fns, names)


def _auto_name(source: str, example: Task, overrides: Mapping[str, str]) -> str | None:
    if source in overrides:
        return overrides[source]
    if example.info.get("style") == "model":
        return None
    if source in SOURCE_REWARDS:
        return SOURCE_REWARDS[source]
    for prefix, name in SOURCE_PREFIX_REWARDS.items():
        if source.startswith(prefix):
            return name
    return ABILITY_REWARDS.get(str(example.info.get("ability")))


def _why(example: Task) -> str:
    if example.info.get("style") == "model":
        return (
            "its rows ask for a learned reward model (reward_model.style = 'model'), "
            "which reinforge does not run; "
        )
    return "the source name is not one reinforge knows; "


def _load(name: str, setting: str, base_dir: str | None) -> RewardFn:
    if name in DATA_REWARDS:
        return DATA_REWARDS[name]
    if ":" in name:
        return load_callable(name, base_dir=base_dir, setting=setting)
    raise ConfigError(
        f"{setting} = {name!r} is not a reward; use one of {sorted(DATA_REWARDS)} or "
        '"module:function" / "path/to/file.py:function"'
    )
