"""The trainer's one forward: per-token logprobs of completions, through packed micro-batches.

A micro-batch's sequences are packed into one row with no padding (`train.packing`: attention
stays inside each sequence), the decoder runs once, and the LM head runs in chunks on the
completion positions only (`train.logprobs`), so no [tokens, vocab] logits ever exist.
`micro_batches` splits a step into micro-batches of at most `train.micro_batch_tokens` tokens,
balanced by token count.

Rows layout: row s holds sequence s's completion tokens left-aligned, zeros past its end, [S, T]
with T the longest completion of the micro-batch. The step's per-token data (loss mask, sampler
logprobs, reference logprobs, values, advantages) are kept in the same layout for the whole step
([B, T_step], see `advantage_step.StepBatch`), so a micro-batch takes its rows with
`step_BT[indices, :T]` and the losses never see prompts or padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reinforge.train.logprobs import chunked_logprobs, lm_head_weight
from reinforge.train.packing import PackSequence, pack_one, packed_hidden_states, plan_micro_batches


@dataclass
class Rows:
    logprobs_ST: torch.Tensor  # float32, with grad when the forward had it
    entropy_ST: torch.Tensor  # float32, with grad when the forward had it
    valid_ST: torch.Tensor  # bool: a completion token (False past each completion's end)
    hidden_STH: torch.Tensor | None  # final hidden states at the positions predicting each token


def micro_batches(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], max_tokens: int
) -> list[list[int]]:
    """Indices of the sequences in each micro-batch (each sorted), at most `max_tokens` tokens
    per micro-batch; a sequence longer than that is a `ConfigError` naming the setting."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    return plan_micro_batches(lengths, max_tokens)


def completion_rows(
    model,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    with_hidden: bool = False,
) -> Rows:
    """Logprob and entropy of each completion token under `model` (and the final hidden states
    for a value head), as completion rows; the sequences form one packed micro-batch."""
    device = next(model.parameters()).device
    seqs = [PackSequence(p, c) for p, c in zip(prompts, completions)]
    batch = pack_one(seqs, range(len(seqs))).to(device)
    hidden_LH = packed_hidden_states(model, batch)
    hidden_KH = hidden_LH.index_select(0, batch.target_positions_K)
    logprobs_K, entropy_K = chunked_logprobs(
        hidden_KH, lm_head_weight(model), batch.targets_K, temperature
    )
    return Rows(
        batch.rows(logprobs_K),
        batch.rows(entropy_K),
        batch.rows_valid_ST,
        hidden_KH[batch.rows_index_ST] if with_hidden else None,
    )
