"""The server against the official `openai` client, serving the built-in micro model: every
answer is checked against the engine driven directly with the same token ids."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.paged import PagedEngine
from reinforge.engine.simple import SimpleEngine
from reinforge.errors import ConfigError
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.server import load_served_model

from .conftest import client

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


@pytest.fixture(scope="module")
def reference():
    """An engine of its own over a fresh copy of the served weights, and its tokenizer."""
    path = str(builtin_path("micro", 0))
    tokenizer = load_tokenizer(path)
    return PagedEngine(load_model(path, torch.device("cpu"), torch.float32), tokenizer), tokenizer


def greedy(reference, prompt: list[int], max_tokens: int):
    engine, _ = reference
    [[completion]] = engine.generate(
        [prompt], SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    )
    return completion


def chat_prompt(tokenizer, messages) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )


def post(url: str, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_lists_the_served_model(micro_url, micro_served):
    api = client(micro_url)
    assert [m.id for m in api.models.list().data] == ["micro"]
    assert api.models.retrieve("micro").id == "micro"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")


def test_chat_greedy_equals_the_engine(micro_url, reference):
    _, tokenizer = reference
    prompt = chat_prompt(tokenizer, MESSAGES)
    expected = greedy(reference, prompt, 24)
    reply = client(micro_url).chat.completions.create(
        model="micro", messages=MESSAGES, temperature=0, max_tokens=24
    )
    [choice] = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(prompt) + len(expected.token_ids)


def test_n_sampled_choices_equal_the_engine_with_the_same_seed(micro_url, reference):
    engine, tokenizer = reference
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=7)
    [expected] = engine.generate([chat_prompt(tokenizer, MESSAGES)], params)
    reply = client(micro_url).chat.completions.create(
        model="micro", messages=MESSAGES, n=3, temperature=1.0, max_tokens=12, seed=7
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert texts == [c.text for c in expected]
    assert len(set(texts)) == 3  # n independent samples, not one copied
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in expected)


def test_logprobs_are_the_engines_with_top_alternatives(micro_url, reference):
    _, tokenizer = reference
    expected = greedy(reference, chat_prompt(tokenizer, MESSAGES), 10)
    reply = client(micro_url).chat.completions.create(
        model="micro",
        messages=MESSAGES,
        temperature=0,
        max_tokens=10,
        logprobs=True,
        top_logprobs=3,
    )
    entries = reply.choices[0].logprobs.content
    assert [tokenizer.decode([t]) for t in expected.token_ids] == [e.token for e in entries]
    assert [e.logprob for e in entries] == pytest.approx(expected.logprobs, abs=1e-4)
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
    plain = client(micro_url).chat.completions.create(
        model="micro", messages=MESSAGES, temperature=0, max_tokens=10
    )
    assert plain.choices[0].logprobs is None


def test_completions_with_text_and_token_prompts(micro_url, reference):
    _, tokenizer = reference
    prompt = tokenizer.encode("The answer is")
    expected = greedy(reference, prompt, 6)
    api = client(micro_url)
    by_text = api.completions.create(
        model="micro", prompt="The answer is", max_tokens=6, temperature=0, logprobs=2
    )
    [choice] = by_text.choices
    assert choice.text == expected.text
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert by_text.usage.prompt_tokens == len(prompt)
    two = api.completions.create(
        model="micro", prompt=[prompt, prompt[:2]], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in two.choices] == [0, 1, 2, 3]  # prompt-major, as OpenAI orders
    assert [c.text for c in two.choices[:2]] == [expected.text] * 2
    assert two.usage.prompt_tokens == len(prompt) + 2


def test_concurrent_requests_are_served_one_engine_call_at_a_time(micro_url, reference):
    _, tokenizer = reference
    expected = greedy(reference, chat_prompt(tokenizer, MESSAGES), 16).text
    api = client(micro_url)
    results: list[str | None] = [None] * 4

    def ask(i: int) -> None:
        reply = api.chat.completions.create(
            model="micro", messages=MESSAGES, temperature=0, max_tokens=16, n=1 + i
        )
        results[i] = reply.choices[-1].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [expected] * 4


def test_stream_usage_chunk(micro_url):
    chunks = list(
        client(micro_url).chat.completions.create(
            model="micro",
            messages=MESSAGES,
            temperature=0,  # greedy repeats a newline: no early end of turn
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_openai_client_sees_an_openai_error(micro_url):
    with pytest.raises(openai.BadRequestError) as bad:
        client(micro_url).chat.completions.create(model="micro", messages=MESSAGES, temperature=3)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "temperature"
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        client(micro_url).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert missing.value.body["code"] == "model_not_found"


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {"model": "micro"}, 400, "messages"),
        ("/v1/chat/completions", {"model": "micro", "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "x", "messages": USER}, 404, "model"),
        ("/v1/chat/completions", b'{"model": "micro", "messages": [', 400, None),
        ("/v1/chat/completions", b"[1, 2", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),  # JSON, but not an object
        ("/v1/chat/completions", {"model": "micro", "messages": USER, "n": 0}, 400, "n"),
        ("/v1/chat/completions", {"model": "micro", "messages": USER, "n": 999}, 400, "n"),
        ("/v1/chat/completions", {"model": "micro", "messages": USER, "top_p": 0}, 400, "top_p"),
        (
            "/v1/chat/completions",
            {"model": "micro", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            {"model": "micro", "messages": [{"role": "user"}]},
            400,
            "messages[0]",
        ),
        (
            "/v1/chat/completions",
            {"model": "micro", "messages": USER, "max_tokens": 10_000},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": "micro", "messages": [{"role": "user", "content": "x" * 300}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "micro", "messages": USER, "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "micro", "messages": USER, "presence_penalty": 0.5},
            400,
            "presence_penalty",
        ),
        ("/v1/completions", {"model": "micro", "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": "micro", "prompt": [1, 10**6]}, 400, "prompt"),
        ("/v1/completions", {"model": "micro", "prompt": "a", "logprobs": 99}, 400, "logprobs"),
        ("/v1/completions", {"model": "micro", "prompt": "a", "echo": True}, 400, "echo"),
        ("/v1/nowhere", {}, 404, None),
    ],
)
def test_bad_requests_get_openai_error_bodies(micro_url, path, body, status, param):
    got_status, got = post(micro_url, path, body)
    assert got_status == status
    assert set(got) == {"error"}
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["param"] == param
    assert got["error"]["message"] and "Traceback" not in got["error"]["message"]


def test_engine_choice(micro_served, reference):
    _, tokenizer = reference
    path = str(builtin_path("micro", 0))
    assert isinstance(micro_served.engine, PagedEngine)  # 'auto' on a Qwen2 model
    simple = load_served_model(path, "simple", max_model_len=64)
    assert isinstance(simple.engine, SimpleEngine)
    assert simple.max_model_len == 64
    prompt = chat_prompt(tokenizer, MESSAGES)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    [[paged_out]] = micro_served.generate([prompt], params)
    [[simple_out]] = simple.generate([prompt], params)
    assert simple_out.token_ids == paged_out.token_ids
    with pytest.raises(ConfigError, match="engine = 'vllm' is unknown"):
        load_served_model(path, "vllm")
    with pytest.raises(ConfigError, match="at most 256"):
        load_served_model(path, max_model_len=4096)
