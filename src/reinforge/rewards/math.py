"""Math answer checking with math-verify, in worker processes with a hard wall-clock timeout.

`math_reward(completion, task)` is 1.0 when the completion's final answer is mathematically
equal to `task.answer` (`1/2`, `0.5` and `\\frac{1}{2}` are one answer; `x=3` and `3` too), else
0.0. The answer is taken from the first `\\boxed{...}`, else from "the answer is ..." phrasing,
else from the last expression in the text: math-verify's own extraction does this.

Why processes: sympy can run for minutes on a model's answer (`9^{9^{9^{9}}}`, `(10^{8})!`), and
math-verify's own timeout is `signal.alarm`, which works only on the main thread and cannot
interrupt C code. So `MathVerifier` keeps a small pool of worker processes; an answer that runs
past `timeout_s` has its worker killed and replaced, scores 0.0 and counts one timeout. The
caller never stalls for longer than the timeout, and the other items of a batch keep scoring on
the other workers.

Workers start with the 'spawn' method (safe beside torch and CUDA, and the only one on Windows),
so a script that builds a verifier needs the usual `if __name__ == "__main__":` guard. The
parent process never imports math-verify or sympy; only the workers do.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from reinforge.errors import ConfigError
from reinforge.types import Task

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine; far past this, something broke
_MAX_FAILED_STARTS = 3  # in a row: one killed starting worker is bad luck, several are a bug


# ---- the worker side: runs in a child process --------------------------------------------------


def _check(completion: str, answer: str) -> bool:
    """Whether the completion's final answer equals `answer`. No timeout of its own: call it only
    inside a worker that the parent can kill."""
    from math_verify import (  # type: ignore[import-untyped]
        ExprExtractionConfig,
        LatexExtractionConfig,
        parse,
        verify,
    )

    # A bare ground truth is boxed so that LaTeX like `\sqrt{2}` or `\{1,2\}` parses whole.
    gold_text = answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"
    gold = parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground-truth answer {answer!r}")
    pred_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    pred = parse(completion, extraction_config=pred_config, parsing_timeout=None)
    return bool(pred) and verify(gold, pred, timeout_seconds=None)


def _worker_main(conn: Connection) -> None:
    # Ctrl-C belongs to the parent, which kills its workers on close.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Disabling math-verify's signal timeout logs a warning; here the parent's kill is the timeout.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        _check("$1$", "1")  # import and warm up now, so no item's clock pays for it
    except ImportError as e:
        conn.send(("failed", f"{e}; install it with: pip install 'math-verify>=0.7'"))
        return
    conn.send(("ready", None))
    while True:
        try:
            item = conn.recv()
        except EOFError:  # the parent is gone
            return
        if item is None:
            return
        # Model output is arbitrary text and sympy raises anything on some of it; such an item is
        # an error to count, not a reason to lose the worker.
        try:
            conn.send(("ok", _check(*item)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


# ---- the parent side ----------------------------------------------------------------------------


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    deadline: float  # startup deadline until ready, then the running item's deadline
    is_ready: bool = False
    job: int | None = None  # index in the current batch of the item being checked


def _stop_worker(worker: _Worker, graceful: bool) -> None:
    if graceful and worker.is_ready and worker.job is None:
        # An idle worker may have died on its own (the OOM killer); then there is no one to tell.
        with contextlib.suppress(OSError):
            worker.conn.send(None)
            worker.process.join(timeout=1.0)
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join()
    worker.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        _stop_worker(worker, graceful=True)
    workers.clear()


class MathVerifier:
    """A pool of math-verify worker processes with a per-item wall-clock timeout.

    Counters (cumulative): `num_checked` items scored, `num_timeouts` items that ran past
    `timeout_s` (scored 0.0), `num_errors` items math-verify raised on or whose ground truth did
    not parse (scored 0.0; the latest message is in `last_error`). Thread-safe: concurrent
    callers take turns. Use as a context manager, or call `close()`.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0):
        if num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {num_workers}; try num_workers=2")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}; try timeout_s=5.0")
        self.timeout_s = float(timeout_s)
        self.num_checked = 0
        self.num_timeouts = 0
        self.num_errors = 0
        self.last_error: str | None = None
        self._num_failed_starts = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._finalizer()

    @property
    def is_closed(self) -> bool:
        return not self._finalizer.alive

    def stats(self) -> dict[str, int]:
        return {
            "num_checked": self.num_checked,
            "num_timeouts": self.num_timeouts,
            "num_errors": self.num_errors,
        }

    def score(self, completion: str, answer: str) -> float:
        """1.0 if the completion's final answer equals `answer`, else 0.0."""
        return self.score_batch([(completion, answer)])[0]

    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Score (completion, answer) pairs concurrently across the workers, in input order."""
        with self._lock:
            if self.is_closed:
                raise RuntimeError("this MathVerifier is closed; create a new one")
            for worker in list(self._workers):
                if worker.job is not None:  # left busy by an interrupted batch: its reply is stale
                    self._replace(worker)
            rewards = [0.0] * len(pairs)
            todo = deque(range(len(pairs)))
            while todo or any(w.job is not None for w in self._workers):
                self._dispatch(todo, pairs)
                self._collect(rewards)
            self.num_checked += len(pairs)
            return rewards

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn,), name="reinforge-math-verify", daemon=True
        )
        process.start()
        child_conn.close()  # the child holds its end; closing ours lets recv() see its death
        return _Worker(process, parent_conn, deadline=time.monotonic() + _STARTUP_TIMEOUT_S)

    def _replace(self, worker: _Worker) -> None:
        _stop_worker(worker, graceful=False)
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _dispatch(self, todo: deque[int], pairs: Sequence[tuple[str, str]]) -> None:
        for worker in list(self._workers):
            if todo and worker.is_ready and worker.job is None:
                job = todo.popleft()
                try:
                    worker.conn.send(tuple(pairs[job]))
                except OSError:  # an idle worker died on its own; its replacement takes the item
                    todo.appendleft(job)
                    self._replace(worker)
                    continue
                worker.job, worker.deadline = job, time.monotonic() + self.timeout_s

    def _collect(self, rewards: list[float]) -> None:
        """Wait for the next reply, startup or deadline, and act on whatever happened."""
        waiting = [w for w in self._workers if w.job is not None or not w.is_ready]
        assert waiting, "nothing to wait for while items remain"
        next_deadline = min(w.deadline for w in waiting)
        wait([w.conn for w in waiting], timeout=max(0.0, next_deadline - time.monotonic()))
        for worker in waiting:
            if worker.conn.poll():
                self._receive(worker, rewards)
            elif time.monotonic() >= worker.deadline:
                self._expire(worker)

    def _receive(self, worker: _Worker, rewards: list[float]) -> None:
        try:
            kind, value = worker.conn.recv()
        except EOFError:  # the worker died (out of memory, a crash in C code)
            self._bury(worker)
            return
        if kind == "failed":
            raise ConfigError(f"math rewards need math-verify: {value}")
        if kind == "ready":
            worker.is_ready = True
            self._num_failed_starts = 0
            return
        assert worker.job is not None, f"reply {kind!r} from an idle worker"
        if kind == "ok":
            rewards[worker.job] = 1.0 if value else 0.0
        else:
            self._count_error(value)
        worker.job = None

    def _bury(self, worker: _Worker) -> None:
        if worker.is_ready:
            self._count_error(f"the worker checking item {worker.job} died")
        else:
            self._num_failed_starts += 1
            if self._num_failed_starts > _MAX_FAILED_STARTS:
                code = worker.process.exitcode
                raise RuntimeError(
                    f"math-verify workers keep exiting while starting (last exit code {code})"
                )
        self._replace(worker)

    def _expire(self, worker: _Worker) -> None:
        if not worker.is_ready:
            raise RuntimeError(
                f"a math-verify worker did not start within {_STARTUP_TIMEOUT_S:.0f} s"
            )
        self.num_timeouts += 1
        self._replace(worker)

    def _count_error(self, message: str) -> None:
        if self.num_errors == 0:
            log.warning("math-verify error (scored 0.0; later ones are only counted): %s", message)
        self.num_errors += 1
        self.last_error = message


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
