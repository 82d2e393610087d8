"""Rows as users have them, read as-is into `Task`s.

The schemas, told apart by their columns (the label is only for the report):
- verl parquet: `data_source`, `prompt` (chat messages), `ability`, `reward_model` ({style,
  ground_truth}), `extra_info`. The answer is `reward_model.ground_truth`.
- TRL standard: `prompt` and `completion` text. TRL conversational: `messages` (the prompt is all
  before the last assistant message, which is the solution), or `prompt` and `completion` as
  message lists.
- plain columns: a prompt (`prompt`, `question` or `problem`) and an `answer`.

Columns are resolved once, from the first record, by `ColumnMap` or the usual names in
`AUTO_COLUMNS`. Converting a row either gives a Task or raises `BadRow` with a short reason (the
count key of the load report) and a detail; it never guesses past a wrong type or truncates.
Columns a row has beyond the ones read land in `task.info` for custom rewards (verl's
`ability`, `extra_info`, a code task's tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from reinforge.data.spec import SETTING, ColumnMap
from reinforge.errors import ConfigError
from reinforge.types import Message, Task, ToolCallRecord

AUTO_COLUMNS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "question", "problem"),
    "messages": ("messages", "conversations"),
    "answer": ("answer", "reward_model.ground_truth", "ground_truth"),
    "solution": ("completion", "solution", "response"),
    "data_source": ("data_source",),
}
_ROLES = {"human": "user", "gpt": "assistant"}  # ShareGPT's `from` names
MISSING = object()


class BadRow(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Columns:
    """The columns a dataset's rows are read from (None: the dataset has none)."""

    prompt: str | None
    messages: str | None
    answer: str | None
    solution: str | None
    data_source: str | None
    schema: str

    def as_dict(self) -> dict[str, str]:
        names = ("prompt", "messages", "answer", "solution", "data_source")
        return {k: v for k in names if (v := getattr(self, k)) is not None}


def lookup(record: dict[str, Any], column: str) -> Any:
    """The value at `column` (a literal key first, then a dotted path into nested records), or
    `MISSING`."""
    if column in record:
        return record[column]
    value: Any = record
    for part in column.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def resolve_columns(
    record: dict[str, Any],
    columns: ColumnMap,
    require_answer: bool,
    where: str,
    require_solution: bool = False,
) -> Columns:
    """Columns from the user's map or the usual names; a clear error when a required one is not
    there."""

    def pick(role: str) -> str | None:
        explicit = getattr(columns, role)
        if explicit is not None:
            if lookup(record, explicit) is MISSING:
                raise ConfigError(
                    f"{SETTING}.columns.{role} = {explicit!r}, but the first row of {where} has "
                    f"no such column; its columns are {sorted(record)}"
                )
            return explicit
        return next((c for c in AUTO_COLUMNS[role] if lookup(record, c) is not MISSING), None)

    prompt = pick("prompt") if columns.messages is None else None
    messages = pick("messages") if prompt is None else None
    if prompt is None and messages is None:
        raise ConfigError(
            f"no prompt column in {where}: its columns are {sorted(record)}; set "
            f"{SETTING}.columns.prompt (text or chat messages) or {SETTING}.columns.messages"
        )
    answer = pick("answer")
    if answer is None and require_answer:
        raise ConfigError(
            f"no answer column in {where}: its columns are {sorted(record)}; set "
            f"{SETTING}.columns.answer to the column holding the ground truth the reward checks, "
            f"or {SETTING}.require_answer = false for data without one (SFT, or a custom reward)"
        )
    solution = pick("solution")
    if solution is None and messages is None and require_solution:
        raise ConfigError(
            f"no solution column in {where}: its columns are {sorted(record)}; SFT trains on a "
            f"reference response, so set {SETTING}.columns.solution to the column holding it, or "
            f"{SETTING}.columns.messages to a conversation column (its last assistant message is "
            "the solution)"
        )
    first_prompt = lookup(record, prompt) if prompt else None
    if "reward_model" in record and isinstance(first_prompt, list):
        schema = "verl"
    elif messages is not None or isinstance(first_prompt, list):
        schema = "trl-conversational"
    elif "completion" in record:
        schema = "trl-standard"
    else:
        schema = "prompt-answer"
    return Columns(prompt, messages, answer, solution, pick("data_source"), schema)


def record_to_task(
    record: dict[str, Any], cols: Columns, task_id: str, row: int, default_source: str
) -> Task:
    solution = None
    if cols.prompt is not None:
        value = lookup(record, cols.prompt)
        if value is MISSING or value is None:
            raise BadRow("missing prompt", f"no value in column {cols.prompt!r}")
        prompt = as_prompt(value, cols.prompt)
    else:
        assert cols.messages is not None
        value = lookup(record, cols.messages)
        if value is MISSING or value is None:
            raise BadRow("missing prompt", f"no value in column {cols.messages!r}")
        prompt = as_messages(value, cols.messages)
        if prompt and prompt[-1].role == "assistant":
            prompt, solution = prompt[:-1], prompt[-1].content
    check_prompt(prompt)
    if cols.solution is not None:
        solution = as_solution(lookup(record, cols.solution), cols.solution)
    answer, ground_truth = as_answer(
        lookup(record, cols.answer) if cols.answer else MISSING, cols.answer
    )
    data_source = lookup(record, cols.data_source) if cols.data_source else None
    if data_source is MISSING or data_source is None:
        data_source = default_source
    elif not isinstance(data_source, str):
        raise BadRow("data_source has wrong type", f"a {type(data_source).__name__}")
    used = {c.split(".")[0] for c in cols.as_dict().values()}
    info = {k: v for k, v in record.items() if k not in used}
    reward_model = record.get("reward_model")
    if isinstance(reward_model, dict) and "style" in reward_model:
        info["style"] = reward_model["style"]
    if ground_truth is not None:
        info["ground_truth"] = ground_truth
    info.update(data_source=data_source, row=row)
    return Task(id=task_id, messages=prompt, answer=answer, solution=solution, info=info)


def as_prompt(value: Any, column: str) -> tuple[Message, ...]:
    if isinstance(value, str):
        return (Message("user", value),)
    if isinstance(value, (list, tuple)):
        return as_messages(value, column)
    raise BadRow(
        "prompt has wrong type", f"{column!r} is a {type(value).__name__}, not text or messages"
    )


def as_messages(value: Any, column: str) -> tuple[Message, ...]:
    if not isinstance(value, (list, tuple)):
        raise BadRow("prompt has wrong type", f"{column!r} is a {type(value).__name__}, not a list")
    return tuple(_as_message(m, f"{column}[{i}]") for i, m in enumerate(value))


def _as_message(value: Any, where: str) -> Message:
    if isinstance(value, Message):
        return value
    if not isinstance(value, dict):
        raise BadRow("bad message", f"{where} is a {type(value).__name__}, not a message")
    role = value.get("role", value.get("from"))
    content = value.get("content", value.get("value"))
    if isinstance(content, list):  # OpenAI content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise BadRow("bad message", f"{where} has non-text content parts")
        content = "".join(p.get("text", "") for p in content)
    calls = value.get("tool_calls") or ()
    if content is None and calls:  # OpenAI: an assistant message of tool calls alone
        content = ""
    if not isinstance(role, str) or not isinstance(content, str):
        raise BadRow("bad message", f"{where} needs a text role and content, got {value!r:.80}")
    call_id = value.get("tool_call_id")
    return Message(
        _ROLES.get(role, role),
        content,
        tool_calls=as_tool_calls(calls, f"{where}.tool_calls"),
        tool_call_id=None if call_id is None else str(call_id),
    )


def as_tool_calls(value: Any, where: str) -> tuple[ToolCallRecord, ...]:
    """OpenAI tool calls (`{"id", "type": "function", "function": {"name", "arguments"}}`, the
    arguments a JSON text or an object) as records with the arguments parsed."""
    if not isinstance(value, (list, tuple)):
        raise BadRow("bad tool call", f"{where} is a {type(value).__name__}, not a list")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRow("bad tool call", f"{where}[{i}] has no function name: {call!r:.80}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRow(
                    "bad tool call", f"{where}[{i}] arguments are not valid JSON ({e.msg})"
                ) from None
        if not isinstance(arguments, dict):
            raise BadRow("bad tool call", f"{where}[{i}] arguments are not a JSON object")
        call_id = call.get("id")
        calls.append(ToolCallRecord(name, arguments, None if call_id is None else str(call_id)))
    return tuple(calls)


def check_prompt(prompt: tuple[Message, ...]) -> None:
    if not prompt or not any(m.content.strip() for m in prompt):
        raise BadRow("empty prompt", "no message with text")


def as_solution(value: Any, column: str) -> str | None:
    if value is MISSING or value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):  # TRL conversational completion: assistant messages
        messages = as_messages(value, column)
        return "".join(m.content for m in messages if m.role == "assistant")
    raise BadRow("solution has wrong type", f"{column!r} is a {type(value).__name__}")


def as_answer(value: Any, column: str | None) -> tuple[str, Any]:
    """The answer as text, and the raw ground truth when it was not text (lists and records are
    kept for custom rewards and serialized to JSON in the text)."""
    if column is None:
        return "", None
    if value is MISSING or value is None:
        raise BadRow("missing answer", f"no value in column {column!r}")
    if isinstance(value, bool):
        raise BadRow("answer has wrong type", f"{column!r} is a bool")
    if isinstance(value, str):
        if not value.strip():
            raise BadRow("empty answer", f"{column!r} is blank")
        return value.strip(), None
    if isinstance(value, (int, float)):
        return str(value), value
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True, default=str), value
    raise BadRow("answer has wrong type", f"{column!r} is a {type(value).__name__}")
