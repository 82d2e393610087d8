"""DAPO's data-side helpers (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476), as pure functions the loop applies before advantages:

- dynamic sampling: drop groups whose rewards are all equal (zero advantage, no gradient) and
  keep sampling until the batch is full; `filter_zero_variance_groups` gives the keep mask;
- soft overlong punishment: a length penalty that ramps from 0 to -1 over a buffer before the
  generation budget, added to the reward;
- overlong filtering: completions cut off by the budget (finish_reason "length") leave the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def filter_zero_variance_groups(
    rewards: torch.Tensor, atol: float = 0.0, group_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Rewards [G, N], or flat [B] in group order with `group_sizes` -> keep mask [G] (bool): True
    where the group's rewards are not all equal (max - min > atol). Only kept groups carry signal
    under group-relative advantages, so a group of one is dropped too (verl's DAPO keeps it: there
    a lone sample's advantage is its raw reward, docs/algorithms.md)."""
    if group_sizes is None:
        return rewards.max(dim=1).values - rewards.min(dim=1).values > atol
    assert sum(group_sizes) == rewards.numel(), (list(group_sizes), rewards.numel())
    spreads = [g.max() - g.min() for g in torch.split(rewards, list(group_sizes))]
    return torch.stack(spreads) > atol if spreads else torch.zeros(0, dtype=torch.bool)


def zero_variance_fraction(
    rewards: torch.Tensor, atol: float = 0.0, group_sizes: Sequence[int] | None = None
) -> float:
    """Fraction of groups dynamic sampling would drop: the metric to log beside the keep mask."""
    return 1.0 - filter_zero_variance_groups(rewards, atol, group_sizes).float().mean().item()


def overlong_penalty(
    lengths_B: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward, with L_max = max_length and L_cache = buffer_length:

      0                                  |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
      -1                                 |y| > L_max

    times `penalty_factor`. The paper used L_max = 20480 with L_cache = 4096."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong buffer {buffer_length} must be in (0, max_length={max_length}]: it is the "
            "stretch of tokens before the generation budget over which the penalty ramps"
        )
    soft_limit = max_length - buffer_length
    ramp_B = (soft_limit - lengths_B.to(torch.float32)) / buffer_length
    return ramp_B.clamp(min=-1.0, max=0.0) * penalty_factor


def mask_truncated(mask_BT: torch.Tensor, finish_reasons: Sequence[str]) -> torch.Tensor:
    """Zero the loss mask of completions that hit the length limit (finish_reason "length"): their
    reward judges an unfinished answer. Compute the step's num_tokens_total / num_seqs_total from
    the returned mask."""
    assert len(finish_reasons) == mask_BT.shape[0], (len(finish_reasons), mask_BT.shape)
    is_kept_B = torch.tensor(
        [reason != "length" for reason in finish_reasons],
        dtype=mask_BT.dtype,
        device=mask_BT.device,
    )
    return mask_BT * is_kept_B[:, None]
