"""The python tool off Linux (`envs.sandbox`), where the user opted in with
`sandbox.allow_uncontained`: the program runs as the user, in a fresh temporary folder, with a
clean environment, the wall and output caps and nothing else (the refusal said so).

Output goes to files, not pipes, and is measured while the program runs: that is portable to
Windows, where select() does not take pipes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time

from reinforge.envs.sandbox_process import SandboxResult, SandboxSettings, clean_env

_POLL_SECONDS = 0.05


def run_unconfined(sandbox: SandboxSettings, workdir: str) -> SandboxResult:
    limits = sandbox.limits
    env = clean_env(workdir, sandbox.python)
    if "SYSTEMROOT" in os.environ:  # Windows' Python cannot start without it
        env["SYSTEMROOT"] = os.environ["SYSTEMROOT"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sandbox.python, "-I", "-B", "-u", "main.py"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=workdir,
            env=env,
            start_new_session=os.name == "posix",
        )
        reason = None
        try:
            while proc.poll() is None and reason is None:
                if time.monotonic() - start > limits.wall_seconds:
                    reason = "wall"
                elif os.fstat(out.fileno()).st_size + os.fstat(err.fileno()).st_size > (
                    limits.max_output_bytes
                ):
                    reason = "output"
                else:
                    time.sleep(_POLL_SECONDS)
        finally:
            _kill(proc)
        seconds = time.monotonic() - start
        stdout, stderr = _read(out, limits.max_output_bytes), _read(err, limits.max_output_bytes)
    truncated = len(stdout) + len(stderr) > limits.max_output_bytes
    if truncated:
        reason = "output"
        stderr = stderr[: max(0, limits.max_output_bytes - len(stdout))]
        stdout = stdout[: limits.max_output_bytes]
    return SandboxResult(
        stdout=stdout.decode("utf-8", errors="replace"),
        stderr=stderr.decode("utf-8", errors="replace"),
        exit_code=proc.returncode,
        timed_out=reason == "wall",
        killed_reason=reason,
        truncated=truncated,
        seconds=seconds,
        backend="unconfined",
        network_isolated=False,
        filesystem="host",
    )


def _kill(proc: subprocess.Popen) -> None:
    if os.name == "posix":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def _read(f, max_bytes: int) -> bytes:
    f.seek(0)
    return f.read(max_bytes + 1)
