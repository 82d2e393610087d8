"""The update's micro-batches replayed from one CUDA graph (`train.cuda_graphs`; issue 26).

Below about 12k tokens a micro-batch's update is bound by the host's launch work, not by the GPU:
G1's micro-batch (24 layers, compiled, checkpointed) costs ~145 ms on an H100 at any size up to
there, against 81 ms for 7,936 tokens replayed from a graph (bench/RESULTS.md, s18f-g). Replayed,
small micro-batches cost no speed, so they can save memory, and the update takes the same time on
a slow host as on a fast one.

How:

1. A step's micro-batches of similar size (at least `SIMILAR` of the graph's tokens) are padded to
   one shape (`train.packing.static`); a smaller one runs as before.
2. A new graph's first micro-batch runs eagerly, padded: it compiles what the shape needs and
   allocates every parameter's `.grad` outside the graph's memory, so the graph's backward adds
   into those. The second is captured (`micro_compute`: forward, loss and backward) and
   replayed; the rest copy their inputs into the captured tensors and replay. Metrics are cloned
   out after each. The capture skips `torch.cuda.graph`'s synchronization and `empty_cache`
   (which made every later allocation of the step a fresh `cudaMalloc`).
3. Mode "step" captures per step and frees the graph at its end (nothing held while generating).
   Mode "run" keeps it: its shape has room (`common_shape`'s `room`), the step's counts are
   device tensors the graph reads (`MicroData.counts`), so later steps only replay. The graph
   adds into the gradients' addresses: each step's gradients are views of one zeroed buffer per
   dtype (`flat_grads`), allocated at the update's start and freed after the optimizer step, so
   generation gets their memory back; the allocator hands the same blocks out again step after
   step, and where it does not (`grad_ptrs` differ) a new graph is built, as when a step's
   micro-batches outgrow the shape.

4. The graph's memory and generation's KV pool take turns on one `torch.cuda.MemPool`
   (`share_memory`, set up with the learner): the KV pool is allocated in it, released before
   the update, and the capture carves the activations out of the freed pool; the next rollout
   allocates the KV pool at the same address again. The step's gradient buffer is allocated in
   it too (`flat_grads`), so the update's whole transient memory, gradients and activations,
   and generation's KV pool take turns: a kept graph holds no memory of its own beside
   generation's (the step's footprint is the larger of the two, not their sum), and the engine
   keeps its decode graphs across the update instead of capturing them every step. The capture
   stream's cuBLAS workspaces (autograd's thread's too) are made before the capture
   (`cuda_graphs.warm_blas`), so no lasting block splits the mempool. Memory the pools hold but
   do not hand out is counted in the step's peaks (`held_bytes`).

Not for: several processes (their collectives), a value head, mixture-of-experts models, an FSDP
packed forward; there, and on a CPU, the update runs as before. A capture that fails prints why
once and the run goes on without graphs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch

from reinforge.distributed import is_distributed
from reinforge.engine.cuda_graphs import capture, capture_stream
from reinforge.metrics import console
from reinforge.sharding import PACKED_FORWARD
from reinforge.train.packing import PackedBatch
from reinforge.train.packing.static import PackedShape, common_shape, fits

SIMILAR = 0.7  # micro-batches with at least this share of the graph's tokens are replayed
MIN_REPLAYED = 3  # a step's graph: the first runs eagerly, the second is captured, then replays
HEADROOM = 1.25  # a kept graph's room over the step that built it (segments, rows, keys)
TARGETS_HEADROOM = 1.1  # ... and in targets: each padded target costs an LM-head row
TIMES_ENV = "REINFORGE_GRAPH_TIMES"  # set to 1: each step prints its graph phases' times


def graph_mode(cfg, memory=None) -> str | None:
    """The mode of `train.cuda_graphs`: "run" (one graph kept across steps), "step" (one per
    step) or None; "auto" follows the memory plan (`memory`: the run's `MemoryChoice`)."""
    value = cfg.train.cuda_graphs
    if value == "auto":
        return "run" if getattr(memory, "keeps_update_graph", False) else None
    if value is True:
        return "run"
    return value or None


def graph_blocker(cfg, learner) -> str | None:
    """Why this run's update is not replayed from graphs (None: it may be)."""
    model = learner.policy.model
    if graph_mode(cfg, learner.policy.setup.memory) is None:
        if cfg.train.cuda_graphs == "auto":
            return "auto: the memory plan has no room for a kept graph beside generation"
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


def similar(packed: list[PackedBatch], tokens: int) -> list[int]:
    """The micro-batches (positions in `packed`) a graph of `tokens` tokens replays."""
    return [i for i, b in enumerate(packed) if SIMILAR * tokens <= b.num_tokens <= tokens]


@dataclass
class UpdateGraph:
    """A graph over `micro_compute` for one padded shape, fed through fixed input tensors."""

    compute: Callable[[object], dict[str, torch.Tensor]]
    shape: PackedShape
    kept: bool = False  # mode "run": lives across steps
    static: object | None = None  # the MicroData the graph reads (the first micro-batch's)
    graph: torch.cuda.CUDAGraph | None = None
    outputs: dict[str, torch.Tensor] | None = None
    on_failure: Callable[[], None] | None = None
    capture: bool = True  # False: every run eager through the fixed inputs (the CPU tests' path)
    times: dict[str, list[float]] = field(default_factory=dict)  # TIMES_ENV's report
    phases: dict[str, int] = field(default_factory=dict)  # this step's runs by phase (metrics)
    outgrown: bool = False  # a similar micro-batch did not fit: the next step builds a new one
    grad_ptrs: tuple[int, ...] = ()  # where the gradients were when it was built (`flat_grads`)
    pool: object | None = None  # the memory pool to capture in (`share_memory`); None: its own

    def takes(self, b: PackedBatch) -> bool:
        """Whether micro-batch `b` replays this graph: similar in size, and it fits (a similar
        one that does not runs launched and marks the graph `outgrown`)."""
        if b.num_tokens < SIMILAR * self.shape.tokens:
            return False
        if fits(b, self.shape):
            return True
        self.outgrown = True
        return False

    def run(self, data) -> dict[str, torch.Tensor]:
        """Micro-batch `data` (padded to `shape`, on the device): eagerly the first time, then
        captured, then replayed."""
        timed = os.environ.get(TIMES_ENV) == "1" and self.capture
        if timed:
            torch.cuda.synchronize()
            start = time.perf_counter()
        phase, out = self._run(data)
        self.phases[phase] = self.phases.get(phase, 0) + 1
        if timed:
            torch.cuda.synchronize()
            self.times.setdefault(phase, []).append(1000 * (time.perf_counter() - start))
        return out

    def _run(self, data) -> tuple[str, dict[str, torch.Tensor]]:
        if self.static is None:
            self.static = data
            return "eager", self.compute(data)
        _copy_into(self.static, data)
        if not self.capture:
            return "eager", self.compute(self.static)
        if self.graph is None:
            try:
                self.graph = torch.cuda.CUDAGraph()
                self.outputs = capture(
                    self.graph, lambda: self.compute(self.static), self.pool, backward=True
                )
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
                return "eager", self.compute(self.static)
            phase = "capture"
        else:
            phase = "replay"
        self.graph.replay()
        assert self.outputs is not None
        metrics = {
            k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.outputs.items()
        }
        return phase, metrics

    def report(self) -> dict[str, float]:
        """The step's micro-batches by phase as metrics (`graph_eager`, `graph_capture`,
        `graph_replay`: a kept graph's later steps only replay), reset for the next step; with
        TIMES_ENV also printed with their milliseconds, synchronized around each micro-batch."""
        counts = {f"graph_{k}": float(v) for k, v in self.phases.items()}
        self.phases = {}
        if self.times:
            parts = [
                f"{k} {len(v)} x {sum(v) / len(v):.1f} ms" for k, v in sorted(self.times.items())
            ]
            console.print(f"update graph ({self.shape.tokens} tokens): " + ", ".join(parts))
            self.times = {}
        return counts

    def close(self) -> None:
        self.graph = self.outputs = self.static = None

    def pool_id(self) -> tuple[int, int] | None:
        """The pool its memory lies in (a captured graph), else None."""
        if self.graph is None:
            return None
        return tuple(self.pool) if self.pool is not None else tuple(self.graph.pool())


def step_graph(
    learner, mode: str, packed: Sequence[PackedBatch], compute, capture: bool
) -> tuple[UpdateGraph | None, frozenset[int] | None]:
    """The graph this step replays, and which of its micro-batches (None: each that the graph
    `takes`, known once it is packed). Mode "run" reuses the kept graph until a step's
    micro-batch outgrew it, then builds one from the step's micro-batches (kept on the learner);
    `packed` may pack lazily: reusing the kept graph reads none of it here, so packing the
    micro-batches overlaps the replays."""
    kept: UpdateGraph | None = getattr(learner, "update_graph", None)
    ptrs = grad_ptrs(getattr(learner, "grad_buffers", None))
    if kept is not None:
        # a CPU run (no capture) reads its inputs each time: addresses do not matter there
        same_grads = not kept.capture or kept.grad_ptrs == ptrs
        if mode == "run" and not kept.outgrown and same_grads:
            return kept, None
        kept.close()
        learner.update_graph = None
    packed = [packed[i] for i in range(len(packed))]
    largest = max(b.num_tokens for b in packed)
    members = similar(packed, largest)
    if len(members) < (2 if mode == "run" else MIN_REPLAYED):
        return None, frozenset()
    chosen = [packed[i] for i in members]
    if mode == "run":  # room for the next steps' micro-batches
        shape = common_shape(chosen, room=HEADROOM, targets_room=TARGETS_HEADROOM)
    else:
        shape = common_shape(chosen)

    def failed() -> None:
        learner.graphs_failed = True
        learner.update_graph = None

    mempool = getattr(learner, "mempool", None)
    graph = UpdateGraph(
        compute,
        shape,
        kept=mode == "run",
        on_failure=failed,
        capture=capture,
        grad_ptrs=ptrs,
        pool=mempool.id if mempool is not None else None,
    )
    if graph.kept:
        learner.update_graph = graph
    return graph, frozenset(members)


def share_memory(learner) -> None:
    """Generation's KV pool and the update's captured graphs in one `torch.cuda.MemPool`
    (module docstring, 4), where both exist: a local paged engine on CUDA and graphs on for the
    run. Called once, with the learner, before the first rollout."""
    engine = getattr(learner.policy, "engine", None)
    runner = getattr(engine, "runner", None)
    if runner is None or getattr(engine, "fallback", None) is not None:
        return
    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")):
        return  # (torch before 2.7: each keeps its own memory, as before)
    learner.mempool = torch.cuda.MemPool()
    runner.share_memory(learner.mempool)


def held_pools(learner, phase: str = "train", captured: bool = False) -> dict[str, tuple]:
    """The CUDA graph pools whose memory is reserved beside the allocated tensors, by name:
    "update" (the shared mempool, or a kept update graph's own pool) and "decode" (the engine's
    decode graphs'). An update that `captured` its graph this phase allocated the update pool's
    activations while capturing (counted then): that pool is left out of its train phase."""
    pools: dict[str, tuple] = {}
    mempool = getattr(learner, "mempool", None)
    kept = getattr(learner, "update_graph", None)
    if not (phase == "train" and captured):
        if mempool is not None:
            pools["update"] = tuple(mempool.id)
        elif kept is not None and kept.pool_id() is not None:
            pools["update"] = kept.pool_id()
    runner = getattr(getattr(learner.policy, "engine", None), "runner", None)
    decode = getattr(runner, "graphs", None)
    if getattr(decode, "pool", None) is not None:
        pools["decode"] = tuple(decode.pool)
    return pools


def pool_bytes(pools: dict[str, tuple], segments: list | None = None) -> dict[str, tuple[int, int]]:
    """Each pool's (reserved, allocated) bytes, from the allocator's `segments`
    (`torch.cuda.memory_snapshot()`, taken here when not given)."""
    out = {name: (0, 0) for name in pools}
    ids = {pool: name for name, pool in pools.items()}
    if pools and segments is None:
        segments = torch.cuda.memory_snapshot()
    for segment in segments if pools else []:
        name = ids.get(tuple(segment.get("segment_pool_id", ())))
        if name is not None:
            reserved, allocated = out[name]
            out[name] = (reserved + segment["total_size"], allocated + segment["allocated_size"])
    return out


def held_bytes(learner, phase: str, captured: bool = False, segments: list | None = None) -> int:
    """Memory the CUDA graphs' pools hold but do not count as allocated: a replay allocates
    nothing, so `max_memory_allocated` does not see what a graph uses, yet no other tensor can
    have it. For the phase just ended ("generate": the KV pool, in a shared mempool, was
    allocated and counted then; "train"): the free bytes of the pools of `held_pools`."""
    sizes = pool_bytes(held_pools(learner, phase, captured), segments)
    free = sum(reserved - allocated for reserved, allocated in sizes.values())
    if "update" in sizes and getattr(learner, "mempool", None) is not None:
        # what the phase allocated in the mempool and freed by its end: free now, counted then
        if phase == "generate":
            free -= learner.policy.engine.runner.kv_bytes_in_mempool
        elif phase == "train":
            free -= getattr(learner, "grad_bytes_in_mempool", 0)  # (gradients: `flat_grads`)
    return max(free, 0)


def peak_allocated(learner, device: torch.device) -> int:
    """The allocator's peak since its last reset, less what the engine's prefills allocated in
    the shared mempool (counted with the mempool's reserved bytes instead: `held_bytes`)."""
    peak = torch.cuda.max_memory_allocated(device)
    runner = getattr(getattr(learner.policy, "engine", None), "runner", None)
    if runner is not None and hasattr(runner, "peak_outside_prefills"):
        peak = runner.peak_outside_prefills(peak)
    return peak


def pool_metrics(learner, segments: list | None = None) -> dict[str, float]:
    """The graph pools' reserved GiB (`gpu_pool_update_gib`, `gpu_pool_decode_gib`) and the KV
    pool's where it lives in the shared mempool (`gpu_kv_gib`): what the peaks' held part is."""
    sizes = pool_bytes(held_pools(learner), segments)
    out = {f"gpu_pool_{name}_gib": reserved / 2**30 for name, (reserved, _) in sizes.items()}
    runner = getattr(getattr(learner.policy, "engine", None), "runner", None)
    if getattr(learner, "mempool", None) is not None and runner is not None:
        out["gpu_kv_gib"] = runner.kv_bytes_in_mempool / 2**30
    return out


def flat_grads(params: list[torch.nn.Parameter], mempool=None) -> dict[torch.dtype, torch.Tensor]:
    """Each parameter's `.grad` set to a zeroed view of one buffer per dtype (returned): a kept
    graph's backward adds into them in place (AccumulateGrad adds into an existing `.grad`).

    With `mempool` (the shared one, `share_memory`) the buffers are allocated in it, on the
    capture stream, like the KV pool: the update's gradients and activations then take turns
    with generation's KV pool in one region (the step's footprint is the larger of the two), and
    the allocator, whose state of the mempool is the same at each update's start, hands out the
    same address each step. Zeroed on the current stream, after whatever used the memory last."""
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    device = params[0].device
    if mempool is None:
        buffers = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
    else:
        with torch.cuda.stream(capture_stream()), torch.cuda.use_mem_pool(mempool):
            buffers = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()}
        for buffer in buffers.values():
            buffer.zero_()
    offsets = dict.fromkeys(sizes, 0)
    for p in params:
        start = offsets[p.dtype]
        p.grad = buffers[p.dtype][start : start + p.numel()].view_as(p)
        offsets[p.dtype] = start + p.numel()
    return buffers


def grad_ptrs(buffers: dict[torch.dtype, torch.Tensor] | None) -> tuple[int, ...]:
    """Where `flat_grads`'s buffers lie (empty: none)."""
    if not buffers:
        return ()
    return tuple(buffers[dt].data_ptr() for dt in sorted(buffers, key=str))


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
