"""`reinforge serve MODEL` as a user runs it: a real subprocess on a loopback port, driven by the
official `openai` client (a tool call, a malformed request), stopped with Ctrl-C; and MODEL as a
run directory whose checkpoint is a LoRA adapter."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from reinforge.errors import ExitCode

from ..conftest import REPO
from ..test_export import IDS, lora_run
from .conftest import WEATHER_MESSAGES, client
from .test_tuned_model import TOOLS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"reinforge serve exited: {proc.stdout.read()}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    raise AssertionError("reinforge serve did not start listening")


@pytest.fixture(scope="module")
def served_url(tuned_dir):
    port = free_port()
    command = [sys.executable, "-m", "reinforge.cli", "serve", str(tuned_dir), "--port", str(port)]
    command += ["--served-model-name", "tuned", "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_command_answers_the_openai_client_with_a_tool_call(served_url):
    url, _ = served_url
    api = client(url)
    assert [m.id for m in api.models.list().data] == ["tuned"]
    reply = api.chat.completions.create(
        model="tuned", messages=WEATHER_MESSAGES, tools=TOOLS, temperature=0, max_tokens=120
    )
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_serve_command_answers_malformed_requests_with_openai_errors(served_url):
    url, _ = served_url
    with pytest.raises(openai.BadRequestError) as bad:
        client(url).chat.completions.create(model="tuned", messages=WEATHER_MESSAGES, top_p=0)
    assert bad.value.body["param"] == "top_p" and bad.value.body["type"] == "invalid_request_error"
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=b'{"model": "tuned", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as broken:
        urllib.request.urlopen(request, timeout=30)
    body = json.loads(broken.value.read())
    assert broken.value.code == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]


def test_serve_command_stops_cleanly_on_ctrl_c(served_url):
    _, proc = served_url
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


def test_a_run_directory_with_a_lora_adapter_is_served_merged(tmp_path):
    from reinforge.server import load_served_model

    trained = lora_run(tmp_path / "run")
    served = load_served_model(str(tmp_path / "run"), device="cpu")
    with torch.no_grad():
        expected = trained.eval()(input_ids=IDS).logits
        got = served.model(input_ids=IDS).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_serve_and_export_refuse_config_settings():
    from reinforge.cli import main

    assert main(["serve", "builtin:micro", "rollout.temperature=0.5"]) == ExitCode.CONFIG_ERROR
    assert main(["export", "runs/x", "out", "run.seed=1"]) == ExitCode.CONFIG_ERROR
