"""A heartbeat between the processes of a torchrun job, and distributed failures in one line.

See `reinforge.cluster` for the contract. The heartbeat's thread and the main thread never both
report: the main thread, on a peer's lost connection, waits for the heartbeat's verdict (the
heartbeat thread then ends the process), and reports alone only when none comes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from reinforge import watchdog
from reinforge.cluster import announce, global_rank, what_now
from reinforge.errors import ExitCode, record_exit

VERDICT = "verdict"  # the store key every process reads: why the job stops
# Texts of torch / gloo / NCCL errors, by what happened (lower case).
LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "glhf",
    "ncclremoteerror",
    "socket closed",
    "connection refused",
)
TIMEOUT = ("timed out", "timeout", "watchdog caught collective operation")
MISMATCH = ("enforcenotmet", "mismatch", "does not match", "size of tensor")


class Heartbeat:
    def __init__(self, labels: list[str], timeout_s: float, run_dir: Path, command: str):
        import torch.distributed as dist

        self.labels, self.timeout_s = labels, timeout_s
        self.run_dir, self.command = run_dir, command
        self.rank, self.world = global_rank(), len(labels)
        self.watched = (self.rank + 1) % self.world
        self.tick_s = max(timeout_s / 6, 0.1)
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.address = f"{host}:{port}"
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=max(timeout_s, 1.0))
        )
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"reinforge/heartbeat/{restart}/", store)
        self.detail = ""  # the main thread's traceback, when it failed first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reinforge-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, failure: str | None = None) -> None:
        """End the beats: "done", or this process's failure for the others to report."""
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(str(self.rank), f"failed {failure}" if failure else "done")
            if failure:
                self.store.set(VERDICT, f"{self.labels[self.rank]} failed: {failure}")
        except Exception:  # the store is gone with its node: nobody is left to tell
            pass

    def await_verdict(self, wait_s: float) -> None:
        """Wait up to `wait_s` for the heartbeat thread to name what happened (it then ends the
        process, so this returns only when it did not)."""
        self._thread.join(wait_s)

    def _run(self) -> None:
        count, seen, seen_at, store_ok_at = 0, None, time.monotonic(), time.monotonic()
        watched_key = str(self.watched)
        while not self._stop.wait(self.tick_s):
            count += 1
            now = time.monotonic()
            try:
                self.store.set(str(self.rank), str(count))
                if self.store.check([VERDICT]):
                    self._end(self.store.get(VERDICT).decode())
                value = (
                    self.store.get(watched_key).decode()
                    if self.store.check([watched_key])
                    else None
                )
                store_ok_at = now
            except Exception:
                if now - store_ok_at > self.timeout_s:
                    self._end(
                        f"the job's store at {self.address} stopped answering for "
                        f"{self.timeout_s:g} s: the torchrun launcher that keeps it (on the node "
                        "hosting the rendezvous) is gone"
                    )
                continue
            if value is not None and value.startswith("failed "):
                self._end(f"{self.labels[self.watched]} failed: {value[len('failed ') :]}")
            if value == "done":
                continue
            if value != seen:
                seen, seen_at = value, now
            elif now - seen_at > self.timeout_s:
                verdict = (
                    f"{self.labels[self.watched]} stopped answering for {now - seen_at:.0f} s "
                    f"(distributed.heartbeat_timeout_s = {self.timeout_s:g}): its process froze "
                    "or died, or its node is gone"
                )
                with contextlib.suppress(Exception):  # the others read it, if the store lives
                    self.store.set(VERDICT, verdict)
                self._end(verdict)

    def _end(self, verdict: str) -> None:
        line = f"{verdict}. Every process stops; {what_now(self.run_dir, self.command)}"
        announce(line, self.run_dir, self.detail)
        record_exit(ExitCode.PEER_LOST)
        os._exit(ExitCode.PEER_LOST)


_active: Heartbeat | None = None


def start(labels: list[str], timeout_s: float, run_dir: Path, command: str) -> None:
    global _active
    if timeout_s > 0 and len(labels) > 1 and "MASTER_ADDR" in os.environ:
        _active = Heartbeat(labels, timeout_s, run_dir, command).start()
        watchdog.set_before_hang_exit(stop)


def stop(failure: str | None = None) -> None:
    global _active
    if _active is not None:
        _active.stop(failure)
        _active = None


def kind_of(error: BaseException) -> str | None:
    """'lost', 'timeout' or 'mismatch' for an error a collective raised; None for others."""
    import torch.distributed as dist

    text = f"{type(error).__name__} {error}".lower()
    is_dist = isinstance(error, (dist.DistError, RuntimeError))
    if not is_dist:
        return None
    for kind, marks in (("lost", LOST), ("mismatch", MISMATCH), ("timeout", TIMEOUT)):
        if any(mark in text for mark in marks):
            return kind
    return None


def explain_failure(error: BaseException, run_dir: Path, command: str) -> tuple[str, int] | None:
    """(the line to show, the exit code) for a distributed failure of the main thread, or None
    when `error` is not one (or this is no distributed run)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    kind = kind_of(error)
    if kind is None:
        return None
    detail = traceback.format_exc()
    if kind in ("lost", "timeout") and _active is not None:
        _active.detail = detail
        _active.await_verdict(_active.timeout_s + 2 * _active.tick_s)  # names the peer, exits
    what = {
        "lost": "the connection to another process of the job was lost (which one: no "
        "heartbeat verdict; distributed.heartbeat_timeout_s = 0 turns it off)",
        "timeout": "a collective waited longer than distributed.collective_timeout_s for "
        "another process",
        "mismatch": "the processes called a collective with different shapes (they ran "
        "different code paths or data); please report it with the run's error files",
    }[kind]
    from reinforge.cluster import node_label

    line = f"{what} (seen by {node_label()}). Every process stops; {what_now(run_dir, command)}"
    announce(line, run_dir, detail)
    stop(line)
    code = ExitCode.RUNTIME_FAILURE if kind == "mismatch" else ExitCode.PEER_LOST
    return line, int(code)
