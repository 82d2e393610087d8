"""Checkpoints of a distributed run, through torch.distributed.checkpoint (DCP): saved on N
processes, resumed on N, on another count, or on one.

A sharded checkpoint folder holds what a single-process one does (`checkpoint`), except that
`optimizer.pt` gives way to:
- `dcp/`: the trainable weights and the optimizer state as DCP shards (a file per rank and the
  metadata), named by parameter through `get_state_dict`, so loading them onto another number
  of processes is DCP's resharding;
- `scheduler.pt`: the learning-rate schedule (the same on every rank);
- `rng_rank{r}.pt`: the RNG states of ranks other than 0 (rank 0's are `rng.pt`).
The HF weights (safetensors, or the PEFT adapter) are gathered to rank 0 and written as one
process writes them, so `reinforge eval` / `export`, a KL reference and a resume on one process
read the folder like any other.

The crash contract is `checkpoint`'s: every rank writes into the temporary folder, and once all
have finished rank 0 makes it durable, renames it and moves `latest`. Several nodes need the run
directory on a filesystem they all see.

Resuming a single-process checkpoint on N processes (`load_full_optimizer`): its optimizer state
is indexed by parameter position; the positions are mapped to the parameters' names (the
optimizer's groups list them in the same order however the model is sharded) and DCP's
`set_optimizer_state_dict` shards the full state.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from reinforge.checkpoint.files import EXTRA_STATE_FILE, TMP_PREFIX, Saved, publish, rng_file
from reinforge.distributed import barrier, is_main, rank, train_group

DCP_DIR = "dcp"
SCHEDULER_FILE = "scheduler.pt"


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / DCP_DIR).is_dir()


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # frozen weights (a LoRA base) are the HF files' and `model.path`'s: not saved twice
    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def save_sharded(root: Path, name: str, saved: Saved, keep_last: int | None) -> Path:
    """Write checkpoint `name` from every rank (a collective); returns its final path, durable
    on every rank once this returns. `saved.rng` is this rank's RNG states."""
    model, optimizer, rng = saved.model, saved.optimizer, saved.rng
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    tmp = root / f"{TMP_PREFIX}{name}"
    if is_main():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / DCP_DIR).mkdir(parents=True)
    barrier()
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer, options=_options())
        shards = {"model": model_state, "optim": optim_state}
    else:
        shards = {"model": get_model_state_dict(model, options=_options())}
    dcp.save(shards, checkpoint_id=tmp / DCP_DIR, process_group=train_group())
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=full_options)  # on rank 0 only
    if rank() != 0:
        torch.save(rng, rng_file(tmp, rank()))
    barrier()  # after the gathers: rank 0 writes the rest alone
    if is_main():
        model.save_pretrained(tmp, safe_serialization=True, state_dict=full)
        saved.tokenizer.save_pretrained(tmp)
        if saved.scheduler is not None:
            torch.save({"scheduler": saved.scheduler.state_dict()}, tmp / SCHEDULER_FILE)
        if saved.extra_state is not None:
            torch.save(saved.extra_state, tmp / EXTRA_STATE_FILE)
        torch.save(rng, rng_file(tmp, 0))
        (tmp / "trainer_state.json").write_text(json.dumps(asdict(saved.state), indent=2))
        publish(root, name, keep_last)
    barrier()
    return root / name


def load_sharded(ckpt: Path, into: Saved) -> None:
    """Trainable weights and optimizer state from `ckpt`'s DCP shards, resharded onto this
    run's processes (one process: no process group needed), and the schedule: into `into`'s
    model, optimizer and scheduler."""
    model, optimizer = into.model, into.optimizer
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options())
    shards = {"model": model_state, "optim": optim_state}
    dcp.load(
        shards, checkpoint_id=ckpt / DCP_DIR, process_group=train_group()
    )  # fails on any key the checkpoint lacks
    set_state_dict(
        model,
        optimizer,
        model_state_dict=shards["model"],
        optim_state_dict=shards["optim"],
        options=_options(strict=False),  # the frozen weights are not in it, by design
    )
    blob = torch.load(ckpt / SCHEDULER_FILE, map_location="cpu", weights_only=False)
    into.scheduler.load_state_dict(blob["scheduler"])


def load_full_optimizer(saved: dict, model, optimizer) -> None:
    """A single-process optimizer state (`optimizer.state_dict()`, indexed by position in the
    param groups) loaded into the optimizer of a sharded model."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        fqns = [names[id(p)] for p in group["params"]]
        assert len(saved_group["params"]) == len(fqns), "the checkpoint's optimizer differs"
        for index, fqn in zip(saved_group["params"], fqns):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**saved_group, "params": fqns})
    set_optimizer_state_dict(
        model,
        optimizer,
        {"state": state, "param_groups": groups},
        options=_options(full_state_dict=True),
    )
