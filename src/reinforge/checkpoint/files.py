"""A run's checkpoint folders on disk, below the code that fills them (`checkpoint`,
`checkpoint.sharded`): where they live, the `latest` pointer, the name order, and how a complete
temporary folder is made durable and published (`publish`: fsync, rename, then the pointer, then
pruning), and what a checkpoint holds (`TrainerState`, `Saved`). Plain files only: no torch, so
`models` can find a run's checkpoints cheaply.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.checkpoint.manifest import write_manifest
from reinforge.faults import maybe_fail

TMP_PREFIX = ".tmp-"
EXTRA_STATE_FILE = "algorithm_state.pt"


@dataclass
class TrainerState:
    phase: str  # "sft" or "rl"
    step: int  # optimizer steps completed in this phase
    data_position: int  # train tasks consumed so far (all phases)
    sft_done: bool = False
    micro_batch_tokens: int | None = None  # the run's packing budget, reused on resume
    non_finite_streak: int = 0  # consecutive skipped non-finite steps up to `step`


@dataclass
class Saved:
    """What one checkpoint holds: the live training objects and the trainer's position; a
    resume loads the optimizer and schedule back into the same fields (`load_optimizer`)."""

    model: Any
    tokenizer: Any
    state: TrainerState
    optimizer: Any = None  # None with the scheduler: the weights alone (`sft_final`)
    scheduler: Any = None
    extra_state: dict | None = None  # algorithm state beyond model and optimizer
    rng: dict | None = None  # None: every RNG's state at save time


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoints_dir(run_dir)
    name = read_latest(root)
    if name is None:
        return None
    path = root / name
    assert (path / "trainer_state.json").exists(), (
        f"`latest` points at an incomplete checkpoint {path}"
    )
    return path


def rng_file(ckpt: Path, rank: int) -> Path:
    """Rank 0's RNG states (the only ones of a single-process run) are `rng.pt`."""
    return ckpt / ("rng.pt" if rank == 0 else f"rng_rank{rank}.pt")


def publish(root: Path, name: str, keep_last: int | None) -> Path:
    """Make the complete temporary folder of checkpoint `name` durable, rename it into place,
    then move `latest` to it, and prune."""
    tmp = root / f"{TMP_PREFIX}{name}"
    write_manifest(tmp)
    _fsync_dir(tmp)
    maybe_fail("checkpoint")  # drills: a crash with every file written, before the rename
    final = root / name
    if final.exists():  # left by a crash before `latest` moved to it: never the one loaded
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_parent(final)
    maybe_fail("checkpoint")  # drills: a crash after the rename, before the pointer
    write_atomic(root / "latest", name)
    if keep_last is not None:
        _prune(root, keep_last, keep={name})
    return final


def clean_incomplete(run_dir: Path) -> list[str]:
    """Before resuming: remove half-written folders and checkpoints newer than `latest` (a crash
    between a rename and the pointer; the resumed run writes them again). Returns their names."""
    root = checkpoints_dir(run_dir)
    latest = read_latest(root)
    assert latest is not None, f"nothing to resume in {root}"
    removed = []
    for path in sorted(root.iterdir()):
        is_tmp = path.name.startswith(TMP_PREFIX) or path.name == "latest.tmp"
        is_newer = path.is_dir() and checkpoint_order(path.name) > checkpoint_order(latest)
        if is_tmp or is_newer:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
            removed.append(path.name)
    return removed


def read_latest(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def checkpoint_order(name: str) -> tuple[int, int]:
    """Where a checkpoint name sits in a run: SFT steps, the SFT result, then RL steps."""
    kind, _, step = name.rpartition("_")
    if name == "sft_final":
        return (1, 0)
    if kind in ("sft_step", "step") and step.isdigit():
        return (0 if kind == "sft_step" else 2, int(step))
    return (-1, 0)  # not a checkpoint folder this module writes: never removed as newer


def _prune(root: Path, keep_last: int, keep: set[str]) -> None:
    """Keep the newest `keep_last` folders of the saved one's kind (`step_*` or `sft_step_*`)."""
    (saved,) = keep
    family = saved.rstrip("0123456789")
    steps = sorted(p for p in root.glob(f"{family}*") if p.is_dir())
    for old in steps[:-keep_last]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_parent(path)


def _fsync_dir(path: Path) -> None:
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_folder(path)


def _fsync_parent(path: Path) -> None:
    _fsync_folder(path.parent)


def _fsync_folder(path: Path) -> None:
    """Make the names in a folder (a rename, a new file) durable: fsync the folder (POSIX)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
