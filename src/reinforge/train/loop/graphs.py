"""The update's micro-batches replayed from one CUDA graph (`train.cuda_graphs`; issue 26).

Below about 12k tokens a micro-batch's update is bound by the host's launch work, not by the GPU:
G1's micro-batch (24 layers, compiled, checkpointed) costs ~145 ms on an H100 at any size up to
there, against 81 ms for 7,936 tokens replayed from a graph (bench/RESULTS.md, s18f-g). Replayed,
small micro-batches cost no speed, so they can save memory, and the update takes the same time on
a slow host as on a fast one.

How, within one optimizer step (graphs are built per step and freed at its end: the memory they
hold goes back to generation, and the step's constants, its token and sequence counts, may be
baked into the graph):

1. The step's micro-batches of similar size (at least `SIMILAR` of the largest) are padded to one
   shape (`train.packing.static`); a smaller one runs as before.
2. The first of them runs eagerly, padded: it compiles what the shape needs and allocates every
   parameter's `.grad` outside the graph's memory, so the graph's backward adds into those.
3. The second is captured (`micro_compute`, forward, loss and backward) and replayed; the rest
   copy their inputs into the captured tensors and replay. Metrics are cloned out after each.

Not for: several processes (their collectives), a value head, mixture-of-experts models, an FSDP
packed forward; there, and on a CPU, the update runs as before. A capture that fails prints why
once and the run goes on without graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from reinforge.distributed import is_distributed
from reinforge.metrics import console
from reinforge.sharding import PACKED_FORWARD
from reinforge.train.packing import PackedBatch
from reinforge.train.packing.static import PackedShape, common_shape

SIMILAR = 0.75  # micro-batches with at least this share of the largest one's tokens are replayed
MIN_REPLAYED = 3  # the first runs eagerly, the second is captured: replays pay from the third


def graph_blocker(cfg, learner) -> str | None:
    """Why this run's update is not replayed from graphs (None: it may be)."""
    model = learner.policy.model
    if not cfg.train.cuda_graphs:
        return "train.cuda_graphs = false"
    if not next(model.parameters()).is_cuda:
        return "not on CUDA"
    if getattr(learner, "graphs_failed", False):
        return "a capture failed earlier in this run"
    if is_distributed() or getattr(model, PACKED_FORWARD, None) is not None:
        return "several processes"
    if learner.value_head is not None:
        return "a value head"
    config = getattr(model, "config", None)
    if any(
        getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    ):
        return "a mixture-of-experts model"
    if cfg.algorithm.routing_replay:
        return "routing replay"
    return None


def replayed(packed: list[PackedBatch]) -> list[int]:
    """Which of the step's micro-batches (positions in `packed`) share the graph."""
    largest = max(b.num_tokens for b in packed)
    chosen = [i for i, b in enumerate(packed) if b.num_tokens >= SIMILAR * largest]
    return chosen if len(chosen) >= MIN_REPLAYED else []


@dataclass
class StepGraph:
    """One step's graph over `micro_compute`, fed through fixed input tensors."""

    compute: Callable[[object], dict[str, torch.Tensor]]
    shape: PackedShape
    static: object | None = None  # the MicroData the graph reads (the first replayed one's)
    graph: torch.cuda.CUDAGraph | None = None
    outputs: dict[str, torch.Tensor] | None = None
    on_failure: Callable[[], None] | None = None
    capture: bool = True  # False: every run eager through the fixed inputs (the CPU tests' path)
    members: frozenset[int] = frozenset()  # the micro-batches (step positions) it runs

    @classmethod
    def for_step(cls, compute, packed: list[PackedBatch], chosen: list[int], on_failure, capture):
        shape = common_shape([packed[i] for i in chosen])
        return cls(
            compute, shape, on_failure=on_failure, capture=capture, members=frozenset(chosen)
        )

    def run(self, data) -> dict[str, torch.Tensor]:
        """Micro-batch `data` (padded to `shape`, on the device): eagerly the first time, then
        captured, then replayed."""
        if self.static is None:
            self.static = data
            return self.compute(data)
        _copy_into(self.static, data)
        if not self.capture:
            return self.compute(self.static)
        if self.graph is None:
            try:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.outputs = self.compute(self.static)
            except Exception as e:  # any capture failure falls back, loudly
                self.graph = self.outputs = None
                console.print(
                    f"[yellow]train.cuda_graphs: capturing the update failed "
                    f"({type(e).__name__}: {str(e)[:200]}); the run goes on without graphs "
                    "(set train.cuda_graphs = false to silence this)[/]"
                )
                if self.on_failure is not None:
                    self.on_failure()
                self.capture = False  # the rest of this step as launched
                return self.compute(self.static)
        self.graph.replay()
        assert self.outputs is not None
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.outputs.items()}

    def close(self) -> None:
        self.graph = self.outputs = self.static = None


def _copy_into(static, data) -> None:
    """Every tensor of `data` into the same place of `static` (same shapes: both padded)."""
    for f in fields(static):
        target, source = getattr(static, f.name), getattr(data, f.name)
        if target is None:
            assert source is None, f"{f.name}: present in one micro-batch only"
        elif isinstance(target, torch.Tensor):
            target.copy_(source, non_blocking=True)
        elif isinstance(target, PackedBatch):
            _copy_into(target, source)
        elif isinstance(target, dict):
            for key, value in target.items():
                value.copy_(source[key], non_blocking=True)
