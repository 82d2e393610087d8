"""Fault injection: recoverable faults become a zero reward and a counter, at the configured rate."""

import math
from collections import Counter

import pytest

from reinforge.faults import FaultInjector, FaultPlan, InjectedFault, guard_reward


def test_rate_is_respected_and_repeatable():
    counts = []
    for _ in range(2):
        inj = FaultInjector(FaultPlan(rate=0.05, sites=("reward",), seed=7))
        hits = 0
        for _ in range(4000):
            try:
                inj.maybe_fail("reward")
            except InjectedFault:
                hits += 1
        counts.append(hits)
    assert counts[0] == counts[1]  # seeded: the same drill twice
    assert 150 < counts[0] < 250  # about 5% of 4000


def test_guarded_reward_turns_faults_into_zero_and_counts():
    counters: Counter = Counter()
    inj = FaultInjector(FaultPlan(rate=0.05, sites=("reward",), kinds=("exception", "nan"), seed=1))
    reward = guard_reward(lambda completion, task: 1.0, inj, counters)
    values = [reward("x", None) for _ in range(1000)]
    zeros = values.count(0.0)
    assert (
        zeros
        == counters["reward_errors"] + counters["reward_nonfinite"]
        == sum(inj.injected.values())
    )
    assert 20 < zeros < 90 and all(math.isfinite(v) for v in values)


def test_unguarded_sites_propagate():
    inj = FaultInjector(FaultPlan(rate=1.0, sites=("checkpoint",)))
    with pytest.raises(InjectedFault):
        inj.maybe_fail("checkpoint")
    assert inj.maybe_fail("reward") is None  # not an instrumented site in this plan
