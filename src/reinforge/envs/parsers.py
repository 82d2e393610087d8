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

Hostile text is a parse error too, never an exception: an integer of more than 4,000 digits
(Python reads and writes at most 4,300), nesting deeper than `MAX_DEPTH` (the JSON decoder's
recursion, and every tool's and template's walk over the arguments after it), a string holding a
lone surrogate escape (`"\\ud800"`, which no UTF-8 encoder takes), and NaN / Infinity (not
JSON; a client's decoder refuses them). So every `ToolCall` holds arguments that `json.dumps`
and UTF-8 encoding accept.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from reinforge.errors import ConfigError

_DECODER = json.JSONDecoder()
_SNIPPET_CHARS = 200  # how much of a broken call a ParseError keeps
MAX_DEPTH = 64  # nesting levels of a call's JSON; no tool schema describes deeper arguments
_MAX_INT_DIGITS = (
    4000  # under Python's int-string limit (4,300): a longer int cannot be written out
)
_MAX_INT_BITS = int(_MAX_INT_DIGITS * math.log2(10))
_SURROGATE = re.compile("[\ud800-\udfff]")


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
        decoded = decode_json(text, _skip_space(text, body))
        if isinstance(decoded, str):
            items.append(_error(f"invalid JSON ({decoded})", text[body:close]))
            pos = close + len(close_tag)
            continue
        obj, end = decoded
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
        decoded = decode_json(body, pos)
        if isinstance(decoded, str):
            items.append(_error(f"invalid JSON ({decoded})", body[pos:]))
            return ParsedOutput("", items)
        obj, end = decoded
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
        decoded = decode_json(arguments, _skip_space(arguments, 0))
        if isinstance(decoded, str):
            items.append(_error(f"invalid JSON ({decoded})", segment))
            continue
        items.append(_to_call({"name": name.strip(), "arguments": decoded[0]}, segment))
    return ParsedOutput(content, items)


def _mistral_array(text: str) -> list[ToolCall | ParseError]:
    decoded = decode_json(text, 0)
    if isinstance(decoded, str):
        return [_error(f"invalid JSON ({decoded})", text)]
    calls = decoded[0]
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
        loaded = load_json(arguments) if arguments.strip() else ({},)
        if isinstance(loaded, str):
            return _error(f"arguments is a string but not valid JSON ({loaded})", source)
        (arguments,) = loaded
    if not isinstance(arguments, dict):
        return _error("arguments must be a JSON object", source)
    return ToolCall(name=name.strip(), arguments=arguments)


def decode_json(text: str, pos: int) -> tuple[Any, int] | str:
    """The JSON value that starts at `pos` and where it ends, or why it is no JSON that is safe
    to pass on (a reason, never an exception: see the module docstring)."""
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        return e.msg
    except ValueError:  # int() past sys.get_int_max_str_digits()
        return "a number too long to read"
    except RecursionError:
        return f"nested deeper than {MAX_DEPTH} levels"
    problem = json_problem(value)
    return (value, end) if problem is None else problem


def load_json(text: str) -> tuple[Any] | str:
    """`json.loads` that never raises: (the value,) or why it is not safe JSON."""
    decoded = decode_json(text, _skip_space(text, 0))
    if isinstance(decoded, str):
        return decoded
    value, end = decoded
    if _skip_space(text, end) < len(text):
        return "Extra data"
    return (value,)


def json_problem(value: Any) -> str | None:
    """What makes a JSON-like value unsafe to pass on, or None: nesting deeper than
    `MAX_DEPTH`, a lone surrogate in a string or key, a non-finite number, an integer too long to
    write as text. Walks without recursion, so any depth is safe to check."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return "a string holds a lone surrogate escape, not valid unicode"
        elif isinstance(node, float):
            if not math.isfinite(node):
                return f"{node} is not a JSON number"
        elif isinstance(node, int):
            if node.bit_length() > _MAX_INT_BITS:
                return f"an integer of more than {_MAX_INT_DIGITS} digits"
        elif isinstance(node, (dict, list)):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return None


def _error(reason: str, source: str) -> ParseError:
    return ParseError(reason=reason, text=source[:_SNIPPET_CHARS])


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _join(parts: list[str]) -> str:
    return "".join(parts).strip()
