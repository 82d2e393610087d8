from dataclasses import asdict

import pytest

from reinforge.envs.base import Env
from reinforge.envs.sandbox import Sandbox, SandboxLimits, make_python_tool
from reinforge.envs.tool_env import ToolCounters, ToolEnv
from reinforge.errors import ConfigError
from reinforge.types import Message, Task


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


def exact_answer(completion: str, task: Task) -> float:
    return float(completion.strip().endswith(task.answer))


def _task(system: str | None = None) -> Task:
    messages = (Message("user", "What is 2 + 3?"),)
    if system is not None:
        messages = (Message("system", system), *messages)
    return Task(id="t0", messages=messages, answer="5")


def _call(body: str) -> Message:
    return Message("assistant", f"<tool_call>{body}</tool_call>")


def test_scripted_episode_messages_and_counters():
    env: Env = ToolEnv([add], exact_answer, system_prompt="Use tools.")
    state = env.reset(_task())
    assert state.messages == [Message("system", "Use tools."), Message("user", "What is 2 + 3?")]
    script = [
        _call('{"name": "add", "arguments": {"a": 2, "b": 3}}'),
        _call('{"name": "add", "arguments": {"a": 2,}}'),
        _call('{"name": "mul", "arguments": {"a": 2, "b": 3}}'),
        Message("assistant", "The sum is 5"),
    ]
    results = [env.step(state, message) for message in script]

    replies = [r.messages for r in results]
    assert replies[0] == [Message("tool", "5")]
    assert replies[1] == [
        Message(
            "tool",
            "Error: malformed tool call: invalid JSON (Expecting property name "
            "enclosed in double quotes).",
        )
    ]
    assert replies[2] == [Message("tool", "Error: unknown tool 'mul'. Available tools: add.")]
    assert replies[3] == []
    assert [r.done for r in results] == [False, False, False, True]
    assert results[3].rewards == {"reward": 1.0}
    assert state.done and state.turn == 4
    assert state.messages[2:] == [
        script[0],
        *replies[0],
        script[1],
        *replies[1],
        script[2],
        *replies[2],
        script[3],
    ]

    totals = state.info["counters"]
    assert totals == ToolCounters(turns=4, tool_calls=2, malformed_calls=1, unknown_tool_calls=1)
    summed = {k: sum(r.metrics[k] for r in results) for k in results[0].metrics}
    assert summed == {k: float(v) for k, v in asdict(totals).items()}


def test_bad_arguments_and_several_calls_in_one_turn():
    env = ToolEnv([add], exact_answer, max_calls_per_turn=2)
    state = env.reset(_task())
    message = Message(
        "assistant",
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 9, "b": 9}}</tool_call>',
    )
    result = env.step(state, message)
    assert [m.content for m in result.messages] == [
        "Error: invalid arguments for 'add': missing required argument 'b'.",
        "2",
        "Error: at most 2 tool calls per turn; the last 1 were not run.",
    ]
    assert result.metrics["invalid_arguments"] == 1
    assert result.metrics["skipped_calls"] == 1


def test_max_turns_ends_and_scores_without_running_the_last_calls():
    env = ToolEnv([add], exact_answer, max_turns=2)
    state = env.reset(_task())
    call = _call('{"name": "add", "arguments": {"a": 2, "b": 3}}')
    assert not env.step(state, call).done
    last = env.step(state, call)
    assert last.done and last.messages == []
    assert last.rewards == {"reward": 0.0}
    assert last.metrics["max_turns_reached"] == 1 and last.metrics["skipped_calls"] == 1


def test_system_prompt_merges_with_the_tasks_own():
    env = ToolEnv([add], exact_answer, system_prompt="Use tools.")
    state = env.reset(_task(system="Be brief."))
    assert state.messages[0] == Message("system", "Use tools.\n\nBe brief.")
    assert len(state.messages) == 2
    assert env.tool_schemas[0]["function"]["name"] == "add"


def test_config_mistakes():
    with pytest.raises(ConfigError, match="max_turns=0"):
        ToolEnv([add], exact_answer, max_turns=0)
    with pytest.raises(ConfigError, match="parser"):
        ToolEnv([add], exact_answer, parser="nope")


def test_python_tool_through_the_env_counts_timeouts():
    sandbox = Sandbox("auto", SandboxLimits(cpu_seconds=1, wall_seconds=5))
    env = ToolEnv([make_python_tool(sandbox)], exact_answer)
    state = env.reset(_task())
    code = '{"name": "python", "arguments": {"code": "print(2 + 3)"}}'
    loop = '{"name": "python", "arguments": {"code": "while True: pass"}}'
    result = env.step(
        state, Message("assistant", f"<tool_call>{code}</tool_call><tool_call>{loop}</tool_call>")
    )
    assert [m.content for m in result.messages] == ["5", "[stopped: CPU time limit of 1 s]"]
    assert result.metrics["tool_timeouts"] == 1
    assert env.step(state, Message("assistant", "5")).rewards == {"reward": 1.0}
