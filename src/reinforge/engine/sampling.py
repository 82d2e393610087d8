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


def row_stats(logits_BV: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, 2] float32: each row's log-sum-exp and entropy (nats) of softmax(logits / T), T = 1
    when greedy: the distribution the logprobs above are taken under, which the trainer's LM
    head computes again unless the engine kept these (`engine.records`)."""
    z_BV = logits_BV.float() / (temperature or 1.0)
    lse_B = torch.logsumexp(z_BV, dim=-1)
    logp_BV = z_BV - lse_B[:, None]
    entropy_B = -(logp_BV.exp() * logp_BV).nan_to_num(0.0).sum(-1)
    return torch.stack([lse_B, entropy_B], dim=1)


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


# Keyed sampling: each draw is a function of (sequence key, position) and the distribution alone,
# so a sequence samples the same tokens whatever batch, rank or process it runs in (the paged
# engine's contract). The Triton sampler on a GPU (`triton_sampling.sample_inverse_cdf`) makes the
# same draw from the same uniform, so both sample the same tokens but within rounding of a
# boundary between two tokens.


def row_uniform(sequence_key: int, position: int) -> float:
    """A uniform number in (0, 1) for the draw at `position` of the sequence keyed
    `sequence_key`: splitmix64 of the pair, 53 bits (host side, exact integer arithmetic)."""
    mask = 2**64 - 1
    z = (sequence_key * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 11) + 0.5) / 2**53


def sample_keyed(
    logits_BV: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    uniforms_B: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `sample`, drawing row b by inverting its cumulative distribution at `uniforms_B[b]`
    (from `row_uniform`) instead of from a generator shared by the batch. Returns (ids_B,
    logprobs_B)."""
    logits_BV = logits_BV.float()
    if temperature == 0.0:
        return sample(logits_BV, 0.0)
    logprobs_BV = torch.log_softmax(logits_BV / temperature, dim=-1)
    filtered_BV = filter_logprobs(logprobs_BV, top_p, top_k, min_p)
    cdf_BV = torch.softmax(filtered_BV, dim=-1).double().cumsum(dim=-1)
    u_B1 = torch.tensor(uniforms_B, dtype=torch.float64, device=cdf_BV.device)[:, None]
    # the first token whose cumulative mass reaches u: never one of probability 0, as u > 0
    ids_B = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:]).squeeze(-1)
    ids_B = ids_B.clamp_(max=logits_BV.shape[-1] - 1)
    return ids_B, logprobs_BV.gather(-1, ids_B[:, None]).squeeze(-1)
