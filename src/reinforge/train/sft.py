"""Supervised fine-tuning on a task's reference solutions, loss on response tokens only.

Used as the warm-up stage of `reinforge train` and by `reinforge sft`. Examples come from the
same indexed task stream as RL, so one data position covers both phases.
"""

from __future__ import annotations

import time

import torch

from reinforge.train.common import eos_ids, pad_batch, render_prompt, token_logprobs


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
    micro_batch_size: int,
) -> dict[str, float]:
    start = time.perf_counter()
    device = next(model.parameters()).device
    num_tokens = float(sum(len(r) for r in responses))
    total_loss = 0.0
    optimizer.zero_grad(set_to_none=True)
    for i in range(0, len(prompts), micro_batch_size):
        batch = pad_batch(
            prompts[i : i + micro_batch_size],
            responses[i : i + micro_batch_size],
            tokenizer.pad_token_id,
            device,
        )
        logprobs_BT, _ = token_logprobs(model, batch)
        loss = -(logprobs_BT * batch.mask_BT).sum() / num_tokens  # token mean over the whole step
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
