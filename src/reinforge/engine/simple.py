"""A simple, correct engine: batched sampling with a KV cache through the model's own forward.

Works for any causal LM that transformers can run, on any device. The fast paged engine plugs in
behind the same interface; this one stays as the reference and the fallback.
"""

from __future__ import annotations

import inspect
import time

import torch

from reinforge.engine.base import GenerationStats, SamplingParams
from reinforge.engine.detokenize import decode_many
from reinforge.engine.sampling import sample
from reinforge.types import Completion


class SimpleEngine:
    """Generates with `model` as it is now: the trainer's own module, so new weights are seen
    by the next call with nothing to sync."""

    def __init__(self, model, tokenizer, max_batch_size: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._stats = GenerationStats()
        self._cache_kwarg = cache_kwarg(model)

    @property
    def stats(self) -> GenerationStats:
        return self._stats

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def release_memory(self) -> None:
        """Nothing to give back: each generate's cache lives only inside that call."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        start = time.perf_counter()
        flat = [p for p in prompts for _ in range(params.n)]
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        done: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for i in range(0, len(flat), self.max_batch_size):
                done.extend(
                    self._generate_batch(flat[i : i + self.max_batch_size], params, generator)
                )
        finally:
            self.model.train(was_training)
        self._stats = GenerationStats(
            num_prompt_tokens=sum(map(len, flat)),
            num_generated_tokens=sum(len(c.token_ids) for c in done),
            seconds=time.perf_counter() - start,
        )
        return [done[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_batch(
        self, batch: list[list[int]], params: SamplingParams, generator
    ) -> list[Completion]:
        from transformers import DynamicCache

        device, B = self.device, len(batch)
        width = max(map(len, batch))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((B, width), pad, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        for row, prompt in enumerate(batch):  # left padding: every row's next token at the end
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)

        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lps: list[list[float]] = [[] for _ in range(B)]
        reasons = ["length"] * B
        alive = [True] * B
        cache = DynamicCache()
        step_ids, step_pos = input_ids, positions
        for _ in range(params.max_new_tokens):
            logits = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_pos,
                use_cache=True,
                **{self._cache_kwarg: cache},
            ).logits[:, -1]
            ids, lps = sample(
                logits, params.temperature, params.top_p, params.top_k, params.min_p, generator
            )
            ids_list, lps_list = ids.tolist(), lps.tolist()
            for row in range(B):
                if not alive[row]:
                    continue
                out_ids[row].append(ids_list[row])
                out_lps[row].append(lps_list[row])
                if ids_list[row] in stop_ids or self._hit_stop_string(
                    out_ids[row], params.stop_strings
                ):
                    alive[row], reasons[row] = False, "stop"
            if not any(alive):
                break
            step_ids = ids[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        texts = decode_many(self.tokenizer, out_ids, skip_special_tokens=True)
        return [
            Completion(
                token_ids=out_ids[r],
                logprobs=out_lps[r],
                finish_reason=reasons[r],
                text=texts[r],
            )
            for r in range(B)
        ]

    def _hit_stop_string(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        if not stops:
            return False
        tail = self.tokenizer.decode(ids[-32:], skip_special_tokens=False)
        return any(s in tail for s in stops)


def cache_kwarg(model) -> str:
    """The name the model's forward takes its KV cache by: `cache` from transformers 5.2x on
    (which warns about `past_key_values`), `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
