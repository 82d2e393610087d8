"""Tool calls, stop strings and streaming, on a micro model tuned to answer two prompts word for
word: one with a Hermes `<tool_call>`, one with a plain sentence (see conftest)."""

from __future__ import annotations

import json

from .conftest import HELLO_MESSAGES, HELLO_REPLY, WEATHER_CALL, WEATHER_MESSAGES, client

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_tool_call_is_parsed_into_tool_calls(tuned_url):
    reply = client(tuned_url).chat.completions.create(
        model="tuned", messages=WEATHER_MESSAGES, tools=TOOLS, temperature=0, max_tokens=120
    )
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_without_tools_or_with_tool_choice_none_the_call_stays_text(tuned_url):
    api = client(tuned_url)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        reply = api.chat.completions.create(
            model="tuned", messages=WEATHER_MESSAGES, temperature=0, max_tokens=120, **extra
        )
        [choice] = reply.choices
        assert choice.message.content == WEATHER_CALL
        assert choice.message.tool_calls is None
        assert choice.finish_reason == "stop"


def test_streamed_tool_call(tuned_url):
    chunks = list(
        client(tuned_url).chat.completions.create(
            model="tuned",
            messages=WEATHER_MESSAGES,
            tools=TOOLS,
            temperature=0,
            max_tokens=120,
            stream=True,
        )
    )
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    [call] = calls
    assert call.index == 0 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_conversation_with_a_tool_result_renders(tuned_url):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *WEATHER_MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    reply = client(tuned_url).chat.completions.create(
        model="tuned", messages=messages, tools=TOOLS, temperature=0, max_tokens=8
    )
    assert reply.usage.completion_tokens >= 1


def test_greedy_reply_and_token_budget(tuned_url):
    api = client(tuned_url)
    full = api.chat.completions.create(
        model="tuned", messages=HELLO_MESSAGES, temperature=0, max_tokens=60
    )
    assert full.choices[0].message.content == HELLO_REPLY
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(HELLO_REPLY) + 1  # byte tokens and <|im_end|>
    short = api.chat.completions.create(
        model="tuned", messages=HELLO_MESSAGES, temperature=0, max_completion_tokens=5
    )
    assert short.choices[0].message.content == "Hello"
    assert short.choices[0].finish_reason == "length"


def test_stop_strings_end_the_text_before_them(tuned_url):
    api = client(tuned_url)
    reply = api.chat.completions.create(
        model="tuned",
        messages=HELLO_MESSAGES,
        temperature=0,
        max_tokens=60,
        stop=",",
        logprobs=True,
    )
    [choice] = reply.choices
    assert choice.message.content == "Hello there"
    assert choice.finish_reason == "stop"
    assert "".join(e.token for e in choice.logprobs.content) == "Hello there"
    assert reply.usage.completion_tokens == len("Hello there,")  # generated, stop string included
    earliest = api.chat.completions.create(
        model="tuned", messages=HELLO_MESSAGES, temperature=0, max_tokens=60, stop=["day", "my f"]
    )
    assert earliest.choices[0].message.content == "Hello there, "
    completion = api.completions.create(
        model="tuned",
        prompt="<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
        temperature=0,
        max_tokens=60,
        stop=["."],
    )
    assert completion.choices[0].text == "Hello there, my friend"


def test_stream_concatenates_to_the_whole_reply(tuned_url):
    api = client(tuned_url)
    kwargs = dict(model="tuned", messages=HELLO_MESSAGES, temperature=0, max_tokens=60)
    whole = api.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(api.chat.completions.create(stream=True, logprobs=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == whole == HELLO_REPLY
    assert sum(1 for d in deltas if d) == len(HELLO_REPLY)  # one chunk per token
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == len(
        HELLO_REPLY
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    text_chunks = list(
        api.completions.create(
            model="tuned",
            prompt="<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in text_chunks) == HELLO_REPLY
    assert text_chunks[-1].choices[0].finish_reason == "stop"
