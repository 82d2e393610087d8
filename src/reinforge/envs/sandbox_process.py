"""One sandboxed run as a process (`envs.sandbox`): the limits, the launcher started under them
in a clean environment and its own process group, stdout and stderr read under the wall and
output caps while the call's memory (and, without private mounts, its work dir) is polled, the
exit classified into a `SandboxResult`, and the cleanup (the tree killed, the work dir removed).

The wall clock starts when the launcher reports that the program is about to start (the status
pipe), so time spent starting bwrap on a busy host is not charged to the code; the launcher
itself gets `_STARTUP_SECONDS` more.

`killed_reason` is the limit that stopped the code: "wall", "output", "memory" (the call's PSS
over memory_mb) and "disk" (the work dir over max_disk_mb) are our kills; "cpu" and "file_size"
come from the exit signal; "memory", "file_size", "disk" and "processes" are also read from
Python's error text in stderr (MemoryError, EFBIG, ENOSPC, EAGAIN from fork): best effort, for
reporting only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Protocol

from reinforge.envs.sandbox_isolation import bwrap_prefix, private_mounts_spec
from reinforge.envs.sandbox_launcher import LAUNCHER
from reinforge.envs.sandbox_monitor import (
    POLL_SECONDS,
    descendants,
    kill_tree,
    memory_bytes,
    tmpfs_bytes,
    tree_bytes,
)
from reinforge.errors import ConfigError

_DRAIN_SECONDS = 0.2  # after the code exits, how long a background child may hold its pipes
_STARTUP_SECONDS = 30.0  # most time from spawning to the program's start (bwrap, namespaces)
_MIB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 10.0
    wall_seconds: float = 20.0
    memory_mb: int = 1024  # the call's processes together (PSS), and each one's address space
    max_output_bytes: int = 64 * 1024  # stdout + stderr together
    max_file_mb: int = 16
    max_disk_mb: int = 64  # the work dir (/tmp) and /dev/shm, each
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
    killed_reason: (
        str | None
    )  # cpu | wall | memory | disk | output | file_size | processes | signal
    truncated: bool  # output went past max_output_bytes and was cut there
    seconds: float  # from the program's start
    backend: str
    network_isolated: bool
    filesystem: str  # "isolated" (bwrap) | "private" (rlimit as root) | "host"
    status: dict = field(default_factory=dict)  # what the launcher reported

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


class SandboxSettings(Protocol):
    """What a run reads of `envs.sandbox.Sandbox` (which imports this module, not the reverse)."""

    limits: SandboxLimits
    python: str  # the interpreter the code runs under
    bwrap: str | None
    bwrap_sizes_tmpfs: bool
    is_root: bool


def run_program(
    sandbox: SandboxSettings, backend: str, code_fd: int, workdir: str, uid: int | None
) -> SandboxResult:
    limits, is_bwrap = sandbox.limits, backend == "bwrap"
    status_r, status_w = os.pipe()
    in_tmp = "/tmp/" + os.path.basename(workdir)  # under the private /tmp, where there is one
    disk_bytes = limits.max_disk_mb * _MIB
    spec = _launch_spec(sandbox, is_bwrap, uid, workdir, in_tmp)
    spec.update(status_fd=status_w, code_fd=code_fd, code_bytes=os.fstat(code_fd).st_size)
    argv = [sandbox.python, "-I", "-S", "-c", LAUNCHER]
    if is_bwrap:
        sized = disk_bytes if sandbox.bwrap_sizes_tmpfs else None
        argv = [*bwrap_prefix(sandbox.bwrap, sandbox.python, sandbox.is_root, sized), *argv]
    proc = subprocess.Popen(
        [*argv, json.dumps(spec)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=workdir,
        env=clean_env(in_tmp if is_bwrap else workdir, sandbox.python),
        start_new_session=True,  # its own process group, so one killpg reaches its children
        pass_fds=(status_w, code_fd),
    )
    os.close(status_w)
    watch = _Watch(proc, limits, status_r, None if is_bwrap else workdir)
    watch.poll_tmpfs = is_bwrap and not sandbox.bwrap_sizes_tmpfs
    try:
        stdout, stderr, truncated, reason = watch.collect()
    finally:
        kill_tree(proc.pid)
        proc.wait()
        os.close(status_r)
    seconds = time.monotonic() - (watch.started or watch.spawned)
    exit_code = proc.returncode
    if exit_code > 128:  # bwrap and the launcher report death by signal N as 128 + N
        exit_code = 128 - exit_code
    out, err = (b.decode("utf-8", errors="replace") for b in (stdout, stderr))
    reason = reason or _killed_reason(exit_code, err)
    status = watch.status
    private = status.get("namespaces", False)
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
        filesystem="isolated" if is_bwrap else "private" if private else "host",
        status=status,
    )


def _launch_spec(
    sandbox: SandboxSettings, is_bwrap: bool, uid: int | None, workdir: str, in_tmp: str
) -> dict:
    """What the launcher does (envs/sandbox_launcher.py), less the file descriptors."""
    disk_bytes = sandbox.limits.max_disk_mb * _MIB
    return {
        "network_isolated": is_bwrap,
        "unshare_net": not is_bwrap,
        "mounts": private_mounts_spec(sandbox.python, disk_bytes)
        if uid is not None and not is_bwrap
        else None,
        "fork": not is_bwrap,
        "rlimits": _rlimits(sandbox.limits, uid),
        "uid": uid,
        "workdir": in_tmp if is_bwrap else workdir,
        "private_workdir": in_tmp,  # used where the launcher made private mounts
        "parent_pid": None if is_bwrap else os.getpid(),  # bwrap has --die-with-parent
        "argv": [sandbox.python, "-I", "-B", "-u", "main.py"],
    }


class _Watch:
    """Reads one run's pipes until they close, a limit is hit or the deadline passes."""

    def __init__(self, proc, limits: SandboxLimits, status_fd: int, host_workdir: str | None):
        self.proc, self.limits, self.status_fd = proc, limits, status_fd
        self.host_workdir = host_workdir
        self.spawned = time.monotonic()
        self.started: float | None = None  # when the launcher handed over to the program
        self.poll_tmpfs = False  # bwrap without --size: measure /tmp and /dev/shm inside
        self.status: dict = {}

    def deadline(self) -> float:
        if self.started is None:
            return self.spawned + _STARTUP_SECONDS + self.limits.wall_seconds
        return self.started + self.limits.wall_seconds

    def collect(self) -> tuple[bytes, bytes, bool, str | None]:
        proc, max_bytes = self.proc, self.limits.max_output_bytes
        assert proc.stdout is not None and proc.stderr is not None
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        buffers = {out_fd: bytearray(), err_fd: bytearray()}
        num_bytes, exited_at, reason, truncated = 0, None, None, False
        with selectors.DefaultSelector() as selector:
            for fd in (out_fd, err_fd, self.status_fd):
                selector.register(fd, selectors.EVENT_READ)
            next_poll = time.monotonic()
            while reason is None and len(selector.get_map()) > self._num_status(selector):
                now = time.monotonic()
                if now >= self.deadline():
                    reason = "wall"
                    break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > _DRAIN_SECONDS:
                    break  # a background child holds the pipes open; it dies with the tree
                if now >= next_poll and exited_at is None:
                    reason, next_poll = self.over_limit(), now + POLL_SECONDS
                    if reason is not None:
                        break
                timeout = min(self.deadline(), next_poll) - now
                for key, _ in selector.select(timeout=max(timeout, 0.001)):
                    chunk = os.read(key.fd, 65536)
                    if key.fd == self.status_fd:
                        self.on_status(chunk)
                        selector.unregister(key.fd)
                        continue
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    buffers[key.fd] += chunk[: max(0, max_bytes - num_bytes)]
                    num_bytes += len(chunk)
                    if num_bytes > max_bytes:
                        reason, truncated = "output", True
                        break
        if reason is None:
            try:
                proc.wait(timeout=max(0.0, self.deadline() - time.monotonic()))
            except subprocess.TimeoutExpired:  # closed its pipes but kept running
                reason = "wall"
        return bytes(buffers[out_fd]), bytes(buffers[err_fd]), truncated, reason

    def _num_status(self, selector: selectors.BaseSelector) -> int:
        return int(self.status_fd in selector.get_map())

    def on_status(self, chunk: bytes) -> None:
        self.started = time.monotonic()
        self.status = json.loads(chunk) if chunk else {}  # EOF: the launcher died first

    def over_limit(self) -> str | None:
        pids = descendants(self.proc.pid)
        if memory_bytes(pids) > self.limits.memory_mb * _MIB:
            return "memory"
        disk = self.limits.max_disk_mb * _MIB
        if self.poll_tmpfs and pids and tmpfs_bytes(pids[0], ("tmp", "dev/shm")) > disk:
            return "disk"
        if (
            self.host_workdir is not None
            and not self.status.get("namespaces")  # else a size-capped tmpfs holds it
            and tree_bytes(self.host_workdir, disk) > disk
        ):
            return "disk"
        return None


def _killed_reason(exit_code: int, stderr: str) -> str | None:
    if exit_code == 0:
        return None
    if exit_code == -signal.SIGXCPU:
        return "cpu"
    if exit_code == -signal.SIGXFSZ or "[Errno 27] File too large" in stderr:
        return "file_size"
    if "[Errno 28] No space left on device" in stderr:
        return "disk"
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
    return [
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits.memory_mb * _MIB, limits.memory_mb * _MIB),
        ("RLIMIT_FSIZE", limits.max_file_mb * _MIB, limits.max_file_mb * _MIB),
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


def clean_env(workdir: str, python: str) -> dict[str, str]:
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


def kill_uid(python: str, uid: int) -> None:
    """kill(-1) sent as the run's uid reaches every process that uid owns, even ones that left
    the process group with setsid(): the fallback where the kernel refused a pid namespace."""
    code = (
        f"import os\nos.setgid({uid}); os.setuid({uid})\n"
        "try: os.kill(-1, 9)\nexcept ProcessLookupError: pass\n"
    )
    subprocess.run([python, "-I", "-S", "-c", code], env={}, check=True)


def remove_tree(path: str) -> None:
    import shutil

    # the code may have left folders without write or search permission for us (non-root)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)
