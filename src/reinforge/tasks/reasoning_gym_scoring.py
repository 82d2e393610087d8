"""reasoning-gym's scorers out of the trainer's process, and model text that looks like code
kept away from the scorers that run it.

Why: several reasoning-gym scorers run the answer they are given as Python: `eval(answer)`
(n_queens, spiral_matrix, binary_matrix, string_insertion) or sympy's `parse_expr`, which
evaluates its text (countdown, puzzle24, polynomial_multiplication, the integration datasets).
In the trainer's process a completion such as `__import__('os').system(...)` would run with the
trainer's rights, `exit()` would end the run with exit code 0, and `9**9**9**9` would hold a
rollout for ever. So:

- Every `score_answer` runs in a worker process: the math reward's pool
  (`rewards.math.MathVerifier`) with this module as its checker, under a wall-clock timeout
  (`SCORE_TIMEOUT_S`) and an address-space cap. A hang, a crash or an exit costs that worker,
  which is replaced; the sample scores 0 and is counted (`reward_errors`).
- For a dataset whose scorer turns text into code (its module's source calls `eval`, `exec`,
  `parse_expr`, `sympify` or `lambdify`), an answer is refused unscored (0, counted) when it
  holds what such code needs to reach past arithmetic: a double underscore, an attribute
  access (`x.y`; a sentence's period passes), a builtin or sympy name that evaluates, opens, imports, prompts or exits
  (`DENIED_NAMES`), or a string literal beside a call (`f('...')`: text handed to an
  evaluator). Numbers, lists, boards, letter strings and math (`sin(x) + x**2/2`) pass.

The screen narrows what an answer can do; it does not make `eval` safe in general. The worker
runs as the trainer's user; untrusted *code* belongs in the sandbox (`envs.sandbox`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import os
import re
import threading

from reinforge.errors import ConfigError

MAX_ITEM_INDEX = 2**48  # reasoning-gym seeds an item's generator with (seed + index)
# index spaces to try, largest first: a few datasets cap their size (word_ladder: 20,000)
ITEM_SPACES = (MAX_ITEM_INDEX, 10**6, 20_000, 10_000, 1_000)

# Wall-clock limit of one score_answer call (its item's clock starts when a worker takes it).
# The slowest scorer measured (sokoban's replay, cryptarithm's checks) takes milliseconds.
SCORE_TIMEOUT_S = 10.0
SCORE_MEMORY_MB = 2048  # above a worker's own size after importing reasoning-gym and sympy

_EVALUATORS = re.compile(r"\b(eval|exec|parse_expr|sympify|lambdify)\s*\(")
_BUILTINS = (  # that evaluate, import, open, prompt, exit or reach any attribute
    "eval exec compile open input breakpoint help exit quit license credits copyright globals "
    "locals vars dir getattr setattr delattr hasattr type object super memoryview classmethod "
    "staticmethod property lambda import"
)
_MODULES = (  # modules, and sympy's names that evaluate text, run code or call programs
    "os sys subprocess builtins shutil pathlib importlib system popen spawn fork kill remove "
    "rmtree unlink rename sympify S lambdify parse_expr preview var init_printing init_session "
    "plot plotting evaluate"
)
DENIED_NAMES = frozenset(f"{_BUILTINS} {_MODULES}".split())
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# `x.y` and `x .y`; a period that ends a sentence ("is 5. So") has a space after it
_ATTRIBUTE = re.compile(r"[A-Za-z_)\]}'\"]\s*\.[A-Za-z_]")
_CALL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*\(")


def code_hazard(answer: str) -> str | None:
    """Why `answer` must not reach a scorer that evaluates it (None: it may)."""
    if "__" in answer:
        return "a double underscore"
    if _ATTRIBUTE.search(answer):
        return "an attribute access"
    denied = sorted(set(_IDENTIFIER.findall(answer)) & DENIED_NAMES)
    if denied:
        return f"the name {denied[0]!r}"
    if ("'" in answer or '"' in answer) and _CALL.search(answer):
        return "a string literal beside a call"
    return None


@functools.cache
def evaluates_code(dataset_cls: type) -> bool:
    """Whether the dataset's module turns text into code (the screen applies); True when its
    source cannot be read."""
    try:
        source = inspect.getsource(inspect.getmodule(dataset_cls))
    except (OSError, TypeError):
        return True
    return bool(_EVALUATORS.search(source))


_pool = None
_pool_lock = threading.Lock()


def scorer_pool():
    """The process-wide pool of scoring workers, started on first use."""
    global _pool
    from reinforge.rewards.math import MathVerifier

    with _pool_lock:
        if _pool is None or _pool.is_closed:
            _pool = MathVerifier(
                num_workers=min(4, os.cpu_count() or 2),  # callers score one answer at a time
                timeout_s=SCORE_TIMEOUT_S,
                memory_mb=SCORE_MEMORY_MB,
                checker=__name__,
                label="reasoning-gym-scorer",
            )
        return _pool


# ---- the worker side (MathVerifier's worker imports this module and calls these)

_datasets: dict[tuple[str, str, int], object] = {}


def warm_up() -> None:
    try:
        import reasoning_gym  # noqa: F401
    except ImportError as e:
        raise ImportError(f'{e}; install it with: pip install "reinforge[reasoning]"') from None


def check(name: str, settings_json: str, seed: int, entry: dict, answer: str) -> float:
    """The dataset's own score_answer, in a worker; the dataset is built once per worker."""
    key = (name, settings_json, seed)
    if key not in _datasets:
        _datasets[key] = create_dataset(name, json.loads(settings_json), seed)
    return float(_datasets[key].score_answer(answer, entry))


def create_dataset(name: str, settings: dict, seed: int):
    """reasoning-gym's dataset `name` with its task.dataset_config `settings`, or a ConfigError
    naming the fix: a missing extra, an unknown name (with the closest), an unknown or invalid
    setting. (The scoring workers build theirs with it too.)"""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(
            'task.name = "reasoning_gym" needs reasoning-gym: pip install "reinforge[reasoning]"'
        ) from None
    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
        hint = f"close names: {close}" if close else f"e.g. {sorted(DATASETS)[:8]}"
        raise ConfigError(
            f"task.datasets: {name!r} is not a reasoning-gym dataset; {hint} "
            f"(all {len(DATASETS)}: reasoning_gym.factory.DATASETS)"
        )
    dataset_cls, config_cls = DATASETS[name]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ConfigError(
            f"task.dataset_config.{name}: {unknown} are not settings of {config_cls.__name__}; "
            f"its settings: {fields}"
        )
    error: Exception | None = None
    for size in ITEM_SPACES:  # the largest index space the dataset's checks accept
        try:
            config = config_cls(**settings, seed=seed, size=size)
            if hasattr(config, "validate"):
                config.validate()
            return dataset_cls(config=config)
        except (AssertionError, ValueError, TypeError) as e:
            error = e  # a complaint about the size: try a smaller one; any other is the answer
            if "size" not in str(e).lower():
                break
    raise ConfigError(f"task.dataset_config.{name}={settings}: {error or type(error).__name__}")
