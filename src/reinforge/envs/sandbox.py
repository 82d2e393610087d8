"""Run untrusted Python (model-written code) in a separate, limited process.

Contract: `Sandbox(backend, limits).run(code)` writes `code` to `main.py` in a fresh temporary
directory, runs it with this interpreter under the limits, and returns a `SandboxResult` (stdout,
stderr, exit code, which limit stopped it, whether output was truncated, what isolation held).
It never raises for anything the code does. Constructing a `Sandbox` runs one empty program
through the backend (once per process) and raises `ConfigError` if that fails: an explicitly
configured backend fails closed, never silently downgrades; `auto` picks bwrap when it works,
else rlimit, and logs which. When `run` returns, the directory is deleted and every process the
code started has been sent SIGKILL (the table in envs/sandbox_isolation.py says how far that
reaches).

Limits (every backend): CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later), wall
seconds (we kill the process group), address space (RLIMIT_AS), stdout+stderr bytes (we stop
reading at the cap and kill), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC), open files;
no core dumps. The environment is rebuilt from nothing (PATH, HOME=TMPDIR=the work dir, LANG,
thread counts) and the code runs with `python -I -B -u`, so PYTHON* variables, the user site and
the caller's secrets do not reach it. The limits are applied by a small launcher
(envs/sandbox_launcher.py, sent to the child as source) that runs before exec'ing the code, not
by `preexec_fn`, which can deadlock in a process with threads (the trainer has many).

This module holds the contract: `Sandbox` (choosing and checking the backend), the `python` tool
and what the model reads of a result. One run's process, its limits and its result are in
envs/sandbox_process.py; what each backend isolates, per platform, and the bwrap and mount
arguments that do it in envs/sandbox_isolation.py.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable

from reinforge.envs.sandbox_process import (
    SandboxLimits,
    SandboxResult,
    kill_uid,
    remove_tree,
    run_program,
)
from reinforge.envs.tools import ToolOutput
from reinforge.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "bwrap", "rlimit")
_checked: dict[
    tuple, str | None
] = {}  # (backend, bwrap, python, root) -> None if it works, else why


class Sandbox:
    """Runs code under one resolved backend; holds no state between runs."""

    def __init__(self, backend: str = "auto", limits: SandboxLimits | None = None):
        if backend not in BACKENDS:
            raise ConfigError(f"sandbox backend={backend!r} is unknown; use one of {BACKENDS}")
        if not sys.platform.startswith("linux"):
            raise ConfigError(
                f"sandbox backend={backend!r}: the code sandbox runs on Linux only (here: "
                f"{sys.platform}); run environments that execute code on a Linux machine"
            )
        self.limits = limits or SandboxLimits()
        self.python = sys.executable
        self.is_root = os.geteuid() == 0
        self.bwrap = shutil.which("bwrap")
        self.backend = self._resolve(backend)
        log.info("sandbox backend: %s (configured: %s)", self.backend, backend)

    def run(self, code: str) -> SandboxResult:
        return self._run_as(self.backend, code)

    def _run_as(self, backend: str, code: str) -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="reinforge-sandbox-")
        uid = secrets.randbelow(1 << 30) + (1 << 30) if self.is_root else None
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(os.path.join(workdir, "main.py"), uid, uid)
            return run_program(self, backend, workdir, uid)
        finally:
            if uid is not None and backend == "rlimit":  # bwrap's pid namespace did this
                kill_uid(self.python, uid)
            remove_tree(workdir)

    def _resolve(self, backend: str) -> str:
        if backend in ("auto", "bwrap"):
            problem = self._problem("bwrap")
            if problem is None:
                return "bwrap"
            if backend == "bwrap":
                raise ConfigError(f"sandbox backend='bwrap' cannot run here: {problem}")
            log.warning("sandbox: bwrap unusable (%s); using backend='rlimit'", problem)
        problem = self._problem("rlimit")
        if problem is not None:
            raise ConfigError(
                f"sandbox backend='rlimit' cannot run here: {problem}; install bubblewrap "
                "(apt-get install bubblewrap) and set backend='bwrap'"
            )
        return "rlimit"

    def _problem(self, backend: str) -> str | None:
        """Why `backend` cannot run an empty program here, or None (checked once per process)."""
        if backend == "bwrap" and self.bwrap is None:
            return (
                "`bwrap` is not on PATH; install bubblewrap (apt-get install bubblewrap) or "
                "set backend='rlimit' (no filesystem isolation)"
            )
        key = (backend, self.bwrap, self.python, self.is_root)
        if key not in _checked:
            result = self._run_as(backend, "")
            _checked[key] = None if result.ok else (result.stderr.strip() or str(result))
        return _checked[key]


def make_python_tool(sandbox: Sandbox | None = None) -> Callable[[str], ToolOutput]:
    """The `python` tool for a tool env: runs the model's program in `sandbox` (a default one if
    None) and returns what it printed, with a note when a limit stopped it."""
    box = sandbox or Sandbox()

    def python(code: str) -> ToolOutput:
        """Run a Python program in a fresh sandbox and return what it printed.

        Each call starts a new interpreter, so nothing persists between calls; there is no
        network. Print the values you need.

        Args:
            code: A complete Python program.
        """
        result = box.run(code)
        return ToolOutput(
            format_result(result, box.limits),
            is_error=not result.ok,
            is_timeout=result.timed_out,
        )

    return python


def format_result(result: SandboxResult, limits: SandboxLimits) -> str:
    """What the model reads: output, errors, then one bracketed note about how it ended."""
    text = (result.stdout + result.stderr).rstrip("\n")
    notes = {
        "cpu": f"stopped: CPU time limit of {limits.cpu_seconds:g} s",
        "wall": f"stopped: time limit of {limits.wall_seconds:g} s",
        "memory": f"stopped: memory limit of {limits.memory_mb} MB",
        "output": f"output truncated at {limits.max_output_bytes} bytes; the program was stopped",
        "file_size": f"stopped: file size limit of {limits.max_file_mb} MB",
        "processes": f"stopped: process limit of {limits.max_processes}",
        "signal": "killed by a signal",
    }
    if result.killed_reason is not None:
        note = notes[result.killed_reason]
    elif result.exit_code != 0:
        note = f"exit code {result.exit_code}"
    else:
        return text or "(no output)"
    return f"{text}\n[{note}]" if text else f"[{note}]"
