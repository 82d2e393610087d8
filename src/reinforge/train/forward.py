"""The trainer's one forward: per-token logprobs of completions, laid out as completion rows.

Rows layout: row s holds sequence s's completion tokens left-aligned, zeros past its end, [S, T]
with T the longest completion of the micro-batch. The step's per-token data (loss mask, sampler
logprobs, reference logprobs, values, advantages) are kept in the same layout for the whole step
([B, T_step], see `advantage_step.StepBatch`), so a micro-batch takes its rows with
`step_BT[indices, :T]` and the losses never see prompts or padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reinforge.train.common import pad_batch


@dataclass
class Rows:
    logprobs_ST: torch.Tensor  # float32, with grad when the forward had it
    entropy_ST: torch.Tensor  # float32; with grad only when asked (an entropy bonus)
    hidden_STH: torch.Tensor | None  # final hidden states at the positions that predict each token


def completion_rows(
    model,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float,
    with_hidden: bool = False,
    entropy_grad: bool = False,
) -> Rows:
    """Logprob and entropy of each completion token under `model` (and its final hidden states
    for a value head), as completion rows."""
    device = next(model.parameters()).device
    batch = pad_batch(prompts, completions, 0, device)
    out = model(
        input_ids=batch.input_ids_BL,
        attention_mask=batch.attention_mask_BL,
        use_cache=False,
        output_hidden_states=with_hidden,
    )
    logits_BTV = out.logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logprobs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    chosen_BT = logprobs_BTV.gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    index_ST, valid_ST = _row_index(prompts, completions, device)
    hidden_STH = None
    if with_hidden:
        hidden_BLH = out.hidden_states[-1]
        hidden_STH = hidden_BLH.gather(1, index_ST[..., None].expand(-1, -1, hidden_BLH.shape[-1]))
    return Rows(
        _gather(chosen_BT, index_ST, valid_ST), _gather(entropy_BT, index_ST, valid_ST), hidden_STH
    )


def _row_index(prompts, completions, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index into the padded [B, L-1] targets of completion token j of row s (the target at t is
    token t + 1, so completion token j of a prompt of length p sits at p - 1 + j)."""
    lengths_S = torch.tensor([len(c) for c in completions], device=device)
    starts_S = torch.tensor([len(p) - 1 for p in prompts], device=device)
    columns_T = torch.arange(int(lengths_S.max()), device=device)
    valid_ST = columns_T[None, :] < lengths_S[:, None]
    return torch.where(valid_ST, starts_S[:, None] + columns_T[None, :], 0), valid_ST


def _gather(x_BT: torch.Tensor, index_ST: torch.Tensor, valid_ST: torch.Tensor) -> torch.Tensor:
    rows_ST = x_BT.gather(1, index_ST)
    return torch.where(valid_ST, rows_ST, torch.zeros_like(rows_ST))


def micro_batches(num_seqs: int, micro_batch_size: int) -> list[list[int]]:
    """Indices of the step's sequences in each micro-batch, in order."""
    return [
        list(range(i, min(i + micro_batch_size, num_seqs)))
        for i in range(0, num_seqs, micro_batch_size)
    ]
