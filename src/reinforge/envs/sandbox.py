"""Run untrusted Python (model-written code) in a separate, limited process.

Contract: `Sandbox(backend, limits).run(code)` writes `code` to `main.py` in a fresh temporary
directory, runs it with this interpreter under the limits, and returns a `SandboxResult` (stdout,
stderr, exit code, which limit stopped it, whether output was truncated, what isolation held).
It never raises for anything the code does. Constructing a `Sandbox` runs one empty program
through the backend (once per process) and raises `ConfigError` if that fails: an explicitly
configured backend fails closed, never silently downgrades; `auto` picks bwrap when it works,
else rlimit, and logs which. When `run` returns, the directory is deleted and every process the
code started has been sent SIGKILL (the table says how far that reaches).

Limits (every backend): CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later), wall
seconds (we kill the process group), address space (RLIMIT_AS), stdout+stderr bytes (we stop
reading at the cap and kill), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC), open files;
no core dumps. The environment is rebuilt from nothing (PATH, HOME=TMPDIR=the work dir, LANG,
thread counts) and the code runs with `python -I -B -u`, so PYTHON* variables, the user site and
the caller's secrets do not reach it. The limits are applied by a small launcher (the `_launch*`
functions below, sent to the child as source) that runs before exec'ing the code, not by
`preexec_fn`, which can deadlock in a process with threads (the trainer has many).

As root, every run gets a fresh unprivileged uid: RLIMIT_NPROC is not enforced for uid 0
(measured here: a fork bomb under `prlimit --nproc=20` ran unchecked, also inside a bwrap user
namespace), host files are not that uid's to write, and afterwards "every process of that uid"
is exactly what the code started, so even a process that left the group with setsid() is killed.
That is also why bwrap as root unshares every namespace except the user one (a user namespace
would map only uid 0, and the launcher could not drop to another uid) instead of
`--unshare-all`; without root, `--unshare-all` is used.

What each platform gets, measured in the dev container (Linux 6.18, Debian 12, bubblewrap 0.8
from apt, Python 3.11 so unshare(2) goes through ctypes; as root with CAP_SYS_ADMIN, and as uid
1000, where the kernel allows unprivileged user namespaces). `bwrap` runs there in both cases,
`unshare -n` as root; tests/envs/test_sandbox.py checks every case it can reach (it runs as root):

- bwrap, root. Network: own netns. Filesystem: a tmpfs root with /usr, the interpreter and
  /etc/ld.so.* read-only; only the work dir is writable. Processes: NPROC on a fresh uid; the
  pid namespace dies with bwrap.
- bwrap, not root (`--unshare-all`): the same, but NPROC also counts the caller's own tasks.
- rlimit, root. Network: own netns (CLONE_NEWNET). Filesystem: the host, seen by a fresh uid
  (root-owned files are read-only to it), with private empty /tmp, /var/tmp and /dev/shm (a
  mount namespace). Processes: NPROC on the fresh uid; after the run every process of that uid
  is killed.
- rlimit, not root. Network: own netns inside a user namespace (measured here; none where the
  kernel forbids unprivileged user namespaces). Filesystem: the host, as the caller, whose files
  and /proc/<pid>/environ are open to the code. Processes: NPROC counted with the caller's
  tasks; the process group is killed, so a child that called setsid() escapes.

`network_isolated` and `filesystem` ("isolated" for bwrap, "private_tmp", "host") in each result
report what that run got; where a netns or mount namespace is refused, the run goes on and says
so. If the trainer dies mid-run, the code's process dies with it (PR_SET_PDEATHSIG; under
bwrap, --die-with-parent takes the whole pid namespace).

`killed_reason` is the limit that stopped the code: "wall" and "output" are our kills, "cpu"
and "file_size" come from the exit signal; "memory", "file_size" and "processes" are read from
Python's error text in stderr (MemoryError, EFBIG, EAGAIN from fork): best effort, for
reporting only.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from reinforge.envs.tools import ToolOutput
from reinforge.errors import ConfigError

if sys.platform != "win32":  # used only by the launcher; Sandbox() refuses non-Linux hosts
    import resource

log = logging.getLogger(__name__)

BACKENDS = ("auto", "bwrap", "rlimit")
_DRAIN_SECONDS = 0.2  # after the code exits, how long a background child may hold its pipes
_ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: the rlimit backend hides them
_checked: dict[
    tuple, str | None
] = {}  # (backend, bwrap, python, root) -> None if it works, else why


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
            return _run(self, backend, workdir, uid)
        finally:
            if uid is not None and backend == "rlimit":  # bwrap's pid namespace did this
                _kill_uid(self.python, uid)
            _remove_tree(workdir)

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


def _run(sandbox: Sandbox, backend: str, workdir: str, uid: int | None) -> SandboxResult:
    limits = sandbox.limits
    is_bwrap = backend == "bwrap"
    status_r, status_w = os.pipe()
    spec = {
        "network_isolated": is_bwrap,
        "unshare_net": not is_bwrap,
        "private_mounts": _private_mounts_spec(workdir, sandbox.python)
        if uid is not None and not is_bwrap
        else None,
        "rlimits": _rlimits(limits, uid),
        "uid": uid,
        "status_fd": status_w,
        "workdir": workdir,
        "parent_pid": None if is_bwrap else os.getpid(),  # bwrap has --die-with-parent
        "argv": [sandbox.python, "-I", "-B", "-u", "main.py"],
    }
    argv = [sandbox.python, "-I", "-S", "-c", _LAUNCHER]
    if is_bwrap:
        argv = [*_bwrap_prefix(sandbox.bwrap, workdir, sandbox.python, sandbox.is_root), *argv]
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


# ----------------------------------------------------------------------------- bwrap


def _bwrap_prefix(bwrap: str | None, workdir: str, python: str, is_root: bool) -> list[str]:
    argv = [bwrap or "bwrap", "--die-with-parent", "--new-session"]
    if is_root:  # no user namespace, so the launcher can drop to a fresh uid (docstring)
        argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        argv += ["--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    made = {"/", "/proc", "/dev", "/tmp"}
    argv += _bwrap_mount("--ro-bind", "/usr", made)
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += _bwrap_mount("--ro-bind", path, made)
    for path in (*_ETC_PATHS, *_python_dirs(python)):
        if os.path.exists(path) and not any(_is_under(path, m) for m in made - {"/"}):
            argv += _bwrap_mount("--ro-bind", path, made)
    argv += _bwrap_mount("--bind", workdir, made)
    return [*argv, "--chdir", workdir, "--"]


def _bwrap_mount(op: str, path: str, made: set[str]) -> list[str]:
    """bwrap creates missing parents with mode 0700, which the dropped uid could not enter."""
    parents = []
    parent = os.path.dirname(path)
    while parent not in made:
        parents.append(parent)
        parent = os.path.dirname(parent)
    args = []
    for parent in reversed(parents):
        args += ["--perms", "0755", "--dir", parent]
        made.add(parent)
    made.add(path)
    return [*args, op, path, path]


def _python_dirs(python: str) -> list[str]:
    """The interpreter's install (and venv) folders, without nesting."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    candidates |= {os.path.realpath(p) for p in candidates}
    candidates.add(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    dirs: list[str] = []
    for path in sorted(candidates, key=len):
        if not any(_is_under(path, d) for d in dirs):
            dirs.append(path)
    return dirs


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# ----------------------------------------------------------------------------- rlimit, as root


def _private_mounts_spec(workdir: str, python: str) -> dict[str, list[str]]:
    """Which folders the launcher covers with an empty tmpfs, and which paths it binds back.

    The shared temp folders are covered so the code cannot leave files there; folders the fresh
    uid could not enter on the way to the interpreter (pyenv under /root, 0700) are covered too,
    with the interpreter bound back, since otherwise it could not even start.
    """
    covers = [d for d in _SHARED_TMP if os.path.isdir(d)]
    for path in _python_dirs(python):
        parent = os.path.dirname(path)
        while parent != "/":
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                covers.append(parent)
            parent = os.path.dirname(parent)
    covers = sorted({c for c in covers if not any(_is_under(c, o) and c != o for o in covers)})
    exposed = [p for p in (*_python_dirs(python), workdir) if any(_is_under(p, c) for c in covers)]
    return {"covers": covers, "exposed": exposed}


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group already exited
        os.killpg(proc.pid, signal.SIGKILL)


def _kill_uid(python: str, uid: int) -> None:
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


def _remove_tree(path: str) -> None:
    # the code may have left folders without write or search permission for us (non-root)
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- launcher
# These run in the child (`python -I -S -c`), before the code: stdlib only, sent as source.


def _launch(spec_json: str) -> None:
    spec = json.loads(spec_json)
    status = {"network_isolated": spec["network_isolated"], "private_tmp": False}
    if spec["unshare_net"]:
        status["network_isolated"] = _launch_try(_launch_isolate_network)
    if spec["private_mounts"] is not None:
        status["private_tmp"] = _launch_try(lambda: _launch_mounts(**spec["private_mounts"]))
    os.chdir(spec["workdir"])  # the view after any mounts
    for name, soft, hard in spec["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if spec["parent_pid"] is not None:
        _launch_die_with_parent(spec["parent_pid"])
    os.write(spec["status_fd"], json.dumps(status).encode())
    os.close(spec["status_fd"])
    os.execv(spec["argv"][0], spec["argv"])


def _launch_try(fn) -> bool:
    try:
        fn()
    except OSError:
        return False  # reported in the status, never hidden
    return True


def _launch_die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL; after setuid, which clears it; kept over exec
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(137)


def _launch_unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _launch_isolate_network() -> None:
    newnet, newuser = 0x40000000, 0x10000000
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _launch_unshare(newnet)
        return
    # an unprivileged netns needs its own user namespace; keep our ids inside it
    _launch_unshare(newuser | newnet)
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _launch_mounts(covers: list[str], exposed: list[str]) -> None:
    ms_nosuid, ms_nodev, ms_bind, ms_rec, ms_private = 2, 4, 4096, 16384, 1 << 18
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, data):
        if libc.mount(source, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount {target}: {os.strerror(err)}")

    _launch_unshare(0x00020000)  # CLONE_NEWNS
    mount(None, "/", None, ms_rec | ms_private, None)  # nothing we do reaches the host
    # opened in the new namespace (a bind source must be in ours) and before covering them
    handles = [(path, os.open(path, os.O_PATH)) for path in exposed]
    for cover in covers:
        mode = b"mode=1777" if cover == "/dev/shm" else b"mode=0755"
        mount(b"tmpfs", cover, b"tmpfs", ms_nosuid | ms_nodev, mode)
    old_umask = os.umask(0o022)
    for path, fd in handles:
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}".encode(), path, None, ms_bind | ms_rec, None)
        os.close(fd)
    os.umask(old_umask)


_LAUNCHER = "\n".join(
    [
        "import ctypes, json, os, resource, sys",
        *(
            inspect.getsource(fn)
            for fn in (
                _launch,
                _launch_try,
                _launch_die_with_parent,
                _launch_unshare,
                _launch_isolate_network,
                _launch_mounts,
            )
        ),
        "_launch(sys.argv[1])",
    ]
)
