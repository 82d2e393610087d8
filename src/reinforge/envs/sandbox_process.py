"""One sandboxed run as a process (`envs.sandbox`): the limits, the launcher started under them
in a clean environment and its own process group, stdout and stderr read under the wall and
output caps, the exit classified into a `SandboxResult`, and the cleanup (the group, or every
process of the run's uid, killed; the work dir removed).

`killed_reason` is the limit that stopped the code: "wall" and "output" are our kills, "cpu"
and "file_size" come from the exit signal; "memory", "file_size" and "processes" are read from
Python's error text in stderr (MemoryError, EFBIG, EAGAIN from fork): best effort, for
reporting only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reinforge.envs.sandbox_isolation import bwrap_prefix, private_mounts_spec
from reinforge.envs.sandbox_launcher import LAUNCHER
from reinforge.errors import ConfigError

if TYPE_CHECKING:
    from reinforge.envs.sandbox import Sandbox

_DRAIN_SECONDS = 0.2  # after the code exits, how long a background child may hold its pipes


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_mb: int = 1024  # address space, not resident memory: the interpreter maps ~30 MB
    max_output_bytes: int = 64 * 1024  # stdout + stderr together
    max_file_mb: int = 16
    max_processes: int = 32
    max_open_files: int = 256

    def __post_init__(self) -> None:
        for name, spec in SandboxLimits.__dataclass_fields__.items():
            if not getattr(self, name) > 0:
                raise ConfigError(
                    f"sandbox limit {name}={getattr(self, name)!r} must be > 0; "
                    f"the default {spec.default!r} works"
                )


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal (subprocess's convention)
    timed_out: bool  # the cpu or wall limit stopped it
    killed_reason: str | None  # cpu | wall | memory | output | file_size | processes | signal
    truncated: bool  # output went past max_output_bytes and was cut there
    seconds: float
    backend: str
    network_isolated: bool
    filesystem: str  # "isolated" | "private_tmp" | "host"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


def run_program(sandbox: Sandbox, backend: str, workdir: str, uid: int | None) -> SandboxResult:
    limits = sandbox.limits
    is_bwrap = backend == "bwrap"
    status_r, status_w = os.pipe()
    spec = {
        "network_isolated": is_bwrap,
        "unshare_net": not is_bwrap,
        "private_mounts": private_mounts_spec(workdir, sandbox.python)
        if uid is not None and not is_bwrap
        else None,
        "rlimits": _rlimits(limits, uid),
        "uid": uid,
        "status_fd": status_w,
        "workdir": workdir,
        "parent_pid": None if is_bwrap else os.getpid(),  # bwrap has --die-with-parent
        "argv": [sandbox.python, "-I", "-B", "-u", "main.py"],
    }
    argv = [sandbox.python, "-I", "-S", "-c", LAUNCHER]
    if is_bwrap:
        argv = [*bwrap_prefix(sandbox.bwrap, workdir, sandbox.python, sandbox.is_root), *argv]
    start = time.monotonic()
    proc = subprocess.Popen(
        [*argv, json.dumps(spec)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=_clean_env(workdir, sandbox.python),
        start_new_session=True,  # its own process group, so one killpg reaches its children
        pass_fds=(status_w,),
    )
    os.close(status_w)
    try:
        stdout, stderr, truncated, reason = _collect(
            proc, start + limits.wall_seconds, limits.max_output_bytes
        )
    finally:
        _kill_group(proc)
        proc.wait()
    seconds = time.monotonic() - start
    status = _read_status(status_r)
    exit_code = proc.returncode
    if is_bwrap and exit_code > 128:  # bwrap reports its child's death by signal N as 128 + N
        exit_code = 128 - exit_code
    out, err = (b.decode("utf-8", errors="replace") for b in (stdout, stderr))
    reason = reason or _killed_reason(exit_code, err)
    private_tmp = status.get("private_tmp", False)
    return SandboxResult(
        stdout=out,
        stderr=err,
        exit_code=exit_code,
        timed_out=reason in ("cpu", "wall"),
        killed_reason=reason,
        truncated=truncated,
        seconds=seconds,
        backend=backend,
        network_isolated=bool(status.get("network_isolated", False)),
        filesystem="isolated" if is_bwrap else "private_tmp" if private_tmp else "host",
    )


def _collect(
    proc: subprocess.Popen, deadline: float, max_bytes: int
) -> tuple[bytes, bytes, bool, str | None]:
    """Read stdout and stderr until both close, the deadline passes, or the output cap is hit."""
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    num_bytes, exited_at, reason, truncated = 0, None, None, False
    with selectors.DefaultSelector() as selector:
        for pipe in buffers:
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map() and reason is None:
            now = time.monotonic()
            if now >= deadline:
                reason = "wall"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _DRAIN_SECONDS:
                break  # a background child holds the pipes open; it dies with the group
            for key, _ in selector.select(timeout=min(deadline - now, 0.1)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fd] += chunk[: max(0, max_bytes - num_bytes)]
                num_bytes += len(chunk)
                if num_bytes > max_bytes:
                    reason, truncated = "output", True
                    break
    if reason is None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its pipes but kept running
            reason = "wall"
    return bytes(buffers[out_fd]), bytes(buffers[err_fd]), truncated, reason


def _killed_reason(exit_code: int, stderr: str) -> str | None:
    if exit_code == 0:
        return None
    if exit_code == -signal.SIGXCPU:
        return "cpu"
    if exit_code == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return "file_size"
    if "MemoryError" in stderr:
        return "memory"
    if "[Errno 11] Resource temporarily unavailable" in stderr:  # fork at RLIMIT_NPROC
        return "processes"
    if exit_code == -signal.SIGKILL:
        return "signal"
    return None


def _rlimits(limits: SandboxLimits, uid: int | None) -> list[tuple[str, int, int]]:
    cpu = math.ceil(limits.cpu_seconds)
    num_processes = limits.max_processes
    if uid is None:  # RLIMIT_NPROC counts every task of the caller's uid, the trainer's too
        num_processes += _count_user_tasks(os.getuid())
    mib = 1024 * 1024
    return [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits.memory_mb * mib, limits.memory_mb * mib),
        ("RLIMIT_FSIZE", limits.max_file_mb * mib, limits.max_file_mb * mib),
        ("RLIMIT_NPROC", num_processes, num_processes),
        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]


def _count_user_tasks(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited while we looked
            continue
        if int(fields["Uid"].split()[0]) == uid:
            count += int(fields["Threads"])
    return count


def _clean_env(workdir: str, python: str) -> dict[str, str]:
    env = {
        "PATH": f"{os.path.dirname(python)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",  # for pythons the code starts itself (ours has -B)
        "PYTHONIOENCODING": "utf-8",
    }
    # BLAS maps an arena per thread, and the address-space limit counts every one
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group already exited
        os.killpg(proc.pid, signal.SIGKILL)


def kill_uid(python: str, uid: int) -> None:
    """kill(-1) sent as the run's uid reaches every process that uid owns, even ones that left
    the process group with setsid()."""
    code = (
        f"import os\nos.setgid({uid}); os.setuid({uid})\n"
        "try: os.kill(-1, 9)\nexcept ProcessLookupError: pass\n"
    )
    subprocess.run([python, "-I", "-S", "-c", code], env={}, check=True)


def _read_status(fd: int) -> dict:
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 4096)
    except BlockingIOError:  # the launcher died before writing: claim no isolation
        data = b""
    finally:
        os.close(fd)
    return json.loads(data) if data else {}


def remove_tree(path: str) -> None:
    # the code may have left folders without write or search permission for us (non-root)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)
