"""Multi-turn tool use: the model calls tools until it answers, then the answer is scored.

`ToolEnv(tools, reward_fn, parser=...)` speaks the Env protocol (envs/base.py). `reset(task)`
opens with the system prompt (if any) and the task's messages. Each `step(state, assistant)`:
- parses tool calls from the assistant text with the configured parser (envs/parsers.py);
- answers every call, in order, with one `Message(role="tool", content=...)`: the tool's output,
  or an error text for a malformed call, an unknown tool, bad arguments or a failing tool;
- when the message holds no tool call, ends the episode and scores the message's text with
  `reward_fn(completion, task) -> float`, reported as rewards["reward"];
- at `max_turns` assistant turns the episode ends too (calls in that last message are not run)
  and the last message is scored the same way.

Counters: `StepResult.metrics` holds this step's counts (summing them over the steps gives the
episode's), and `state.info["counters"]` the running totals as a `ToolCounters`.

Tokenization stays above this layer: the chat template renders `env.tool_schemas` (the
`tools=` argument of `apply_chat_template`) and the messages; this env only sees text.
`write_calls(content, calls)` is the other direction: recorded tool calls (SFT data in the
OpenAI format) written as the text a model in this env's format writes, which its parser reads
back.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from reinforge.envs.base import EnvState, StepResult
from reinforge.envs.parsers import ParseError, ToolCall, get_parser
from reinforge.envs.tools import call_tool, make_tools
from reinforge.errors import ConfigError
from reinforge.types import Message, Task, ToolCallRecord


@dataclass
class ToolCounters:
    turns: int = 0
    tool_calls: int = 0  # well-formed calls, run or not
    malformed_calls: int = 0
    unknown_tool_calls: int = 0
    invalid_arguments: int = 0
    tool_errors: int = 0  # the tool ran and failed (raised, or flagged an error)
    tool_timeouts: int = 0
    skipped_calls: int = 0  # past max_calls_per_turn, or in the last allowed turn
    max_turns_reached: int = 0


# call_tool's status -> the counter it bumps ("ok" bumps none)
_COUNTER_OF_STATUS = {
    "unknown_tool": "unknown_tool_calls",
    "invalid_arguments": "invalid_arguments",
    "error": "tool_errors",
    "timeout": "tool_timeouts",
}


class ToolEnv:
    name = "tool"

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        reward_fn: Callable[[str, Task], float],
        *,
        parser: str = "hermes",
        system_prompt: str | None = None,
        max_turns: int = 8,
        max_calls_per_turn: int = 8,
        max_output_chars: int = 8000,
    ):
        for key, value, works in (
            ("max_turns", max_turns, 8),
            ("max_calls_per_turn", max_calls_per_turn, 8),
            ("max_output_chars", max_output_chars, 8000),
        ):
            if value < 1:
                raise ConfigError(f"tool env {key}={value} must be >= 1; {works} works")
        self.tools = make_tools(tools)
        self.parse = get_parser(parser)
        self.parser_name = parser
        self.reward_fn = reward_fn
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.max_output_chars = max_output_chars

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas, for the chat template's `tools=` argument."""
        return [tool.schema for tool in self.tools.values()]

    def write_calls(self, content: str, calls: Sequence[ToolCallRecord]) -> str:
        """An assistant message's text with `calls` in this env's tool-call format."""
        if not calls:
            return content
        return _WRITERS[self.parser_name](content, calls)

    def reset(self, task: Task) -> EnvState:
        messages = list(task.messages)
        if self.system_prompt is not None:
            if messages and messages[0].role == "system":  # one system message: ours, then theirs
                text = f"{self.system_prompt}\n\n{messages[0].content}"
                messages[0] = Message("system", text)
            else:
                messages.insert(0, Message("system", self.system_prompt))
        return EnvState(task=task, messages=messages, info={"counters": ToolCounters()})

    def step(self, state: EnvState, assistant: Message) -> StepResult:
        assert not state.done, "step() after the episode ended"
        state.messages.append(assistant)
        state.turn += 1
        step = ToolCounters(turns=1)
        items = self.parse(assistant.content).items
        if not items or state.turn >= self.max_turns:
            step.max_turns_reached = int(bool(items))
            step.skipped_calls = len(items)
            return self._finish(state, assistant, step)
        replies = [self._answer(item, step) for item in items[: self.max_calls_per_turn]]
        if len(items) > self.max_calls_per_turn:
            step.skipped_calls = len(items) - self.max_calls_per_turn
            replies.append(
                f"Error: at most {self.max_calls_per_turn} tool calls per turn; "
                f"the last {step.skipped_calls} were not run."
            )
        tool_messages = [Message("tool", text) for text in replies]
        state.messages.extend(tool_messages)
        _add(state.info["counters"], step)
        return StepResult(messages=tool_messages, done=False, metrics=_as_metrics(step))

    def _answer(self, item: ToolCall | ParseError, step: ToolCounters) -> str:
        if isinstance(item, ParseError):
            step.malformed_calls += 1
            return f"Error: malformed tool call: {item.reason}."
        step.tool_calls += 1
        result = call_tool(self.tools, item.name, item.arguments)
        counter = _COUNTER_OF_STATUS.get(result.status)
        if counter is not None:
            setattr(step, counter, getattr(step, counter) + 1)
        return _clip(result.text, self.max_output_chars)

    def _finish(self, state: EnvState, assistant: Message, step: ToolCounters) -> StepResult:
        state.done = True
        _add(state.info["counters"], step)
        reward = float(self.reward_fn(assistant.content, state.task))
        return StepResult(
            messages=[], done=True, rewards={"reward": reward}, metrics=_as_metrics(step)
        )


def _write_hermes(content: str, calls: Sequence[ToolCallRecord]) -> str:
    # Qwen2.5's template writes calls this way: the text, then each call on its own lines
    blocks = [
        f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>"
        for c in calls
    ]
    return "\n".join([content, *blocks] if content else blocks)


def _write_llama3_json(content: str, calls: Sequence[ToolCallRecord]) -> str:
    # a message of calls only, as Llama 3.1's template writes them (it drops the text too)
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


def _write_mistral(content: str, calls: Sequence[ToolCallRecord]) -> str:
    array = [{"name": c.name, "arguments": c.arguments} for c in calls]
    return f"{content}[TOOL_CALLS]{json.dumps(array)}"


_WRITERS = {
    "hermes": _write_hermes,
    "qwen": _write_hermes,
    "llama3_json": _write_llama3_json,
    "mistral": _write_mistral,
}


def _add(total: ToolCounters, step: ToolCounters) -> None:
    for key, value in asdict(step).items():
        setattr(total, key, getattr(total, key) + value)


def _as_metrics(counters: ToolCounters) -> dict[str, float]:
    return {key: float(value) for key, value in asdict(counters).items()}


def _clip(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[tool output cut at {max_chars} characters]"
