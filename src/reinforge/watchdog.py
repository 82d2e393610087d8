"""Hang watchdog: phases beat, a monitor thread notices silence.

The trainer runs each phase (generation, reward, tool, training, checkpoint, logging, eval) inside
`phase(name)`; every forward pass of the policy beats too (`beat_on_forward`), so a long rollout is
progress, not silence. When no beat arrives for the phase's limit, the watchdog writes every
thread's stack to stderr and to `hang.txt` (`hang.rank{r}.txt` on other ranks) in the run
directory, saves a checkpoint when the state is consistent, and ends the process with
`ExitCode.HANG`, naming the phase that hung.

The state is consistent outside the phases that change it (training, checkpoint): parameters and
optimizer are still those of the last step boundary, where the loop registered how to save them
(`set_consistent_save`). From the moment the watchdog fires, a main thread that wakes up is held at
its next phase, so it cannot change the weights while they are saved.

The watchdog exits the process instead of raising because it cannot interrupt a hung C call. Its
monitor is a Python thread: a hang inside a C call that holds the GIL (rare: torch, NCCL, sockets
and sleeps release it) stops it too.

One watchdog per process (`armed`); `phase` and `beat` are no-ops when none is armed, so library
code can mark its phases without knowing whether it runs under a trainer.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from reinforge.errors import ExitCode, record_exit

# Phases in which parameters, optimizer and algorithm state equal the last step boundary's.
CONSISTENT_PHASES = frozenset({"generation", "reward", "tool", "logging", "eval"})


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        run_dir: Path | None = None,
        on_hang: Callable[[str], str] | None = None,
        rank: int = 0,
        poll_s: float | None = None,
        phase_limits: dict[str, float] | None = None,
    ):
        assert timeout_s > 0
        self.timeout_s = timeout_s
        self.phase_limits = dict(phase_limits or {})
        self.run_dir = run_dir
        self.on_hang = on_hang
        self.rank = rank
        self.poll_s = poll_s or min(1.0, timeout_s / 4)
        self.current_phase = "startup"
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._firing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="reinforge-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, phase: str | None = None) -> None:
        if phase is not None:
            self.current_phase = phase
        self._last_beat = time.monotonic()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._firing.is_set() and threading.current_thread() is not self._thread:
            threading.Event().wait()  # the process is ending: leave the state being saved alone
        # Once a first phase starts, startup is over: code between phases is the "loop".
        previous = "loop" if self.current_phase == "startup" else self.current_phase
        self.beat(name)
        try:
            yield
        finally:
            self.beat(previous)

    def limit(self) -> float:
        return self.phase_limits.get(self.current_phase, self.timeout_s)

    def seconds_since_beat(self) -> float:
        return time.monotonic() - self._last_beat

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.seconds_since_beat() > self.limit():
                self._fire()
                return

    def _fire(self) -> None:
        self._firing.set()
        phase, limit = self.current_phase, self.limit()
        header = (
            f"\nreinforge watchdog: no progress for {self.seconds_since_beat():.1f}s in phase "
            f"'{phase}' (rank {self.rank}, limit {limit:g}s: watchdog.timeout_s, or "
            "watchdog.startup_timeout_s while starting); stacks of every thread follow\n"
        )
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        path = None
        if self.run_dir is not None:
            name = "hang.txt" if self.rank == 0 else f"hang.rank{self.rank}.txt"
            path = Path(self.run_dir) / name
            with open(path, "w") as f:
                f.write(header.lstrip("\n"))
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        if self.on_hang is not None:
            try:
                outcome = str(self.on_hang(phase))
            except Exception as e:  # the process is ending either way; say why saving failed
                outcome = f"watchdog: saving after the hang failed: {e!r}"
            sys.stderr.write(outcome + "\n")
            if path is not None:  # last, so the file is newer than the checkpoint it names
                with open(path, "a") as f:
                    f.write(outcome + "\n")
        sys.stderr.write(
            f"reinforge: hung in phase '{phase}'; exiting with code {int(ExitCode.HANG)}\n"
        )
        sys.stderr.flush()
        if _before_hang_exit is not None:  # the cluster's heartbeat: the others stop too
            _before_hang_exit(f"hung in phase '{phase}' (exit code {int(ExitCode.HANG)})")
        record_exit(ExitCode.HANG)
        os._exit(ExitCode.HANG)


_active: Watchdog | None = None
_consistent_save: Callable[[], Path | None] | None = None
_before_hang_exit: Callable[[str], None] | None = None


def set_before_hang_exit(tell: Callable[[str], None] | None) -> None:
    """What a hang does last before the process exits (the cluster's heartbeat tells the other
    ranks; registered from above so this module imports nothing of the cluster's)."""
    global _before_hang_exit
    _before_hang_exit = tell


def _save_if_consistent(phase: str) -> str:
    if phase not in CONSISTENT_PHASES:
        return f"watchdog: no checkpoint saved (the state is half-changed in phase '{phase}')"
    if _consistent_save is None:
        return "watchdog: no checkpoint saved (no step has completed in this process)"
    return f"watchdog: checkpoint of the last completed step: {_consistent_save()}"


@contextmanager
def armed(
    timeout_s: float, startup_timeout_s: float, run_dir: Path, save_on_hang: bool = True
) -> Iterator[Watchdog | None]:
    """Watch this process while the block runs (timeout_s 0: not at all)."""
    global _active, _consistent_save
    assert _active is None, "one watchdog per process"
    if timeout_s <= 0:
        yield None
        return
    rank = int(os.environ.get("RANK", "0"))
    limits = {"startup": max(startup_timeout_s, timeout_s)}
    on_hang = _save_if_consistent if save_on_hang else None
    _active = Watchdog(timeout_s, run_dir, on_hang, rank, phase_limits=limits).start()
    try:
        yield _active
    finally:
        _active.stop()
        _active, _consistent_save = None, None


@contextmanager
def phase(name: str) -> Iterator[None]:
    if _active is None:
        yield
        return
    with _active.phase(name):
        yield


def beat() -> None:
    if _active is not None:
        _active.beat()


def set_consistent_save(save: Callable[[], Path | None] | None) -> None:
    """How to checkpoint the state as of now, should a later consistent phase hang. Called at step
    boundaries with a function that saves a snapshot of the loop's position."""
    global _consistent_save
    _consistent_save = save


def beat_on_forward(model) -> None:
    """Beat on every forward pass of `model` (through its input embeddings, which every forward
    uses and which survive LoRA attach and merge). Idempotent."""
    embeddings = model.get_input_embeddings()
    if not getattr(embeddings, "_reinforge_beats", False):
        embeddings.register_forward_hook(lambda *_: beat())
        embeddings._reinforge_beats = True
