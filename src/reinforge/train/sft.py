"""Supervised fine-tuning on a task's reference solutions, loss on response tokens only.

Used as the warm-up stage of `reinforge train` and by `reinforge sft`. Examples come from the
same indexed task stream as RL, so one data position covers both phases.
"""

from __future__ import annotations

import time

import torch

from reinforge.train.common import eos_ids, render_prompt
from reinforge.train.forward import completion_rows, micro_batches


def sft_examples(
    tokenizer, task_source, start: int, count: int
) -> tuple[list[list[int]], list[list[int]]]:
    prompts, responses = [], []
    for i in range(start, start + count):
        task = task_source.train_task(i)
        assert task.solution is not None, f"task {task.id} has no reference solution to train on"
        prompts.append(render_prompt(tokenizer, task.messages))
        responses.append(
            tokenizer.encode(task.solution, add_special_tokens=False) + eos_ids(tokenizer)
        )
    return prompts, responses


def sft_step(
    model,
    tokenizer,
    optimizer,
    scheduler,
    prompts,
    responses,
    max_grad_norm: float,
    micro_batch_tokens: int | None = None,
    micro_batch_size: int | None = None,
) -> dict[str, float]:
    """One optimizer step: token-mean negative log-likelihood of the responses over the whole
    batch, in packed micro-batches of at most `micro_batch_tokens` tokens (default: the whole
    batch at once; `micro_batch_size` sequences' worth of the longest one, the older way to say
    it)."""
    start = time.perf_counter()
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    if micro_batch_tokens is None:
        micro_batch_tokens = max(lengths) * micro_batch_size if micro_batch_size else sum(lengths)
    num_tokens = float(sum(len(r) for r in responses))
    total_loss = 0.0
    optimizer.zero_grad(set_to_none=True)
    for idx in micro_batches(prompts, responses, micro_batch_tokens):
        rows = completion_rows(model, [prompts[i] for i in idx], [responses[i] for i in idx], 1.0)
        loss = -rows.logprobs_ST.sum() / num_tokens  # token mean over the whole step
        loss.backward()
        total_loss += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    scheduler.step()
    return {
        "loss": total_loss,
        "grad_norm": float(grad_norm),
        "lr": scheduler.get_last_lr()[0],
        "step_s": time.perf_counter() - start,
    }
