"""The plain path the trainer used before packing: full [B, L, V] logits over right-padded rows.
Tests keep it as the reference the packed path (`train.packing.forward`, `train.packing.logprobs`) must
reproduce; the package does not use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reinforge.train.packing.hidden import final_hidden_states, lm_head_weight
from reinforge.train.packing.logprobs import DEFAULT_CHUNK_SIZE, chunked_logprobs


@dataclass
class PaddedBatch:
    """Right-padded sequences; `targets_BT[b, t]` is the token predicted at position t, and
    `mask_BT` marks the targets that count in the loss."""

    input_ids_BL: torch.Tensor  # [B, L]
    attention_mask_BL: torch.Tensor  # [B, L]
    targets_BT: torch.Tensor  # [B, L-1]
    mask_BT: torch.Tensor  # [B, L-1] float


def pad_batch(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, device
) -> PaddedBatch:
    """Concatenate prompt and response ids; only response tokens are loss targets."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    mask = torch.zeros((len(seqs), L - 1))
    for b, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        ids[b, :n] = torch.tensor(p + r)
        attn[b, :n] = 1
        mask[b, len(p) - 1 : n - 1] = 1.0  # the target at t is token t+1
    return PaddedBatch(ids.to(device), attn.to(device), ids[:, 1:].to(device), mask.to(device))


def token_logprobs(
    model, batch: PaddedBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target token (and the per-position entropy) under `model`, [B, L-1]."""
    logits = model(
        input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False
    ).logits
    logits_BTV = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logprobs_BTV = torch.log_softmax(logits_BTV, dim=-1)
    chosen_BT = logprobs_BTV.gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    entropy_BT = None
    if with_entropy:
        with torch.no_grad():
            entropy_BT = -(logprobs_BTV.exp() * logprobs_BTV).sum(-1)
    return chosen_BT, entropy_BT


def chunked_token_logprobs(
    model, batch, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `token_logprobs` on a `PaddedBatch`: logprobs and entropy [B, L-1],
    computed only where `mask_BT` is set (zeros elsewhere); entropy keeps its grad."""
    hidden_BLH = final_hidden_states(model, batch.input_ids_BL, batch.attention_mask_BL)
    keep_BT = batch.mask_BT > 0
    hidden_KH = hidden_BLH[:, :-1][keep_BT]
    logprobs_K, entropy_K = chunked_logprobs(
        hidden_KH, lm_head_weight(model), batch.targets_BT[keep_BT], temperature, chunk_size
    )
    logprobs_BT = torch.zeros(keep_BT.shape, dtype=torch.float32, device=keep_BT.device)
    entropy_BT = torch.zeros_like(logprobs_BT)
    return (
        logprobs_BT.masked_scatter(keep_BT, logprobs_K),
        entropy_BT.masked_scatter(keep_BT, entropy_K),
    )
