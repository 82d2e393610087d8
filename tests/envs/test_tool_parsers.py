import pytest

from reinforge.envs.parsers import (
    ParseError,
    ToolCall,
    get_parser,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
)
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
