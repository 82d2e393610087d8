"""Each escape is tried for real, under every backend that runs here, and must be contained and
reported. Where a backend cannot provide an isolation on this host (it says so in the result),
the test skips with that reason instead of passing vacuously."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reinforge.envs.sandbox import Sandbox, SandboxLimits, make_python_tool
from reinforge.envs.tools import call_tool, make_tools
from reinforge.errors import ConfigError
from reinforge.run import Summary

LIMITS = SandboxLimits(
    cpu_seconds=1,
    wall_seconds=8,
    memory_mb=256,
    max_output_bytes=4096,
    max_file_mb=1,
    max_processes=16,
)
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module", params=["bwrap", "rlimit"])
def sandbox(request):
    if request.param == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not on PATH; apt-get install bubblewrap to test it")
    return Sandbox(request.param, LIMITS)


def _alive(marker: str) -> list[int]:
    """Processes whose command line holds `marker`, after giving SIGKILLs a moment to land."""
    deadline = time.monotonic() + 2
    while True:
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # empty for zombies
            except OSError:
                continue
            if marker.encode() in cmdline:
                pids.append(int(pid))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def test_runs_code_in_a_fresh_deleted_workdir(sandbox):
    result = sandbox.run("import os\nprint(6 * 7)\nprint(os.getcwd())\nprint(os.listdir('.'))")
    assert result.ok, result
    answer, workdir, listing = result.stdout.splitlines()
    assert answer == "42"
    assert listing == "['main.py']"
    assert result.backend == sandbox.backend
    assert not os.path.exists(workdir)


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    result = sandbox.run("while True:\n    pass")
    assert result.timed_out
    assert result.killed_reason == "cpu"
    assert result.seconds < LIMITS.wall_seconds


def test_sleeping_code_hits_the_wall_limit(sandbox):
    box = Sandbox(sandbox.backend, SandboxLimits(wall_seconds=1))
    result = box.run("import time\nprint('start', flush=True)\ntime.sleep(60)")
    assert result.timed_out
    assert result.killed_reason == "wall"
    assert result.stdout == "start\n"  # output before the kill is kept
    assert result.seconds < 5


def test_fork_bomb_is_limited_and_every_child_dies(sandbox):
    marker = uuid.uuid4().hex
    code = f"""
import os, subprocess, sys
sleep = [sys.executable, "-c", "import time; time.sleep(300)", "{marker}"]
for escape in (False, True):  # one child stays in the group, one leaves it with setsid()
    subprocess.Popen(sleep, start_new_session=escape)
while True:
    os.fork()
"""
    result = sandbox.run(code)
    # every copy that hits the limit prints a traceback: together they may pass the output cap
    assert result.killed_reason in ("processes", "output"), result
    assert result.exit_code != 0
    assert _alive(marker) == []


def test_memory_bomb_hits_the_memory_limit(sandbox):
    result = sandbox.run("hoard = []\nwhile True:\n    hoard.append(bytearray(10**7))")
    assert result.killed_reason == "memory", result
    assert not result.timed_out


def test_huge_output_is_truncated_and_stopped(sandbox):
    result = sandbox.run("while True:\n    print('y' * 1000)")
    assert result.truncated
    assert result.killed_reason == "output"
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= LIMITS.max_output_bytes
    assert result.stdout.startswith("y" * 1000)


def test_big_file_hits_the_file_size_limit(sandbox):
    result = sandbox.run("with open('big', 'wb') as f:\n    f.write(b'x' * (8 << 20))")
    assert result.killed_reason == "file_size", result


def test_writes_outside_the_workdir_do_not_land(sandbox):
    name = f"reinforge-evil-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, Path(__file__).parent / name]  # shared tmp and the repo
    code = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('wrote', {str(t)!r})\n"
        "except OSError as e:\n    print('refused', e)"
        for t in targets
    )
    try:
        result = sandbox.run(code)
        if result.filesystem == "host":
            pytest.skip(f"{sandbox.backend} has no filesystem isolation on this host")
        assert [t for t in targets if t.exists()] == [], result.stdout
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


def test_parent_secrets_are_not_visible(sandbox, monkeypatch):
    monkeypatch.setenv("REINFORGE_TEST_SECRET", "hunter2-secret-value")
    code = f"""
import os
print(dict(os.environ))
try:
    print(open("/proc/{os.getpid()}/environ", "rb").read())
except OSError as e:
    print("refused", e)
"""
    result = sandbox.run(code)
    assert "REINFORGE_TEST_SECRET" in os.environ
    if result.filesystem == "host":
        pytest.skip("without root the rlimit code runs as the caller: /proc/<pid>/environ is open")
    assert "hunter2" not in result.stdout + result.stderr
    assert "REINFORGE_TEST_SECRET" not in result.stdout


def test_network_is_unreachable_when_isolated(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"""
import socket
s = socket.socket()
s.settimeout(3)
try:
    s.connect(("127.0.0.1", {port}))
    print("connected")
except OSError as e:
    print("refused", e)
"""
        result = sandbox.run(code)
    if not result.network_isolated:
        pytest.skip(f"{sandbox.backend} could not isolate the network here (no netns allowed)")
    assert result.stdout.startswith("refused"), result


def test_python_tool_reports_output_errors_and_timeouts(sandbox):
    tools = make_tools([make_python_tool(sandbox)])
    ok = call_tool(tools, "python", {"code": "print(sum(range(10)))"})
    assert (ok.status, ok.text) == ("ok", "45")
    failed = call_tool(tools, "python", {"code": "1 / 0"})
    assert failed.status == "error"
    assert "ZeroDivisionError" in failed.text
    assert failed.text.endswith("[exit code 1]")
    slow = call_tool(tools, "python", {"code": "while True: pass"})
    assert slow.status == "timeout"
    assert slow.text == "[stopped: CPU time limit of 1 s]"


def test_auto_fails_closed_without_bwrap_and_rlimit_must_be_explicit(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap here
    with pytest.raises(ConfigError, match="bwrap"):
        Sandbox("bwrap")
    with pytest.raises(ConfigError, match=r'sandbox.backend = auto .*sandbox.backend = "rlimit"'):
        Sandbox("auto")
    box = Sandbox("rlimit")
    assert box.backend == "rlimit"
    assert box.run("print(1)").stdout == "1\n"
    # the run summary says what it leaves open, as root or not
    note = Summary("train", tmp_path).notes[-1]
    assert note.startswith("sandbox.backend = 'rlimit'")
    assert ("world-readable" in note) if IS_ROOT else ("cannot change uid" in note)


def test_bwrap_runs_an_interpreter_from_a_venv_under_tmp(tmp_path):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not on PATH; apt-get install bubblewrap to test it")
    venv = Path(tempfile.mkdtemp(prefix="reinforge-venv-", dir="/tmp"))
    venv.chmod(0o755)  # as a venv made by `python -m venv` is
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv],
            check=True,
        )
        code = (
            "from reinforge.envs.sandbox import Sandbox\n"
            "box = Sandbox('auto')\n"
            "print(box.backend, box.run('import sys; print(sys.prefix)').stdout)"
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
        out = subprocess.run(
            [venv / "bin" / "python", "-c", code], env=env, capture_output=True, text=True
        )
        assert out.stdout.split() == ["bwrap", str(venv)], out.stderr
    finally:
        shutil.rmtree(venv)


def test_off_linux_the_tool_refuses_unless_the_user_opts_in(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match=r"sandbox\.allow_uncontained = true"):
        Sandbox("auto")
    box = Sandbox("auto", SandboxLimits(wall_seconds=1), allow_uncontained=True)
    assert box.backend == "unconfined"
    assert "everything" in box.uncontained
    assert box.run("print(6 * 7)").stdout == "42\n"
    slow = box.run("import time\ntime.sleep(30)")
    assert slow.killed_reason == "wall"
    flood = Sandbox("auto", SandboxLimits(max_output_bytes=1000), allow_uncontained=True)
    result = flood.run("while True:\n    print('y' * 100)")
    assert (result.killed_reason, result.truncated) == ("output", True)
    assert len(result.stdout) == 1000


def test_wall_clock_starts_with_the_program_not_in_the_queue(sandbox):
    """Six calls at once on a small machine: each program sleeps 1.5 s under a 3 s wall limit;
    time spent waiting to start is not charged to it."""
    box = Sandbox(sandbox.backend, SandboxLimits(wall_seconds=3))
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(box.run, ["import time\ntime.sleep(1.5)\nprint('ok')"] * 6))
    assert [r.stdout for r in results] == ["ok\n"] * 6, results
    assert all(r.seconds < 3 for r in results)


def test_config_mistakes_are_config_errors():
    with pytest.raises(ConfigError, match="backend='docker' is unknown"):
        Sandbox("docker")
    with pytest.raises(ConfigError, match="cpu_seconds=0"):
        SandboxLimits(cpu_seconds=0)


def test_the_config_section_builds_the_sandbox():
    from reinforge.config.envs import SandboxSection
    from reinforge.envs.sandbox import sandbox_from_config

    section = SandboxSection(backend="rlimit", memory_mb=300, max_disk_mb=7)
    box = sandbox_from_config(section)
    assert (box.backend, box.limits.memory_mb, box.limits.max_disk_mb) == ("rlimit", 300, 7)
