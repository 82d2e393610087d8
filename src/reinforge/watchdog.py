"""Hang watchdog: phases beat, a monitor thread notices silence.

The trainer wraps each phase (generation, reward, tool, training, checkpoint) in `phase(name)`
and calls `beat()` inside long loops. When no beat arrives for `timeout_s`, the watchdog writes
every thread's stack to stderr and to `hang.txt` in the run directory, runs the `on_hang`
callback (which may save a checkpoint if the state is consistent, e.g. between steps), and ends
the process with `ExitCode.HANG`, naming the phase that hung. It cannot interrupt a hung C call,
which is why it exits the process instead of raising.
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

from reinforge.errors import ExitCode


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        run_dir: Path | None = None,
        on_hang: Callable[[str], None] | None = None,
        rank: int = 0,
        poll_s: float | None = None,
    ):
        assert timeout_s > 0
        self.timeout_s = timeout_s
        self.run_dir = run_dir
        self.on_hang = on_hang
        self.rank = rank
        self.poll_s = poll_s or min(1.0, timeout_s / 4)
        self.current_phase = "startup"
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
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
        previous = self.current_phase
        self.beat(name)
        try:
            yield
        finally:
            self.beat(previous)

    def seconds_since_beat(self) -> float:
        return time.monotonic() - self._last_beat

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.seconds_since_beat() > self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        phase = self.current_phase
        header = (
            f"\nreinforge watchdog: no progress for {self.seconds_since_beat():.0f}s in phase "
            f"'{phase}' (rank {self.rank}, limit {self.timeout_s:.0f}s); stacks of every thread follow\n"
        )
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.run_dir is not None:
            path = Path(self.run_dir) / (
                "hang.txt" if self.rank == 0 else f"hang.rank{self.rank}.txt"
            )
            with open(path, "w") as f:
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        if self.on_hang is not None:
            try:
                self.on_hang(phase)
            except Exception as e:  # the process is ending either way; say why saving failed
                sys.stderr.write(f"watchdog: saving after the hang failed: {e!r}\n")
        sys.stderr.write(
            f"reinforge: hung in phase '{phase}'; exiting with code {int(ExitCode.HANG)}\n"
        )
        sys.stderr.flush()
        os._exit(ExitCode.HANG)
