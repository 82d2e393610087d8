"""Advantage estimators: rewards in, one advantage per completion out.

GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r_group)) / (std(r_group) + eps); without
the division it is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training").
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards_GN: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """rewards_GN: [groups, samples per group] -> advantages [G, N]. A group whose rewards are all
    equal gets zero advantage (it carries no signal)."""
    centred = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    std = (
        rewards_GN.std(dim=1, keepdim=True, unbiased=True)
        if rewards_GN.shape[1] > 1
        else torch.zeros_like(centred[:, :1])
    )
    return centred / (std + eps)
