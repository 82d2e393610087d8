"""Turning last-position logits into sampled ids and their logprobs, on the logits' device.

The logprob returned is that of the sampled id under the temperature-scaled distribution before
top-p / top-k / min-p filtering: the policy the trainer scores with the same temperature.
"""

from __future__ import annotations

import torch


def sample(
    logits_BV: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (ids_B, logprobs_B)."""
    logits_BV = logits_BV.float()
    if temperature == 0.0:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        ids_B = logits_BV.argmax(dim=-1)
        return ids_B, logprobs_BV.gather(-1, ids_B[:, None]).squeeze(-1)
    logprobs_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
    filtered_BV = filter_logprobs(logprobs_BV, top_p, top_k, min_p)
    probs_BV = torch.softmax(filtered_BV, dim=-1)
    ids_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    return ids_B, logprobs_BV.gather(-1, ids_B[:, None]).squeeze(-1)


def filter_logprobs(
    logprobs_BV: torch.Tensor, top_p: float, top_k: int, min_p: float
) -> torch.Tensor:
    """Set excluded entries to -inf; the most likely token always survives."""
    out = logprobs_BV
    if top_k > 0 and top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if min_p > 0.0:
        top = out.max(dim=-1, keepdim=True).values
        out = out.masked_fill(
            out < top + torch.log(torch.tensor(min_p, device=out.device)), float("-inf")
        )
    if top_p < 1.0:
        sorted_lp, order = out.sort(dim=-1, descending=True)
        cum = sorted_lp.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (cum - sorted_lp.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


# Keyed sampling: the noise of a draw is a function of (sequence key, position, token id) alone,
# so a sequence samples the same tokens whatever batch, rank or process it runs in (the paged
# engine's contract; its Triton sampler on a GPU keys the same way with its own generator).
_MASK32 = 0xFFFFFFFF
_TOKEN_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def row_key(sequence_key: int, position: int) -> int:
    """A 32-bit key for the draw at `position` of the sequence keyed `sequence_key` (host side,
    exact integer arithmetic)."""
    mixed = (sequence_key * 0x9E3779B97F4A7C15 + position * 0xD6E8FEB86659FD93) & (2**64 - 1)
    mixed = ((mixed ^ (mixed >> 32)) * 0xD6E8FEB86659FD93) & (2**64 - 1)
    return (mixed ^ (mixed >> 32)) & _MASK32


def sample_keyed(
    logits_BV: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    row_keys_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sample`, with Gumbel-max noise drawn from `row_keys_B` (int64 [B], from `row_key`)
    instead of a generator shared by the batch. Returns (ids_B, logprobs_B)."""
    logits_BV = logits_BV.float()
    if temperature == 0.0:
        return sample(logits_BV, 0.0)
    logprobs_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
    filtered_BV = filter_logprobs(logprobs_BV, top_p, top_k, min_p)
    ids_B = (filtered_BV + gumbel_noise(row_keys_B, logits_BV.shape[-1])).argmax(dim=-1)
    return ids_B, logprobs_BV.gather(-1, ids_B[:, None]).squeeze(-1)


def gumbel_noise(row_keys_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V], float32: a 32-bit hash (murmur3's finaliser) of each row key
    and token id, computed in int64 without overflow, as a uniform in (0, 1)."""
    device = row_keys_B.device
    cache_key = (vocab_size, str(device))
    if cache_key not in _TOKEN_KEYS:
        ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
        _TOKEN_KEYS[cache_key] = _fmix32(_mul32(ids, 0x9E3779B1) ^ 0x7F4A7C15)
    bits_BV = _fmix32(row_keys_B[:, None] ^ _TOKEN_KEYS[cache_key][None, :])
    uniform_BV = ((bits_BV >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(uniform_BV))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) and a 32-bit constant c, with no int64 overflow."""
    low = x * (c & 0xFFFF)  # < 2^48
    high = (x * (c >> 16)) & 0xFFFF  # only its low 16 bits survive the shift below
    return (low + (high << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)
