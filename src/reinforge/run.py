"""A run's life around the trainer: its directory, signals, and the summary it ends with.

Ctrl-C or SIGTERM asks the trainer to stop at the next step boundary; the trainer saves a
checkpoint and raises `Stopped`, and the command exits with `ExitCode.STOPPED_AFTER_SAVE` and
says how to resume. A second signal stops at once.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError, RunFailure


class Stopped(Exception):
    """Raised at a step boundary after a stop signal, once the checkpoint is on disk."""

    def __init__(self, signal_name: str, checkpoint: Path | None):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.checkpoint = checkpoint


def _component_notes() -> list[str]:
    """What parts built for this run asked the summary to say (the code sandbox's gaps)."""
    from reinforge.envs.sandbox import containment_notes

    return containment_notes()


@dataclass
class Summary:
    command: str
    run_dir: Path
    steps_trained: int = 0
    final_step: int = 0
    eval_before: float | None = None
    eval_after: float | None = None
    sft_eval_before: float | None = None
    wall_s: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)  # failures counted over the run
    notes: list[str] = field(default_factory=_component_notes)  # built before the Summary
    extra: dict[str, Any] = field(default_factory=dict)


def run_dir_of(cfg) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


class RunContext:
    """Under torchrun every process checks the run directory, the main one alone changes it, and
    the others wait until it has."""

    def __init__(
        self,
        run_dir: Path,
        resume: bool,
        overwrite: bool,
        config_toml: str,
        on_damaged: str = "previous",
    ):
        from reinforge.distributed import barrier_all, is_launched, is_main

        self.run_dir = run_dir
        self.resume = resume
        self.on_damaged = on_damaged  # checkpoint.on_damaged: what a damaged `latest` means
        self.started = time.perf_counter()
        self.stop_signal: str | None = None
        problem = None
        if resume:
            if not (run_dir / "checkpoints" / "latest").exists():
                problem = (
                    f"--resume {run_dir}: no checkpoint found there (expected {run_dir}/checkpoints/latest); "
                    "start a new run without --resume"
                )
        elif run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
            problem = (
                f"run directory {run_dir} already holds a run; continue it with --resume {run_dir}, "
                f"choose another run.name, or set run.overwrite=true to replace it"
            )
        _agree_on(problem)  # every process has looked before the main one changes anything
        failure = None
        if is_main():
            try:
                self._prepare(config_toml)
            except RunFailure as e:  # a damaged checkpoint: every process stops, none waits
                failure = e
        failure = _from_main(failure)
        if failure is not None:
            raise failure
        barrier_all()
        if is_launched():  # every node must see the folder rank 0 just prepared
            from reinforge.cluster import check_shared_run_dir

            check_shared_run_dir(run_dir, is_writer=is_main())

    def _prepare(self, config_toml: str) -> None:
        run_dir = self.run_dir
        if self.resume:
            from reinforge.checkpoint import prepare_resume

            for note in prepare_resume(run_dir, self.on_damaged):  # type: ignore[arg-type]
                print(note, file=sys.stderr)
            print(resume_point(run_dir))
        elif run_dir.exists() and any(run_dir.iterdir()):
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_toml)

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop_signal is not None:
                raise KeyboardInterrupt(f"second {name}: stopping without saving")
            self.stop_signal = name
            print(
                f"\n{name} received: finishing this step, saving a checkpoint, then stopping "
                "(send it again to stop at once)",
                flush=True,
            )

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    @property
    def should_stop(self) -> bool:
        return self.stop_signal is not None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _agree_on(problem: str | None) -> None:
    """Raise `problem` as a ConfigError; under torchrun on every process when any has one."""
    from reinforge.distributed import is_launched

    if is_launched():
        from reinforge.cluster import agree_on_problems

        agree_on_problems(problem)
    elif problem is not None:
        raise ConfigError(problem)


def _from_main(failure: RunFailure | None) -> RunFailure | None:
    """The main process's failure, on every process of a torchrun job (rank 0 is the main)."""
    from reinforge.distributed import is_launched

    if not is_launched():
        return failure
    import torch.distributed

    shared = [failure]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def resume_point(run_dir: Path) -> str:
    """The line a resumed run starts with: which checkpoint, which phase and step."""
    from reinforge.checkpoint import load_trainer_state
    from reinforge.checkpoint.files import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None  # checked in __init__
    state = load_trainer_state(ckpt)
    if state.phase == "sft":
        where = f"after SFT step {state.step}"
    elif state.step == 0:
        where = "after the SFT stage, before RL step 1"
    else:
        where = f"after RL step {state.step}"
    return (
        f"resuming {run_dir} {where} (checkpoint {ckpt.name}, "
        f"{state.data_position} training tasks consumed)"
    )


@contextmanager
def guarded(cfg, ctx: RunContext) -> Iterator[None]:
    """The run's hang watchdog and fault plan (a drill, when `[faults]` sets a rate), for the
    block's duration."""
    from reinforge import faults, watchdog
    from reinforge.distributed import is_launched

    w, f = cfg.watchdog, cfg.faults
    faults.install(faults.FaultPlan(f.rates(), tuple(f.kinds), f.hang_s, f.seed))
    save_on_hang = w.save_on_hang and not is_launched()  # the other processes are elsewhere
    try:
        with watchdog.armed(w.timeout_s, w.startup_timeout_s, ctx.run_dir, save_on_hang):
            yield
    finally:
        faults.install(None)
