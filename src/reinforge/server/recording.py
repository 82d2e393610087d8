"""The served model of agent episodes: every request recorded with its exact token ids.

`RecordingModel` is a `ServedModel` (so `create_app` serves it unchanged) whose requests belong
to an episode: the in-process endpoint (`server/in_process.py`) reads the episode's id from the
URL and sets `current_episode` for the request's worker thread. For each request it

- renders the prompt: a chat request that repeats an earlier request of the episode with one of
  that request's answers appended (as returned: content and tool calls) and more messages after
  it gets the earlier prompt's ids + the ids sampled for that answer + the template's rendering
  of the new messages (`EpisodeRecords.continued_prompt`); any other request is rendered whole;
- samples through the shared `RequestBatcher` under the rollout's sampling settings (the trainer
  scores the tokens under them), at most `max_new_tokens` per request;
- records the prompt ids and, per choice, every sampled id (the stop id included) with its
  logprob (`Record`), in the order requests finish.
"""

from __future__ import annotations

import contextvars
import json
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from reinforge.engine.base import SamplingParams
from reinforge.envs.parsers import Parser
from reinforge.server.backend import Generated, ServedModel
from reinforge.server.protocol import RequestError
from reinforge.server.responses import tool_calls_of
from reinforge.types import Completion

# The episode of the request being answered (set per request by the endpoint's router).
current_episode: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "current_episode", default=None
)


@dataclass
class Record:
    """One choice of one request, as the engine saw and sampled it."""

    request_index: int  # the episode's requests, numbered as they arrived
    prompt_ids: list[int]
    completion_ids: list[int]  # every sampled id, the stop id included
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    text: str  # what the client was given

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class _Chat:
    """A chat request of the episode: what it sent, and its records (one per choice)."""

    messages: list[dict[str, Any]]
    tools: list[dict] | None
    records: list[Record]


@dataclass
class EpisodeRecords:
    """Everything one episode's requests did, in the order they finished."""

    key: str
    max_requests: int
    records: list[Record] = field(default_factory=list)
    chats: list[_Chat] = field(default_factory=list)
    num_requests: int = 0
    is_closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_request(self) -> int:
        with self.lock:
            if self.is_closed:
                raise RequestError(
                    f"episode {self.key} is over (its agent returned or timed out)", status=400
                )
            if self.num_requests >= self.max_requests:
                raise RequestError(
                    f"this episode made {self.num_requests} requests, the most task.max_turns "
                    f"= {self.max_requests} allows; end the episode or raise task.max_turns",
                    code="too_many_requests",
                )
            self.num_requests += 1
            return self.num_requests - 1

    def add(self, records: list[Record], chat: tuple[list[dict], list[dict] | None] | None):
        with self.lock:
            if self.is_closed:  # a request still running when its agent timed out
                return
            self.records += records
            if chat is not None:
                self.chats.append(_Chat(chat[0], chat[1], records))

    def continued_prompt(
        self, tokenizer, parser: Parser, messages: list[dict], tools: list[dict] | None
    ) -> list[int] | None:
        """The prompt ids of `messages` built on an earlier request's exact ids, or None when
        they do not continue one (see the module docstring)."""
        with self.lock:
            chats = list(self.chats)
        for chat in reversed(chats):
            k = len(chat.messages)
            if chat.tools != tools or len(messages) < k + 2 or messages[:k] != chat.messages:
                continue
            answer = messages[k]
            for record in chat.records:
                if answer.get("role") == "assistant" and _same_answer(answer, record.text, parser):
                    delta = _delta(tokenizer, messages[: k + 1], messages[k + 1 :], tools, record)
                    if delta is not None:
                        return record.ids + delta
        return None


def _same_answer(sent: dict[str, Any], text: str, parser: Parser) -> bool:
    """Whether an assistant message the client sent back is the answer whose text was `text`
    (content, and tool calls by name and arguments, as the response gave them)."""
    calls = sent.get("tool_calls") or []
    if not calls:
        return (sent.get("content") or "") == text
    split = tool_calls_of(text, parser)
    if split is None:
        return False
    content, parsed = split
    sent_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    given = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed]
    return (sent.get("content") or "") == (content or "") and sent_calls == given


def _delta(tokenizer, conversation, new_messages, tools, record: Record) -> list[int] | None:
    """The ids the chat template writes after the assistant turn that ends `conversation` when
    `new_messages` follow it, through the next generation prompt; None when the template does
    not close that turn with the EOS id (the whole conversation is rendered instead)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        return None
    base = _render(tokenizer, conversation, tools, False)
    nxt = _render(tokenizer, conversation + new_messages, tools, True)
    num_closed = base.count(eos)
    closes = [i for i, t in enumerate(nxt) if t == eos]
    if num_closed == 0 or len(closes) < num_closed:
        return None
    end = closes[num_closed - 1] + 1
    closed = record.completion_ids[-1:] == [eos] or record.finish_reason == "stop"
    return ([] if closed else [eos]) + nxt[end:]


def _render(tokenizer, messages, tools, add_generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    )


class RecordingModel(ServedModel):
    """A `ServedModel` over the trainer's engine whose requests are recorded per episode."""

    def __init__(self, engine, model, tokenizer, name, max_model_len, batcher, parser: Parser):
        super().__init__(engine, model, tokenizer, name, max_model_len)
        self.batcher = batcher
        self.parser = parser
        self.episodes: dict[str, EpisodeRecords] = {}
        self.sampling = SamplingParams()  # the rollout's; set before each rollout
        self.max_tokens_per_request = 16
        self._chat = threading.local()  # the chat messages behind the prompt being generated
        self._tokenizing = threading.Lock()  # one tokenizer, many request threads

    def configure(self, sampling: SamplingParams, max_tokens_per_request: int, context: int):
        self.sampling = sampling
        self.max_tokens_per_request = max_tokens_per_request
        self.max_model_len = context

    def episode(self) -> EpisodeRecords:
        key = current_episode.get()
        found = self.episodes.get(key) if key is not None else None
        if found is None:
            raise RequestError(
                f"no episode {key!r} is running; use the base URL the agent was given",
                status=404,
                code="episode_not_found",
            )
        return found

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        episode = self.episode()
        self._chat.value = (messages, tools)
        with self._tokenizing:
            ids = episode.continued_prompt(self.tokenizer, self.parser, messages, tools)
            return ids if ids is not None else super().render_chat(messages, tools)

    def encode(self, text: str) -> list[int]:
        self._chat.value = None
        with self._tokenizing:
            return super().encode(text)

    def max_new_tokens(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> int:
        """At most the rollout's per-request budget and the context's room, never an error:
        an agent written for a larger model asks for more than a training run gives."""
        room = self.max_model_len - len(prompt_ids)
        return min(max_tokens or room, room, self.max_tokens_per_request)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, num_top_logprobs: int = 0
    ) -> list[list[Generated]]:
        episode = self.episode()
        chat, self._chat.value = getattr(self._chat, "value", None), None
        request_index = episode.take_request()
        s = self.sampling
        stop_ids = () if s.ignore_eos else tuple(sorted({*s.stop_token_ids, *self.stop_token_ids}))
        params = replace(
            params,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            stop_token_ids=stop_ids,
            stop_strings=() if s.ignore_eos else (*params.stop_strings, *s.stop_strings),
            ignore_eos=s.ignore_eos,
            max_new_tokens=min(
                params.max_new_tokens,
                *(self.max_new_tokens(p, None, "max_tokens") for p in prompts),
            ),
        )
        groups = self.batcher.generate(prompts, params)
        visible = [
            [self._shown(p, c, params, num_top_logprobs) for c in g]
            for p, g in zip(prompts, groups)
        ]
        records = [
            _record(request_index, prompt, completion, shown.text)
            for prompt, group, shown_group in zip(prompts, groups, visible)
            for completion, shown in zip(group, shown_group)
        ]
        episode.add(records, chat)
        return visible

    def _shown(self, prompt, completion: Completion, params, k: int) -> Generated:
        if k == 0:
            return self._visible(prompt, completion, params, 0)
        with self.batcher.lock:  # scoring top logprobs runs the model: not beside the engine
            return self._visible(prompt, completion, params, k)


def _record(request_index: int, prompt: list[int], c: Completion, text: str) -> Record:
    return Record(
        request_index, list(prompt), list(c.token_ids), list(c.logprobs), c.finish_reason, text
    )
