"""A benchmark's `reinforge train` subprocess, stopped once the steps it is measured on are
logged (the final evaluation and checkpoint are no part of a step), or at a timeout, with every
process below it (torchrun's workers run in sessions of their own). No torch here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_until_logged(
    cmd: list[str], metrics: Path, steps: int, log: Path, timeout: float, profile_step: int
) -> tuple[str, float]:
    """Run `cmd` (output to `log`) until it exits ("exit CODE"), its `steps`-th step is logged
    ("logged"; not when a profile is written at the end) or `timeout` s pass ("timeout"; 0:
    none); the bench kills it in the last two cases. (status, seconds)."""
    start = time.perf_counter()
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                done = not profile_step and len(step_rows(metrics)) >= steps
                late = timeout and time.perf_counter() - start > timeout
                if done or late:
                    return ("logged" if done else "timeout"), time.perf_counter() - start
        finally:  # stopped here, or the bench itself is (its own timeout: SIGTERM)
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    return f"exit {proc.returncode}", time.perf_counter() - start


def kill_tree(pid: int, wait_s: float = 30.0) -> None:
    """SIGKILL `pid` and every process below it, and wait (up to `wait_s`) until they are gone,
    so the next run finds its GPUs free. Not a process group: torchrun starts each worker in a
    session of its own; and not SIGTERM, which the workers answer with a checkpoint."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    deadline = time.perf_counter() + wait_s
    while time.perf_counter() < deadline and any(alive(m) for m in tree[1:]):
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """Running (a zombie, killed and waiting for its parent's wait, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def step_rows(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if row.get("phase") == "rl" and "step_s" in row:
            rows.append(row)
    return rows
