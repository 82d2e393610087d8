"""Agents for the tests, written only against the `openai` client (as a user writes them)."""

from __future__ import annotations

import asyncio
import time

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def nudging_agent(agent, turns: int = 3) -> float:
    """Multi-turn with tools: runs the tool calls the model makes; when it makes none, asks it
    again. Always `turns` requests, each extending the last one's conversation."""
    messages = list(agent.messages)
    for turn in range(turns):
        response = agent.client.chat.completions.create(
            model=agent.model, messages=messages, tools=TOOLS, max_tokens=8
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        elif turn < turns - 1:
            messages.append({"role": "user", "content": "Use the tool."})
    return float(len(message.content or "") % 2)


async def weather_agent(agent) -> dict:
    """Async, with a tool call answered and a final answer: two requests, one sequence."""
    messages = list(agent.messages)
    first = await agent.client.chat.completions.create(
        model=agent.model, messages=messages, tools=TOOLS, max_tokens=120
    )
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    await agent.client.chat.completions.create(
        model=agent.model, messages=messages, tools=TOOLS, max_tokens=8, logprobs=True
    )
    return {"reward": 1.0, "called": float(bool(message.tool_calls))}


def rewriting_agent(agent) -> float:
    """Rewrites its history after the first turn (a summary instead of the turn), and asks for
    two choices once: 3 requests, a history break, and an extra choice's segment."""
    client, model = agent.client, agent.model
    first = client.chat.completions.create(model=model, messages=agent.messages, max_tokens=4)
    summary = [{"role": "user", "content": "Earlier you said: " + first.choices[0].message.content}]
    second = client.chat.completions.create(model=model, messages=summary, max_tokens=4, n=2)
    follow = [*summary, second.choices[0].message.model_dump(exclude_none=True)]
    follow.append({"role": "user", "content": "Go on."})
    client.chat.completions.create(model=model, messages=follow, max_tokens=4)
    return 0.5


def streaming_agent(agent) -> float:
    """Streams its answer, with logprobs, and a token-id completion request after it."""
    stream = agent.client.chat.completions.create(
        model=agent.model, messages=agent.messages, max_tokens=6, stream=True, logprobs=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    agent.client.completions.create(model=agent.model, prompt=[1, 2, 3], max_tokens=3)
    return float(len(text) > 0)


def bad_agent(agent, hang_s: float = 0.0):
    """By sample: raises, hangs for `hang_s` (then behaves), returns a string, makes no
    request, or behaves."""
    k = agent.sample_index
    if k == 0:
        raise RuntimeError("the agent's own bug")
    if k == 1:
        agent.client.chat.completions.create(
            model=agent.model, messages=agent.messages, max_tokens=2
        )
        time.sleep(hang_s)  # past task.agent_timeout_s, when the test sets it so
        return 1.0
    if k == 2:
        agent.client.chat.completions.create(
            model=agent.model, messages=agent.messages, max_tokens=2
        )
        return "not a number"
    if k == 3:
        return 1.0  # without a request
    agent.client.chat.completions.create(model=agent.model, messages=agent.messages, max_tokens=2)
    return 1.0


async def sleepy_async_agent(agent) -> float:
    await asyncio.sleep(30)
    return 1.0
