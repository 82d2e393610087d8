"""Real servers for the server tests: uvicorn on a loopback port in a background thread, serving
the built-in micro model and a copy of it tuned on CPU to answer two prompts word for word (one
with a tool call), so the tool-call, stop-string and streaming paths see known text.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import uvicorn
from openai import OpenAI

from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.server import ServedModel, create_app, load_served_model
from reinforge.server.limits import ServerLimits
from tests.padded_reference import pad_batch, token_logprobs

WEATHER_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
HELLO_MESSAGES = [{"role": "user", "content": "Say hello."}]
HELLO_REPLY = "Hello there, my friend. Nice day!"


def start_server(served: ServedModel, limits: ServerLimits | None = None) -> Iterator[str]:
    """Serve `served` on 127.0.0.1 (a free port bound here, so no race); yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(served, limits=limits)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def micro_served() -> ServedModel:
    return load_served_model(str(builtin_path("micro", 0)), served_model_name="micro")


@pytest.fixture(scope="session")
def micro_url(micro_served) -> Iterator[str]:
    yield from start_server(micro_served)


def tune(source: Path, out: Path, max_steps: int = 300) -> None:
    """Teach the micro model the two replies above (Adam, until every reply token has probability
    > 0.5, so greedy decoding reproduces them with a margin), then save it like any checkpoint."""
    tokenizer = load_tokenizer(str(source))
    model = load_model(str(source), torch.device("cpu"), torch.float32)
    prompts, replies = [], []
    for messages, reply in [(WEATHER_MESSAGES, WEATHER_CALL), (HELLO_MESSAGES, HELLO_REPLY)]:
        prompts.append(
            list(
                tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_dict=False
                )
            )
        )
        replies.append([*tokenizer.encode(reply), tokenizer.eos_token_id])
    batch = pad_batch(prompts, replies, tokenizer.pad_token_id, "cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # tensors this small only pay for thread hand-offs, badly on a busy box
    try:
        for _ in range(max_steps):
            logprobs_BT, _ = token_logprobs(model, batch)
            if logprobs_BT.detach().masked_fill(batch.mask_BT == 0, 0.0).min() > math.log(0.5):
                break
            loss = -(logprobs_BT * batch.mask_BT).sum() / batch.mask_BT.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            raise AssertionError(f"the micro model did not learn the replies in {max_steps} steps")
    finally:
        torch.set_num_threads(num_threads)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="session")
def tuned_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tuned") / "model"
    tune(builtin_path("micro", 0), out)
    return out


@pytest.fixture(scope="session")
def tuned_url(tuned_dir) -> Iterator[str]:
    yield from start_server(load_served_model(str(tuned_dir), served_model_name="tuned"))
