"""Per-call accounting of a sandboxed run (`envs.sandbox`), read from /proc on the host: the
processes of one call (the launcher's descendants; orphans stay among them, reparented to the
pid namespace's init or to the launcher as child subreaper), their memory summed as PSS (shared
pages counted once, so six forked children are six times their own pages, not six interpreters),
the size of a work dir on the host, and killing the whole tree.

Polled, not enforced by the kernel: a process tree can outgrow `memory_mb` for one poll interval
(0.1 s) before it is killed; RLIMIT_AS still bounds each process. A memory cgroup would be exact,
but this host (and most containers) offers no writable cgroup v2 with the memory controller.
"""

from __future__ import annotations

import contextlib
import os
import signal

POLL_SECONDS = 0.1  # one poll costs ~2 ms of CPU on a host with ~170 processes


def descendants(root: int) -> list[int]:
    """Every process below `root` (not `root` itself), found by scanning /proc for parents."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # exited while we looked
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def memory_bytes(pids: list[int]) -> int:
    """The PSS of these processes together (RSS where smaps_rollup is closed to us)."""
    total = 0
    for pid in pids:
        total += _pss(pid)
    return total


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):  # gone, or a kernel thread
        return 0


def tree_bytes(path: str, limit: int) -> int:
    """Bytes of the files under `path` (allocated blocks, so sparse files count what they hold);
    stops counting once past `limit`."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            if total > limit:
                return total
    return total


def tmpfs_bytes(pid: int, mounts: tuple[str, ...]) -> int:
    """Bytes used in these (separate) mounts as process `pid` sees them: its mount namespace,
    through /proc/<pid>/root."""
    used = 0
    for mount in mounts:
        with contextlib.suppress(OSError):  # gone, or not ours to look into
            st = os.statvfs(f"/proc/{pid}/root/{mount}")
            used += (st.f_blocks - st.f_bfree) * st.f_frsize
    return used


def kill_tree(root: int) -> None:
    """SIGKILL `root`, its process group and everything below it."""
    pids = [root, *descendants(root)]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(root, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
