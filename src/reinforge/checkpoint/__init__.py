"""A run's saved state: atomic save and exact resume (here), the folder layout, `latest` pointer
and publishing (`files`), per-file hashes (`manifest`) and the torch.distributed.checkpoint path
(`sharded`). It may import `errors`, `faults` and `distributed`; it sits below `models`, which
finds a run's checkpoints through it.

Checkpoints that a crash cannot corrupt, and exact resume.

A checkpoint folder is a loadable HF checkpoint (config, safetensors weights, tokenizer) plus
`optimizer.pt` (optimizer and schedule), `rng.pt` (every RNG state), `trainer_state.json`
(phase, step, data position) and, when the trainer has any, `algorithm_state.pt` (state beyond
the model and optimizer: a value head, an EMA baseline).

The contract:
- A folder is written under a temporary name, every file fsynced, then renamed into place; the
  `latest` pointer is replaced atomically after it. A crash at any moment leaves `latest` naming
  a complete checkpoint (or no pointer at all).
- Folders left half-written keep their temporary name and are never loaded; resuming removes them,
  and step folders newer than `latest` (a crash between the rename and the pointer), which the
  resumed run writes again (`clean_incomplete`).
- Every folder carries `manifest.json`, each file's size and hash; a resume checks `latest`
  against it and, when a file was damaged on disk, falls back to the newest intact checkpoint
  or stops, as `checkpoint.on_damaged` says (`prepare_resume`, `checkpoint.manifest`).
- `keep_last` step folders stay on disk; `latest` is never pruned.
- A state with a non-finite parameter is never written (`NonFiniteState`).
- In a distributed run (torchrun) the optimizer state and trainable weights are saved through
  torch.distributed.checkpoint as well, and resume on any number of processes
  (`checkpoint.sharded`); saves are then synchronous.
- `asynchronous=True` copies every tensor to host memory first (the only part training waits
  for), then writes in a background thread: the copy is the checkpoint's own, so training cannot
  overwrite what is being saved. One save is in flight at a time; the next save, and
  `wait_for_saves`, wait for it and raise its error.
"""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reinforge.checkpoint.files import (
    EXTRA_STATE_FILE,
    TMP_PREFIX,
    Saved,
    TrainerState,
    checkpoint_order,
    checkpoints_dir,
    clean_incomplete,
    publish,
    read_latest,
    rng_file,
    write_atomic,
)
from reinforge.checkpoint.manifest import OnDamaged, choose_intact
from reinforge.distributed import any_rank, is_distributed, rank
from reinforge.errors import RunFailure
from reinforge.faults import maybe_fail
from reinforge.sharding import local_tensor


class NonFiniteState(RunFailure):
    """The model holds a NaN or infinity: saving it would make the last good checkpoint unusable."""


@dataclass
class _Snapshot:
    """Everything one checkpoint writes, detached from the live training objects when async."""

    model: Any
    tokenizer: Any
    model_state: dict | None  # None: save the live model's own tensors
    optimizer_blob: dict | None
    extra_state: dict | None
    rng: dict
    state: dict


def checkpoint_bytes(model, optimizer_state_bytes: int) -> int:
    """About what one checkpoint of `model` writes: its weights (a LoRA model: the adapter
    only), `optimizer_state_bytes` per trainable parameter, and, under torchrun, the weights once
    more in the sharded copy. Global sizes: a DTensor shard counts as its whole tensor."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    saved = trainable if hasattr(model, "peft_config") else params
    weights = sum(p.numel() * p.element_size() for p in saved)
    states = sum(p.numel() for p in trainable) * optimizer_state_bytes
    return weights + states + (weights if is_distributed() else 0)


def check_disk_room(run_dir: Path, need: int, keep_last: int) -> str | None:
    """Before training: a ConfigError when one checkpoint of `need` bytes cannot fit where the
    run writes them (found at the first save otherwise, hours in, as an I/O error deep inside
    torch.save); a warning (returned) when fewer than `keep_last` + 1 fit (a new checkpoint is
    written before the oldest is pruned). Every training process agrees."""
    from reinforge.errors import ConfigError

    probe = checkpoints_dir(run_dir)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if any_rank(free < need):
        raise ConfigError(
            f"a checkpoint of this run is about {need / 2**30:.1f} GiB (weights and optimizer "
            f"states) but {probe} has {free / 2**30:.1f} GiB free: set run.output_dir to a folder "
            f"on a disk with at least {need / 2**30:.0f} GiB free"
        )
    fits = free // max(need, 1)
    if fits < keep_last + 1:
        return (
            f"disk: {probe} has room for {fits} checkpoint(s) of {need / 2**30:.1f} GiB; "
            f"checkpoint.keep_last = {keep_last} needs {keep_last + 1} while a new one is written "
            f"(set checkpoint.keep_last = {max(fits - 1, 1)}, or free space)"
        )
    return None


def save_checkpoint(
    run_dir: Path,
    name: str,
    saved: Saved,
    keep_last: int | None = None,
    asynchronous: bool = False,
) -> Path:
    """Write checkpoint `name`; returns its final path (durable once this returns, or, when
    asynchronous, once the next save or `wait_for_saves` returns)."""
    wait_for_saves()
    root = checkpoints_dir(run_dir)
    assert read_latest(root) != name, f"checkpoint {name} is `latest`; it is never rewritten"
    check_finite(saved.model, name)
    saved = replace(saved, rng=saved.rng or rng_state())
    if is_distributed():  # every rank writes its shards (collective; never asynchronous)
        from reinforge.checkpoint.sharded import save_sharded

        return save_sharded(root, name, saved, keep_last)
    optimizer_blob = (
        {"optimizer": saved.optimizer.state_dict(), "scheduler": saved.scheduler.state_dict()}
        if saved.optimizer is not None
        else None
    )
    snap = _Snapshot(
        saved.model,
        saved.tokenizer,
        None,
        optimizer_blob,
        saved.extra_state,
        saved.rng,
        asdict(saved.state),
    )
    if not asynchronous:
        return _write(root, name, snap, keep_last)
    snap.model_state = host_copy(saved.model.state_dict())
    snap.optimizer_blob, snap.extra_state = host_copy((optimizer_blob, saved.extra_state))
    global _pending
    _pending = _writer().submit(_write, root, name, snap, keep_last)
    return root / name


def wait_for_saves() -> None:
    """Block until the save in flight (if any) is durable; raise its error if it failed."""
    global _pending
    pending, _pending = _pending, None
    if pending is not None:
        pending.result()


def check_finite(model, name: str) -> None:
    """Refuse to save a NaN or infinity (each rank checks its own shards; all ranks agree)."""
    params = [local_tensor(p.detach()) for p in model.parameters()]
    is_finite = not params or bool(torch.stack([torch.isfinite(p).all() for p in params]).all())
    if any_rank(not is_finite):
        named = model.named_parameters()
        bad = next((n for n, p in named if not torch.isfinite(local_tensor(p)).all()), None)
        raise NonFiniteState(
            f"not saving checkpoint {name}: parameter {bad or '(on another rank)'} holds NaN or "
            "infinity; the last checkpoint on disk is the last good state"
        )


def _write(root: Path, name: str, snap: _Snapshot, keep_last: int | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{TMP_PREFIX}{name}"
    if snap.model_state is None:
        snap.model.save_pretrained(tmp, safe_serialization=True)
    else:
        snap.model.save_pretrained(tmp, safe_serialization=True, state_dict=snap.model_state)
    maybe_fail("checkpoint")  # drills: a crash after the weights, before the rest
    snap.tokenizer.save_pretrained(tmp)
    if snap.optimizer_blob is not None:
        torch.save(snap.optimizer_blob, tmp / "optimizer.pt")
    if snap.extra_state is not None:
        torch.save(snap.extra_state, tmp / EXTRA_STATE_FILE)
    torch.save(snap.rng, tmp / "rng.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(snap.state, indent=2))
    return publish(root, name, keep_last)


def prepare_resume(run_dir: Path, on_damaged: OnDamaged = "previous") -> list[str]:
    """Before resuming (the main process): make `latest` name an intact checkpoint (its files
    against its manifest; `checkpoint.manifest.choose_intact`), then `clean_incomplete`.
    Returns what to report."""
    root = checkpoints_dir(run_dir)
    latest = read_latest(root)
    assert latest is not None, f"nothing to resume in {root}"
    chosen, notes = choose_intact(root, latest, on_damaged, checkpoint_order)
    if chosen != latest:
        write_atomic(root / "latest", chosen)
    removed = clean_incomplete(run_dir)
    if removed:
        notes.append(f"resume: removed what a crash left unfinished: {', '.join(removed)}")
    return notes


def load_trainer_state(ckpt: Path) -> TrainerState:
    return TrainerState(**json.loads((ckpt / "trainer_state.json").read_text()))


def load_optimizer(ckpt: Path, into: Saved) -> None:
    """The optimizer and schedule saved in `ckpt`, loaded into `into.optimizer` and
    `into.scheduler`. A checkpoint of a distributed run, or any checkpoint resumed by one, goes
    through `checkpoint.sharded` (DCP names optimizer states by `into.model`'s parameters)."""
    from reinforge.checkpoint.sharded import is_sharded, load_full_optimizer, load_sharded

    if is_sharded(ckpt):
        load_sharded(ckpt, into)
        return
    blob = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)
    if is_distributed():
        load_full_optimizer(blob["optimizer"], into.model, into.optimizer)
    else:
        into.optimizer.load_state_dict(blob["optimizer"])
    into.scheduler.load_state_dict(blob["scheduler"])


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
    """This rank's RNG states; a rank the saving run did not have takes rank 0's."""
    path = rng_file(ckpt, rank())
    state = torch.load(
        path if path.exists() else rng_file(ckpt, 0), map_location="cpu", weights_only=False
    )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def host_copy(obj: Any, _memo: dict | None = None) -> Any:
    """`obj` with every tensor copied to host memory; tensors that shared storage (tied weights)
    share it in the copy too, so the saved file is the one a synchronous save writes."""
    memo = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage().data_ptr()
        key = (obj.device, storage, obj.storage_offset(), obj.dtype, obj.shape, obj.stride())
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, memo)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(host_copy(v, memo) for v in obj)
    return obj


_executor: ThreadPoolExecutor | None = None
_pending: Future | None = None


def _writer() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reinforge-checkpoint")
    return _executor
