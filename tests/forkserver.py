"""Runs `reinforge` commands in processes forked from one that has already imported everything.

A fresh interpreter spends most of a short command's start importing torch and transformers
(about 6.5 s of CPU on the 2-core CI machine). The tests run dozens of commands, and a kill -9
drill restarts one run twenty times; children forked from this server start at once. Each child
runs `reinforge.cli.main` (the real command, its own process, its own process group, working
directory, environment and output files), so killing it is killing a run.

Client side: `ForkServer` (stdlib only; what the tests import). Server side: this file run as a
script. Protocol, one JSON line each way: the client writes {"argv", "stdout", "stderr", "cwd",
"env"}; the server answers {"pid": N} and, when that child ends (by itself or killed),
{"pid": N, "returncode": rc}, -signal for a killed child, as `subprocess` reports it. One child at
a time. EOF on stdin stops the server.

Forking is safe because the server has only imported: no torch op has run (so no OpenMP pool) and
no thread exists. Tests that must see exactly what a user's fresh `python -m reinforge.cli` does
(the README's demo, the shipped examples) pass `fresh=True` to `conftest.cli`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


class ForkServer:
    """A running server: `start` a command, `wait` for its exit code, `close` when done."""

    def __init__(self, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"},
        )
        self._buffer = b""

    def start(
        self,
        argv: list[str],
        stdout: Path,
        stderr: Path | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> int:
        """Fork a child running `reinforge ARGV`; its output goes to the files; returns its pid."""
        request = {"argv": argv, "stdout": str(stdout), "stderr": str(stderr or stdout)}
        if cwd is not None:
            request["cwd"] = str(cwd)
        if env is not None:
            request["env"] = env
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply(None)["pid"]

    def wait(self, timeout: float | None = None) -> int:
        """The exit code of the child started last; TimeoutError if it runs past `timeout`."""
        return self._reply(timeout)["returncode"]

    def kill(self, pid: int) -> None:
        """SIGKILL the child and every process it started (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def _reply(self, timeout: float | None) -> dict:
        # Lines are read off the raw pipe: a buffered reader could hold the exit line while
        # select() waits on an empty pipe.
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no reply from the fork server in {timeout} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


# ------------------------------------------------------------------------------- server side


def _child(request: dict) -> None:
    """In the forked process: become the command, then exit as its interpreter would."""
    import atexit
    import traceback

    import reinforge.cli

    os.setpgid(0, 0)  # a timeout's kill reaches what the command started
    if "env" in request:
        os.environ.clear()
        os.environ.update(request["env"])
    if "cwd" in request:
        os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the protocol stays the server's
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out
    if request["stderr"] != request["stdout"]:
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 1
    try:
        result = reinforge.cli.main(request["argv"])
        code = 0 if result is None else int(result)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _serve() -> None:
    import threading

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    import reinforge.cli
    import reinforge.preflight
    import reinforge.train.loop.rl  # noqa: F401

    for line in sys.stdin:
        assert threading.active_count() == 1, "forking needs a process without threads"
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
