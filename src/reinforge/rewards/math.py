"""Math answer checking with math-verify, in worker processes with a hard wall-clock timeout.

`math_reward(completion, task)` is 1.0 when the completion's final answer is mathematically
equal to `task.answer` (`1/2`, `0.5` and `\\frac{1}{2}` are one answer; `x=3` and `3` too), else
0.0. The answer is taken from the first `\\boxed{...}`, else from "the answer is ..." phrasing,
else from the last expression in the text: math-verify's own extraction does this.

Why processes: sympy can run for minutes on a model's answer (`9^{9^{9^{9}}}`, `(10^{8})!`), and
math-verify's own timeout is `signal.alarm`, which works only on the main thread and cannot
interrupt C code. So `MathVerifier` keeps a small pool of worker processes; an answer that runs
past `timeout_s` has its worker killed and replaced, scores 0.0 and counts one timeout.

Callers share the pool without taking turns: every call, from any thread, takes whichever
workers are free, so concurrent callers check in parallel (as many at once as there are
workers: one per core, up to 8, by default), and an item never waits behind another caller's
slow item while a worker is free. An item's clock starts when a worker takes it (time queued is
not held against it): with a free worker, a call from any thread returns within `timeout_s` plus
the pipe's overhead; with more concurrent items than workers, the extra ones queue for the next
free worker. A killed worker's replacement starts at once, in the background.

Memory: on Linux each worker's address space is capped (RLIMIT_AS) at what it holds after
importing math-verify plus `memory_mb`, so an answer that makes sympy allocate without end fails
its allocations instead of swapping the machine. An item during which the worker reached three
quarters of `memory_mb` (math-verify swallows the MemoryError it causes) scores 0.0, counts in
`num_out_of_memory`, and the worker is replaced. Elsewhere (macOS, Windows) the workers run
without a memory cap, and the first start says so.

Workers start with the 'spawn' method (safe beside torch and CUDA, and the only one on Windows),
so a script that builds a verifier needs the usual `if __name__ == "__main__":` guard. The
parent process never imports math-verify or sympy; only the workers do.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from reinforge.errors import ConfigError
from reinforge.rewards.math_worker import worker_main
from reinforge.types import Task

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine; far past this, something broke
_MAX_FAILED_STARTS = 3  # in a row: one killed starting worker is bad luck, several are a bug
_POLL_S = 0.02  # how often a call with items still queued looks for a worker another call freed
_said_no_memory_limit = False


# ---- the parent side ----------------------------------------------------------------------------


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection


def _stop_worker(worker: _Worker) -> None:
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join()
    worker.conn.close()


def _stop_all(workers: list[_Worker], idle: deque[_Worker]) -> None:
    """Idle workers are asked to exit (and given a second together); the rest are killed."""
    for worker in idle:
        # An idle worker may have died on its own (the OOM killer); then there is no one to tell.
        with contextlib.suppress(OSError):
            worker.conn.send(None)
    deadline = time.monotonic() + 1.0
    for worker in workers:
        if worker in idle:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        _stop_worker(worker)
    workers.clear()
    idle.clear()


class MathVerifier:
    """A pool of math-verify worker processes with a per-item wall-clock timeout.

    Counters (cumulative): `num_checked` items scored, `num_timeouts` items that ran past
    `timeout_s`, `num_out_of_memory` items that hit the workers' memory limit, `num_errors`
    items math-verify raised on or whose ground truth did not parse (all scored 0.0; the latest
    message is in `last_error`). Thread-safe, and concurrent calls run in parallel across the
    workers. Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        checker: str = "reinforge.rewards.math_worker",
        label: str = "math-verify",
    ):
        if num_workers is None:  # a worker per core, up to 8 (each holds sympy, ~60 MB)
            num_workers = min(8, os.cpu_count() or 2)
        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}; try num_workers=2")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}; try timeout_s=5.0")
        if memory_mb < 16:
            raise ConfigError(f"memory_mb must be >= 16, got {memory_mb}; try memory_mb=1024")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        # the workers' check (`math_worker`'s docstring) and the name logs and errors give them
        self.checker, self.label = checker, label
        self.num_checked = 0
        self.num_timeouts = 0
        self.num_out_of_memory = 0
        self.num_errors = 0
        self.last_error: str | None = None
        self._num_failed_starts = 0
        self._failure: Exception | None = None  # why the pool cannot work, for every caller
        self._ctx = multiprocessing.get_context("spawn")
        self._cond = threading.Condition()
        self._workers: list[_Worker] = []  # every live worker: starting, idle or busy
        self._idle: deque[_Worker] = deque()  # started and free
        self._finalizer = weakref.finalize(self, _stop_all, self._workers, self._idle)
        with self._cond:
            for _ in range(num_workers):
                self._start_worker()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._finalizer()
            self._cond.notify_all()

    @property
    def is_closed(self) -> bool:
        return not self._finalizer.alive

    def stats(self) -> dict[str, int]:
        return {
            "num_checked": self.num_checked,
            "num_timeouts": self.num_timeouts,
            "num_out_of_memory": self.num_out_of_memory,
            "num_errors": self.num_errors,
        }

    def wait_until_ready(self, timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
        """Block until every worker has started (benchmarks and tests time the checks alone)."""
        with self._cond:
            is_ready = self._cond.wait_for(
                lambda: self._failure is not None or len(self._idle) == len(self._workers),
                timeout_s,
            )
            self._raise_if_unusable()
            if not is_ready:
                raise TimeoutError(f"{self.label} workers did not start within {timeout_s} s")

    def score(self, completion: str, answer: str) -> float:
        """1.0 if the completion's final answer equals `answer`, else 0.0."""
        return self.score_batch([(completion, answer)])[0]

    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Score (completion, answer) pairs concurrently across the free workers, in input
        order."""
        return [score for score, _ in self.check_batch(pairs)]

    def check_batch(self, items: Sequence[tuple]) -> list[tuple[float, str | None]]:
        """Each item's (score, why it failed or None), in input order: a failed item (it ran
        past the timeout, hit the memory cap, raised, or its worker died) scores 0.0."""
        rewards = [0.0] * len(items)
        failures: list[str | None] = [None] * len(items)
        todo = deque(range(len(items)))
        running: dict[_Worker, tuple[int, float]] = {}  # worker -> (item, its deadline)
        try:
            while todo or running:
                self._dispatch(todo, running, items)
                self._collect(running, rewards, failures, is_queued=bool(todo))
        except BaseException:  # an interrupted call: its busy workers' replies would be stale
            with self._cond:
                for worker in running:
                    self._replace(worker)
            raise
        with self._cond:
            self.num_checked += len(items)
        return list(zip(rewards, failures, strict=True))

    # ---- taking, returning and replacing workers (under self._cond)

    def _raise_if_unusable(self) -> None:
        if self.is_closed:
            raise RuntimeError("this MathVerifier is closed; create a new one")
        if self._failure is not None:
            raise self._failure

    def _start_worker(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=worker_main,
            args=(child_conn, self.memory_mb, self.checker),
            name=f"reinforge-{self.label}",
            daemon=True,
        )
        process.start()
        child_conn.close()  # the child holds its end; closing ours lets recv() see its death
        worker = _Worker(process, parent_conn)
        self._workers.append(worker)
        threading.Thread(
            target=self._await_start, args=(worker,), name=f"{self.label}-start", daemon=True
        ).start()

    def _replace(self, worker: _Worker) -> None:
        if worker not in self._workers:  # the verifier was closed meanwhile
            return
        self._workers.remove(worker)
        _stop_worker(worker)
        self._start_worker()

    def _release(self, worker: _Worker) -> None:
        with self._cond:  # a re-entrant lock: callers may hold it already
            if worker in self._workers:
                self._idle.append(worker)
                self._cond.notify_all()

    def _await_start(self, worker: _Worker) -> None:
        """In a thread per starting worker: wait for its 'ready', then offer it to callers."""
        try:
            has_news = worker.conn.poll(_STARTUP_TIMEOUT_S)
            kind, value = worker.conn.recv() if has_news else ("slow", None)
        except (EOFError, OSError):  # it died starting, or the verifier closed it
            kind, value = "died", None
        with self._cond:
            if worker not in self._workers:
                return
            if kind == "ready":
                self._num_failed_starts = 0
                self._idle.append(worker)
                global _said_no_memory_limit
                if not value and not _said_no_memory_limit:
                    _said_no_memory_limit = True
                    log.warning(
                        "%s workers run without a memory limit on %s (Linux only)",
                        self.label,
                        sys.platform,
                    )
            elif kind == "failed":
                self._failure = ConfigError(f"{self.label} workers cannot start: {value}")
            elif kind == "slow":
                self._failure = RuntimeError(
                    f"a {self.label} worker did not start within {_STARTUP_TIMEOUT_S:.0f} s"
                )
            else:
                self._num_failed_starts += 1
                if self._num_failed_starts > _MAX_FAILED_STARTS:
                    code = worker.process.exitcode
                    self._failure = RuntimeError(
                        f"{self.label} workers keep exiting while starting (last exit code {code})"
                    )
                else:
                    self._replace(worker)
            self._cond.notify_all()

    # ---- one call's items

    def _dispatch(
        self, todo: deque[int], running: dict[_Worker, tuple[int, float]], pairs: Sequence
    ) -> None:
        """Hand queued items to free workers; block for one only when this call has nothing
        running."""
        if not todo:
            return
        with self._cond:
            self._cond.wait_for(
                lambda: self.is_closed or self._failure is not None or self._idle or running
            )
            self._raise_if_unusable()
            taken = [
                (self._idle.popleft(), todo.popleft())
                for _ in range(min(len(self._idle), len(todo)))
            ]
        for worker, item in taken:
            if self._send(worker, pairs[item]):
                running[worker] = (item, time.monotonic() + self.timeout_s)
            else:
                todo.appendleft(item)

    def _send(self, worker: _Worker, pair: tuple[str, str]) -> bool:
        """Give a free worker an item; False (and the worker replaced) when it died while idle
        (the OOM killer), so its successor takes the item."""
        with contextlib.suppress(OSError):
            if worker.process.is_alive():
                worker.conn.send(tuple(pair))
                return True
        with self._cond:
            self._replace(worker)
        return False

    def _collect(
        self,
        running: dict[_Worker, tuple[int, float]],
        rewards: list[float],
        failures: list[str | None],
        is_queued: bool,
    ) -> None:
        """Wait for a reply or the first deadline among this call's running items (briefly,
        when items wait for a worker that another call may free), and act on what happened."""
        if not running:
            return
        timeout = max(0.0, min(d for _, d in running.values()) - time.monotonic())
        try:
            wait([w.conn for w in running], timeout=min(timeout, _POLL_S) if is_queued else timeout)
            now = time.monotonic()
            for worker, (item, deadline) in list(running.items()):
                if worker.conn.poll():
                    del running[worker]
                    self._receive(worker, item, rewards, failures)
                elif now >= deadline:
                    del running[worker]
                    failures[item] = f"ran past the {self.timeout_s:g} s timeout"
                    with self._cond:
                        self.num_timeouts += 1
                        self._replace(worker)
        except OSError:  # close() from another thread closed the pipes
            with self._cond:
                self._raise_if_unusable()
            raise

    def _receive(
        self, worker: _Worker, item: int, rewards: list[float], failures: list[str | None]
    ) -> None:
        try:
            kind, value = worker.conn.recv()
        except EOFError:  # the worker died (killed from outside, a crash in C code)
            kind, value = "died", f"the worker checking item {item} died"
        if kind == "ok":
            rewards[item] = float(value)  # a bool (math-verify) or a score
            self._release(worker)
            return
        failures[item] = value
        with self._cond:
            self.last_error = value
            if kind == "memory":
                self.num_out_of_memory += 1
            else:
                if self.num_errors == 0:
                    log.warning(
                        "%s error (scored 0.0; later ones only counted): %s", self.label, value
                    )
                self.num_errors += 1
            if kind == "error":
                self._release(worker)
            else:
                self._replace(worker)


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier behind `math_reward`, started on first use."""
    global _default
    with _default_lock:
        if _default is None or _default.is_closed:
            _default = MathVerifier()
        return _default


def math_reward(completion: str, task: Task) -> float:
    """1.0 if the completion's final answer equals `task.answer`, else 0.0 (and on timeout)."""
    return default_verifier().score(completion, task.answer)


def math_rewards(completions: Sequence[str], tasks: Sequence[Task]) -> list[float]:
    """`math_reward` over a batch, checked concurrently on the default verifier's workers."""
    pairs = [(c, t.answer) for c, t in zip(completions, tasks, strict=True)]
    return default_verifier().score_batch(pairs)
