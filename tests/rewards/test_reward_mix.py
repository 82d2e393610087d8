"""Weighted reward mixes, their error messages, and loading custom rewards by reference."""

from __future__ import annotations

import math
import os
import textwrap

import pytest

from reinforge.errors import ConfigError
from reinforge.rewards import BUILTIN_REWARDS
from reinforge.rewards.format import format_reward
from reinforge.rewards.mix import RewardMix, RewardSpec, load_callable
from reinforge.types import Message, Task

TASK = Task(id="t", messages=(Message("user", "1+1?"),), answer="2")


def exact(completion: str, task: Task) -> float:
    return 1.0 if completion.strip().endswith(task.answer) else 0.0


def brevity(completion: str, task: Task) -> float:
    return -len(completion) / 100


REGISTRY = {"exact": exact, "format": format_reward, "brevity": brevity}


def test_mix_total_is_the_weighted_sum_and_components_are_raw():
    mix = RewardMix(
        [{"name": "exact", "weight": 1.0}, {"name": "format", "weight": 0.5}, {"name": "brevity"}],
        REGISTRY,
    )
    completion = "<think>one and one</think><answer>2</answer>"  # 44 characters
    score = mix.score(completion, TASK)
    assert score.components == {"exact": 0.0, "format": 1.0, "brevity": -0.44}
    assert score.total == pytest.approx(0.5 - 0.44)
    assert mix(completion, TASK) == pytest.approx(0.06)
    score = mix.score("2", TASK)
    assert score.components == {"exact": 1.0, "format": 0.0, "brevity": -0.01}
    assert score.total == pytest.approx(0.99)


def test_zero_weight_component_is_logged_not_trained_on():
    mix = RewardMix([RewardSpec("exact"), RewardSpec("format", weight=0.0)], REGISTRY)
    score = mix.score("<think>x</think><answer>2</answer>", TASK)
    assert score.components == {"exact": 0.0, "format": 1.0}
    assert score.total == 0.0


def test_specs_may_be_objects_with_name_and_weight():
    class PydanticLike:
        name = "exact"
        weight = 2

    assert RewardMix([PydanticLike()], REGISTRY)("2", TASK) == 2.0


def test_builtin_registry_names():
    assert set(BUILTIN_REWARDS) >= {"math", "format"}
    assert RewardMix([{"name": "format"}], BUILTIN_REWARDS).specs == [RewardSpec("format", 1.0)]


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        RewardMix([{"name": "exact"}, {"name": "fromat", "weight": 0.5}], REGISTRY)
    message = str(info.value)
    assert "rewards[1].name = 'fromat' is not a known reward" in message
    assert 'did you mean "format"?' in message
    assert "brevity, exact, format" in message


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], "rewards is empty"),
        ([{"weight": 1.0}], "must have a name"),
        ([{"name": "exact", "wieght": 1.0}], r"keys \['name', 'wieght'\]"),
        ([{"name": ""}], r"rewards\[0\].name must be a reward name"),
        ([{"name": "exact", "weight": "high"}], r"rewards\[0\].weight must be a finite number"),
        ([{"name": "exact", "weight": math.nan}], "finite"),
        ([{"name": "exact"}, {"name": "exact"}], r"rewards\[1\].name 'exact' is listed twice"),
    ],
)
def test_bad_specs_name_the_setting(specs, message):
    with pytest.raises(ConfigError, match=message):
        RewardMix(specs, REGISTRY)


def test_reward_returning_a_non_number_is_reported_by_name():
    mix = RewardMix([{"name": "broken"}], {"broken": lambda completion, task: None})
    with pytest.raises(TypeError, match="reward 'broken' returned None"):
        mix("2", TASK)


def test_load_callable_from_a_module():
    fn = load_callable("reinforge.rewards.format:format_reward")
    assert fn is format_reward
    assert load_callable("os.path:join") is os.path.join


def _write_reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        textwrap.dedent(
            """
            LIMIT = 3

            def short(completion, task):
                return 1.0 if len(completion) <= LIMIT else 0.0
            """
        )
    )
    return path


def test_load_callable_from_a_file(tmp_path):
    path = _write_reward_file(tmp_path)
    short = load_callable(f"{path}:short")
    assert short("ab", TASK) == 1.0
    assert short("abcd", TASK) == 0.0
    # Relative to base_dir, and the same module on a second load.
    assert load_callable("my_rewards.py:short", base_dir=tmp_path) is short


def test_mix_loads_a_custom_reward_by_reference(tmp_path):
    _write_reward_file(tmp_path)
    mix = RewardMix(
        [{"name": "exact"}, {"name": "my_rewards.py:short", "weight": 0.5}],
        REGISTRY,
        base_dir=tmp_path,
    )
    assert mix.score("2", TASK).components == {"exact": 1.0, "my_rewards.py:short": 1.0}
    assert mix("2", TASK) == 1.5


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("format_reward", 'must look like "module:function"'),
        ("reinforge.rewards.format:", 'must look like "module:function"'),
        ("no_such_module_xyz:fn", "no module named 'no_such_module_xyz'"),
        ("reinforge.no_such_module:fn", "no module named 'reinforge.no_such_module'"),
        ("reinforge.rewards.format:fromat_reward", 'did you mean "format_reward"'),
        ("reinforge.rewards.format:THINK_ANSWER", "is not callable \\(it is the tuple"),
    ],
)
def test_load_callable_module_errors(ref, message):
    with pytest.raises(ConfigError, match=message):
        load_callable(ref)


def test_load_callable_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"file .*missing\.py does not exist"):
        load_callable("missing.py:short", base_dir=tmp_path)
    _write_reward_file(tmp_path)
    with pytest.raises(ConfigError, match=r'has no \'shrot\'; did you mean "short"'):
        load_callable("my_rewards.py:shrot", base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"is not callable \(it is the int 3\)"):
        load_callable("my_rewards.py:LIMIT", base_dir=tmp_path)


def test_load_callable_keeps_a_broken_import_inside_the_users_module(tmp_path):
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        load_callable("needs_missing_dep.py:fn", base_dir=tmp_path)
