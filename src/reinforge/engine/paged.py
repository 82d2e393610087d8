"""The paged engine: continuous batching over a paged KV pool, with the prompt of each group
prefilled once and its pages shared by the group's n samples.

Same contract as `SimpleEngine` (token ids in, token ids and sampler logprobs out), and the same
live model: its own forward reads the trainer's parameter tensors in place, so the next
`generate` after an optimizer step samples from the new policy. Architectures without a paged
forward (see `qwen_forward.SUPPORTED_MODEL_TYPES`) run through `SimpleEngine`, with a warning.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import torch

from reinforge.engine.base import GenerationStats, SamplingParams
from reinforge.engine.block_manager import BlockManager
from reinforge.engine.model_runner import ModelRunner, num_blocks_for_budget
from reinforge.engine.qwen_forward import unsupported_reason
from reinforge.engine.sampling import sample
from reinforge.engine.scheduler import Batch, Scheduler
from reinforge.engine.sequence import Sequence
from reinforge.engine.simple import SimpleEngine
from reinforge.types import Completion


class PagedEngine:
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
    ):
        """`num_blocks` sets the pool size in pages; otherwise it is what fits in
        `kv_cache_bytes` (default: 64 MiB on CPU, half the free memory on an accelerator)."""
        self.model = model
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._stats = GenerationStats()
        self.fallback: SimpleEngine | None = None
        reason = unsupported_reason(model)
        if reason is not None:
            warnings.warn(
                f"PagedEngine: {reason}; falling back to the model's own forward "
                "(SimpleEngine: correct, but no paged KV, no prompt sharing, slower)",
                stacklevel=2,
            )
            self.fallback = SimpleEngine(model, tokenizer, max_batch_size=max_num_seqs)
            return
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(model, block_size, kv_cache_bytes)
        self.num_blocks = num_blocks
        self.runner = ModelRunner(model, num_blocks, block_size)

    @property
    def stats(self) -> GenerationStats:
        return self.fallback.stats if self.fallback is not None else self._stats

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if self.fallback is not None:
            return self.fallback.generate(prompts, params)
        start = time.perf_counter()
        scheduler = Scheduler(
            BlockManager(self.num_blocks, self.block_size),
            self.max_num_seqs,
            self.max_num_batched_tokens,
        )
        groups = [self._new_group(i, prompt, params) for i, prompt in enumerate(prompts)]
        for group in groups:
            scheduler.add(group)
        generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        finish_reason = self._finish_rule(params)
        num_steps = num_prefill_tokens = 0
        while not scheduler.is_finished():
            batch = scheduler.schedule()
            if batch.is_prefill:
                num_prefill_tokens += sum(seq.num_tokens for seq in batch.leaders)
            logits = self.runner.run(batch)
            token_ids, logprobs = self._sample(batch, logits, params, generator)
            scheduler.postprocess(batch, token_ids, logprobs, finish_reason)
            num_steps += 1
        self._record_stats(groups, scheduler, start, num_steps, num_prefill_tokens)
        return [[self._completion(seq) for seq in group] for group in groups]

    def _new_group(self, index: int, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        if not prompt:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        return [
            Sequence(list(prompt), params, group_id=index, sample_index=k) for k in range(params.n)
        ]

    def _sample(
        self, batch: Batch, logits_GV: torch.Tensor, params: SamplingParams, generator
    ) -> tuple[list[int], list[float]]:
        """Every member of a group samples from its leader's logits."""
        sizes = [len(group) for group in batch.groups]
        if any(size > 1 for size in sizes):
            repeats = torch.tensor(sizes, device=logits_GV.device)
            logits_GV = logits_GV.repeat_interleave(repeats, dim=0)
        ids, lps = sample(
            logits_GV, params.temperature, params.top_p, params.top_k, params.min_p, generator
        )
        return ids.tolist(), lps.tolist()

    def _finish_rule(self, params: SamplingParams) -> Callable[[Sequence], str | None]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)

        def finish_reason(seq: Sequence) -> str | None:
            if seq.output_ids[-1] in stop_ids or self._hit_stop_string(seq, params.stop_strings):
                return "stop"
            if seq.num_output_tokens >= params.max_new_tokens:
                return "length"
            return None

        return finish_reason

    def _hit_stop_string(self, seq: Sequence, stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(seq.output_ids[-32:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _completion(self, seq: Sequence) -> Completion:
        assert seq.is_finished and seq.finish_reason is not None
        return Completion(
            token_ids=seq.output_ids,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            text=self.tokenizer.decode(seq.output_ids, skip_special_tokens=True),
        )

    def _record_stats(self, groups, scheduler: Scheduler, start, num_steps, num_prefill_tokens):
        seqs = [seq for group in groups for seq in group]
        self._stats = GenerationStats(
            num_prompt_tokens=sum(seq.num_prompt_tokens for seq in seqs),
            num_generated_tokens=sum(seq.num_output_tokens for seq in seqs),
            seconds=time.perf_counter() - start,
            extra={
                "num_steps": float(num_steps),
                "num_prefill_tokens": float(num_prefill_tokens),  # computed, shared ones once
                "num_preemptions": float(scheduler.num_preemptions),
                "kv_blocks_total": float(self.num_blocks),
                "kv_blocks_peak": float(scheduler.peak_used_blocks),
                "kv_blocks_peak_unshared": float(scheduler.peak_unshared_blocks),
            },
        )
