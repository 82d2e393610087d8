"""One optimizer step on the step's batch: packed micro-batches of the policy loss (and the value
loss), gradient accumulation, clipping, the step.

Every micro-batch's loss is already divided by the whole step's token and sequence counts
(`algorithms.losses`), so the accumulated gradient is the configured aggregate whatever the
micro-batching; metrics follow the same rule and are summed. On policy with one update per batch
the old logprobs are this forward's own, detached (`algorithm.old_logprobs = "trainer"`).

In a distributed run the counts are the global step's (all ranks), each rank backpropagates its
loss times the world size (FSDP, or a replica's once-a-step reduction, averages gradients over
ranks), and the summed metrics are summed
over ranks too: the step is the single-process step of the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reinforge.algorithms.losses import LossInputs
from reinforge.algorithms.mismatch import mismatch_kl
from reinforge.algorithms.value import clipped_value_loss
from reinforge.config import TrainConfig
from reinforge.distributed import loss_scale, reduce_metrics
from reinforge.metrics import console
from reinforge.sharding import accumulation, in_lockstep
from reinforge.train.loop.advantage_step import StepBatch, select_rows
from reinforge.train.loop.diagnostics import (
    clip_fractions,
    measure_policy_change,
    probe_sequences,
)
from reinforge.train.loop.engine_records import records_ready, store_of, weights_changed
from reinforge.train.loop.graphs import (
    UpdateGraph,
    flat_grads,
    graph_blocker,
    graph_mode,
    step_graph,
)
from reinforge.train.loop.learner import Learner
from reinforge.train.loop.optimizer_step import optimizer_step
from reinforge.train.packing import PackedBatch, pack_one, to_device
from reinforge.train.packing.forward import completion_sequences, micro_batches, packed_rows
from reinforge.train.packing.static import PackedShape, pad_packed, pad_rows
from reinforge.train.policy.moe import (
    begin_micro_batch,
    replay_metrics,
    router_aux_loss,
    routing_replay_ratio,
)
from reinforge.train.policy.value import head_values


def update_policy(
    cfg: TrainConfig,
    learner: Learner,
    batch: StepBatch,
    while_busy: Callable[[], None] | None = None,
) -> dict[str, float]:
    """The step's update: its micro-batches' gradients, the optimizer step, the policy-change
    probe; metrics. `while_busy`: called once every micro-batch is queued, before the first wait
    for the device (host work the device's queue then hides: `Collector.collect`)."""
    start_grads(cfg, learner)
    model = learner.policy.model
    memory = learner.policy.setup.memory  # the run's plan (`train.planner.memory`)
    batches = micro_batches(
        batch.prompts,
        batch.completions,
        memory.micro_batch_tokens,
        cfg.train.share_prompts,
        in_lockstep(model),
    )
    unsharded = memory.accumulate_unsharded
    # Metrics stay on the device until the last micro-batch: a float() per metric and
    # micro-batch would wait for the GPU each time, draining its queue between micro-batches
    # (G1's profile, session 15: 72 of the update's 220 synchronizations).
    on_device: dict[str, torch.Tensor | float] = {}
    packed = LazyPacked(cfg, batch, batches)
    device = next(model.parameters()).device
    records_ready(learner, device)  # the engine's records of the rollout, where it kept them
    graph, members = update_graph(cfg, learner, packed)
    counts = None
    if graph is not None:  # the step's counts as the graph reads them: on the device
        counts = torch.tensor([batch.num_tokens, batch.num_seqs], dtype=torch.float32)
        counts = counts.to(device, non_blocking=True)
    launched = 0  # micro-batches that ran outside the step's graph
    recorded = 0  # micro-batches run from the engine's records (`train.engine_records`)
    head_stats = 0  # and of them, those whose LM head took the engine's statistics
    with accumulation(model, unsharded) as before:
        for i, idx in enumerate(batches):
            before(last=i == len(batches) - 1)
            if graph is not None and (graph.takes(packed[i]) if members is None else i in members):
                data = micro_data(batch, idx, packed[i], device, graph.shape, counts)
                step_metrics = graph.run(data)
            else:
                launched += 1
                data = micro_data(batch, idx, packed[i], device)
                step_metrics = micro_compute(cfg, learner, batch, len(idx), data)
            recorded += data.packed.record_rows_L is not None
            head_stats += data.packed.record_stats_K2 is not None
            for key, value in step_metrics.items():
                on_device[key] = combine(key, on_device.get(key), _detached(value))
    probe = probe_sequences(cfg, batch, batches, device)  # packed while the device still runs
    if while_busy is not None:  # the host's own work, while the queued micro-batches run
        while_busy()
    phases: dict[str, float] = {}
    if graph is not None:
        phases = {**graph.report(), "graph_launched": float(launched)}
        if not graph.kept:
            graph.close()
    totals = to_floats(on_device)
    # each rank's terms are divided by the global counts: over the ranks they add up
    extremes = {k for k in totals if k.endswith(("_min", "_max"))}
    totals = reduce_metrics(
        totals,
        summed=set(totals) - extremes,
        maxed={k for k in extremes if k.endswith("_max")},
        minned={k for k in extremes if k.endswith("_min")},
    )
    routing_replay_ratio(totals)
    totals.update(phases)  # this rank's micro-batches by graph phase (not reduced: host counts)
    if recorded or store_of(learner) is not None:  # (`train.engine_records`)
        totals["records_micro_batches"] = float(recorded)
        totals["records_missed_micro_batches"] = float(len(batches) - recorded)
        totals["records_head_micro_batches"] = float(head_stats)
    totals.update(optimizer_step(cfg, learner))
    weights_changed(learner)  # the engine's records of this rollout are stale now
    totals.update(measure_policy_change(cfg, learner, batch, probe))  # one no-grad forward
    return totals


class LazyPacked:
    """The step's micro-batches as packed rows (`pack_micro_batch`), each packed when first read:
    with a kept update graph the host packs one while the device replays the one before."""

    def __init__(self, cfg: TrainConfig, batch: StepBatch, batches: list[list[int]]):
        self.cfg, self.batch, self.batches = cfg, batch, batches
        self.done: dict[int, PackedBatch] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> PackedBatch:
        if i not in self.done:
            self.done[i] = pack_micro_batch(self.cfg, self.batch, self.batches[i])
        return self.done[i]


def update_graph(
    cfg: TrainConfig, learner: Learner, packed: LazyPacked
) -> tuple[UpdateGraph | None, frozenset[int] | None]:
    """The CUDA graph this step replays (`train.loop.graphs`) and which micro-batches, or None."""
    blocker = graph_blocker(cfg, learner)
    if blocker is not None:
        explicit = cfg.train.cuda_graphs not in (False, "auto")
        if explicit and not learner.graphs_failed and not learner.graphs_noted:
            value = str(cfg.train.cuda_graphs).lower()
            console.print(f"[yellow]train.cuda_graphs = {value} has no effect here: {blocker}[/]")
            learner.graphs_noted = True
        return None, frozenset()
    mode = graph_mode(cfg, learner.policy.setup.memory)
    assert mode is not None

    def compute(data: MicroData) -> dict[str, torch.Tensor]:
        return micro_compute(cfg, learner, None, -1, data)  # (no batch: the counts are tensors)

    capture = next(learner.policy.model.parameters()).is_cuda
    return step_graph(learner, mode, packed, compute, capture)


def start_grads(cfg: TrainConfig, learner: Learner) -> None:
    """The update's gradients: none (each micro-batch's backward allocates them), or under a
    kept CUDA graph (mode "run") zeroed views of one buffer per dtype, where the graph adds
    (`graphs.flat_grads`; `free_grads` frees them after the optimizer step)."""
    learner.optimizer.zero_grad(set_to_none=True)
    learner.grad_buffers = None
    if (
        graph_blocker(cfg, learner) is None
        and graph_mode(cfg, learner.policy.setup.memory) == "run"
    ):
        params = [p for p in learner.policy.model.parameters() if p.requires_grad]
        mempool = learner.mempool
        learner.grad_buffers = flat_grads(params, mempool)
        if mempool is not None:  # (freed by the step's end: `graphs.held_bytes`)
            learner.grad_bytes_in_mempool = sum(
                b.numel() * b.element_size() for b in learner.grad_buffers.values()
            )


def combine(key: str, total, value):
    """A metric over micro-batches (floats or 0-d tensors): extremes (`*_min`, `*_max`) by min
    and max, the rest (terms already divided by the step's counts) by sum."""
    if total is None:
        return value
    tensors = isinstance(total, torch.Tensor) or isinstance(value, torch.Tensor)
    if key.endswith("_min"):
        return (
            torch.minimum(torch.as_tensor(total), torch.as_tensor(value))
            if tensors
            else min(total, value)
        )
    if key.endswith("_max"):
        return (
            torch.maximum(torch.as_tensor(total), torch.as_tensor(value))
            if tensors
            else max(total, value)
        )
    return total + value


def _detached(value):
    return value.detach().float() if isinstance(value, torch.Tensor) else float(value)


def to_floats(metrics: dict) -> dict[str, float]:
    """Tensor metrics read back in one transfer (one synchronization), floats as they are."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        device = metrics[keys[0]].device
        values = torch.stack([metrics[k].reshape(()).to(device) for k in keys]).tolist()
        out.update(zip(keys, values))
    return {k: out[k] for k in metrics}


@dataclass
class MicroData:
    """One micro-batch's inputs on the device: the packed row and its rows of step data."""

    packed: PackedBatch
    counts: torch.Tensor | None  # [2] the step's tokens and sequences (graphs: read on device)
    mask_ST: torch.Tensor
    sampler_ST: torch.Tensor | None
    advantages: torch.Tensor  # [S] per sequence, or [S, T] per token
    ref_ST: torch.Tensor | None
    old_values_ST: torch.Tensor | None
    returns_ST: torch.Tensor | None


def pack_micro_batch(cfg: TrainConfig, batch: StepBatch, idx: list[int]) -> PackedBatch:
    """Micro-batch `idx` of the step laid out as one packed row (CPU tensors)."""
    seqs = completion_sequences(
        [batch.prompts[i] for i in idx],
        [batch.completions[i] for i in idx],
        [batch.routes[i] for i in idx] if cfg.algorithm.routing_replay else None,
        [batch.hidden[i] for i in idx] if batch.hidden is not None else None,
        [batch.trajs[i].completion.loss_mask for i in idx],
    )
    return pack_one(seqs, range(len(seqs)), cfg.train.share_prompts)


def micro_data(
    batch: StepBatch,
    idx: list[int],
    packed: PackedBatch,
    device,
    shape: PackedShape | None = None,
    counts: torch.Tensor | None = None,
) -> MicroData:
    """`packed` (micro-batch `idx`) and its step data on `device`; padded to `shape` if given;
    `counts`: the step's counts on the device (a graph's inputs, `micro_compute`)."""
    width = packed.rows_index_ST.shape[1]

    def take(step_BT: torch.Tensor | None) -> torch.Tensor | None:
        return None if step_BT is None else select_rows(step_BT, idx, width)

    advantages = batch.advantages
    assert advantages is not None, "advantages are assigned before the update"
    rows = {
        "mask_ST": take(batch.mask_BT),
        "sampler_ST": take(batch.sampler_BT),
        "advantages": select_rows(advantages, idx) if advantages.dim() == 1 else take(advantages),
        "ref_ST": take(batch.ref_BT),
        "old_values_ST": take(batch.old_values_BT),
        "returns_ST": take(batch.returns_BT),
    }
    if shape is not None:
        packed = pad_packed(packed, shape)
        rows = {k: pad_rows(v, shape) for k, v in rows.items()}
    moved = {k: None if v is None else to_device(v, device) for k, v in rows.items()}
    return MicroData(packed.to(device), counts, **moved)


def micro_compute(
    cfg: TrainConfig, learner: Learner, batch: StepBatch | None, num_seqs: int, data: MicroData
) -> dict[str, torch.Tensor]:
    """Forward, loss and backward of one micro-batch whose inputs are on the device (`micro_data`);
    returns its share of the step's metrics. A CUDA graph captures this call
    (`train.loop.graphs`), so it reads nothing from the host but the run's constants: the step's
    counts come as device tensors (`data.counts`, and no `batch`). `num_seqs` (the micro-batch's
    sequences) weighs the MoE router's loss only."""
    a, algorithm = cfg.algorithm, learner.algorithm
    if data.counts is not None:
        num_tokens, num_step_seqs = data.counts[0], data.counts[1]
    else:
        assert batch is not None, "a micro-batch without device counts reads the batch's"
        num_tokens, num_step_seqs = batch.num_tokens, batch.num_seqs
    begin_micro_batch(learner.policy.model, a.router_aux_coef)
    rows = packed_rows(
        learner.policy.model,
        data.packed,
        cfg.rollout.temperature or 1.0,
        with_hidden=learner.value_head is not None,
    )
    mask_ST, sampler_ST = data.mask_ST, data.sampler_ST
    inputs = LossInputs(
        logprobs_BT=rows.logprobs_ST,
        old_logprobs_BT=rows.logprobs_ST.detach() if a.old_logprobs == "trainer" else sampler_ST,
        advantages_B=data.advantages,
        mask_BT=mask_ST,
        num_tokens_total=num_tokens,
        num_seqs_total=num_step_seqs,
        ref_logprobs_BT=data.ref_ST,
        entropy_BT=rows.entropy_ST,
        sampler_logprobs_BT=sampler_ST,
        token_sum_norm=float(cfg.rollout.max_new_tokens),
    )
    loss, metrics = algorithm.policy_loss(inputs, algorithm.settings)
    metrics.update(clip_fractions(inputs, algorithm.settings))
    metrics["loss"] = loss.detach()
    if learner.value_head is not None:
        value_loss, value_metrics = clipped_value_loss(
            head_values(learner.value_head, rows.hidden_STH),
            data.old_values_ST,
            data.returns_ST,
            mask_ST,
            num_tokens,
            a.value_clip or None,
        )
        loss = loss + value_loss  # the head reads detached hidden states: separate gradients
        metrics.update(value_metrics)
    aux = router_aux_loss(learner.policy.model, a.router_aux_coef)
    if aux is not None:  # per micro-batch, weighted by its share of the step's sequences
        assert batch is not None, "mixture-of-experts models are not replayed from graphs"
        aux = aux * (num_seqs / len(batch.completions))
        loss = loss + aux
        metrics["router_aux_loss"] = aux.detach()
    metrics.update(replay_metrics(learner.policy.model))  # before the backward's recompute
    (loss * loss_scale()).backward()
    metrics["kl_sampler"] = mismatch_kl(sampler_ST, rows.logprobs_ST, mask_ST, num_tokens)
    return metrics
