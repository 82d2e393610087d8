"""Generated outputs to OpenAI response bodies and stream chunks (plain dicts, as JSON sends them).

Tool calls: when the request offered tools, the text is read by the model family's parser
(`reinforge.envs.parsers`); if it holds calls and every call parses, the choice carries them as
`tool_calls` (arguments as a JSON string) with `finish_reason = "tool_calls"`, and the text
outside the calls as content. A call that cannot be read leaves the whole text as content, so
the client sees what the model wrote.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from reinforge.envs.parsers import Parser
from reinforge.server.backend import Generated


@dataclass(frozen=True)
class Header:
    """The fields every response and chunk of one request repeat."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str) -> Header:
        return cls(f"{prefix}-{uuid.uuid4().hex}", model)

    def body(self, object_: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def usage(num_prompt_tokens: int, outputs: list[Generated]) -> dict[str, int]:
    num_completion_tokens = sum(g.num_generated_tokens for g in outputs)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def tool_calls_of(text: str, parser: Parser) -> tuple[str | None, list[dict]] | None:
    """(content, OpenAI tool_calls) when the text holds tool calls that all parse, else None."""
    parsed = parser(text)
    if not parsed.calls or parsed.errors:
        return None
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": json.dumps(call.arguments, ensure_ascii=False),
            },
        }
        for call in parsed.calls
    ]
    return parsed.content or None, calls


# ---- chat


def chat_response(
    header: Header,
    outputs: list[Generated],
    num_prompt_tokens: int,
    tokenizer,
    parser: Parser | None,
    with_logprobs: bool,
) -> dict[str, Any]:
    choices = []
    for index, g in enumerate(outputs):
        message: dict[str, Any] = {"role": "assistant", "content": g.text}
        finish_reason = g.finish_reason
        split = tool_calls_of(g.text, parser) if parser is not None else None
        if split is not None:
            message["content"], message["tool_calls"] = split
            finish_reason = "tool_calls"
        logprobs = None
        if with_logprobs:
            logprobs = {"content": chat_logprobs(tokenizer, g, 0, len(g.token_ids))}
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        )
    return header.body("chat.completion", choices, usage=usage(num_prompt_tokens, outputs))


def chat_chunks(
    header: Header,
    outputs: list[Generated],
    num_prompt_tokens: int,
    tokenizer,
    parser: Parser | None,
    with_logprobs: bool,
    include_usage: bool,
) -> Iterator[dict[str, Any]]:
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs}
        return header.body(
            "chat.completion.chunk", [{**choice, "finish_reason": finish_reason}], **extra
        )

    for index, g in enumerate(outputs):
        yield chunk(index, {"role": "assistant", "content": ""})
        split = tool_calls_of(g.text, parser) if parser is not None else None
        if split is not None:
            content, calls = split
            if content:
                yield chunk(index, {"content": content})
            for k, call in enumerate(calls):
                yield chunk(index, {"tool_calls": [{"index": k, **call}]})
            yield chunk(index, {}, finish_reason="tool_calls")
            continue
        for start, end in _text_spans(g.pieces):
            logprobs = None
            if with_logprobs:
                logprobs = {"content": chat_logprobs(tokenizer, g, start, end)}
            yield chunk(index, {"content": "".join(g.pieces[start:end])}, logprobs)
        yield chunk(index, {}, finish_reason=g.finish_reason)
    if include_usage:
        yield header.body("chat.completion.chunk", [], usage=usage(num_prompt_tokens, outputs))


def chat_logprobs(tokenizer, g: Generated, start: int, end: int) -> list[dict[str, Any]]:
    entries = []
    for i in range(start, end):
        entry = _token_logprob(tokenizer, g.token_ids[i], g.logprobs[i])
        top = g.top_logprobs[i] if g.top_logprobs is not None else []
        entry["top_logprobs"] = [_token_logprob(tokenizer, t, lp) for t, lp in top]
        entries.append(entry)
    return entries


def _token_logprob(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _text_spans(pieces: list[str]) -> Iterator[tuple[int, int]]:
    """Token ranges to stream as one chunk each: a token whose piece is empty (a partial
    character) travels with the next one that has text."""
    start = 0
    for end, piece in enumerate(pieces, start=1):
        if piece:
            yield start, end
            start = end
    if start < len(pieces):
        yield start, len(pieces)


# ---- completions


def completion_response(
    header: Header,
    outputs: list[Generated],
    num_prompt_tokens: int,
    tokenizer,
    logprobs: int | None,
) -> dict[str, Any]:
    choices = [
        {
            "index": index,
            "text": g.text,
            "logprobs": None if logprobs is None else completion_logprobs(tokenizer, g),
            "finish_reason": g.finish_reason,
        }
        for index, g in enumerate(outputs)
    ]
    return header.body("text_completion", choices, usage=usage(num_prompt_tokens, outputs))


def completion_chunks(
    header: Header,
    outputs: list[Generated],
    num_prompt_tokens: int,
    tokenizer,
    logprobs: int | None,
    include_usage: bool,
) -> Iterator[dict[str, Any]]:
    extra = {"usage": None} if include_usage else {}
    for index, g in enumerate(outputs):
        for start, end in _text_spans(g.pieces):
            part = Generated(
                g.token_ids[start:end],
                g.pieces[start:end],
                g.logprobs[start:end],
                None if g.top_logprobs is None else g.top_logprobs[start:end],
                g.finish_reason,
                0,
            )
            lps = None if logprobs is None else completion_logprobs(tokenizer, part)
            choice = {"index": index, "text": part.text, "logprobs": lps, "finish_reason": None}
            yield header.body("text_completion", [choice], **extra)
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": g.finish_reason}
        yield header.body("text_completion", [choice], **extra)
    if include_usage:
        yield header.body("text_completion", [], usage=usage(num_prompt_tokens, outputs))


def completion_logprobs(tokenizer, g: Generated) -> dict[str, Any]:
    offsets, offset = [], 0
    for piece in g.pieces:
        offsets.append(offset)
        offset += len(piece)
    top = None
    if g.top_logprobs is not None:
        top = [{tokenizer.decode([t]): lp for t, lp in row} for row in g.top_logprobs]
    return {
        "tokens": [tokenizer.decode([t]) for t in g.token_ids],
        "token_logprobs": g.logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
