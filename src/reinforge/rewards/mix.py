"""Weighted mixes of reward functions, and loading a user's own reward by reference.

A reward is a plain function `(completion: str, task: Task) -> float`. A mix is a list of specs
such as `[{name = "math", weight = 1.0}, {name = "format", weight = 0.5}]`, resolved once against
a registry (name -> function). Scoring returns the weighted total and every component's raw
value, so each is logged on its own; a weight of 0 logs a signal without training on it.

A spec name that is not in the registry but holds a colon is loaded as a custom reward:
`"my_pkg.rewards:brevity"` (an importable module) or `"rewards/brevity.py:brevity"` (a file,
relative to `base_dir`). Every mistake (an unknown name, a missing module, file or function,
something not callable) is a `ConfigError` that names the setting and what would work.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from reinforge.errors import ConfigError
from reinforge.types import Task

RewardFn = Callable[[str, Task], float]


@dataclass(frozen=True)
class RewardSpec:
    name: str
    weight: float = 1.0


@dataclass(frozen=True)
class RewardScore:
    total: float  # sum of weight * value
    components: dict[str, float]  # each reward's raw (unweighted) value, by spec name


def _closest(name: str, choices: Sequence[str]) -> str | None:
    matches = difflib.get_close_matches(name, choices, n=1, cutoff=0.0)
    return matches[0] if matches else None


def _as_spec(value: Any, setting: str) -> RewardSpec:
    """A spec from a RewardSpec, a mapping, or any object with `name` and `weight` (pydantic)."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"name", "weight"}
        if unknown or "name" not in value:
            raise ConfigError(
                f"{setting} must have a name and optionally a weight, got keys {sorted(value)}; "
                'e.g. {name = "math", weight = 1.0}'
            )
        value = RewardSpec(value["name"], value.get("weight", 1.0))
    name, weight = getattr(value, "name", None), getattr(value, "weight", 1.0)
    if not isinstance(name, str) or not name:
        raise ConfigError(f'{setting}.name must be a reward name, got {name!r}; e.g. name = "math"')
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ConfigError(f"{setting}.weight must be a finite number, got {weight!r}; e.g. 1.0")
    return RewardSpec(name, float(weight))


class RewardMix:
    """Specs resolved against a registry; calling it gives the total, `score` the components."""

    def __init__(
        self,
        specs: Sequence[RewardSpec | Mapping[str, Any]],
        registry: Mapping[str, RewardFn],
        setting: str = "rewards",
        base_dir: str | Path | None = None,
    ):
        if not specs:
            raise ConfigError(f'{setting} is empty; list at least one, e.g. [{{name = "math"}}]')
        self.specs = [_as_spec(s, f"{setting}[{i}]") for i, s in enumerate(specs)]
        names = [s.name for s in self.specs]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"{setting}[{i}].name {name!r} is listed twice; list it once")
        self.fns = [
            _resolve(s.name, registry, f"{setting}[{i}].name", base_dir)
            for i, s in enumerate(self.specs)
        ]

    def score(self, completion: str, task: Task) -> RewardScore:
        components = {}
        for spec, fn in zip(self.specs, self.fns):
            value = fn(completion, task)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"reward {spec.name!r} returned {value!r:.60} (a {type(value).__name__}); "
                    "a reward returns a float"
                )
            if not math.isfinite(value):
                raise ValueError(f"reward {spec.name!r} returned {value}; a reward must be finite")
            components[spec.name] = float(value)
        total = sum(spec.weight * components[spec.name] for spec in self.specs)
        return RewardScore(total=total, components=components)

    def __call__(self, completion: str, task: Task) -> float:
        return self.score(completion, task).total


def _resolve(
    name: str, registry: Mapping[str, RewardFn], setting: str, base_dir: str | Path | None
) -> RewardFn:
    if name in registry:
        return registry[name]
    if ":" in name:
        return load_callable(name, base_dir=base_dir, setting=setting)
    closest = _closest(name, list(registry))
    hint = f'did you mean "{closest}"? ' if closest else ""
    raise ConfigError(
        f"{setting} = {name!r} is not a known reward; {hint}known: {', '.join(sorted(registry))}. "
        'For your own reward use "module:function" or "path/to/file.py:function".'
    )


def load_callable(
    ref: str, base_dir: str | Path | None = None, setting: str = "reward"
) -> Callable[..., Any]:
    """The callable named by `"module.path:function"` or `"path/to/file.py:function"`.

    A file path is relative to `base_dir` (default: the working directory). The function part may
    be dotted (`"module:Class.method"`).
    """
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f'{setting} = {ref!r} must look like "module:function" or "path/to/file.py:function"'
        )
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(target, base_dir, setting) if is_file else _import(target, setting)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            callables = sorted(k for k, v in vars(module).items() if callable(v) and k[0] != "_")
            closest = _closest(part, callables)
            hint = f'did you mean "{closest}"? ' if closest else ""
            raise ConfigError(
                f"{setting} = {ref!r}: {target} has no {attr!r}; {hint}"
                f"its functions: {', '.join(callables) or 'none'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"{setting} = {ref!r} is not callable (it is the {type(obj).__name__} {obj!r:.40}); "
            "point it at a function (completion, task) -> float"
        )
    return obj


def _import(module_name: str, setting: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the module asked for (or a parent package) being absent is the user's reference
        # being wrong; a missing import inside their module keeps its own traceback.
        if e.name is None or not (module_name + ".").startswith(e.name + "."):
            raise
        raise ConfigError(
            f"{setting}: no module named {module_name!r}; install it, put it on PYTHONPATH, or "
            f'give a file instead, e.g. "path/to/{module_name.rpartition(".")[2]}.py:function"'
        ) from e


def _load_file(target: str, base_dir: str | Path | None, setting: str) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"{setting}: file {path} does not exist (from {target!r})")
    # One module per file, registered, so loading twice shares state and dataclasses work.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"reinforge_custom_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, f"no loader for {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]  # a half-run module must not be found next time
        raise
    return module
