"""Attacks by model-written code, tried for real under every backend that runs here (as whoever
runs the tests; test_sandbox_unprivileged.py runs this file again as an ordinary user). An
attack a backend is documented not to contain here (`Sandbox.uncontained`, the same text as the
run summary and docs/security.md) is skipped with that reason before it runs: `kill(-1, 9)` as
the caller would take the test run down with it.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from reinforge.envs.sandbox import Sandbox, SandboxLimits

IS_ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(
    cpu_seconds=5,
    wall_seconds=10,
    memory_mb=160,
    max_output_bytes=8192,
    max_file_mb=2,
    max_disk_mb=6,
    max_processes=24,
)


@pytest.fixture(scope="module", params=["bwrap", "rlimit"])
def box(request):
    if request.param == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not on PATH; apt-get install bubblewrap to test it")
    try:
        return Sandbox(request.param, LIMITS)
    except Exception as e:  # e.g. bwrap without root where user namespaces are off
        pytest.skip(f"{request.param} cannot run here: {e}")


def _contains(box: Sandbox, gap: str) -> None:
    for key in (gap, "namespaces"):  # "namespaces": the kernel refused them (rlimit as root)
        if key in box.uncontained:
            pytest.skip(f"{box.backend}: documented not contained here: {box.uncontained[key]}")


def _victim(*argv: str) -> subprocess.Popen:
    """A process of the test's own user, standing in for the trainer's other processes."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])


def test_code_cannot_signal_the_trainer_or_its_users_processes(box):
    _contains(box, "signal")
    victim = _victim()
    code = f"""
import os
for pid, sig in ((os.getppid(), 9), ({os.getpid()}, 9), ({victim.pid}, 9), (-1, 9)):
    try:
        os.kill(pid, sig)
        print("sent", pid)
    except OSError as e:
        print("refused", pid, e.errno)
"""
    try:
        result = box.run(code)
        time.sleep(0.1)
        assert victim.poll() is None, result  # alive
    finally:
        victim.kill()
        victim.wait()


def test_code_cannot_ptrace_the_trainer(box):
    _contains(box, "signal")
    victim = _victim()
    code = f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for pid in ({os.getpid()}, {victim.pid}):
    rc = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    print("attached" if rc == 0 else f"refused {{ctypes.get_errno()}}", pid)
"""
    try:
        result = box.run(code)
    finally:
        victim.kill()
        victim.wait()
    assert result.ok, result
    assert "attached" not in result.stdout


def test_command_lines_and_environments_of_other_processes_are_hidden(box):
    _contains(box, "signal")
    secret = f"secret-{uuid.uuid4().hex}"
    victim = _victim(secret)
    code = f"""
import os
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("cmdline", "environ"):
        try:
            if {secret!r}.encode() in open(f"/proc/{{pid}}/{{name}}", "rb").read():
                print("found", pid, name)
        except OSError:
            pass
"""
    try:
        result = box.run(code)
    finally:
        victim.kill()
        victim.wait()
    assert result.ok, result
    assert "found" not in result.stdout


@pytest.fixture(scope="module")
def host_files():
    """A private (0600) file, a world-readable project file, a checkpoint dir and a listening
    unix socket, in a folder outside the shared temp folders (the tests' own folder)."""
    here = Path(__file__).parent  # the project, outside the shared temp folders, where we may
    folder = Path(
        tempfile.mkdtemp(
            prefix="reinforge-hostfiles-", dir=here if os.access(here, os.W_OK) else None
        )
    )
    folder.chmod(0o755)
    private = folder / "private.txt"
    private.write_text("private-secret")
    private.chmod(0o600)
    public = folder / "answers.jsonl"
    public.write_text("the-answer-is-42")
    public.chmod(0o644)
    ckpt = folder / "checkpoints"
    ckpt.mkdir(mode=0o777)
    ckpt.chmod(0o777)  # even a folder open to all must not be writable from the sandbox
    sockets = []
    for where in (folder, Path(tempfile.gettempdir())):
        path = where / f"rf-{uuid.uuid4().hex[:8]}.sock"
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        path.chmod(0o777)
        server.listen()
        sockets.append((path, server))
    yield {"private": private, "public": public, "ckpt": ckpt, "sockets": sockets}
    for path, server in sockets:
        server.close()
        path.unlink(missing_ok=True)
    shutil.rmtree(folder)


def test_private_and_project_files_are_unreadable(box, host_files):
    _contains(box, "files")
    code = "\n".join(
        f"try:\n    print(open({str(host_files[k])!r}).read())\nexcept OSError as e:\n"
        f"    print('refused', e.errno)"
        for k in ("private", "public")
    )
    result = box.run(code)
    assert result.ok, result
    assert "secret" not in result.stdout
    assert "the-answer-is-42" not in result.stdout


def test_home_checkpoints_and_run_lock_are_not_writable(box, host_files):
    _contains(box, "files")
    name = f"evil-{uuid.uuid4().hex}"
    home = Path(os.path.expanduser("~"))
    targets = [host_files["ckpt"] / name, home / name, Path("/run/lock") / name]
    code = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as e:\n    print('refused', e)"
        for t in targets
    )
    try:
        result = box.run(code)
        assert [t for t in targets if t.exists()] == [], result
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_host_unix_sockets_are_unreachable(box, host_files):
    _contains(box, "sockets")
    code = "\n".join(
        f"s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({str(p)!r})\n"
        f"    print('connected', {str(p)!r})\nexcept OSError as e:\n    print('refused', e.errno)"
        for p, _ in host_files["sockets"]
    )
    result = box.run("import socket\n" + code)
    assert result.ok, result
    assert "connected" not in result.stdout


def test_nothing_written_in_one_call_is_seen_by_the_next(box):
    _contains(box, "shared_tmp")
    name = f"left-{uuid.uuid4().hex}"
    places = ["/tmp", "/dev/shm", "/var/tmp", "."]
    write = "\n".join(
        f"try:\n    open({p!r} + '/{name}', 'w').write('x')\nexcept OSError as e:\n    print(e)"
        for p in places
    )
    first = box.run(write)
    assert first.ok, first
    read = "import os\n" + "\n".join(f"print(os.path.exists({p!r} + '/{name}'))" for p in places)
    second = box.run(read)
    assert second.stdout.split() == ["False"] * len(places), second
    for p in ("/tmp", "/dev/shm", "/var/tmp"):  # nor on the host
        assert not os.path.exists(f"{p}/{name}")


def test_no_process_outlives_the_call(box):
    marker = uuid.uuid4().hex
    code = f"""
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)", "{marker}"]
subprocess.Popen(sleep, start_new_session=True)  # a setsid daemon
if os.fork() == 0:  # and a double-forked one, orphaned at once
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleep)
    os._exit(0)
time.sleep(0.3)
print("started")
"""
    result = box.run(code)
    assert result.stdout == "started\n", result
    assert _alive(marker) == []


def _alive(marker: str) -> list[int]:
    """Processes whose command line holds `marker`, after giving SIGKILLs a moment to land."""
    deadline = time.monotonic() + 2
    while True:
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def test_memory_is_limited_per_call_not_per_process(box):
    # each child stays far below memory_mb; six of them are well above it
    code = """
import os, time
pids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        hoard = bytearray(40 << 20)
        hoard[::4096] = b"x" * len(hoard[::4096])
        time.sleep(30)
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
print("held")
"""
    result = box.run(code)
    assert result.killed_reason == "memory", result
    assert "held" not in result.stdout
    assert result.seconds < LIMITS.wall_seconds


def test_tmpfs_files_are_capped(box):
    _contains(box, "shared_tmp")
    code = """
for i in range(8):  # 8 x 2 MB into /dev/shm: more than max_disk_mb
    with open(f"/dev/shm/f{i}", "wb") as f:
        f.write(b"x" * (2 << 20))
print("stored")
"""
    result = box.run(code)
    assert "stored" not in result.stdout, result
    assert result.killed_reason in ("disk", "file_size"), result


def test_total_disk_is_capped(box):
    code = """
for i in range(8):  # 8 files of 1.5 MB: each under max_file_mb, together over max_disk_mb
    with open(f"f{i}", "wb") as f:
        f.write(b"x" * (3 << 19))
import time
time.sleep(1)
print("stored")
"""
    result = box.run(code)
    assert "stored" not in result.stdout, result
    assert result.killed_reason == "disk", result


def test_disk_is_capped_with_a_bubblewrap_older_than_0_7(box):
    """bubblewrap < 0.7 (Ubuntu 22.04 has 0.6) cannot size a tmpfs: the sizes of the sandbox's
    /tmp and /dev/shm are polled instead, here with this bwrap told not to use --size."""
    if box.backend != "bwrap":
        pytest.skip("bwrap only")
    old = Sandbox("bwrap", LIMITS)
    old.bwrap_sizes_tmpfs = False
    code = """
import time
for i in range(6):  # 6 x 1.5 MB into /dev/shm and the work dir: over max_disk_mb = 6
    open(f"/dev/shm/f{i}" if i % 2 else f"f{i}", "wb").write(b"x" * (3 << 19))
time.sleep(2)
print("stored")
"""
    result = old.run(code)
    assert result.killed_reason == "disk", result
    assert "stored" not in result.stdout
