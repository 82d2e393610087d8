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
