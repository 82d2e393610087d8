"""The sandbox's launcher (`envs.sandbox`): the code that runs in the child (`python -I -S -c`)
before the model's program. It isolates the network and, for the rlimit backend as root, the
temp folders; sets the rlimits; drops to the run's uid; asks to die with the trainer; reports
what isolation held on a pipe; then execs the program. Stdlib only: `LAUNCHER` is these
functions' source, sent as the child's `-c` argument.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os


def _launch(spec_json: str) -> None:
    import resource  # Unix only: imported in the child, so the package imports on Windows

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


LAUNCHER = "\n".join(
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
