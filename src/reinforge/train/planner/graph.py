"""The memory plan's choice for `train.cuda_graphs`: whether the update's CUDA graph is kept
across steps (`train.loop.graphs`), and what a kept one holds.

Where generation's KV pool is released for the update (a local engine on CUDA) the kept graph
lives in one `torch.cuda.MemPool` with it (`graphs.share_memory`): the update's gradients and
activations and the KV pool take turns in one region, the larger of the two, held in both
phases. Elsewhere (the pool kept through the update) the graph has a pool of its own: one
micro-batch's activations, held while generating too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from reinforge.train.planner.sizes import (
    GRAPH_MICRO_TOKENS,
    PlanInputs,
    Sizes,
    activation_bytes_per_token,
    training_peak,
)


@dataclass(frozen=True)
class KeptGraph:
    keeps: bool
    held_generating: int  # what generation's phase holds for it beyond the KV pool
    held_training: int  # what the update's phase holds for it beyond gradients and activations
    note: str  # the plan row's


def kept_update_graph(
    x: PlanInputs, s: Sizes, tokens: int, checkpointing: bool, kv: int
) -> KeptGraph:
    """Whether the graph is kept ("run" keeps it, "auto" where it fits, "off" never) and what it
    holds in each phase (module docstring)."""
    activations = tokens * activation_bytes_per_token(x, checkpointing)
    shared = x.kv_released_in_training and replays_update(x)
    if shared:
        region = s.grads + activations  # the update's part of the shared pool
        generating, training = max(0, region - kv), max(0, kv - region)
        what = "gradients + activations, in one pool with the KV pool (the larger of the two)"
    else:
        generating, training = activations, 0
        what = "one micro-batch's activations"
    # "auto" weighs generation's phase on the sum (KV pool + one micro-batch's activations), as
    # before the pool was shared: the shared pool's smaller figure would let more runs keep a
    # graph (LoRA ones among them), which no GPU run has measured yet. The update's phase is
    # weighed with what the shared pool holds then (the KV pool's size, where that is larger).
    room = s.generation_fixed + kv + activations <= s.usable
    room = room and training_peak_room(x, s, checkpointing, tokens, kv, training)
    keeps = x.update_graph == "run" or (x.update_graph == "auto" and room)
    note = (
        f"train.cuda_graphs = {x.update_graph}: {what}, "
        + ("held while generating" if keeps else "not kept")
        + ("" if room else " (no room beside the KV pool)")
    )
    if not keeps:
        return KeptGraph(False, 0, 0, note)
    return KeptGraph(True, generating, training, note)


def training_peak_room(
    x: PlanInputs, s: Sizes, checkpointing: bool, tokens: int, kv: int, held: int
) -> bool:
    """Whether the update's phase still fits with `held` more bytes."""
    pages = kv // s.page_bytes(x.page_size)
    return training_peak(x, s, checkpointing, tokens, pages) + held <= s.usable


def plan_update_graph(
    x: PlanInputs, s: Sizes, tokens: int, checkpointing: bool, kv: int
) -> tuple[int, KeptGraph]:
    """The micro-batch tokens and the kept graph: where the graph is kept and replays the
    update, micro-batches of at most `GRAPH_MICRO_TOKENS` (no host work per micro-batch to
    spread over more tokens), unless the user set their size."""
    graph = kept_update_graph(x, s, tokens, checkpointing, kv)
    replayed = min(tokens, max(s.tokens_min, GRAPH_MICRO_TOKENS))
    if graph.keeps and x.micro_batch_tokens is None and replayed < tokens and replays_update(x):
        graph = kept_update_graph(x, s, replayed, checkpointing, kv)
        smaller = f"; micro-batches of <= {GRAPH_MICRO_TOKENS:,} tokens: replayed, no slower"
        return replayed, replace(graph, note=graph.note + smaller)
    return tokens, graph


def replays_update(x: PlanInputs) -> bool:
    """Whether a kept graph can replay this run's update at all (`train.loop.graphs.graph_blocker`
    refuses several processes and mixture-of-experts models): only then are the planner's
    micro-batches the smaller replayed size (`GRAPH_MICRO_TOKENS`)."""
    return x.num_shards == 1 and x.replicas == 1 and not x.model.num_experts
