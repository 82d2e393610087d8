"""PPO's critic side: a value head over hidden states and the clipped value loss.

The value model's per-token predictions feed `advantages.gae_advantages` (with values from
before the update, "old values"); its loss trains V toward the GAE returns. As with the policy
losses, a micro-batch's value loss is divided by the whole step's token count so gradient
accumulation is exact.
"""

from __future__ import annotations

import torch
from torch import nn

from reinforge.algorithms.counts import at_least_one


class ValueHead(nn.Module):
    """hidden states [B, T, H] -> values [B, T]. Zero-initialised: V = 0 at the start, so the first
    advantages are plain (lam-weighted) returns rather than noise from a random head."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_BTH).squeeze(-1)


def clipped_value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens_total: float,
    clip_eps: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Schulman et al. 2017; the clipping is from OpenAI baselines):

      V_clip = V_old + clip(V - V_old, -eps, eps)
      L = 1/2 * max((V - R)^2, (V_clip - R)^2)         (clip_eps None: 1/2 * (V - R)^2)

    token mean over the step. Where the clipped error is the larger, the token gets no gradient:
    the value may not move more than eps from V_old to reduce its error further.
    """
    error_BT = (values_BT - returns_BT).square()
    metrics: dict[str, torch.Tensor] = {}
    if clip_eps is not None:
        delta_BT = values_BT - old_values_BT
        clamped_BT = delta_BT.clamp(-clip_eps, clip_eps)
        clipped_error_BT = (old_values_BT + clamped_BT - returns_BT).square()
        with torch.no_grad():
            # the clamp itself decides: rebuilding V_old + clamp(V - V_old) and comparing its
            # error with V's would count unclipped tokens where float32 rounding differs
            is_clipped_BT = ((clamped_BT != delta_BT) & (clipped_error_BT > error_BT)).float()
            metrics["value_clip_frac"] = (is_clipped_BT * mask_BT).sum() / at_least_one(
                num_tokens_total
            )
        error_BT = torch.maximum(error_BT, clipped_error_BT)
    loss = 0.5 * (error_BT * mask_BT).sum() / at_least_one(num_tokens_total)
    with torch.no_grad():
        metrics["value_loss"] = loss.detach()
        metrics["value_mean"] = (values_BT * mask_BT).sum() / at_least_one(num_tokens_total)
    return loss, metrics
