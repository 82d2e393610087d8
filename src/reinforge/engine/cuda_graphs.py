"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

Every graph reads the same static inputs (token ids, positions, slots, context lengths and the
page table, padded to the bucket: `graph_rows`) and writes logits into one shared buffer, so a
step costs a small host-to-device copy and one replay instead of a few hundred kernel launches.
A graph that samples also moves its rows on to the next step of the same sequences (the sampled
ids in, positions and lengths one on; each slot is read from the page table at a replay's
start), so a step that follows it sends nothing but the pages taken. Graphs are captured
largest bucket first into one memory pool, the first time a decode needs them.

A graph holds the addresses of the tensors it read at capture: the model's parameters (LoRA A/B
included), a merged LoRA copy's buffers (`lora_merge`, rebuilt in place before a generate) and the
KV pool. Parameters updated in place (an optimizer step, `load_state_dict`,
`copy_`) are seen by the next replay; a parameter *replaced* by a new tensor, or a change of the
adapters' state that the forward's Python decided at capture (`disable_adapter()`, another active
adapter, a new scaling: `lora_forward.adapter_state`), is caught by `check_params`, which drops
the graphs so they are captured again.

Padded rows attend to one token of page 0 and write no K/V (slot -1); their logits are ignored.
"""

from __future__ import annotations

import bisect
import operator
import threading
import time
from typing import Any

import numpy as np
import torch

from reinforge.engine.attention import AttentionMetadata
from reinforge.engine.graph_rows import (
    CONTEXT_LENS,
    IDS,
    NUM_ROW_FIELDS,
    OUTPUT_POSITIONS,
    PAD_ROW,
    POSITIONS,
    SEEDS,
    SLOTS,
    advance_rows,
    decode_rows,
    table_update,
)
from reinforge.engine.lora_forward import adapter_state
from reinforge.engine.qwen_forward import forward
from reinforge.engine.sequence import Sequence

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# Held while a graph is captured: CUDA calls from another thread (the disaggregated generator's
# weight receive, train/loop/disaggregated.py) during a capture would invalidate it.
CAPTURE_LOCK = threading.Lock()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}
_BACKWARD_WARMED: set[int] = set()  # devices whose capture stream has autograd's workspace too


def capture_stream() -> torch.cuda.Stream:
    """The one side stream of the current device that every capture runs on. One, not a new
    one per capture: cuBLAS keeps a workspace (32 MiB on Hopper) per stream for the process's
    life, and the allocator hands a freed block out again only on the stream it was allocated
    on, so memory meant for a capture (`ModelRunner.share_memory`) is allocated on this one."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        stream = torch.cuda.Stream()
        _BACKWARD_WARMED.discard(device)
        warm_blas(stream)
        _CAPTURE_STREAMS[device] = stream
    return _CAPTURE_STREAMS[device]


def warm_blas(stream: torch.cuda.Stream, backward: bool = False) -> None:
    """cuBLAS's workspaces for `stream`, allocated now, in the default pool. Made lazily, at a
    stream's first matrix product, inside a capture they would land in the capture's pool and
    stay there for the process's life: a live 32 MiB block in the middle of a shared mempool
    (session 21: 540 MiB into G1's, so the 1.5 GiB KV pool no longer fit in the freed memory and
    the mempool grew to 2.1 GiB). Each product kind that may take its own workspace, a plain
    product (cuBLAS) and one with a bias (cuBLASLt), in each float type a capture may use; with
    `backward`, through a backward too: its products run on autograd's device thread, whose
    cuBLAS handle (handles are per thread) has a workspace of its own (made only for a capture
    that runs a backward: a run that never captures its update does not hold it)."""
    device = torch.cuda.current_device()
    stream.wait_stream(torch.cuda.current_stream())
    # (the first capture may come from inside the engine's inference mode)
    with torch.cuda.stream(stream), torch.inference_mode(False), torch.enable_grad():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            a = torch.ones(64, 64, dtype=dtype, device=device)
            if not backward:
                torch.mm(a, a)
                torch.mm(a.t(), a)
                torch.addmm(a[0], a, a)
                continue
            w = torch.ones(64, 64, dtype=dtype, device=device, requires_grad=True)
            b = torch.ones(64, dtype=dtype, device=device, requires_grad=True)
            torch.nn.functional.linear(a @ w, w, b).float().sum().backward()
    torch.cuda.current_stream().wait_stream(stream)


def capture(graph: torch.cuda.CUDAGraph, fn, pool=None, backward: bool = False):
    """`fn()` captured into `graph` on `capture_stream()` (its memory in `pool`, a graph's or a
    `torch.cuda.MemPool`'s handle, else a fresh private pool); returns what `fn` returned.
    `backward`: `fn` runs a backward (its workspaces are made first: `warm_blas`).
    Unlike `torch.cuda.graph`, no device synchronization, `gc.collect` or `empty_cache` first:
    those cost a step tens of milliseconds and make every later allocation of the step a fresh
    `cudaMalloc` (the trainer's update and the decode graphs both capture between steps)."""
    stream = capture_stream()
    device = torch.cuda.current_device()
    if backward and device not in _BACKWARD_WARMED:
        warm_blas(stream, backward=True)
        _BACKWARD_WARMED.add(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class DecodeGraphs:
    def __init__(self, runner, max_batch_size: int):
        self.runner = runner
        self.buckets = [b for b in BUCKETS if b < max_batch_size] + [
            min(max_batch_size, BUCKETS[-1])
        ]
        self.max_batch_size = self.buckets[-1]
        device = runner.device
        # two host buffers, used in turn: the host fills one while the previous step's copy from
        # the other may still be queued behind the step in flight
        self.rows_hosts = [
            torch.empty((NUM_ROW_FIELDS, self.max_batch_size), dtype=torch.long, pin_memory=True)
            for _ in range(2)
        ]
        for rows_host in self.rows_hosts:
            rows_host.numpy()[:] = np.array(PAD_ROW)[:, None]
        self.num_runs = 0
        self.rows = self.rows_hosts[0].to(device)
        self.tables = torch.zeros(
            (self.max_batch_size, runner.max_pages), dtype=torch.int32, device=device
        )
        # what each row of `tables` holds: [sequence id, number of pages, last page] by row
        # (-1: nothing known)
        self.table_keys = np.full((3, self.max_batch_size), -1, dtype=np.int64)
        # the sequences of the last replay, row by row (None: unknown, e.g. after an eager step)
        self.last_seqs: list[Sequence] | None = None
        vocab = runner.model.lm_head.weight.shape[0]
        # the logits rows every replay writes: the runner's, beside a KV pool in a shared mempool
        # (`ModelRunner.logits_area`, at the same address whenever the pool is), else our own
        self._logits = None
        area = runner.logits_area
        if area is None or area.shape[0] < self.max_batch_size:
            shape = (self.max_batch_size, vocab)
            self._logits = torch.empty(shape, dtype=runner.dtype, device=device)
        # routing replay: every replay writes its tokens' experts here (a few bytes per token)
        self.routes = None
        if runner.route_shape is not None:
            shape = (self.max_batch_size, *runner.route_shape)
            self.routes = torch.zeros(shape, dtype=runner.route_dtype, device=device)
        # recording (`ModelRunner.record_hidden`): every replay writes its tokens' residual
        # streams here, [rows, layers, hidden]
        self.records = None
        # and a sampling replay its rows' log-sum-exp and entropy, [rows, 2] (`row_stats`)
        self.stats = None
        if runner.records is not None:
            shape = (self.max_batch_size, *runner.records.row_shape)
            self.records = torch.zeros(shape, dtype=runner.dtype, device=device)
            self.stats = torch.zeros((self.max_batch_size, 2), dtype=torch.float32, device=device)
        # by (batch size, the temperature the graph samples at: None, it only computes logits)
        self.graphs: dict[tuple[int, float | None], torch.cuda.CUDAGraph] = {}
        # a sampling graph's ids and logprobs [bucket] (its own output tensors)
        self.samples: dict[tuple[int, float | None], tuple[torch.Tensor, torch.Tensor]] = {}
        # the last replay's samples, row by row (None: that graph did not sample)
        self.last_samples: tuple[torch.Tensor, torch.Tensor] | None = None
        self.last_stats: torch.Tensor | None = None  # and its rows' stats, when it kept them
        # the graph whose last replay moved the rows on to the next step (a sampling one)
        self.advanced_key: tuple[int, float | None] | None = None
        self.host_rows_current = False  # `rows_hosts` hold the rows the device has
        # (samples, stats) views by (graph, rows): made once
        self.views: dict[tuple, tuple] = {}
        self.pool: Any = None  # the graphs' shared memory pool (an opaque handle)
        self.capture_key = self._capture_key()
        self.capture_seconds = 0.0

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is not None:
            return self._logits
        assert self.runner.logits_area is not None, "a replay while the KV pool is released"
        return self.runner.logits_area

    def fits(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch_size

    def check_params(self) -> None:
        """Drop the graphs if any parameter tensor or the KV pool moved, or the adapters' state
        changed, since capture."""
        key = self._capture_key()
        if key != self.capture_key:
            self.graphs.clear()
            self.samples.clear()
            self.views.clear()
            self.pool = None
            self.capture_key = key

    def run(
        self,
        seqs: list[Sequence],
        prev_ids: torch.Tensor | None = None,
        grown_rows: list[int] | None = None,
        temperature: float | None = None,
    ) -> torch.Tensor:
        """Replays the decode step of `seqs`; returns their logits [len(seqs), vocab] (a view of
        the shared buffer, valid until the next replay). `temperature`: the replay samples each
        row too, with the fused inverse-CDF sampler at that temperature (`last_samples`: ids and
        logprobs, views of the graph's outputs, valid until the next replay): the sampler's two
        kernel launches cost the host 25-75 us a decode step (s26b), the graph none. `prev_ids`: the input tokens, on the
        device (the previous step's samples, not read back yet). `grown_rows`: the only rows
        whose page table may have changed (`Batch.grown_rows`); with the same sequences in the
        same rows as the last replay, only these are checked (checking all 256 rows took 82-123 us
        a decode step under cProfile on two H200 hosts, s25b and s25d)."""
        n = len(seqs)
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        key = (bucket, temperature)
        if key not in self.graphs:  # captured on first use: a step often needs one or two
            start = time.perf_counter()
            self._capture(bucket, temperature)
            torch.cuda.synchronize()
            self.capture_seconds += time.perf_counter() - start
            self.last_seqs = None  # (the capture's warm-up ran on padding rows)
        last, self.last_seqs = self.last_seqs, seqs
        same_rows = last is not None and len(last) == n and all(map(operator.is_, seqs, last))
        follows = same_rows and grown_rows is not None and prev_ids is not None
        if follows and temperature is not None and self.advanced_key == key:
            # the last replay, of this graph, sampled these rows and moved them on to this
            # step's inputs (`_capture`): nothing to send but the pages taken (a slow host spent
            # 0.2-0.3 ms a step filling and sending the rows and the input ids, s29c)
            self.host_rows_current = False
        else:
            previous = self.rows_hosts[(self.num_runs - 1) % 2].numpy()
            rows_host = self.rows_hosts[self.num_runs % 2]
            self.num_runs += 1
            rows_np = rows_host.numpy()
            if follows and self.host_rows_current:
                # each sequence one token on from the last replay's rows (its input id comes
                # from the device): 5-14 us at 256 rows, where filling them took 84-130
                advance_rows(previous, rows_np, seqs, grown_rows, self.runner.block_size)
            else:
                decode_rows(seqs, self.runner.block_size, rows_np)
            rows_np[:, n:bucket] = np.array(PAD_ROW)[:, None]
            self.rows.copy_(rows_host, non_blocking=True)
            if prev_ids is not None:
                self.rows[IDS, :n].copy_(prev_ids)
            self.host_rows_current = True
        self._update_tables(seqs, grown_rows if same_rows else None)
        self.graphs[key].replay()
        self.advanced_key = key if temperature is not None else None
        views = self.views.get((key, n))
        if views is None:
            samples = self.samples.get(key)
            sampled = samples is not None and self.stats is not None
            views = self.views[(key, n)] = (
                None if samples is None else (samples[0][:n], samples[1][:n]),
                self.stats[:n] if sampled else None,
            )
        self.last_samples, self.last_stats = views
        # (not kept: a view would keep the logits' block, the KV pool's, from being released)
        return self.logits[:n]

    def row(self, field: int, n: int) -> torch.Tensor:
        return self.rows[field, :n]

    def forget_tables(self) -> None:
        """After a prefill, or the pool restored: pages were (re)allocated, so every row's table
        is sent again and the next replay's rows are filled from the sequences. (An eager decode
        only forgets `last_seqs`: the tables it leaves are still the rows' own.)"""
        self.table_keys[:] = -1
        self.last_seqs = None
        self.advanced_key = None

    def _update_tables(self, seqs: list[Sequence], rows: list[int] | None = None) -> None:
        """Send only the page-table entries that changed since the last step (`table_update`);
        `rows`: the only rows that may have changed (None: any)."""
        update = table_update(self.table_keys, self.runner.max_pages, seqs, rows)
        if update is None:
            return
        # pinned and not waited for: a pageable copy waits for the device to drain the step
        # launched ahead (G1: every 16th decode step, when every sequence takes a page)
        update = torch.from_numpy(update)
        if self.tables.is_cuda:
            update = update.pin_memory()
        update = update.to(self.tables.device, non_blocking=True)
        self.tables.view(-1).index_copy_(0, update[0], update[1].to(torch.int32))

    def _capture(self, bucket: int, temperature: float | None = None) -> None:
        r = self.runner
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.rows[SLOTS, :bucket],
            block_tables=self.tables[:bucket],
            context_lens=self.rows[CONTEXT_LENS, :bucket],
            query_lens=[1] * bucket,
            context_lens_host=[1] * bucket,
        )
        self.rows.copy_(torch.tensor(PAD_ROW)[:, None].expand_as(self.rows))

        rows, bs = self.rows, r.block_size

        from reinforge.engine.triton_ops import advance_rows_on_device, row_slots

        def step() -> tuple[torch.Tensor, torch.Tensor] | None:
            # each row's slot from its position and page table (the host's value where it sent
            # the rows; a step the last replay moved on gets it here), padding's kept at -1
            row_slots(rows, self.tables, bucket, bs, (POSITIONS, SLOTS))
            forward(
                r.model,
                self.rows[IDS, :bucket],
                self.rows[POSITIONS, :bucket],
                r.kv_cache,
                meta,
                None,
                r.backend,
                r.shape,
                r.ops,
                r.rope,
                logits_out=self.logits[:bucket],
                routes_out=None if self.routes is None else self.routes[:bucket],
                records_out=None if self.records is None else self.records[:bucket],
            )
            if temperature is None:
                return None
            from reinforge.engine.triton_sampling import sample_inverse_cdf

            seeds, outputs = rows[SEEDS, :bucket], rows[OUTPUT_POSITIONS, :bucket]
            stats = None if self.stats is None else self.stats[:bucket]
            ids, logprobs = sample_inverse_cdf(
                self.logits[:bucket], temperature, seeds, outputs, stats_out=stats
            )
            # the rows moved on to the next step of the same sequences (`run` sends nothing
            # then): the sampled ids in, positions, context and output lengths one on
            fields = (IDS, SLOTS, POSITIONS, CONTEXT_LENS, OUTPUT_POSITIONS)
            advance_rows_on_device(rows, ids, bucket, fields)
            return ids, logprobs

        step()  # compiles the Triton kernels and sets up cuBLAS outside the capture
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_LOCK:
            samples = capture(graph, step, self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bucket, temperature)] = graph
        if samples is not None:
            self.samples[(bucket, temperature)] = samples

    def _capture_key(self) -> tuple:
        model, merged = self.runner.model, self.runner.merged
        merged_key = merged.graph_key() if merged is not None else None
        kv = self.runner.kv_cache
        kv_ptr = kv.data_ptr() if kv is not None else None
        params = tuple(p.data_ptr() for p in model.parameters())
        return (params, adapter_state(model), merged_key, kv_ptr)
