"""Runs `reinforge` commands in processes forked from one that has already imported everything.

A kill -9 drill restarts a run many times; a fresh interpreter spends most of its start importing
torch and transformers (about 5 s of CPU each, 20 s on a loaded 2-core machine). Children forked
from this server start training at once. Each child runs `reinforge.cli.main` (the real command,
its own process, its own files), so killing it is killing a run.

Protocol, one JSON line each way: the client writes {"argv": [...], "log": path}; the server
answers {"pid": N}, and when that child ends (by itself or killed) {"pid": N, "returncode": rc},
with -signal for a killed child. One child at a time. EOF on stdin stops the server.

Forking is safe here because nothing has run yet: no torch op (so no OpenMP pool), no thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401

import reinforge.cli
import reinforge.preflight
import reinforge.train.rl


def child(argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        code = reinforge.cli.main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    assert threading.active_count() == 1, "forking needs a process without threads"
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request["argv"], request["log"])
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
