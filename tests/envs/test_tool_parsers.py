import json
import random

import pytest

from reinforge.envs.parsers import (
    MAX_DEPTH,
    ParseError,
    ToolCall,
    get_parser,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)
from reinforge.envs.tools import call_tool, make_tools, validate_arguments
from reinforge.errors import ConfigError


def test_hermes_one_call_and_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.items == [ToolCall("add", {"a": 1, "b": 2})]
    assert parsed.content == "Let me add."


def test_hermes_several_calls_in_order():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
        '<tool_call>{"name": "b", "arguments": {"x": [1, 2]}}</tool_call>'
    )
    assert parse_hermes(text).items == [ToolCall("a", {}), ToolCall("b", {"x": [1, 2]})]


def test_hermes_nested_json_and_closing_tag_inside_a_string():
    text = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(\'</tool_call>\')", '
        '"opts": {"deep": {"list": [{"k": "}"}]}}}}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.items == [
        ToolCall(
            "python",
            {"code": "print('</tool_call>')", "opts": {"deep": {"list": [{"k": "}"}]}}},
        )
    ]
    assert parsed.content == ""


def test_hermes_arguments_as_json_string():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_hermes(text).items == [ToolCall("add", {"a": 1, "b": 2})]


def test_hermes_malformed_json_is_an_error_and_parsing_goes_on():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    )
    first, second = parse_hermes(text).items
    assert isinstance(first, ParseError)
    assert first.reason.startswith("invalid JSON")
    assert second == ToolCall("ok", {})


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"arguments": {"a": 1}}', "missing tool name"),
        ('{"name": "", "arguments": {}}', "missing tool name"),
        ('{"name": "f", "arguments": "{not json"}', "arguments is a string but not valid JSON"),
        ('{"name": "f", "arguments": [1, 2]}', "arguments must be a JSON object"),
        ('["f", {}]', "a tool call must be a JSON object"),
        ('{"name": "f", "arguments": {}} trailing', "text after the JSON object"),
    ],
)
def test_hermes_bad_call_reasons(body, reason):
    (item,) = parse_hermes(f"<tool_call>{body}</tool_call>").items
    assert isinstance(item, ParseError)
    assert item.reason.startswith(reason)


def test_hermes_unclosed_tag():
    parsed = parse_hermes('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}')
    (item,) = parsed.items
    assert isinstance(item, ParseError)
    assert item.reason == "unclosed <tool_call> tag"
    assert parsed.content == "Sure."


def test_hermes_plain_answer_has_no_items():
    parsed = parse_hermes("The answer is 42.")
    assert parsed.items == []
    assert parsed.content == "The answer is 42."


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parse_llama3_json(text).items == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parse_llama3_json("The answer is 3.").items == []
    (error,) = parse_llama3_json('{"name": "a", "parameters": {').items
    assert isinstance(error, ParseError)


def test_mistral_array_and_args_formats():
    text = 'ok [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    parsed = parse_mistral(text)
    assert parsed.items == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parsed.content == "ok "
    text = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert parse_mistral(text).items == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    (error,) = parse_mistral("[TOOL_CALLS]a{}").items
    assert isinstance(error, ParseError)
    assert parse_mistral("no calls").items == []


def test_parser_table_by_name():
    assert get_parser("qwen") is parse_hermes
    with pytest.raises(ConfigError, match="hermes"):
        get_parser("gorilla")


# ---- hostile text: a parse error with its reason, never an exception

HOSTILE_VALUES = {  # an argument value a model can write, and the reason it is refused
    "5,000-digit integer": ("9" * 5000, "a number too long to read"),
    "4,200-digit integer": ("9" * 4200, "more than 4000 digits"),
    "100k-deep arrays": ("[" * 100_000 + "]" * 100_000, "nested deeper"),
    "100k-deep objects": ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested deeper"),
    "500-deep arrays": ("[" * 500 + "]" * 500, f"nested deeper than {MAX_DEPTH}"),
    "lone surrogate": ('"\\ud800 x"', "lone surrogate"),
    "NaN": ("NaN", "not a JSON number"),
    "-Infinity": ("-Infinity", "not a JSON number"),
    "1e999": ("1e999", "not a JSON number"),
}


def _formats(value: str) -> dict[str, tuple]:
    """One tool call whose argument `x` is `value`, in every format a parser reads."""
    arguments = '{"x": ' + value + "}"
    return {
        "hermes": (
            parse_hermes,
            f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>',
        ),
        "hermes, arguments as a string": (
            parse_hermes,
            f'<tool_call>{{"name": "f", "arguments": {json.dumps(arguments)}}}</tool_call>',
        ),
        "llama3_json": (parse_llama3_json, f'{{"name": "f", "parameters": {arguments}}}'),
        "mistral array": (
            parse_mistral,
            f'[TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}]',
        ),
        "mistral [ARGS]": (parse_mistral, f"[TOOL_CALLS]f[ARGS]{arguments}"),
    }


@pytest.mark.parametrize("fmt", list(_formats("1")))
@pytest.mark.parametrize("hostile", list(HOSTILE_VALUES))
def test_hostile_arguments_are_parse_errors_in_every_format(hostile, fmt):
    value, reason = HOSTILE_VALUES[hostile]
    parser, text = _formats(value)[fmt]
    (item,) = parser(text).items
    assert isinstance(item, ParseError), item
    assert reason in item.reason
    assert len(item.text) <= 200
    parser, text = _formats("1")[fmt]  # the same call with a plain value parses
    assert parser(text).items == [ToolCall("f", {"x": 1})]


def test_hostile_call_does_not_stop_the_next_one():
    hostile = '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>"
    fine = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    first, second = parse_hermes(hostile + fine).items
    assert isinstance(first, ParseError) and second == ToolCall("g", {})


def test_lone_surrogate_in_the_tool_name_is_an_error():
    (item,) = parse_hermes('<tool_call>{"name": "f\\udc00", "arguments": {}}</tool_call>').items
    assert isinstance(item, ParseError) and "lone surrogate" in item.reason


def _deep_list(depth: int) -> list:
    root = node = []
    for _ in range(depth):
        node.append([])
        node = node[0]
    return root


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ('{"x": ' + "9" * 5000 + "}", "a number too long to read"),
        ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper"),
        ('{"x": "\\ud800"}', "lone surrogate"),
        ('{"x": NaN}', "not a JSON number"),
        ({"x": 10**5000}, "more than 4000 digits"),  # arguments built in Python, not parsed
        ({"x": _deep_list(100_000)}, "nested deeper"),
        ({"x": float("inf")}, "not a JSON number"),
    ],
    ids=[
        "5000 digits",
        "100k deep",
        "lone surrogate",
        "NaN",
        "python int 10**5000",
        "python list 100k deep",
        "python inf",
    ],
)
def test_tool_argument_validation_refuses_hostile_values(arguments, reason):
    registry = make_tools([echo])
    kwargs, problems = validate_arguments(
        registry["echo"].schema["function"]["parameters"], arguments
    )
    assert kwargs == {} and len(problems) == 1 and reason in problems[0]
    result = call_tool(registry, "echo", arguments)
    assert result.status == "invalid_arguments" and reason in result.text


def echo(x: str) -> str:
    """Say x back.

    Args:
        x: What to say.
    """
    return x


FUZZ_TOKENS = [
    *'{}[]":,\\ ;',
    "9" * 5000,
    "[" * 3000,
    "{" * 3000,
    "NaN",
    "1e999",
    "\\ud800",
    "\\udfff",
    '"\\u0000"',
    "\x00",
    "\ufffd",
    "null",
    "true",
    '"name"',
    '"arguments"',
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
]


def _mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(text) + 1)
        kind = rng.random()
        if kind < 0.6:
            text = text[:at] + rng.choice(FUZZ_TOKENS) + text[at:]
        elif kind < 0.8:
            text = text[:at] + text[at + rng.randint(1, 8) :]
        else:
            text = text[:at] + text[at : at + rng.randint(1, 40)] * rng.randint(2, 5) + text[at:]
    return text


@pytest.mark.parametrize("fmt", list(_formats("1")))
def test_fuzzed_calls_never_raise_and_every_call_is_safe_json(fmt):
    parser, seed_text = _formats('{"y": [1, "two", 3.5, null]}')[fmt]
    rng = random.Random(f"tool-call-fuzz/{fmt}")
    parameters = {"type": "object", "properties": {}, "required": []}
    for _ in range(2000):
        parsed = parser(_mutate(rng, seed_text))
        assert isinstance(parsed.content, str)
        for item in parsed.items:
            if isinstance(item, ToolCall):
                json.dumps(item.arguments, ensure_ascii=False).encode("utf-8")
                item.name.encode("utf-8")
                validate_arguments(parameters, item.arguments)
            else:
                assert isinstance(item, ParseError) and len(item.text) <= 200
