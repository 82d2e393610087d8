"""Whether the update runs from the engine's records (`train.engine_records`), and their life
over an RL step: reset before each rollout, stale after each optimizer step.

The records (`engine.records`, `train.packing.records`) replace a checkpointed micro-batch's
first forward with the engine's own, made during generation on the same weights. They apply in
one process with the local paged engine, a dense model, gradient checkpointing on (without it
the plain forward keeps its activations and there is no forward to save) and host memory for a
rollout's rows (`HOST_SHARE` of it at most; past it a rollout's micro-batches run as before).
"""

from __future__ import annotations

import os

from reinforge.distributed import is_distributed
from reinforge.metrics import console

HOST_SHARE = 0.4  # of the host's memory, at most, for one rollout's records


def records_blocker(cfg, learner) -> str | None:
    """Why this run's update does not run from the engine's records (None: it does)."""
    value = cfg.train.engine_records
    if value is False:
        return "train.engine_records = false"
    engine = learner.policy.engine
    runner = getattr(engine, "runner", None)
    if runner is None or getattr(engine, "fallback", None) is not None:
        return "no local paged engine"
    if value == "auto" and runner.device.type != "cuda":
        return "auto: not on CUDA"
    if is_distributed():
        return "several processes"
    if not learner.policy.setup.memory.gradient_checkpointing:
        return "gradient checkpointing is off (no first forward to save)"
    config = learner.policy.model.config
    if any(
        getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    ):
        return "a mixture-of-experts model"
    if cfg.algorithm.routing_replay:
        return "routing replay"
    need = rollout_record_bytes(cfg, learner.policy.model)
    if need > HOST_SHARE * host_bytes():
        return (
            f"a rollout's records would take ~{need / 2**30:.0f} GiB of host memory, over "
            f"{HOST_SHARE:.0%} of its {host_bytes() / 2**30:.0f} GiB"
        )
    return None


def rollout_record_bytes(cfg, model) -> int:
    """A rollout's records at least: every sampled token's row (its prompts add more)."""
    r, config = cfg.rollout, model.config
    tokens = r.prompts_per_step * r.samples_per_prompt * r.max_new_tokens
    row = config.num_hidden_layers * config.hidden_size * next(model.parameters()).element_size()
    return tokens * row


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def start_records(cfg, learner) -> None:
    """Attach a record store to the engine where the update can use it (`records_blocker`);
    an explicit `train.engine_records = true` that cannot apply says why, once."""
    blocker = records_blocker(cfg, learner)
    if blocker is None:
        store = learner.policy.engine.runner.record_hidden(int(HOST_SHARE * host_bytes()))
        # the LM head's statistics serve at the trainer's temperature only
        store.trainer_temperature = float(cfg.rollout.temperature or 1.0)
    elif cfg.train.engine_records is True:
        console.print(f"[yellow]train.engine_records = true has no effect here: {blocker}[/]")


def store_of(learner):
    runner = getattr(learner.policy.engine, "runner", None)
    return getattr(runner, "records", None)


def begin_rollout(learner) -> None:
    """The rollout about to run writes fresh rows (the last step's are consumed)."""
    store = store_of(learner)
    if store is not None:
        store.reset()


def records_ready(learner, device) -> None:
    """Before the update reads the rollout's rows: their copies to the host done, and the
    device's table of the host chunks up to date (a kept graph's replays read it, and run no
    Python that could update it)."""
    store = store_of(learner)
    if store is not None and store.num_rows > 1:
        store.wait()
        if device.type == "cuda":
            store.pointer_table(device)


def weights_changed(learner) -> None:
    """After an optimizer step: the rows written so far came from the old weights."""
    store = store_of(learner)
    if store is not None:
        store.invalidate()
