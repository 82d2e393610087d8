"""The paged engine: continuous batching over a paged KV pool, with the prompt of each group
prefilled once and its pages shared by the group's n samples.

Same contract as `SimpleEngine` (token ids in, token ids and sampler logprobs out), and the same
live model: its own forward reads the trainer's parameter tensors in place, so the next
`generate` after an optimizer step samples from the new policy. Architectures without a paged
forward (see `qwen_forward.SUPPORTED_MODEL_TYPES`) run through `SimpleEngine`, with a warning.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from reinforge.engine import moe
from reinforge.engine.base import GenerationStats, SamplingParams
from reinforge.engine.block_manager import BlockManager, pages_to_run_at_once
from reinforge.engine.detokenize import TextsAhead, decode_many
from reinforge.engine.lora_merge import merged_bytes, resolve_mode
from reinforge.engine.model_runner import LaunchedStep, ModelRunner
from reinforge.engine.pool_size import (
    CPU_KV_GROWTH_LIMIT_BYTES,
    gpu_reserve_bytes,
    kv_bytes_per_block,
    num_blocks_for_budget,
)
from reinforge.engine.qwen_forward import unsupported_reason
from reinforge.engine.scheduler import Batch, Scheduler
from reinforge.engine.sequence import Sequence
from reinforge.engine.simple import SimpleEngine
from reinforge.types import Completion
from reinforge.watchdog import beat


class PagedEngine:
    overlap = True  # queue each decode before reading the previous one back (off: for tests)

    def __init__(
        self,
        model,
        tokenizer,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        use_cuda_graphs: bool | None = None,
        lora_generation: str = "auto",
        record_routes: bool = False,
    ):
        """`num_blocks` sets the pool size in pages; otherwise it is what fits in
        `kv_cache_bytes`. With neither: on CUDA, the free memory less a reserve for
        activations; elsewhere the pool grows before each generate to what its sequences need
        at full length (up to `CPU_KV_GROWTH_LIMIT_BYTES`; beyond it they take turns).
        A trainer sharing the device passes the memory planner's budget. `use_cuda_graphs`: None
        uses them where they work. `lora_generation` ("auto", "merged", "adapters"): how a PEFT
        LoRA model decodes (`lora_merge`); a trainer passes its memory plan's choice, "auto"
        decides from the free memory (`lora_merge.resolve_mode`). `record_routes` (a
        mixture-of-experts model): each completion carries the experts every position before its
        last token was routed to (`Completion.routes`, for routing replay)."""
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._stats = GenerationStats()
        # over the engine's life, seconds spent taking the KV pool back after a release and
        # capturing decode graphs (the trainer logs each step's share: `gen_restore_s`, ...)
        # running totals of generation's time (a step reads the difference): all of `generate`,
        # and its fixed costs (restoring the KV pool, capturing decode graphs); and the ids
        # whose texts were decoded during the decode loop (`TextsAhead`)
        self.totals = {
            "gen_engine_s": 0.0,
            "gen_restore_s": 0.0,
            "gen_graph_capture_s": 0.0,
            "gen_texts_ahead_ids": 0.0,
        }
        self.fallback: SimpleEngine | None = None
        self.lora_generation = "adapters"  # "merged" or "adapters", resolved below
        reason = unsupported_reason(model)
        if reason is not None:
            warnings.warn(
                f"PagedEngine: {reason}; falling back to the model's own forward "
                "(SimpleEngine: correct, but no paged KV, no prompt sharing, slower)",
                stacklevel=2,
            )
            self.fallback = SimpleEngine(model, tokenizer, max_batch_size=max_num_seqs)
            return
        device = next(model.parameters()).device
        # off CUDA, with no size given, the pool follows the requests (up to a limit)
        self.pool_grows = num_blocks is None and kv_cache_bytes is None and device.type != "cuda"
        self.lora_generation = self._lora_mode(lora_generation, kv_cache_bytes, num_blocks)
        held = merged_bytes(model) if self.lora_generation == "merged" else 0
        if self.pool_grows:
            num_blocks = 1  # sized by each generate (`_grow_pool`)
        elif num_blocks is None:
            num_blocks = num_blocks_for_budget(
                model, block_size, kv_cache_bytes, max_num_seqs, max_num_batched_tokens, held
            )
        self.runner = ModelRunner(
            model,
            num_blocks,
            block_size,
            max_num_seqs,
            use_cuda_graphs,
            self.lora_generation,
            record_routes,
        )

    def _lora_mode(self, mode: str, kv_cache_bytes: int | None, num_blocks: int | None) -> str:
        """The LoRA generation mode to run (`lora_merge.resolve_mode`; reads the free memory on
        CUDA)."""
        device = next(self.model.parameters()).device
        free = reserve = None
        if mode == "auto" and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            reserve = gpu_reserve_bytes(
                self.model, total, self.max_num_seqs, self.max_num_batched_tokens
            )
            if num_blocks is not None:
                kv_cache_bytes = num_blocks * kv_bytes_per_block(self.model, self.block_size)
        return resolve_mode(mode, self.model, kv_cache_bytes, free, reserve or 0)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def stats(self) -> GenerationStats:
        return self.fallback.stats if self.fallback is not None else self._stats

    def release_memory(self) -> None:
        if self.fallback is None:
            self.runner.release()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if self.fallback is not None:
            return self.fallback.generate(prompts, params)
        start = time.perf_counter()
        self.runner.restore()
        self.totals["gen_restore_s"] += time.perf_counter() - start
        if self.pool_grows:
            self._grow_pool(prompts, params)
        scheduler = Scheduler(
            BlockManager(self.num_blocks, self.block_size),
            self.max_num_seqs,
            self.max_num_batched_tokens,
        )
        groups = [self._new_group(i, prompt, params) for i, prompt in enumerate(prompts)]
        for group in groups:
            # more samples than can run at once share the prompt's pages in turns (each turn
            # prefills the prompt again)
            for k in range(0, len(group), self.max_num_seqs):
                scheduler.add(group[k : k + self.max_num_seqs])
        if prompts:
            self.runner.ensure_max_len(max(map(len, prompts)) + params.max_new_tokens)
        self.runner.begin_generate()
        capture_before = self.runner.graph_capture_seconds
        finish_reason = self._finish_rule(params)
        timers = StepTimers()
        texts = TextsAhead(self.tokenizer, [seq for group in groups for seq in group])
        inflight: LaunchedStep | None = None
        while True:
            ahead = self._launch_ahead(scheduler, inflight, params, timers)
            if ahead is not None:  # two steps queued: texts while the first is not done
                texts.advance_while(inflight.ready)
            if inflight is not None:
                self._commit(scheduler, inflight, finish_reason, timers)
                beat()  # a decode step is progress for the hang watchdog
            inflight = ahead or self._launch_next(scheduler, params, timers)
            if inflight is None:
                break
        timers.capture = self.runner.graph_capture_seconds - capture_before
        self.totals["gen_graph_capture_s"] += timers.capture
        self._record_stats(groups, scheduler, start, timers)
        completions = self._completions(groups, texts)
        self.totals["gen_texts_ahead_ids"] += texts.num_decoded
        self.totals["gen_engine_s"] += time.perf_counter() - start
        return completions

    def _grow_pool(self, prompts: list[list[int]], params: SamplingParams) -> None:
        bs = self.block_size
        want = pages_to_run_at_once(
            list(map(len, prompts)), params.max_new_tokens, params.n, bs, self.max_num_seqs
        )
        limit = CPU_KV_GROWTH_LIMIT_BYTES // kv_bytes_per_block(self.model, bs)
        self.runner.grow_pool(min(want, limit))

    def _launch_ahead(self, scheduler, inflight, params, timers) -> LaunchedStep | None:
        """Queue decode N+1 before step N (in flight) is read back, when nothing N's tokens
        could reveal would change it: its input tokens are N's samples, still on the device, so
        the host's bookkeeping overlaps the GPU."""
        if not self.overlap or inflight is None or inflight.batch.is_prefill:
            return None
        start = time.perf_counter()
        batch = scheduler.schedule_next_decode()
        if batch is None:
            return None
        prev_ids = self._input_ids_from(inflight, batch)
        ahead = self.runner.launch(batch, params, prev_ids=prev_ids)
        scheduler.launched(batch)
        timers.add(False, "launch", time.perf_counter() - start)
        return ahead

    def _launch_next(self, scheduler, params, timers) -> LaunchedStep | None:
        """Schedule and queue the next step with every earlier one committed; None when done."""
        if scheduler.is_finished():
            return None
        start = time.perf_counter()
        batch = scheduler.schedule()
        step = self.runner.launch(batch, params)
        scheduler.launched(batch)
        timers.add(batch.is_prefill, "launch", time.perf_counter() - start)
        return step

    def _commit(self, scheduler, step: LaunchedStep, finish_reason, timers) -> None:
        start = time.perf_counter()
        token_ids, logprobs = step.result()  # waits for the device
        waited = time.perf_counter()
        if step.routes is not None:
            assert step.route_spans is not None
            moe.record_routes(step.routes, step.route_spans)
        scheduler.commit(step.batch, token_ids, logprobs, finish_reason, step.entropy_values())
        timers.add(step.batch.is_prefill, "wait", waited - start)
        timers.add(step.batch.is_prefill, "commit", time.perf_counter() - waited)

    def _input_ids_from(self, inflight: LaunchedStep, batch: Batch) -> torch.Tensor:
        """The tokens `batch` decodes from: the samples of the step in flight, on the device,
        in `batch`'s order (the same sequences, less those a commit found finished)."""
        seqs, previous = batch.seqs, inflight.batch.seqs
        if seqs is previous or (
            len(seqs) == len(previous) and all(map(operator.is_, seqs, previous))
        ):
            return inflight.ids
        row = {id(seq): i for i, seq in enumerate(previous)}
        rows = torch.tensor([row[id(seq)] for seq in seqs], device=inflight.ids.device)
        return inflight.ids[rows]

    def _new_group(self, index: int, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        if not prompt:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        return [
            Sequence(
                list(prompt),
                params,
                group_id=index,
                sample_index=k,
                sample_seed=sample_seed(params.seed, params.first_prompt_index + index, k),
            )
            for k in range(params.n)
        ]

    def _finish_rule(self, params: SamplingParams) -> Callable[[Sequence], str | None]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)

        stop_strings = params.stop_strings

        def finish_reason(seq: Sequence) -> str | None:
            outputs = seq.output_ids
            if outputs[-1] in stop_ids or (
                stop_strings and self._hit_stop_string(seq, stop_strings)
            ):
                return "stop"
            if len(outputs) >= seq.params.max_new_tokens:  # a session's requests differ
                return "length"
            return None

        # the rule's parts, for the scheduler's loop without a call per sequence
        finish_reason.stop_ids = frozenset(stop_ids)  # type: ignore[attr-defined]
        finish_reason.stop_strings = stop_strings  # type: ignore[attr-defined]
        return finish_reason

    def _hit_stop_string(self, seq: Sequence, stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(seq.output_ids[-32:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _completions(
        self, groups: list[list[Sequence]], ahead: TextsAhead | None = None
    ) -> list[list[Completion]]:
        """The finished groups' completions, their texts decoded in one call (`decode_many`);
        `ahead`: the texts decoded during the loop (`TextsAhead`), its sequences `groups`'."""
        if ahead is not None:
            texts = iter(ahead.texts())
        else:
            seqs = [seq.output_ids for group in groups for seq in group]
            texts = iter(decode_many(self.tokenizer, seqs, skip_special_tokens=True))
        return [[self._completion(seq, next(texts)) for seq in group] for group in groups]

    def _completion(self, seq: Sequence, text: str | None = None) -> Completion:
        """`seq`'s completion; `text`: its ids decoded already (`_completions`)."""
        assert seq.is_finished and seq.finish_reason is not None
        if text is None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return Completion(
            token_ids=seq.output_ids,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            text=text,
            # every position whose output predicts a sampled token (the last token's, never fed
            # back, is left out)
            routes=None if seq.routes is None else seq.routes.prefix(seq.num_tokens - 1),
            hidden=None if seq.hidden is None else seq.hidden.completed(seq.token_ids),
        )

    def _record_stats(self, groups, scheduler: Scheduler, start: float, timers: StepTimers):
        seqs = [seq for group in groups for seq in group]
        self._stats = GenerationStats(
            num_prompt_tokens=sum(seq.num_prompt_tokens for seq in seqs),
            num_generated_tokens=sum(seq.num_output_tokens for seq in seqs),
            seconds=time.perf_counter() - start,
            extra={
                "num_steps": float(scheduler.num_prefill_steps + scheduler.num_decode_steps),
                "num_decode_steps": float(scheduler.num_decode_steps),
                "num_overlapped_steps": float(scheduler.num_overlapped_steps),
                # computed tokens: a group's shared prompt once
                "num_prefill_tokens": float(scheduler.num_prefill_tokens),
                "num_preemptions": float(scheduler.num_preemptions),
                "kv_blocks_total": float(self.num_blocks),
                "kv_blocks_peak": float(scheduler.peak_used_blocks),
                "kv_blocks_peak_unshared": float(scheduler.peak_unshared_blocks),
                **timers.as_dict(),
            },
        )


def sample_seed(seed: int, group_id: int, sample_index: int) -> int:
    """A 63-bit key for one sequence's sampling noise on the device: the same (seed, prompt,
    sample) draws the same tokens whatever batch it runs in."""
    mixed = (
        seed * 0x9E3779B97F4A7C15
        + group_id * 0xBF58476D1CE4E5B9
        + sample_index * 0x94D049BB133111EB
    )
    return (mixed ^ (mixed >> 31)) & (2**63 - 1)


@dataclass
class StepTimers:
    """Host wall time per phase of the loop, by step kind: `launch` (scheduling and queueing a
    step; a graph replay returns at once), `wait` (blocked reading a step's tokens back: the
    device time not hidden behind the host), `commit` (recording the tokens)."""

    seconds: dict[str, float] = field(default_factory=dict)
    capture: float = 0.0

    def add(self, is_prefill: bool, phase: str, seconds: float) -> None:
        key = f"seconds_{'prefill' if is_prefill else 'decode'}_{phase}"
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def as_dict(self) -> dict[str, float]:
        return {**self.seconds, "seconds_graph_capture": self.capture}
