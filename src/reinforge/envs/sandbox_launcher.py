"""The sandbox's launcher (`envs.sandbox`): the code that runs in the child (`python -I -S -c`)
before the model's program. Stdlib only: `LAUNCHER` is these functions' source, sent as the
child's `-c` argument, with a JSON spec as its one argument.

In order: isolate the network; for the rlimit backend as root, new mount and pid namespaces
(private size-capped tmpfs over /tmp, /dev/shm, /run and the folders that hold the user's
files, a fresh /proc); then fork. The child (pid 1 of the new pid namespace, where there is one)
sets the rlimits, drops to the run's uid, asks to die with its parent, writes the program
(read from a memfd) into the work dir, reports on the status pipe and execs the program. The
parent waits for it, then kills whatever is left: with a pid namespace the kernel does that when
its pid 1 exits; without one (rlimit, not root) the parent is a child subreaper, so orphans of
the program become its children and are killed one generation at a time. The parent exits with
the program's exit code, or 128 + N for death by signal N (as bwrap does). Under bwrap (which
has its own pid namespace and init) the launcher does not fork: it execs the program itself.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import signal
import sys

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWUSER, _CLONE_NEWNET = (
    0x00020000,
    0x20000000,
    0x10000000,
    0x40000000,
)


def _launch(spec_json: str) -> None:
    spec = json.loads(spec_json)
    status = {"network_isolated": spec["network_isolated"], "namespaces": False}
    if spec["parent_pid"] is not None:  # die with the trainer (bwrap: --die-with-parent)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != spec["parent_pid"]:  # the trainer died before the line above
            os._exit(137)
    if spec["unshare_net"]:
        status["network_isolated"] = _launch_try(_launch_isolate_network)
    if spec["mounts"] is not None:
        status["namespaces"] = _launch_try(lambda: _launch_mounts(**spec["mounts"]))
    if spec["fork"]:
        subreaper = not status["namespaces"]
        if subreaper and sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)
        spec["launcher_pid"] = os.getpid()
        pid = os.fork()
        if pid:
            _launch_supervise(pid, subreaper, spec["status_fd"])
        if status["namespaces"]:  # pid 1 of the new pid namespace: its own /proc, and stays
            # its init (the kernel ignores signals to an init that has no handler: SIGXCPU too)
            _launch_mount(b"proc", "/proc", b"proc", 2 | 4 | 8, None)  # nosuid nodev noexec
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            spec["launcher_pid"] = os.getpid()
            pid = os.fork()
            if pid:
                _launch_supervise(pid, False, spec["status_fd"])
    _launch_program(spec, status)


def _launch_program(spec: dict, status: dict) -> None:
    import resource  # Unix only: imported in the child, so the package imports on Windows

    for name, soft, hard in spec["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["uid"] is not None:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if "launcher_pid" in spec:  # after setuid, which clears it; kept over exec
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != spec["launcher_pid"]:  # the launcher died before the line above
            os._exit(137)
    workdir = spec["private_workdir"] if status["namespaces"] else spec["workdir"]
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    os.chdir(workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    code = os.pread(spec["code_fd"], spec["code_bytes"], 0)
    os.close(spec["code_fd"])
    with open("main.py", "wb") as f:
        f.write(code)
    os.write(spec["status_fd"], json.dumps(status).encode())
    os.close(spec["status_fd"])
    os.execv(spec["argv"][0], spec["argv"])


def _launch_supervise(pid: int, subreaper: bool, status_fd: int) -> None:
    """Wait for the program; kill what it left (see the module docstring); exit as it did."""
    os.close(status_fd)  # the host reads EOF if the child dies before reporting
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _, wait_status = os.waitpid(pid, 0)
    if subreaper:
        _launch_kill_children()
    code = os.waitstatus_to_exitcode(wait_status)
    os._exit(128 - code if code < 0 else code)


def _launch_kill_children() -> None:
    me = str(os.getpid())
    while True:
        found = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = f.read().rsplit(")", 1)[1].split()[1]
            except (OSError, IndexError):
                continue
            if ppid == me:
                found = True
                _launch_try(lambda pid=pid: os.kill(int(pid), signal.SIGKILL))
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            if not found:
                return


def _launch_try(fn) -> bool:
    try:
        fn()
    except OSError:
        return False  # reported in the status, never hidden
    return True


def _launch_unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _launch_isolate_network() -> None:
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _launch_unshare(_CLONE_NEWNET)
        return
    # an unprivileged netns needs its own user namespace; keep our ids inside it
    _launch_unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _launch_mount(source, target: str, fstype, flags: int, data) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _launch_mounts(covers: list[list], exposed: list[str]) -> None:
    """New mount and pid namespaces; each cover [path, size_bytes, mode] gets an empty tmpfs,
    and the `exposed` paths under them (the interpreter) are bound back read-only."""
    ms_rdonly, ms_nosuid, ms_nodev, ms_remount, ms_bind, ms_rec, ms_private = (
        1,
        2,
        4,
        32,
        4096,
        16384,
        1 << 18,
    )
    _launch_unshare(_CLONE_NEWNS | _CLONE_NEWPID)
    _launch_mount(None, "/", None, ms_rec | ms_private, None)  # nothing we do reaches the host
    # opened in the new namespace (a bind source must be in ours) and before covering them
    handles = [(path, os.open(path, os.O_PATH)) for path in exposed]
    for path, size, mode in covers:
        data = f"size={size},mode={mode}".encode()
        _launch_mount(b"tmpfs", path, b"tmpfs", ms_nosuid | ms_nodev, data)
    old_umask = os.umask(0o022)
    for path, fd in handles:
        os.makedirs(path, exist_ok=True)
        _launch_mount(f"/proc/self/fd/{fd}".encode(), path, None, ms_bind | ms_rec, None)
        _launch_mount(None, path, None, ms_remount | ms_bind | ms_rdonly, None)
        os.close(fd)
    os.umask(old_umask)


LAUNCHER = "\n".join(
    [
        "import ctypes, json, os, resource, signal, sys",
        f"_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = {_PR_SET_PDEATHSIG}, {_PR_SET_CHILD_SUBREAPER}",
        f"_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWUSER, _CLONE_NEWNET = "
        f"{_CLONE_NEWNS}, {_CLONE_NEWPID}, {_CLONE_NEWUSER}, {_CLONE_NEWNET}",
        *(
            inspect.getsource(fn)
            for fn in (
                _launch,
                _launch_program,
                _launch_supervise,
                _launch_kill_children,
                _launch_try,
                _launch_unshare,
                _launch_isolate_network,
                _launch_mount,
                _launch_mounts,
            )
        ),
        "_launch(sys.argv[1])",
    ]
)
