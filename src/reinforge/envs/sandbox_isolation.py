"""The sandbox's isolation (`envs.sandbox`): what each backend and platform gets, the bwrap
command line (a read-only view of the system with only the work dir writable), and for the
rlimit backend as root the folders the launcher covers with private mounts.

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
"""

from __future__ import annotations

import os
import stat
import sys

_ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives")
_SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: the rlimit backend hides them


def bwrap_prefix(bwrap: str | None, workdir: str, python: str, is_root: bool) -> list[str]:
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


def private_mounts_spec(workdir: str, python: str) -> dict[str, list[str]]:
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
