"""Supervised fine-tuning: the step and the validation loss (here) and reference episodes of env
tasks (`demos`). It may import `train.packing`, `train.policy` and the layers below `train`.

Supervised fine-tuning on reference solutions, the loss on the assistant's tokens only.

Used as the warm-up stage of `reinforge train` and by `reinforge sft`. Examples come from the
same indexed task stream as RL, so one data position covers both phases. A task's conversation
is its prompt messages (earlier assistant turns included, as a multi-turn chat log has them)
followed by its solution as the last assistant turn; the loss covers every assistant turn, cut
from the chat template (`reinforge.data.chat`). An example is (prompt ids up to the first
assistant turn, the ids after them, the loss mask over those).
"""

from __future__ import annotations

import math
import time

import torch

from reinforge.data.chat import chat_example, eos_ids
from reinforge.distributed import loss_scale, sum_over_ranks
from reinforge.envs.env_tasks import EnvTasks
from reinforge.sharding import accumulation, clip_grad_norm, in_lockstep
from reinforge.tasks import prefetch
from reinforge.train.packing.forward import completion_rows, micro_batches
from reinforge.train.policy.optim import advance_schedule
from reinforge.types import Message, Task

SFTBatch = tuple[list[list[int]], list[list[int]], list[list[int]]]  # prompts, responses, masks


def sft_examples(tokenizer, task_source, start: int, count: int) -> SFTBatch:
    if isinstance(task_source, EnvTasks):  # whole reference episodes, env replies masked out
        from reinforge.train.sft.demos import demonstration_examples

        return demonstration_examples(tokenizer, task_source, start, count)
    prefetch(task_source, range(start, start + 2 * count))  # this batch's and the next's
    return sft_batch(tokenizer, [task_source.train_task(i) for i in range(start, start + count)])


def sft_batch(tokenizer, tasks: list[Task]) -> SFTBatch:
    prompts, responses, masks = [], [], []
    for task in tasks:
        assert task.solution is not None, f"task {task.id} has no reference solution to train on"
        conversation = (*task.messages, Message("assistant", task.solution))
        example = chat_example(tokenizer, conversation, eos_ids(tokenizer))
        start = example.num_prompt_tokens
        prompts.append(example.ids[:start])
        responses.append(example.ids[start:])
        masks.append(example.loss_mask[start:])
    return prompts, responses, masks


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
    poison: bool = False,
    masks: list[list[int]] | None = None,
    accumulate_unsharded: bool = False,
    share_prompts: bool = True,
) -> dict[str, float]:
    """One optimizer step: token-mean negative log-likelihood of the responses over the whole
    batch, in packed micro-batches of at most `micro_batch_tokens` tokens (default: the whole
    batch at once; `micro_batch_size` sequences' worth of the longest one, the older way to say
    it); responses to one prompt hold it once (`share_prompts`, see `train.packing`). A gradient that is not finite skips the optimizer step (`nonfinite_skipped` = 1);
    `poison` (a fault-injection drill) makes the loss NaN. `masks` (one 0/1 per response token)
    leaves tokens out of the loss, such as a conversation's user turns; default: all count.
    In a distributed run these are this rank's share of the batch; the loss is the global
    batch's token mean; `accumulate_unsharded`: see `sharding.accumulation`."""
    start = time.perf_counter()
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    if micro_batch_tokens is None:
        micro_batch_tokens = max(lengths) * micro_batch_size if micro_batch_size else sum(lengths)
    masks = masks if masks is not None else [[1] * len(r) for r in responses]
    num_tokens = sum_over_ranks(float(sum(map(sum, masks))))  # the global batch's
    total_loss = 0.0
    optimizer.zero_grad(set_to_none=True)
    lockstep = in_lockstep(model)
    batches = micro_batches(prompts, responses, micro_batch_tokens, share_prompts, lockstep)
    with accumulation(model, accumulate_unsharded) as before:
        for i, idx in enumerate(batches):
            before(last=i == len(batches) - 1)
            loss = -masked_logprob_sum(model, prompts, responses, masks, idx, share_prompts)
            loss = loss / num_tokens
            if poison:
                loss = loss * math.nan
            (loss * loss_scale()).backward()  # averaged over ranks (see `distributed`)
            total_loss += loss.item()
    total_loss = sum_over_ranks(total_loss)
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    is_finite = math.isfinite(grad_norm)
    if is_finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # a skipped step's gradient must not leak into the next
    advance_schedule(scheduler)
    return {
        "loss": total_loss,
        "grad_norm": grad_norm,
        "nonfinite_skipped": 0.0 if is_finite else 1.0,
        "lr": scheduler.get_last_lr()[0],
        "step_s": time.perf_counter() - start,
    }


def masked_logprob_sum(
    model, prompts, responses, masks, idx: list[int], share_prompts: bool = True
) -> torch.Tensor:
    """Sum of the log-likelihoods of the masked response tokens of sequences `idx` (one packed
    micro-batch)."""
    rows = completion_rows(
        model,
        [prompts[i] for i in idx],
        [responses[i] for i in idx],
        1.0,
        share_prompts=share_prompts,
    )
    mask_ST = torch.zeros_like(rows.logprobs_ST)
    for row, i in enumerate(idx):
        mask_ST[row, : len(masks[i])] = torch.tensor(masks[i], dtype=mask_ST.dtype)
    return (rows.logprobs_ST * mask_ST).sum()


@torch.no_grad()
def validation_loss(model, tokenizer, tasks: list[Task], micro_batch_tokens: int) -> float | None:
    """Token-mean negative log-likelihood of the held-out tasks' solutions (the SFT loss, no
    gradient); None when no held-out task has a solution."""
    tasks = [t for t in tasks if t.solution is not None]
    if not tasks:
        return None
    prompts, responses, masks = sft_batch(tokenizer, tasks)
    was_training = model.training
    model.eval()  # no dropout in a measurement
    total = sum(
        masked_logprob_sum(model, prompts, responses, masks, idx).item()
        for idx in micro_batches(prompts, responses, micro_batch_tokens, True, in_lockstep(model))
    )
    model.train(was_training)
    return -total / sum(map(sum, masks))
