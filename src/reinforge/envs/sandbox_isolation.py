"""The sandbox's isolation (`envs.sandbox`): the bwrap command line, the private mounts of the
rlimit backend as root, and what each backend does not contain (`uncontained`), which the refusal,
the run summary and docs/security.md all state.

bwrap: its own network, pid, ipc and uts namespaces; a tmpfs root with /usr, /etc/ld.so.* and the
interpreter's folders bound read-only (also a venv under /tmp: those binds come after the private
/tmp); private size-capped tmpfs on /tmp (the work dir), /dev/shm and /run. Without root bwrap
also makes a user namespace (`--unshare-all`). As root it does not, so that the launcher can drop
to a fresh uid: RLIMIT_NPROC is not enforced for uid 0 (a fork bomb under `prlimit --nproc=20`
ran unchecked, also in a bwrap user namespace), and root's files are not that uid's to write.

rlimit as root: the launcher drops to a fresh uid too, in its own network, mount and pid
namespaces, with a fresh /proc (only its own processes), and size-capped empty tmpfs over /tmp,
/var/tmp, /dev/shm, /run and the folders where users keep files (/home, /root, /srv, /mnt,
/media, /opt, the trainer's working directory), the interpreter bound back read-only. The rest
of the host stays visible: world-readable files elsewhere are readable.

rlimit without root: the code runs as the caller. Resource limits, the per-call memory and disk
accounting and a clean environment hold; the rest is the caller's to lose (`uncontained`).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

_ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")
_USER_DIRS = ("/home", "/root", "/srv", "/mnt", "/media", "/opt")
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/proc", "/sys")
_SMALL_TMPFS = 64 * 1024  # an empty folder's tmpfs: nothing may be stored there
_RUN_TMPFS = 1024 * 1024

# What the code can do to the host where a backend does not stop it (docs/security.md's rows).
_NOT_AS_ROOT = {
    "signal": "signal or ptrace the trainer and every process of its user (os.kill(os.getppid(), "
    "9), kill(-1, 9)), and read their command lines and environments",
    "files": "read and write every file the user can: 0600 files, $HOME, the checkpoint directory",
    "sockets": "connect to the user's unix sockets",
    "shared_tmp": "leave files in the shared /tmp and /dev/shm, outside the memory and disk caps, "
    "for the next call to read",
    "survive": "outlive the call by killing the launcher first (a setsid daemon that does not is "
    "killed)",
}
_ROOT = {
    "world_readable": "read world-readable host files outside the covered folders (/home, /root, "
    "/srv, /mnt, /media, /opt, the working directory), and connect to world-writable unix sockets "
    "there",
}


def uncontained(backend: str, is_root: bool, status: dict | None = None) -> dict[str, str]:
    """What `backend` does not contain here, by attack; empty for bwrap. `status` is a probe
    run's report: a namespace the kernel refused widens the list."""
    if backend == "bwrap":
        return {}
    status = status or {}
    gaps = dict(_ROOT) if is_root else dict(_NOT_AS_ROOT)
    if not status.get("network_isolated", True):
        gaps["network"] = "reach the network (the kernel refused a network namespace here)"
    if is_root and not status.get("namespaces", True):
        gaps["namespaces"] = (
            "see every process's command line, leave files in the shared /tmp and /dev/shm, and "
            "use /run (the kernel refused mount and pid namespaces here)"
        )
    return gaps


# ----------------------------------------------------------------------------- bwrap


def bwrap_has_size(bwrap: str) -> bool:
    """bubblewrap >= 0.7 sizes a tmpfs (`--size`); older ones (Ubuntu 22.04 has 0.6) do not,
    and the sandbox polls the size of /tmp and /dev/shm instead."""
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False)
    return "--size" in out.stdout + out.stderr


def bwrap_prefix(
    bwrap: str | None, python: str, is_root: bool, disk_bytes: int | None
) -> list[str]:
    """`disk_bytes` None: the tmpfs mounts get no size (polled instead)."""
    argv = [bwrap or "bwrap", "--die-with-parent", "--new-session"]
    if is_root:  # no user namespace, so the launcher can drop to a fresh uid (docstring)
        argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        argv += ["--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all"]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for path, size, mode in (
        ("/tmp", disk_bytes, "1777"),  # the work dir
        ("/dev/shm", disk_bytes, "1777"),
        ("/run", _RUN_TMPFS, "0755"),
    ):
        if disk_bytes is not None:
            argv += ["--size", str(size)]
        argv += ["--perms", mode, "--tmpfs", path]
    made = {"/", "/proc", "/dev", "/tmp", "/dev/shm", "/run"}
    bound: list[str] = []
    argv += _bwrap_mount("--ro-bind", "/usr", made, bound)
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += _bwrap_mount("--ro-bind", path, made, bound)
    for path in (*_ETC_PATHS, *_python_dirs(python)):
        if os.path.exists(path) and not any(_is_under(path, b) for b in bound):
            argv += _bwrap_mount("--ro-bind", path, made, bound)
    return [*argv, "--chdir", "/tmp", "--"]


def _bwrap_mount(op: str, path: str, made: set[str], bound: list[str]) -> list[str]:
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
    bound.append(path)
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


def private_mounts_spec(python: str, disk_bytes: int) -> dict[str, list]:
    """The folders the launcher covers with an empty tmpfs ([path, size, mode]), and the
    interpreter's folders under them that it binds back read-only.

    Folders the fresh uid could not enter on the way to the interpreter (pyenv under /root,
    0700) are covered too, since otherwise it could not even start.
    """
    sizes = {"/tmp": (disk_bytes, "1777"), "/dev/shm": (disk_bytes, "1777")}
    sizes["/run"] = (_RUN_TMPFS, "0755")
    paths = ["/tmp", "/dev/shm", "/var/tmp", "/run", *_USER_DIRS, os.getcwd()]
    for path in _python_dirs(python):
        parent = os.path.dirname(path)
        while parent != "/":
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                paths.append(parent)
            parent = os.path.dirname(parent)
    paths = [
        os.path.realpath(p)
        for p in paths
        if os.path.isdir(p) and not os.path.islink(p) and _may_cover(os.path.realpath(p))
    ]
    tops = sorted({p for p in paths if not any(_is_under(p, o) and p != o for o in paths)})
    covers = [[p, *sizes.get(p, (_SMALL_TMPFS, "0755"))] for p in tops]
    exposed = [p for p in _python_dirs(python) if any(_is_under(p, c) for c in tops)]
    return {"covers": covers, "exposed": exposed}


def _may_cover(path: str) -> bool:
    return path != "/" and not any(_is_under(path, s) for s in _SYSTEM_DIRS)
