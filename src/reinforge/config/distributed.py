"""The `[distributed]` section: colocated or disaggregated training, the sharding strategy, the
disaggregated mode's rollout staleness, and the cluster's timeouts (collectives, heartbeat,
rendezvous). Re-exported by `reinforge.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reinforge.config.base import Section


class DistributedSection(Section):
    mode: Literal["colocated", "disaggregated"] = "colocated"
    """How the processes of a torchrun launch share the work (ignored in a single process):
    "colocated": every process generates for its share of a step's prompts and trains (FSDP2,
    the global batch's loss); "disaggregated": the last distributed.generators ranks only
    generate, each with its own copy of the weights, while the other processes train; the
    trainers broadcast the weights to them after each optimizer step and they generate ahead
    meanwhile, so a step trains on samples from weights up to distributed.rollout_staleness
    steps old. The sampler/trainer mismatch is reported as `kl_sampler`; algorithm.tis_cap
    corrects for it (set it, e.g. 2.0)."""
    generators: int = 1
    """The disaggregated mode only: how many processes generate (the last ranks of the launch;
    the others train, so at least one must be left: checked at start, where the number of
    processes is known). Each step's prompts are split among them, each sampling its share with
    the same per-prompt seeds one generator would use, so the rollout does not depend on how
    many there are; the trainers receive every share and broadcast the weights to all of them
    after each optimizer step."""
    rollout_staleness: int | None = None
    """The disaggregated mode only: how many optimizer steps each generator may run ahead of the
    trainers (k). It keeps up to k sampled rollouts queued, each tagged with the weights that
    sampled it, so step s trains on samples from the weights of step s - 1 - k at the oldest
    (logged per step: `rollout_staleness`, `rollout_weights_step`). 0: the generator waits for
    each step's weights before sampling, on-policy (the colocated run's numbers, no overlap);
    1 (the default in the disaggregated mode): generation overlaps training; 2 or more absorb
    uneven rollout times, at more staleness. Correct for it with algorithm.tis_cap and/or
    algorithm.mis_low / mis_high (docs/algorithms.md, "Off-policy by k steps"). Queued rollouts
    are not saved: a resumed run samples its first rollout from the checkpoint's weights."""

    @model_validator(mode="after")
    def _disaggregated_settings_fit_the_mode(self) -> DistributedSection:
        k = self.rollout_staleness
        if k is not None and k < 0:
            raise ValueError(
                f"distributed.rollout_staleness = {k}: it counts the optimizer steps the generator "
                "may run ahead of the trainers; set 0 (on-policy) or 1 (overlap generation "
                "with training)"
            )
        if k and self.mode != "disaggregated":
            raise ValueError(
                f"distributed.rollout_staleness = {k} needs distributed.mode = 'disaggregated' "
                f"(mode is {self.mode!r}): only a separate generator rank can sample ahead of "
                "the trainers; the colocated mode always samples with the current weights. "
                "Set distributed.mode = 'disaggregated' (under torchrun with 2 or more "
                "processes), or remove distributed.rollout_staleness"
            )
        g = self.generators
        if g < 1:
            raise ValueError(
                f"distributed.generators = {g}: it counts the processes that generate in the "
                "disaggregated mode; set 1 (or more, leaving at least one process to train)"
            )
        if g > 1 and self.mode != "disaggregated":
            raise ValueError(
                f"distributed.generators = {g} needs distributed.mode = 'disaggregated' (mode "
                f"is {self.mode!r}): in the colocated mode every process generates its share. "
                "Set distributed.mode = 'disaggregated', or distributed.generators = 1"
            )
        return self

    @property
    def staleness(self) -> int:
        """rollout_staleness resolved: 1 in the disaggregated mode unless set, else 0."""
        if self.rollout_staleness is not None:
            return self.rollout_staleness
        return 1 if self.mode == "disaggregated" else 0

    strategy: Literal["auto", "fsdp", "replicate"] = "auto"
    """How the training processes hold the model (ignored in a single process): "replicate":
    every process holds the whole model, its gradients and optimizer states, as one process
    would, and the gradients are averaged over the processes once per optimizer step (float32
    all-reduce, in buckets): no per-layer gathers, hooks or sharded optimizer, so the fastest
    where it fits; "fsdp": FSDP2 shards the weights, gradients and optimizer states over the
    processes (a model that fits no single GPU). "auto": replicate when the memory planner finds
    it fits without checkpointing, KV-pool or micro-batch sacrifices that FSDP would avoid, else
    FSDP (`--dry-run` shows its choice)."""
    accumulate_unsharded: Literal["auto"] | bool = "auto"
    """Under FSDP, within an optimizer step: keep every layer's weights gathered from the first
    micro-batch to the last and add the micro-batches' gradients up unsharded (float32),
    reduce-scattering them across processes once per step (true), or gather each layer and
    reduce its gradients at every micro-batch (false: least memory). true costs, per process,
    the rest of the weights (gathered) and 4 bytes per parameter (the float32 gradient sum), and
    saves a gather, a reduction and their host work per layer and micro-batch. "auto": the
    memory planner turns it on when it fits beside the rest of the training peak (`--dry-run`
    shows its choice). Ignored in a single process."""
    collective_timeout_s: float = Field(900.0, gt=0.0, le=604_800.0)
    """Seconds one collective (an all-reduce, a broadcast, a barrier) may wait for the other
    processes before the run fails with a message naming it (torch's own default is 30
    minutes). It covers what one process does while the others wait: rank 0 writing a
    checkpoint, a node downloading the model the others have cached; raise it for very large
    models. A frozen or lost process is named sooner, by the heartbeat. Ignored in a single
    process."""
    heartbeat_timeout_s: float = Field(60.0, ge=0.0, le=604_800.0)
    """Every process beats through the job's store several times within this many seconds; a
    process that misses them all for this long (frozen, or its node gone) is named by the
    others, which stop with exit code 6 (checkpoints intact; resume on any number of nodes).
    Independent of training progress (the watchdog watches that). 0 = off."""
    rendezvous_timeout_s: float = Field(300.0, gt=0.0, le=604_800.0)
    """Seconds `reinforge launch` lets the nodes meet (torchrun's --rdzv-conf join_timeout for
    c10d, timeout for the static rendezvous; torchrun's own default is 10 minutes); a node that
    waits longer fails with a message listing what to check. An explicit --rdzv-conf wins."""
