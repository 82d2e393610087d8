"""Tool-call parsers: the model's text in, tool calls and parse errors out, never an exception.

Each parser reads one model family's tool-call format and returns a `ParsedOutput`: the text
outside the calls (`content`) and, in the order they appeared, each call as a `ToolCall` or,
when it cannot be read (bad JSON, no name, arguments that are not an object, an unclosed tag),
a `ParseError` with the reason. The env answers a parse error with an error message and counts
it; a model cannot crash a run by writing a broken call.

Parsers, chosen by name from `PARSERS` (`get_parser`):
- "hermes" (alias "qwen"): Hermes / Qwen2.5 / Qwen3 templates,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them.
- "llama3_json": Llama 3.1+ JSON tool calls, the message (after an optional `<|python_tag|>`)
  is `{"name": ..., "parameters": {...}}`, several separated by `;`.
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
  `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+ tokenizers).
Everywhere, `arguments` (or `parameters`) may also be a JSON string holding the object.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reinforge.errors import ConfigError

_DECODER = json.JSONDecoder()
_SNIPPET_CHARS = 200  # how much of a broken call a ParseError keeps


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    reason: str
    text: str  # the start of the call that could not be read


@dataclass
class ParsedOutput:
    content: str  # the message without its tool calls
    items: list[ToolCall | ParseError] = field(default_factory=list)  # in order of appearance

    @property
    def calls(self) -> list[ToolCall]:
        return [item for item in self.items if isinstance(item, ToolCall)]

    @property
    def errors(self) -> list[ParseError]:
        return [item for item in self.items if isinstance(item, ParseError)]


Parser = Callable[[str], ParsedOutput]


def parse_hermes(
    text: str, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"
) -> ParsedOutput:
    content: list[str] = []
    items: list[ToolCall | ParseError] = []
    pos = 0
    while (start := text.find(open_tag, pos)) != -1:
        content.append(text[pos:start])
        body = start + len(open_tag)
        close = text.find(close_tag, body)
        if close == -1:
            items.append(_error("unclosed <tool_call> tag", text[start:]))
            return ParsedOutput(_join(content), items)
        # Decode from the tag rather than slicing up to the first close tag: an argument string
        # may itself contain "</tool_call>" (code that prints it, say).
        try:
            obj, end = _DECODER.raw_decode(text, _skip_space(text, body))
        except json.JSONDecodeError as e:
            items.append(_error(f"invalid JSON ({e.msg})", text[body:close]))
            pos = close + len(close_tag)
            continue
        after = _skip_space(text, end)
        if text.startswith(close_tag, after):
            items.append(_to_call(obj, text[body:after]))
            pos = after + len(close_tag)
            continue
        close = text.find(close_tag, end)
        if close == -1:
            items.append(_error("unclosed <tool_call> tag", text[start:]))
            return ParsedOutput(_join(content), items)
        items.append(_error("text after the JSON object inside <tool_call>", text[body:close]))
        pos = close + len(close_tag)
    content.append(text[pos:])
    return ParsedOutput(_join(content), items)


def parse_llama3_json(text: str) -> ParsedOutput:
    body = text.strip().removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return ParsedOutput(text)  # a plain answer
    items: list[ToolCall | ParseError] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            items.append(_error(f"invalid JSON ({e.msg})", body[pos:]))
            return ParsedOutput("", items)
        items.append(_to_call(obj, body[pos:end]))
        pos = _skip_space(body, end)
        if body.startswith(";", pos):
            pos = _skip_space(body, pos + 1)
        elif pos < len(body):
            return ParsedOutput(body[pos:], items)  # prose after the calls
    return ParsedOutput("", items)


def parse_mistral(text: str, marker: str = "[TOOL_CALLS]") -> ParsedOutput:
    start = text.find(marker)
    if start == -1:
        return ParsedOutput(text)
    content, rest = text[:start], text[start + len(marker) :].lstrip()
    if rest.startswith("["):
        return ParsedOutput(content, _mistral_array(rest))
    items: list[ToolCall | ParseError] = []
    for segment in rest.split(marker):
        name, sep, arguments = segment.partition("[ARGS]")
        if not sep:
            items.append(_error("missing [ARGS] after the tool name", segment))
            continue
        try:
            obj, _ = _DECODER.raw_decode(arguments, _skip_space(arguments, 0))
        except json.JSONDecodeError as e:
            items.append(_error(f"invalid JSON ({e.msg})", segment))
            continue
        items.append(_to_call({"name": name.strip(), "arguments": obj}, segment))
    return ParsedOutput(content, items)


def _mistral_array(text: str) -> list[ToolCall | ParseError]:
    try:
        calls, _ = _DECODER.raw_decode(text)
    except json.JSONDecodeError as e:
        return [_error(f"invalid JSON ({e.msg})", text)]
    if not isinstance(calls, list):
        return [_error("[TOOL_CALLS] must be followed by a JSON array", text)]
    return [_to_call(call, json.dumps(call)) for call in calls]


PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "qwen": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def get_parser(name: str) -> Parser:
    if name not in PARSERS:
        raise ConfigError(
            f"tool-call parser {name!r} is unknown; use one of {sorted(PARSERS)} "
            "('hermes' for Qwen2.5 / Qwen3 models)"
        )
    return PARSERS[name]


def _to_call(obj: Any, source: str) -> ToolCall | ParseError:
    if not isinstance(obj, dict):
        return _error("a tool call must be a JSON object", source)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _error('missing tool name ("name": a non-empty string)', source)
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models JSON-encode the arguments object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return _error(f"arguments is a string but not valid JSON ({e.msg})", source)
    if not isinstance(arguments, dict):
        return _error("arguments must be a JSON object", source)
    return ToolCall(name=name.strip(), arguments=arguments)


def _error(reason: str, source: str) -> ParseError:
    return ParseError(reason=reason, text=source[:_SNIPPET_CHARS])


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _join(parts: list[str]) -> str:
    return "".join(parts).strip()
