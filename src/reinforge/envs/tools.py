"""Tools are typed Python functions; their signature and docstring become the tool schema.

A tool is a plain function with type hints and a Google-style docstring whose `Args:` section
describes every parameter. `tool_schema(fn)` turns it into the OpenAI tool schema chat templates
render (`{"type": "function", "function": {"name", "description", "parameters"}}`), using
transformers' `get_json_schema` (str, int, float, bool, list[...], dict[...], tuple, Literal,
Optional / `X | None`, unions; defaulted parameters are optional) and turning its errors into a
`ConfigError` that says how to fix the function.

`call_tool(registry, name, arguments)` is the boundary with the model: it never raises for what
the model wrote. An unknown tool, missing / unknown / mistyped arguments, arguments that are no
safe JSON (`reinforge.envs.parsers.json_problem`: too deep, a lone surrogate, a number too long
to write, NaN), or a tool that raised
become a `ToolResult` whose text tells the model what went wrong, with a `status` the env counts.
A tool returns text (anything else is JSON-encoded), or a `ToolOutput` to flag an error or a
timeout along with its text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reinforge.envs.parsers import json_problem, load_json
from reinforge.errors import ConfigError
from reinforge.faults import site

STATUSES = ("ok", "unknown_tool", "invalid_arguments", "error", "timeout")

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    # JSON has no int/float split: 3.0 is an integer there; bool is never a number
    "integer": lambda v: (
        not isinstance(v, bool)
        and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))
    ),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolOutput:
    """What a tool may return instead of plain text, to flag how it went."""

    text: str
    is_error: bool = False
    is_timeout: bool = False


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees in the tool message
    status: str  # one of STATUSES


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI tool schema of a typed, documented function."""
    from transformers.utils import get_json_schema  # transformers is slow to import

    name = getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers raises plain Exception subclasses for both problems
        raise ConfigError(
            f"tool {name!r} cannot become a tool schema: {e}. A tool needs a type hint on every "
            "parameter and a Google-style docstring: a one-line description, then\n"
            "    Args:\n        query: What to search for.\n"
            "with one line per parameter."
        ) from e
    function = schema["function"]
    function.pop("return", None)  # not part of the OpenAI tool format
    function["parameters"].setdefault("required", [])
    return schema


def make_tools(fns: Iterable[Callable[..., Any]]) -> dict[str, Tool]:
    """A registry: tool name -> Tool, names unique."""
    registry: dict[str, Tool] = {}
    for fn in fns:
        schema = tool_schema(fn)
        name = schema["function"]["name"]
        if name in registry:
            raise ConfigError(f"two tools are named {name!r}; tool names must be unique")
        registry[name] = Tool(name=name, fn=fn, schema=schema)
    return registry


def call_tool(registry: Mapping[str, Tool], name: str, arguments: Any) -> ToolResult:
    """Validate `arguments` (a dict, or its JSON text) against the tool's schema and run it."""
    tool = registry.get(name)
    if tool is None:
        available = ", ".join(sorted(registry)) or "none"
        return ToolResult(
            f"Error: unknown tool {name!r}. Available tools: {available}.", "unknown_tool"
        )
    kwargs, problems = validate_arguments(tool.schema["function"]["parameters"], arguments)
    if problems:
        return ToolResult(
            f"Error: invalid arguments for {name!r}: {'; '.join(problems)}.", "invalid_arguments"
        )
    try:
        with site("tool"):  # a watchdog phase, and a fault-injection site for drills
            output = tool.fn(**kwargs)
    except Exception as e:  # the tool's own failure is news for the model, not a crash of the run
        return ToolResult(f"Error: {name!r} failed: {type(e).__name__}: {e}", "error")
    if isinstance(output, ToolOutput):
        status = "timeout" if output.is_timeout else "error" if output.is_error else "ok"
        return ToolResult(output.text, status)
    if isinstance(output, str):
        return ToolResult(output, "ok")
    return ToolResult(json.dumps(output, default=str), "ok")


def validate_arguments(
    parameters: dict[str, Any], arguments: Any
) -> tuple[dict[str, Any], list[str]]:
    """Check arguments against a tool's `parameters` schema: (cleaned kwargs, problems)."""
    if isinstance(arguments, str):
        loaded = load_json(arguments) if arguments.strip() else ({},)
        if isinstance(loaded, str):
            return {}, [f"arguments are not valid JSON ({loaded})"]
        (arguments,) = loaded
    problem = json_problem(arguments)  # arguments built in Python may hold anything
    if problem is not None:
        return {}, [f"arguments are not valid JSON ({problem})"]
    if not isinstance(arguments, dict):
        return {}, [f"arguments must be a JSON object, got {_json_type(arguments)}"]
    properties = parameters.get("properties", {})
    problems = [
        f"missing required argument {key!r}"
        for key in parameters.get("required", [])
        if key not in arguments
    ]
    problems += [
        f"unknown argument {key!r} (expected: {', '.join(properties) or 'none'})"
        for key in arguments
        if key not in properties
    ]
    kwargs = {}
    for key, value in arguments.items():
        if key in properties:
            kwargs[key], problem = _check(value, properties[key], key)
            if problem:
                problems.append(problem)
    return kwargs, problems


def _check(value: Any, schema: dict[str, Any], path: str) -> tuple[Any, str | None]:
    """(the value, integral floats made int; a problem or None) for one JSON-schema node."""
    if value is None and schema.get("nullable"):
        return None, None
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if types is not None and not any(_JSON_TYPES[t](value) for t in types if t in _JSON_TYPES):
        return (
            value,
            f"{path!r} must be {' or '.join(types)}, got {_json_type(value)} {_short(value)}",
        )
    if "enum" in schema and value not in schema["enum"]:
        return value, f"{path!r} must be one of {schema['enum']}, got {_short(value)}"
    if types and "integer" in types and isinstance(value, float) and "number" not in types:
        return int(value), None
    if isinstance(value, list):
        return _check_items(value, schema, path)
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        checked = {
            k: _check(v, schema["additionalProperties"], f"{path}.{k}") for k, v in value.items()
        }
        problem = next((p for _, p in checked.values() if p), None)
        return {k: v for k, (v, _) in checked.items()}, problem
    return value, None


def _check_items(value: list, schema: dict[str, Any], path: str) -> tuple[Any, str | None]:
    prefix = schema.get("prefixItems")  # tuple[...] parameters
    if prefix is not None and len(value) != len(prefix):
        return value, f"{path!r} must have {len(prefix)} items, got {len(value)}"
    item_schemas = prefix or [schema.get("items", {})] * len(value)
    checked = [_check(v, s, f"{path}[{i}]") for i, (v, s) in enumerate(zip(value, item_schemas))]
    problem = next((p for _, p in checked if p), None)
    return [v for v, _ in checked], problem


def _json_type(value: Any) -> str:
    names = {
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
