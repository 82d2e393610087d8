"""Fault injection: recoverable faults become a zero reward and a counter, at the configured rate;
sites draw independently; NaN is drawn only where a value can be NaN."""

import math

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.errors import ConfigError, RunFailure
from reinforge.faults import (
    FaultInjector,
    FaultPlan,
    InjectedFault,
    RewardErrors,
    guard_reward,
    install,
)


def draws(injector: FaultInjector, site: str, n: int) -> list[bool]:
    hits = []
    for _ in range(n):
        try:
            hits.append(injector.maybe_fail(site) is not None)
        except InjectedFault:
            hits.append(True)
    return hits


def test_rate_is_respected_repeatable_and_per_site():
    plan = FaultPlan(rates={"reward": 0.05}, seed=7)
    first, second = (
        draws(FaultInjector(plan), "reward", 4000),
        draws(FaultInjector(plan), "reward", 4000),
    )
    assert first == second  # seeded: the same drill twice
    assert 150 < sum(first) < 250  # about 5% of 4000
    # turning on another site does not move this site's draws
    both = FaultInjector(FaultPlan(rates={"reward": 0.05, "tool": 0.5}, seed=7))
    interleaved = []
    for _ in range(4000):
        interleaved += draws(both, "reward", 1)
        draws(both, "tool", 1)
    assert interleaved == first


def test_guarded_reward_turns_faults_into_zero_and_counts():
    injector = install(FaultPlan(rates={"reward": 0.05}, kinds=("exception", "nan"), seed=1))
    try:
        errors = RewardErrors()
        reward = guard_reward(lambda completion, task: 1.0, errors)
        values = [reward("x", None) for _ in range(1000)]
    finally:
        install(None)
    zeros = values.count(0.0)
    assert zeros == errors.num_failed == sum(injector.injected.values())
    assert errors.counts["reward_errors"] > 0 and errors.counts["reward_nonfinite"] > 0
    assert 20 < zeros < 90 and all(math.isfinite(v) for v in values)
    errors.check(1000, zeros)  # some failed: the run goes on
    with pytest.raises(RunFailure, match="all 16 reward calls"):
        errors.check(16, 16)  # a reward that never works is a bug


def test_a_failing_reward_function_is_counted_without_injection():
    errors = RewardErrors()
    reward = guard_reward(lambda completion, task: {"x": 1}[completion], errors)
    assert [reward("x", None), reward("y", None), reward("x", None)] == [1.0, 0.0, 1.0]
    assert errors.metrics() == {"reward_errors": 1.0, "reward_nonfinite": 0.0}
    assert errors.first == "KeyError: 'y'"


def test_fatal_sites_propagate_and_nan_only_where_a_value_is():
    inj = FaultInjector(FaultPlan(rates={"checkpoint": 1.0}))
    with pytest.raises(InjectedFault):
        inj.maybe_fail("checkpoint")
    assert inj.maybe_fail("reward") is None  # rate 0 there
    nan_plan = FaultInjector(FaultPlan(rates={"training": 1.0, "generation": 1.0}, kinds=("nan",)))
    assert nan_plan.maybe_fail("training") == "nan"
    assert nan_plan.maybe_fail("generation") is None  # generation computes no number


def test_faults_config_is_checked():
    cfg = load_config(TrainConfig, None, ["faults.reward=0.05", "faults.kinds=['exception','nan']"])
    assert cfg.faults.rates()["reward"] == 0.05 and cfg.faults.rates()["tool"] == 0.0
    with pytest.raises(ConfigError, match=r"faults\.generation"):
        load_config(TrainConfig, None, ["faults.generation=0.1", "faults.kinds=['nan']"])
    with pytest.raises(ConfigError, match=r"faults\.reward"):
        load_config(TrainConfig, None, ["faults.reward=1.5"])


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_a_tool_fault_reaches_the_model_as_the_tools_error():
    from reinforge.envs.tools import call_tool, make_tools

    tools = make_tools([add])
    install(FaultPlan(rates={"tool": 1.0}))
    try:
        failed = call_tool(tools, "add", {"a": 1, "b": 2})
    finally:
        install(None)
    assert failed.status == "error" and "injected fault at tool" in failed.text
    assert call_tool(tools, "add", {"a": 1, "b": 2}).text == "3"  # no plan: the tool runs
