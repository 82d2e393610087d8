"""The memory plan's choice for `train.cuda_graphs`: whether the update's CUDA graph is kept
across steps (`train.loop.graphs`). Kept, its memory (about one micro-batch's activations)
stays allocated while generating, so it must fit beside generation's KV pool and working set.
"""

from __future__ import annotations

from reinforge.train.planner.sizes import PlanInputs, Sizes, activation_bytes_per_token


def kept_update_graph(
    x: PlanInputs, s: Sizes, tokens: int, checkpointing: bool, kv: int
) -> tuple[bool, int, str]:
    """(kept, bytes held while generating, the plan row's note): "run" keeps it, "auto" where it
    fits, "off" never."""
    graph = tokens * activation_bytes_per_token(x, checkpointing)
    room = s.generation_fixed + kv + graph <= s.usable
    keeps = x.update_graph == "run" or (x.update_graph == "auto" and room)
    note = (
        f"train.cuda_graphs = {x.update_graph}: one micro-batch's activations, "
        + ("held while generating" if keeps else "not kept")
        + ("" if room else " (no room beside the KV pool)")
    )
    return keeps, graph if keeps else 0, note


def replays_update(x: PlanInputs) -> bool:
    """Whether a kept graph can replay this run's update at all (`train.loop.graphs.graph_blocker`
    refuses several processes and mixture-of-experts models): only then are the planner's
    micro-batches the smaller replayed size (`GRAPH_MICRO_TOKENS`)."""
    return x.num_shards == 1 and x.replicas == 1 and not x.model.num_experts
