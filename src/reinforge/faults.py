"""Fault injection for tests and drills: exceptions, hangs and NaNs at a configured rate.

A run installs one `FaultInjector` (from the `[faults]` config) for the process; instrumented
call sites draw from it with `maybe_fail(site)` or enter `site(name)`, which also marks the
watchdog phase. The sites are the run's phases: reward, tool, generation, training, logging,
checkpoint. Each site has its own seeded RNG, so a drill is repeatable, enabling one site does not
move another's draws, and training's own RNG streams are never touched.

What a fault does depends on the site:
- exception: raised at the site. At `reward` it becomes a zero reward plus `reward_errors`
  (`guard_reward`); at `tool` the model gets the tool's error text and `tool_errors` counts it;
  anywhere else it fails the run loudly (exit code 1, traceback in error.txt).
- hang: the call sleeps `hang_s`; the watchdog must catch it (exit code 4).
- nan: the value computed at the site becomes NaN. At `reward` it becomes a zero reward plus
  `reward_nonfinite`; at `training` the step's advantages (the loss's weights) become NaN, so the
  gradient is not finite and the non-finite policy (`train.non_finite`) acts. Sites that compute
  no number (tool, generation, logging, checkpoint) never draw it.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from reinforge import watchdog
from reinforge.errors import RunFailure

SITES = ("reward", "tool", "generation", "training", "logging", "checkpoint")
KINDS = ("exception", "hang", "nan")
RECOVERABLE = frozenset({"reward", "tool"})
NAN_SITES = frozenset({"reward", "training"})


class InjectedFault(RuntimeError):
    """An error raised on purpose by the fault injector."""


@dataclass
class FaultPlan:
    rates: dict[str, float] = field(default_factory=dict)  # site -> probability per call
    kinds: tuple[str, ...] = ("exception",)
    hang_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        assert set(self.rates) <= set(SITES), f"unknown fault sites {set(self.rates) - set(SITES)}"
        assert all(0.0 <= r <= 1.0 for r in self.rates.values()), self.rates
        assert self.kinds and set(self.kinds) <= set(KINDS), self.kinds

    def kinds_at(self, site: str) -> tuple[str, ...]:
        return tuple(k for k in self.kinds if k != "nan" or site in NAN_SITES)

    @property
    def is_active(self) -> bool:
        return any(r > 0 for r in self.rates.values())


class FaultInjector:
    """Draws faults per site; `injected` counts them by `site/kind`."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan
        self.injected: Counter = Counter()
        self.num_reported = 0  # injected faults already in a step's metrics
        self._rngs = {s: random.Random(f"{plan.seed}/{s}") for s in SITES}

    def maybe_fail(self, site: str) -> str | None:
        """Raise, hang, or return "nan" (the caller poisons its value) for a drawn fault."""
        assert site in SITES, site
        rate, kinds = self.plan.rates.get(site, 0.0), self.plan.kinds_at(site)
        if rate <= 0.0 or not kinds or self._rngs[site].random() >= rate:
            return None
        kind = self._rngs[site].choice(kinds)
        self.injected[f"{site}/{kind}"] += 1
        if kind == "exception":
            raise InjectedFault(f"injected fault at {site}")
        if kind == "hang":
            sys.stderr.write(
                f"reinforge faults: injected hang of {self.plan.hang_s:.0f}s at {site}\n"
            )
            sys.stderr.flush()
            time.sleep(self.plan.hang_s)
            return None
        return "nan"


# One injector per process, like the watchdog: the sites sit in layers (envs, rewards, the
# trainer) that should not carry a drill object through every signature.
_active: FaultInjector | None = None


def install(plan: FaultPlan | None) -> FaultInjector | None:
    """Make `plan` the process's fault plan (None or an all-zero plan: no faults)."""
    global _active
    _active = FaultInjector(plan) if plan is not None and plan.is_active else None
    if _active is not None:
        rates = ", ".join(f"{s} {r:g}" for s, r in _active.plan.rates.items() if r > 0)
        kinds = list(_active.plan.kinds)
        print(f"fault injection on (a drill): {rates}; kinds {kinds}", file=sys.stderr)
    return _active


def maybe_fail(site: str) -> str | None:
    return _active.maybe_fail(site) if _active is not None else None


def step_metrics() -> dict[str, float]:
    """`faults_injected`: faults drawn since the last call (one step's), when a drill is on."""
    if _active is None:
        return {}
    total = sum(_active.injected.values())
    count, _active.num_reported = total - _active.num_reported, total
    return {"faults_injected": float(count)}


@contextmanager
def suspended() -> Iterator[None]:
    """No faults drawn inside: evaluation measures the policy, the drill targets training (and
    its counters, `faults_injected` against `reward_errors`, stay a step's own)."""
    global _active
    saved, _active = _active, None
    try:
        yield
    finally:
        _active = saved


@contextmanager
def site(name: str) -> Iterator[bool]:
    """Enter watchdog phase `name` and draw this call's fault; yields True when the caller must
    make its value NaN."""
    with watchdog.phase(name):
        yield maybe_fail(name) == "nan"


@dataclass
class RewardErrors:
    """What went wrong in reward calls: counts, and the first error's text (to say it once)."""

    counts: Counter = field(default_factory=Counter)
    first: str | None = None

    def metrics(self) -> dict[str, float]:
        return {k: float(self.counts[k]) for k in ("reward_errors", "reward_nonfinite")}

    @property
    def num_failed(self) -> int:
        return sum(self.counts.values())

    def check(self, num_calls: int, num_failed: int) -> None:
        """After `num_calls` reward calls of which `num_failed` failed: fail the run when all of
        them did (a reward that never works is a bug, not noise); say the first error once."""
        global _said_reward_error
        if num_calls and num_failed == num_calls:
            raise RunFailure(
                f"all {num_calls} reward calls of a rollout failed; the first: {self.first}. Fix "
                "the reward function (in a drill: lower faults.reward below 1)"
            )
        if num_failed and not _said_reward_error:
            _said_reward_error = True
            print(
                f"warning: a reward call failed ({self.first}); such samples score 0 and are "
                "counted in reward_errors / reward_nonfinite (metrics, summary, reinforge report)",
                file=sys.stderr,
            )


_said_reward_error = False


def reward_value(value: object, fn: Callable[..., object]) -> float:
    """A reward's return value as a float. A bool or a string is refused (TypeError): `float`
    would read True and "1.0" as 1.0, hiding a reward function that returns the wrong thing."""
    if isinstance(value, (bool, np.bool_, str, bytes)):
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise TypeError(
            f"reward {name} returned {value!r:.60} (a {type(value).__name__}); a reward "
            "returns a float"
        )
    return float(value)  # type: ignore[arg-type]


def guard_reward(
    fn: Callable[..., float], errors: RewardErrors, site_name: str = "reward"
) -> Callable[..., float]:
    """Wrap a reward: an exception, a non-finite value or a value that is no number (a bool, a
    string: `reward_value`) becomes 0.0 and is counted, so one bad call costs one sample's
    reward, never the step."""
    assert site_name in RECOVERABLE

    def guarded(*args, **kwargs) -> float:
        try:
            with site(site_name) as poison:
                value = math.nan if poison else reward_value(fn(*args, **kwargs), fn)
        except Exception as e:  # a reward's failure is one sample's zero, counted and shown
            errors.counts[f"{site_name}_errors"] += 1
            errors.first = errors.first or f"{type(e).__name__}: {e}"
            return 0.0
        if not math.isfinite(value):
            errors.counts[f"{site_name}_nonfinite"] += 1
            errors.first = errors.first or f"non-finite {site_name} {value}"
            return 0.0
        return value

    return guarded
