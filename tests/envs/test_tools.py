from typing import Literal, Optional

import pytest

from reinforge.envs.tools import ToolOutput, call_tool, make_tools, tool_schema
from reinforge.errors import ConfigError


def search(
    query: str,
    k: int = 3,
    min_score: float = 0.5,
    exact: bool = False,
    tags: list[str] | None = None,
    order: Literal["relevance", "date"] = "relevance",
    year: Optional[int] = None,  # noqa: UP045 - the Optional spelling is what we test
) -> str:
    """Search the notes.

    Args:
        query: Words to look for.
        k: How many hits
            to return.
        min_score: Lowest score kept.
        exact: Match whole words only.
        tags: Only notes with one of these tags.
        order: How to sort the hits.
        year: Only notes from this year.

    Returns:
        The hits, one per line.
    """
    return f"{query}|{k}|{min_score}|{exact}|{tags}|{order}|{year}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


def fails(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


def flags(kind: str) -> ToolOutput:
    """Reports an error or a timeout.

    Args:
        kind: "error" or "timeout".
    """
    return ToolOutput(kind, is_error=kind == "error", is_timeout=kind == "timeout")


def test_schema_from_signature_and_docstring():
    assert tool_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Words to look for."},
                    "k": {"type": "integer", "description": "How many hits to return."},
                    "min_score": {"type": "number", "description": "Lowest score kept."},
                    "exact": {"type": "boolean", "description": "Match whole words only."},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string"},
                        "nullable": True,
                        "description": "Only notes with one of these tags.",
                    },
                    "order": {
                        "type": "string",
                        "enum": ["relevance", "date"],
                        "description": "How to sort the hits.",
                    },
                    "year": {
                        "type": "integer",
                        "nullable": True,
                        "description": "Only notes from this year.",
                    },
                },
                "required": ["query"],
            },
        },
    }


def test_schema_errors_name_the_fix():
    def undocumented(x: int) -> str:
        return ""

    def untyped(x) -> str:
        """Untyped.

        Args:
            x: Something.
        """
        return ""

    for fn in (undocumented, untyped):
        with pytest.raises(ConfigError, match="Google-style docstring"):
            tool_schema(fn)
    with pytest.raises(ConfigError, match="unique"):
        make_tools([add, add])


@pytest.fixture(scope="module")
def registry():
    return make_tools([search, add, fails, flags])


def test_call_tool_runs_with_defaults(registry):
    result = call_tool(registry, "search", {"query": "rl", "tags": ["a"], "order": "date"})
    assert (result.status, result.text) == ("ok", "rl|3|0.5|False|['a']|date|None")
    assert call_tool(registry, "add", '{"a": 2, "b": 3.0}').text == "5"  # 3.0 is a JSON integer
    assert call_tool(registry, "search", {"query": "x", "min_score": 1}).status == "ok"


@pytest.mark.parametrize(
    ("name", "arguments", "status", "message"),
    [
        (
            "nope",
            {},
            "unknown_tool",
            "unknown tool 'nope'. Available tools: add, fails, flags, search",
        ),
        ("add", {"a": 1}, "invalid_arguments", "missing required argument 'b'"),
        ("add", {"a": 1, "b": 2, "c": 3}, "invalid_arguments", "unknown argument 'c'"),
        ("add", {"a": "1", "b": 2}, "invalid_arguments", "'a' must be integer, got string \"1\""),
        ("add", {"a": True, "b": 2}, "invalid_arguments", "'a' must be integer, got boolean"),
        ("add", {"a": 1.5, "b": 2}, "invalid_arguments", "'a' must be integer, got number 1.5"),
        ("search", {"query": "x", "order": "size"}, "invalid_arguments", "must be one of"),
        ("search", {"query": "x", "tags": [1]}, "invalid_arguments", "'tags[0]' must be string"),
        ("search", {"query": None}, "invalid_arguments", "'query' must be string, got null"),
        ("add", "{bad json", "invalid_arguments", "arguments are not valid JSON"),
        ("add", [1, 2], "invalid_arguments", "arguments must be a JSON object, got array"),
        ("fails", {"reason": "boom"}, "error", "'fails' failed: RuntimeError: boom"),
        ("flags", {"kind": "error"}, "error", "error"),
        ("flags", {"kind": "timeout"}, "timeout", "timeout"),
    ],
)
def test_call_tool_problems_become_text(registry, name, arguments, status, message):
    result = call_tool(registry, name, arguments)
    assert result.status == status
    assert message in result.text
