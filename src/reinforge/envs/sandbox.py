"""Run untrusted Python (model-written code) in a separate, limited process.

Contract: `Sandbox(backend, limits).run(code)` runs `code` as `main.py` in a fresh, private work
dir with this interpreter under the limits, and returns a `SandboxResult` (stdout, stderr, exit
code, which limit stopped it, whether output was truncated, what isolation held). It never raises
for anything the code does. When `run` returns, every process the code started is dead and
everything it wrote is gone; nothing of one call is visible to the next.

Backends (what each contains: envs/sandbox_isolation.py, docs/security.md). "bwrap"
(bubblewrap) contains everything listed there, root or not. "rlimit" is resource limits plus
what the kernel allows without bubblewrap: as root a fresh uid in its own mount, pid and network
namespaces; without root the code runs as the caller and can reach the caller's processes and
files. So `auto` means bwrap or nothing: if bwrap cannot run here, constructing the Sandbox
raises `ConfigError` naming `sandbox.backend`, and only an explicit "rlimit" runs without it;
then `containment_notes()` (shown in the run summary) says what that backend leaves open. An
explicit backend that cannot run here fails the same way, never silently downgrades. Each
backend is checked once per process by running an empty program.

Limits (every backend): CPU seconds (RLIMIT_CPU), wall seconds from the program's start (the
tree is killed), memory: the PSS of all the call's processes together (polled) and each one's
address space (RLIMIT_AS), disk: size-capped private tmpfs for the work dir and /dev/shm (polled
size of the work dir where there are no private mounts), stdout+stderr bytes, file size,
processes, open files; no core dumps. The environment is rebuilt from nothing and the code runs
with `python -I -B -u`, so PYTHON* variables, the user site and the caller's secrets do not reach
it. The limits are applied by a small launcher (envs/sandbox_launcher.py) that runs before
exec'ing the code, not by `preexec_fn`, which can deadlock in a process with threads.

Off Linux there is no sandbox: `Sandbox` refuses, saying so, unless `allow_uncontained=True`
(`sandbox.allow_uncontained`); then the code runs as the user with only the wall and output caps.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable

from reinforge.envs.sandbox_isolation import bwrap_has_size, uncontained
from reinforge.envs.sandbox_process import (
    SandboxLimits,
    SandboxResult,
    kill_uid,
    remove_tree,
    run_program,
)
from reinforge.envs.sandbox_unconfined import run_unconfined
from reinforge.envs.tools import ToolOutput
from reinforge.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "bwrap", "rlimit")
_checked: dict[tuple, SandboxResult] = {}  # (backend, bwrap, python, root) -> the probe's result
_has_size: dict[str, bool] = {}  # bwrap path -> whether it has --size (bubblewrap >= 0.7)
_notes: list[str] = []  # what the sandboxes built in this process leave open, for the summary


def containment_notes() -> list[str]:
    """One line per sandbox built in this process that leaves something uncontained."""
    return list(_notes)


class Sandbox:
    """Runs code under one resolved backend; holds no state between runs."""

    def __init__(
        self,
        backend: str = "auto",
        limits: SandboxLimits | None = None,
        allow_uncontained: bool = False,
    ):
        if backend not in BACKENDS:
            raise ConfigError(f"sandbox.backend={backend!r} is unknown; use one of {BACKENDS}")
        self.limits = limits or SandboxLimits()
        self.python = sys.executable
        self.is_root = os.name == "posix" and os.geteuid() == 0
        self.bwrap = shutil.which("bwrap")
        self.bwrap_sizes_tmpfs = self.bwrap is not None and _bwrap_has_size(self.bwrap)
        if not sys.platform.startswith("linux"):
            self.backend = _unconfined(backend, allow_uncontained)
            self.uncontained = {
                "everything": "run as you (your files, network and processes): on "
                f"{sys.platform} only the time and output limits hold"
            }
        else:
            self.backend = self._resolve(backend)
            status = _checked[self._key(self.backend)].status
            self.uncontained = uncontained(self.backend, self.is_root, status)
        note = self.note()
        if note is not None and note not in _notes:
            _notes.append(note)
            log.warning("%s", note)
        log.info("sandbox backend: %s (configured: %s)", self.backend, backend)

    def note(self) -> str | None:
        """What this backend leaves open here, as one line; None if nothing."""
        if not self.uncontained:
            return None
        who = "as root" if self.is_root else "without root (it cannot change uid)"
        if self.backend == "unconfined":
            who = "(sandbox.allow_uncontained = true)"
        gaps = "; ".join(self.uncontained.values())
        return f"sandbox.backend = {self.backend!r} {who} lets model-written code {gaps}"

    def run(self, code: str) -> SandboxResult:
        if self.backend == "unconfined":
            workdir = tempfile.mkdtemp(prefix="reinforge-sandbox-")
            try:
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                    f.write(code)
                return run_unconfined(self, workdir)
            finally:
                remove_tree(workdir)
        return self._run_as(self.backend, code)

    def _run_as(self, backend: str, code: str) -> SandboxResult:
        workdir = tempfile.mkdtemp(prefix="reinforge-sandbox-")
        uid = secrets.randbelow(1 << 30) + (1 << 30) if self.is_root else None
        code_fd = os.memfd_create("main.py")
        try:
            os.write(code_fd, code.encode("utf-8"))
            if uid is not None:
                os.chown(workdir, uid, uid)
            result = run_program(self, backend, code_fd, workdir, uid)
            if uid is not None and backend == "rlimit" and not result.status.get("namespaces"):
                kill_uid(self.python, uid)  # no pid namespace died with the program
            return result
        finally:
            os.close(code_fd)
            remove_tree(workdir)

    def _resolve(self, backend: str) -> str:
        if backend in ("auto", "bwrap"):
            problem = self._problem("bwrap")
            if problem is None:
                return "bwrap"
            what = "auto (bubblewrap or nothing)" if backend == "auto" else "'bwrap'"
            raise ConfigError(
                f"sandbox.backend = {what} cannot run here: {problem}. Install bubblewrap "
                "(apt-get install bubblewrap) and allow it user namespaces, or set "
                'sandbox.backend = "rlimit" to run model-written code with resource limits only '
                f"({self._rlimit_gaps()})"
            )
        problem = self._problem("rlimit")
        if problem is not None:
            raise ConfigError(
                f'sandbox.backend = "rlimit" cannot run here: {problem}; install bubblewrap '
                '(apt-get install bubblewrap) and set sandbox.backend = "bwrap"'
            )
        return "rlimit"

    def _rlimit_gaps(self) -> str:
        who = "as root it" if self.is_root else "without root it cannot change uid, so it"
        return f"{who} lets the code " + "; ".join(uncontained("rlimit", self.is_root).values())

    def _key(self, backend: str) -> tuple:
        return (backend, self.bwrap, self.python, self.is_root)

    def _problem(self, backend: str) -> str | None:
        """Why `backend` cannot run an empty program here, or None (checked once per process)."""
        if backend == "bwrap" and self.bwrap is None:
            return "`bwrap` is not on PATH"
        key = self._key(backend)
        if key not in _checked:
            _checked[key] = self._run_as(backend, "")
        result = _checked[key]
        return None if result.ok else (result.stderr.strip() or str(result))


def _bwrap_has_size(bwrap: str) -> bool:
    if bwrap not in _has_size:
        _has_size[bwrap] = bwrap_has_size(bwrap)
    return _has_size[bwrap]


def _unconfined(backend: str, allow: bool) -> str:
    if not allow:
        raise ConfigError(
            f"sandbox.backend = {backend!r}: the python tool has no sandbox on {sys.platform} "
            "(no namespaces, no bubblewrap): model-written code would run as you, able to read "
            "and change your files, use the network and stop your processes, with only time and "
            "output limits. Run environments that execute code on Linux, or set "
            "sandbox.allow_uncontained = true to run it anyway"
        )
    return "unconfined"


def sandbox_from_config(section) -> Sandbox:
    """The Sandbox of a `[task.sandbox]` section (config.envs.SandboxSection)."""
    limits = SandboxLimits(
        cpu_seconds=section.cpu_seconds,
        wall_seconds=section.wall_seconds,
        memory_mb=section.memory_mb,
        max_output_bytes=section.max_output_bytes,
        max_file_mb=section.max_file_mb,
        max_disk_mb=section.max_disk_mb,
        max_processes=section.max_processes,
    )
    return Sandbox(section.backend, limits, section.allow_uncontained)


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
        "memory": f"stopped: memory limit of {limits.memory_mb} MB (all its processes together)",
        "disk": f"stopped: disk limit of {limits.max_disk_mb} MB",
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
