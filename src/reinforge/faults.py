"""Fault injection for tests and drills: exceptions, hangs and NaNs at a configured rate.

`FaultInjector.maybe_fail(site)` is called at the instrumented sites (reward, tool, generation,
logging, checkpoint). Draws come from a private seeded RNG, so a drill is repeatable and does not
disturb training's RNG streams. Recoverable sites turn a fault into a zero reward plus a counter
(`guard_reward`); the others let it propagate so the run fails loudly.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

SITES = ("reward", "tool", "generation", "logging", "checkpoint")
RECOVERABLE = frozenset({"reward", "tool"})


class InjectedFault(RuntimeError):
    """An error raised on purpose by the fault injector."""


@dataclass
class FaultPlan:
    rate: float = 0.0  # probability that an instrumented call faults
    sites: tuple[str, ...] = ("reward", "tool")
    kinds: tuple[str, ...] = ("exception",)  # "exception", "hang", "nan"
    hang_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        assert 0.0 <= self.rate <= 1.0
        unknown = set(self.sites) - set(SITES)
        assert not unknown, f"unknown fault sites {unknown}; known: {SITES}"
        assert set(self.kinds) <= {"exception", "hang", "nan"}, self.kinds


@dataclass
class FaultInjector:
    plan: FaultPlan
    injected: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)

    def maybe_fail(self, site: str) -> str | None:
        """Raise, hang, or return "nan" (the caller poisons its value) for a drawn fault."""
        if site not in self.plan.sites or self._rng.random() >= self.plan.rate:
            return None
        kind = self._rng.choice(self.plan.kinds)
        self.injected[f"{site}/{kind}"] += 1
        if kind == "exception":
            raise InjectedFault(f"injected fault at {site}")
        if kind == "hang":
            time.sleep(self.plan.hang_s)
            return None
        return "nan"


def guard_reward(
    fn: Callable[..., float],
    injector: FaultInjector | None,
    counters: Counter,
    site: str = "reward",
) -> Callable[..., float]:
    """Wrap a reward (or tool-scored reward): an exception or non-finite value becomes 0.0 and is
    counted, so one bad call costs one sample's reward, never the step."""
    assert site in RECOVERABLE

    def guarded(*args, **kwargs) -> float:
        try:
            poison = injector.maybe_fail(site) if injector is not None else None
            value = float(fn(*args, **kwargs))
            if poison == "nan":
                value = math.nan
        except Exception:
            counters[f"{site}_errors"] += 1
            return 0.0
        if not math.isfinite(value):
            counters[f"{site}_nonfinite"] += 1
            return 0.0
        return value

    return guarded
