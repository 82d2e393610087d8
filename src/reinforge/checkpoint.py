"""Checkpoints that a crash cannot corrupt, and exact resume.

A checkpoint folder is a loadable HF checkpoint (config, safetensors weights, tokenizer) plus
`optimizer.pt` (optimizer and schedule), `rng.pt` (every RNG state), `trainer_state.json`
(phase, step, data position) and, when the trainer has any, `algorithm_state.pt` (state beyond
the model and optimizer: a value head, an EMA baseline). It is written under a temporary name and renamed into place; the
`latest` pointer is replaced atomically after it. Folders left half-written by a crash keep their
temporary name, are never loaded, and are removed by the next save.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

TMP_PREFIX = ".tmp-"
EXTRA_STATE_FILE = "algorithm_state.pt"


@dataclass
class TrainerState:
    phase: str  # "sft" or "rl"
    step: int  # optimizer steps completed in this phase
    data_position: int  # train tasks consumed so far (all phases)
    sft_done: bool = False
    micro_batch_tokens: int | None = None  # the run's packing budget, reused on resume


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path,
    name: str,
    model,
    tokenizer,
    optimizer,
    scheduler,
    state: TrainerState,
    keep_last: int | None = None,
    extra_state: dict | None = None,
) -> Path:
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{TMP_PREFIX}{name}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if optimizer is not None:
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            tmp / "optimizer.pt",
        )
    if extra_state is not None:
        torch.save(extra_state, tmp / EXTRA_STATE_FILE)
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    _fsync_dir(tmp)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / "latest", name)
    if keep_last is not None:
        _prune(root, keep_last, keep={name})
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoints_dir(run_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    assert (path / "trainer_state.json").exists(), (
        f"`latest` points at an incomplete checkpoint {path}"
    )
    return path


def load_trainer_state(ckpt: Path) -> TrainerState:
    return TrainerState(**json.loads((ckpt / "trainer_state.json").read_text()))


def load_optimizer(ckpt: Path, optimizer, scheduler) -> None:
    blob = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])


def load_extra_state(ckpt: Path) -> dict:
    path = ckpt / EXTRA_STATE_FILE
    assert path.exists(), f"{ckpt} has no {EXTRA_STATE_FILE}: not written by an RL step"
    return torch.load(path, map_location="cpu", weights_only=False)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(ckpt: Path) -> None:
    state = torch.load(ckpt / "rng.pt", map_location="cpu", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _prune(root: Path, keep_last: int, keep: set[str]) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep_last]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
