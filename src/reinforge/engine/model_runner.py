"""The device side of the paged engine: the KV pool tensor, one forward per scheduled step, and
the sampler.

Everything that touches tensors lives here; the scheduler hands over a `Batch` of sequences with
their page tables and gets back one sampled token and its logprob per sequence. On CUDA with
Triton, the decode step replays a CUDA graph (`cuda_graphs`), the small ops are fused
(`triton_ops`), and sampling without top-p / top-k / min-p runs on the device (the inverse of
each row's distribution at its keyed uniform, as the torch sampler draws; greedy: the argmax);
the host reads back the ids and logprobs once per step. `launch` only queues a step and
returns a `LaunchedStep` to wait on, so the engine can queue the next decode first.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from reinforge.engine import eager_inputs, moe
from reinforge.engine.attention_select import select_attention_backend
from reinforge.engine.base import SamplingParams
from reinforge.engine.cuda_graphs import (
    BUCKETS,
)
from reinforge.engine.lora_forward import causal_lm, prepare_adapters
from reinforge.engine.lora_merge import MergedAdapters
from reinforge.engine.pool_size import kv_bytes_per_block
from reinforge.engine.qwen_forward import TORCH_OPS, ForwardOps, ModelShape, forward, rope_table
from reinforge.engine.records import HiddenStore
from reinforge.engine.scheduler import Batch
from reinforge.engine.sequence import num_blocks_for
from reinforge.engine.shared_mempool import MempoolPrefills, pool_block
from reinforge.engine.step_sampling import LaunchedStep, StepSampling, uses_fused_sampler

if TYPE_CHECKING:
    from reinforge.engine.cuda_graphs import DecodeGraphs


def select_ops(device: torch.device) -> ForwardOps:
    if device.type != "cuda":
        return TORCH_OPS
    try:
        from reinforge.engine import triton_ops
    except ImportError:
        return TORCH_OPS
    return ForwardOps(add_rms_norm=triton_ops.add_rms_norm, silu_mul=triton_ops.silu_mul)


class ModelRunner(StepSampling):
    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 256,
        use_cuda_graphs: bool | None = None,
        lora_generation: str = "adapters",
        record_routes: bool = False,
    ):
        """`use_cuda_graphs`: None takes them where they work (CUDA, Triton backend, a rope that
        can be tabulated). `lora_generation`: "merged" decodes a PEFT model's adapted projections
        from a merged copy (`lora_merge`), "adapters" applies A/B at every step. `record_routes`
        (a mixture-of-experts model): every step also returns the experts each computed token was
        routed to (routing replay)."""
        self.model = causal_lm(model)  # PEFT's layers live inside it: read in place too
        self.block_size = block_size
        self.shape = ModelShape.from_config(model.config)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        # [sparse layers, k] of a token's routes, when recorded
        self.route_shape: tuple[int, int] | None = None
        if record_routes:
            num_sparse = moe.sparse_layer_count(self.model)
            assert num_sparse, "routes are recorded on a mixture-of-experts model only"
            self.route_shape = (num_sparse, self.model.config.num_experts_per_tok)
            self.route_dtype = moe.route_dtype(self.model.config.num_experts)
        self.last_routes: torch.Tensor | None = None  # the last `run`'s, on the device
        # the residual streams each step computes, kept for the trainer (`record_hidden`)
        self.records: HiddenStore | None = None
        self.last_records: torch.Tensor | None = None  # the last `run`'s [T, layers, hidden]
        self.backend = select_attention_backend(self.device)
        self.is_fast_path = self.backend.name == "triton-paged"
        self.ops = select_ops(self.device) if self.is_fast_path else TORCH_OPS
        assert lora_generation in ("merged", "adapters"), lora_generation
        self.merged: MergedAdapters | None = None
        if lora_generation == "merged":
            self.merged = MergedAdapters(self.model)
            self.ops = replace(self.ops, linear=self.merged.linear, fused=self.merged.fused)
        # a torch.cuda.MemPool the KV pool lives in, shared with a trainer's captured update
        # (`share_memory`); None: the allocator's default pool
        self.kv_mempool = None
        # in a shared mempool: the decode graphs' logits rows, allocated with the KV pool (one
        # block: released and restored with it, at the same address); None: the graphs keep their
        # own buffer
        self.logits_area: torch.Tensor | None = None
        self.prefills = MempoolPrefills()  # prefills run in the shared mempool, their peaks
        self.kv_cache: torch.Tensor | None = self._new_pool(num_blocks)
        self._num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        if use_cuda_graphs is None:
            use_cuda_graphs = self.is_fast_path
        self.use_cuda_graphs = use_cuda_graphs
        self.graphs: DecodeGraphs | None = None
        self._graph_logits = False  # the last decode's logits came from a graph replay
        self._host_results: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self._host_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._num_fetches = 0
        # whether any sequence ever asked for the sampler's entropies (`Sequence.entropy_window`,
        # a session's): until one does, a step does not check each sequence's window (at 256
        # sequences 133-193 us a decode step under cProfile on two H200 hosts, s25b and s25d)
        self.entropy_requested = False
        self.max_model_len = 0
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ensure_max_len(getattr(model.config, "max_position_embeddings", 0) or 4096)

    def _new_pool(self, num_blocks: int) -> torch.Tensor:
        # zeros, not empty: decode attention masks the unused tail of a sequence's last page,
        # and a masked NaN would still poison the weighted sum (in a shared pool the memory
        # holds the last update's activations)
        s = self.shape
        shape = (s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        if self.kv_mempool is None:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        # the decode graphs' logits rows in the same block (`shared_mempool.pool_block`)
        pool, self.logits_area = pool_block(
            shape, self._logits_area_shape(), self.dtype, self.device, self.kv_mempool
        )
        return pool

    def _logits_area_shape(self) -> tuple[int, int]:
        """(rows, vocab) of the decode graphs' logits buffer kept in the shared mempool."""
        if not getattr(self, "use_cuda_graphs", False) or self.rope is None:
            return 0, 0
        return min(self.max_num_seqs, BUCKETS[-1]), self.model.lm_head.weight.shape[0]

    def share_memory(self, mempool) -> None:
        """From now on the KV pool lives in `mempool` (a `torch.cuda.MemPool`), where a trainer
        sharing the device captures its update's graph while the pool is released: the update's
        activations take the pool's memory in turn, and the memory counts once, not twice.
        Released and restored, the pool comes back at the same address (the allocator's state
        of the mempool is the same each time), so the decode graphs are kept across a release
        (`check_params` drops them if it moved). Called between generates."""
        self.kv_mempool = mempool
        if self.kv_cache is not None:  # move the current pool in now, before any capture
            self.kv_cache = None
            self.kv_cache = self._new_pool(self._num_blocks)
            self._new_graphs()

    @property
    def kv_bytes_in_mempool(self) -> int:
        """The KV pool's bytes when it lives in the shared mempool (allocated or released), with
        the decode graphs' logits rows allocated beside it."""
        if self.kv_mempool is None:
            return 0
        rows, vocab = self._logits_area_shape()
        pool = kv_bytes_per_block(self.model, self.block_size) * self._num_blocks
        return pool + rows * vocab * self.dtype.itemsize

    def peak_outside_prefills(self, peak: int) -> int:
        """`peak` (the allocator's `max_memory_allocated`) without what prefills run in the
        shared mempool allocated there (`MempoolPrefills.peak_outside`)."""
        return self.prefills.peak_outside(peak)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def released(self) -> bool:
        return self.kv_cache is None

    def release(self) -> None:
        """Free the KV pool and the decode graphs with their private memory pool (between
        generates: nothing is cached across calls), so that a trainer sharing the device gets
        that memory for its update; `restore` takes it again at the next generate. A graph
        replays at fixed addresses, so the graphs go with the pool; they are captured again
        lazily, one batch-size bucket at a time, as decode steps need them. In a shared mempool
        (`share_memory`) the pool comes back at its address, so the graphs are kept."""
        if self.kv_cache is None:
            return
        self.kv_cache = None
        self.logits_area = None  # (the same block: nothing may keep it alive)
        if self.kv_mempool is None:  # (in a shared mempool the pool returns where it was)
            self.graphs = None
        if self.merged is not None:
            self.merged.release()

    def restore(self) -> None:
        """The pool (and the graphs' buffers) again after `release`; a no-op otherwise."""
        if self.kv_cache is not None:
            return
        try:
            self.kv_cache = self._new_pool(self._num_blocks)
        except torch.OutOfMemoryError:  # the update's freed blocks, cached but split: return them
            torch.cuda.empty_cache()
            self.kv_cache = self._new_pool(self._num_blocks)
        if self.graphs is None:
            self._new_graphs()
        else:  # kept (shared mempool): replayed only if the pool came back at its address
            # (checked here, before `begin_generate` builds a released LoRA copy again: graphs
            # over a copy that was released are dropped whatever addresses it comes back at. A
            # single check after the build kept graphs whose copy's weights returned to their
            # addresses: right only while the key holds every buffer they read, which it missed
            # for the joined biases in s30c-d.)
            self.graphs.check_params()
            self.graphs.forget_tables()  # (every row's page table is sent again)

    def grow_pool(self, num_blocks: int) -> None:
        """A larger pool, between generates (its contents are not kept: no step is in flight and
        nothing is cached across calls). Graphs captured over the old pool are dropped."""
        assert self.kv_cache is not None, "restore() before growing a released pool"
        if num_blocks <= self.num_blocks:
            return
        self.kv_cache = self.logits_area = None  # free the old pool before allocating anew
        self.kv_cache = self._new_pool(num_blocks)
        self._num_blocks = num_blocks
        if self.graphs is not None:
            self._new_graphs()

    @property
    def max_pages(self) -> int:
        return num_blocks_for(self.max_model_len, self.block_size)

    def ensure_max_len(self, num_tokens: int) -> None:
        """Size the rope table and the graphs' page tables for sequences of `num_tokens`."""
        if num_tokens <= self.max_model_len:
            return
        self.max_model_len = num_tokens
        self.rope = rope_table(self.model, num_tokens)
        if self.use_cuda_graphs and self.rope is None:
            warnings.warn(
                "a rope type recomputed per call: decode runs without CUDA graphs", stacklevel=2
            )
        self._new_graphs()

    def _new_graphs(self) -> None:
        """Fresh decode graphs (none captured yet) over the current pool, where graphs work."""
        self.graphs = None
        if self.use_cuda_graphs and self.rope is not None and self.kv_cache is not None:
            from reinforge.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, self.max_num_seqs)

    def record_hidden(self, max_bytes: int) -> HiddenStore:
        """From now on every step keeps the residual stream after each layer of every token it
        computes, in host rows (`engine.records`, up to `max_bytes`); decode graphs are captured
        anew with the buffer they write it to."""
        if self.records is None:
            config = self.model.config
            self.records = HiddenStore(
                config.num_hidden_layers, config.hidden_size, self.dtype, self.device, max_bytes
            )
            self._new_graphs()
        return self.records

    def begin_generate(self) -> None:
        assert self.kv_cache is not None, "restore() after release() before generating"
        prepare_adapters(self.model)
        if self.merged is not None:
            self.merged.refresh()  # in place: captured graphs read the new copy
        if self.graphs is not None:
            self.graphs.check_params()

    @property
    def graph_capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs is not None else 0.0

    def launch(
        self,
        batch: Batch,
        params: SamplingParams,
        prev_ids: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """Queue the step and its sampling on the device; returns before they run."""
        spans = None
        if self.route_shape is not None:  # positions computed, before the scheduler caches them
            spans = [(g, g[0].num_cached_tokens, g[0].num_tokens) for g in batch.groups]
        fused = self.is_fast_path and uses_fused_sampler(params) and params.temperature > 0.0
        logits = self.run(batch, prev_ids, params.temperature if fused else None)
        samples = self.graphs.last_samples if self._graph_logits else None
        recording = self.records is not None and self.last_records is not None
        recording = recording and self.records.active
        if samples is not None:
            ids, logprobs = samples
            stats = self.graphs.last_stats
        else:
            ids, logprobs, stats = self.sample(batch, logits, params, stats=recording)
        routes = self._routes_to_host()  # queued before `_fetch`'s event
        step = LaunchedStep(batch, ids, *self._fetch(ids, logprobs))
        if recording:
            # after the results' copy: a copy engine busy with the records' transfer must not
            # hold the step's results (and the stream behind them) back
            self.records.write(
                self.last_records,
                batch.groups,
                reused=self._graph_logits,
                stats_G2=stats,
                temperature=params.temperature,
                seqs=batch.seqs,
            )
        step.routes, step.route_spans = (routes, spans) if routes is not None else (None, None)
        if self.entropy_requested and any(
            seq.num_output_tokens < seq.entropy_window for seq in batch.seqs
        ):
            step.entropies = self.entropy(batch, logits, params.temperature)
        return step

    @torch.inference_mode()
    def run(
        self,
        batch: Batch,
        prev_ids: torch.Tensor | None = None,
        sample_temperature: float | None = None,
    ) -> torch.Tensor:
        """Computes the step and returns logits [len(batch.groups), vocab]. `prev_ids`: in a
        decode, the input tokens on the device (the last step's samples, not read back yet).
        `sample_temperature`: a decode replayed from a graph samples in it too, at that
        temperature (`DecodeGraphs.last_samples`; what `sample` would draw, bit for bit)."""
        self._copy_blocks(batch.block_copies)
        leaders = batch.leaders
        self._graph_logits = False
        if self.graphs is not None:
            if batch.is_prefill:
                self.graphs.forget_tables()
            elif self.graphs.fits(len(leaders)):
                self._graph_logits = True
                logits = self.graphs.run(
                    leaders, prev_ids, batch.grown_rows, temperature=sample_temperature
                )
                routes, records = self.graphs.routes, self.graphs.records
                self.last_routes = None if routes is None else routes[: len(leaders)]
                self.last_records = None if records is None else records[: len(leaders)]
                return logits
        if self.graphs is not None:  # an eager step: the next replay checks every row's table
            self.graphs.last_seqs = None
        if batch.is_prefill:
            input_ids, positions, meta, logits_indices = eager_inputs.prefill(
                leaders, self.block_size, self.device, self.is_fast_path
            )
        else:
            input_ids, positions, meta, logits_indices = eager_inputs.decode(
                leaders, self.block_size, self.device
            )
            if prev_ids is not None:
                input_ids = prev_ids
        self.last_routes = None
        if self.route_shape is not None:
            shape = (input_ids.shape[0], *self.route_shape)
            self.last_routes = torch.empty(shape, dtype=self.route_dtype, device=self.device)
        self.last_records = None

        def run() -> torch.Tensor:
            if self.records is not None:  # (a prefill's in the shared mempool, as its activations)
                shape = (input_ids.shape[0], *self.records.row_shape)
                self.last_records = torch.empty(shape, dtype=self.dtype, device=self.device)
            return forward(
                self.model,
                input_ids,
                positions,
                self.kv_cache,
                meta,
                logits_indices,
                self.backend,
                self.shape,
                self.ops,
                self.rope,
                routes_out=self.last_routes,
                records_out=self.last_records,
            )

        if batch.is_prefill and self.kv_mempool is not None:  # the update's free memory
            return self.prefills.run(self.kv_mempool, self.device, run)
        return run()

    def _routes_to_host(self) -> torch.Tensor | None:
        """Start copying the last step's routes to the host (pinned memory on CUDA)."""
        routes = self.last_routes
        if routes is None or self.device.type != "cuda":
            return routes
        host = torch.empty(routes.shape, dtype=routes.dtype, pin_memory=True)
        return host.copy_(routes, non_blocking=True)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in zip(*copies))
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
