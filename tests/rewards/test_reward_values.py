"""A reward that returns no number (True, the string "1.0") is refused and counted as a reward
error naming the reward, never read as 1.0; real numbers of any kind (int, numpy) pass."""

from __future__ import annotations

import numpy as np
import pytest

from reinforge.data.rewards import RewardRouter
from reinforge.faults import RewardErrors, guard_reward
from reinforge.rewards.mix import RewardMix
from reinforge.types import Message, Task

TASK = Task(id="t", messages=(Message("user", "1+1?"),), answer="2", info={"data_source": "s"})


def says_yes(completion: str, task: Task):
    return {"bool": True, "str": "1.0", "bytes": b"1", "numpy bool": np.True_}[completion]


@pytest.mark.parametrize("kind", ["bool", "str", "bytes", "numpy bool"])
def test_a_reward_that_is_no_number_is_a_counted_error_naming_the_function(kind):
    errors = RewardErrors()
    assert guard_reward(says_yes, errors)(kind, TASK) == 0.0
    assert errors.metrics() == {"reward_errors": 1.0, "reward_nonfinite": 0.0}
    assert errors.first.startswith("TypeError: reward says_yes returned")
    assert "a reward returns a float" in errors.first


@pytest.mark.parametrize("value", [1, 0.5, np.float32(0.25), np.int64(1)])
def test_real_numbers_of_any_kind_pass(value):
    errors = RewardErrors()
    assert guard_reward(lambda c, t: value, errors)("x", TASK) == float(value)
    assert errors.num_failed == 0


def test_mixes_and_data_source_routes_name_the_reward_too():
    errors = RewardErrors()
    mix = RewardMix([{"name": "yes"}], {"yes": says_yes})
    assert guard_reward(mix, errors)("str", TASK) == 0.0
    assert errors.first.startswith("TypeError: reward 'yes' returned '1.0' (a str)")
    errors = RewardErrors()
    router = RewardRouter({"s": says_yes}, {"s": "rewards.py:says_yes"})
    assert guard_reward(router, errors)("bool", TASK) == 0.0
    assert "reward 'rewards.py:says_yes' (data_source 's') returned True" in errors.first
