"""The arithmetic tool task: the calculator's evaluation and its limits, named values in scope
per episode, the python tool's prelude, and scripted demonstrations that score."""

import shutil

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.envs.calculator import calculator, python_with_values, values_in_scope
from reinforge.envs.sources import build_tool_arithmetic
from reinforge.envs.tools import ToolOutput
from reinforge.types import Message


def _tasks(*overrides):
    cfg = load_config(TrainConfig, None, ["task.name=tool_arithmetic", *overrides])
    return build_tool_arithmetic(cfg.task)


@pytest.mark.parametrize(
    "expression,value",
    [("2+3*4", "14"), ("(2+3)*4", "20"), ("-7*-6", "42"), (" 12 - 30 ", "-18"), ("a*b", "1155")],
)
def test_calculator_evaluates_integer_arithmetic_with_named_values(expression, value):
    with values_in_scope({"a": 35, "b": 33}):
        assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression,message",
    [
        ("__import__('os')", "is not integer arithmetic"),
        ("2**10", "is not integer arithmetic"),
        ("1/2", "is not integer arithmetic"),
        ("c*2", "unknown name 'c'; the named values are: a, b"),
        ("2 +", "invalid syntax"),
        ("9" * 40 + "*" + "9" * 40, "more than 60 digits"),
        ("1+" * 150 + "1", "longer than 200 characters"),
    ],
)
def test_calculator_refuses_anything_else_with_a_message(expression, message):
    with values_in_scope({"a": 1, "b": 2}):
        out = calculator(expression)
    assert isinstance(out, ToolOutput) and out.is_error and message in out.text


def test_values_are_in_scope_only_inside_their_episode_step():
    tasks = _tasks()
    task = tasks.train_task(0)
    state = tasks.env.reset(task)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "a*b"}}\n</tool_call>'
    result = tasks.env.step(state, Message("assistant", call))
    assert result.messages[0].content == task.answer  # the env put this task's values in scope
    assert "unknown name 'a'" in calculator("a*b").text  # and took them out again


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_scripted_demonstrations_score_and_call_the_tool_at_their_rate(fraction):
    tasks = _tasks(f"task.demo_tool_fraction={fraction}")
    num_called, num = 0, 40
    for i in range(num):
        state = tasks.env.reset(tasks.train_task(i))
        while True:
            result = tasks.env.step(state, Message("assistant", tasks.demonstration(state)))
            if result.done:
                break
        assert result.rewards["reward"] == 1.0
        num_called += state.info["counters"].tool_calls
    expected = {0.0: range(0, 1), 0.5: range(10, 31), 1.0: range(num, num + 1)}[fraction]
    assert num_called in expected


def test_held_out_questions_never_appear_in_training():
    tasks = _tasks("task.num_eval=50")
    held_out = {t.info["key"] for t in tasks.eval_tasks()}
    assert len(held_out) == 50
    assert not held_out & {tasks.train_task(i).info["key"] for i in range(500)}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not on PATH")
def test_python_tool_runs_with_the_named_values_assigned():
    from reinforge.envs.sandbox import Sandbox, SandboxLimits, make_python_tool

    python = python_with_values(make_python_tool(Sandbox("bwrap", SandboxLimits(wall_seconds=10))))
    with values_in_scope({"a": 35, "b": 33}):
        out = python("print(a*b)")
    assert out.text.strip() == "1155" and not out.is_error
