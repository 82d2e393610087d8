"""KL(policy || reference) from sampled tokens, as a loss term or as a reward penalty.

Per-token estimators (Schulman, "Approximating KL divergence", 2020), log_ratio = logp - ref_logp,
tokens sampled from the policy:

  k1 = log_ratio                          unbiased, high variance, can be negative
  k2 = 0.5 * log_ratio^2                  biased, low variance
  k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, always >= 0

Placement. As a *loss term* (GRPO) the estimator is differentiated: `kl_coef * KL` is added to
each token's loss (see `losses.py`). As a *reward penalty* (PPO for LMs, REINFORCE++, RLOO) it is
computed once at rollout time from the behaviour policy's logprobs, never differentiated, and
subtracted from the reward before advantages are estimated: per token (`kl_penalized_token_rewards`)
or summed over the completion and taken off its scalar reward (`kl_penalized_rewards`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reinforge.algorithms.table import KLEstimator, KLPlacement

__all__ = ["KL_ESTIMATORS", "KLEstimator", "KLPlacement", "kl_estimate"]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # clamp keeps exp finite when a token was essentially impossible under the policy
    return torch.exp((-log_ratio).clamp(max=20.0)) - 1.0 + log_ratio


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token KL estimate, same shape as `logp`; differentiable through `logp`."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; use one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp - ref_logp)


@torch.no_grad()
def kl_penalized_token_rewards(
    token_rewards_BT: torch.Tensor,
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    beta: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """r'_t = r_t - beta * KL_t on every completion token, 0 off the mask (InstructGPT, Ouyang et
    al. 2022; REINFORCE++, Hu et al. 2025). `logprobs_BT` are the behaviour policy's (rollout
    time); the penalty is data, so no gradient flows through it. Feed the result to
    `gae_advantages` or `discounted_returns`."""
    kl_BT = kl_estimate(logprobs_BT.detach(), ref_logprobs_BT, estimator)
    return (token_rewards_BT - beta * kl_BT) * mask_BT


@torch.no_grad()
def kl_penalized_rewards(
    rewards_B: torch.Tensor,
    logprobs_BT: torch.Tensor,
    ref_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    beta: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """r'_i = r_i - beta * sum_t KL_t: the sequence-level penalty of RLOO (Ahmadian et al. 2024),
    which treats the whole completion as one action. Detached, like the token version."""
    kl_BT = kl_estimate(logprobs_BT.detach(), ref_logprobs_BT, estimator)
    return rewards_B - beta * (kl_BT * mask_BT).sum(-1)
