"""KL(policy || reference) from sampled tokens, as a loss term or as a reward penalty.

Per-token estimators (Schulman, "Approximating KL divergence", 2020), log_ratio = logp - ref_logp,
tokens sampled from the policy:

  k1 = log_ratio                          unbiased, high variance, can be negative
  k2 = 0.5 * log_ratio^2                  biased, low variance
  k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, always >= 0
  abs = |log_ratio|                       (verl's "abs")
  k3+ = k3's value, k2's gradient          straight-through (verl's "k3+" / "low_var_kl+")

k3 is clamped as verl's `low_var_kl` is: the log-ratio to [-20, 20] before the exponential, the
estimate to [-10, 10] after it. Unclamped, a log-ratio below -20 gives k3 ~ e^20 with gradient
1 - e^20 (after a clamp of the exponent alone: +1, which pushes the policy further from the
reference); clamped, k3 is at most 10 and passes no gradient once past the clamp (log-ratio below
about -2.6 or above 11). k3+ keeps the clamped value but takes k2's gradient, log_ratio, so the
pull back towards the reference grows with the distance instead of vanishing: the choice when the
policy may wander far (verl's argument: k1 and k3 have the right expected value but not the right
expected gradient as a loss term; k2's gradient is).

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


# verl's low_var_kl bounds: the log-ratio before exp, the estimate after
MAX_KL_LOG_RATIO = 20.0
MAX_K3 = 10.0


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    clamped = log_ratio.clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    return (torch.exp(-clamped) - 1.0 + clamped).clamp(-MAX_K3, MAX_K3)


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def _k3_plus(log_ratio: torch.Tensor) -> torch.Tensor:
    """Straight-through: the value of k3, the gradient of k2."""
    k2 = _k2(log_ratio)
    return k2 - k2.detach() + _k3(log_ratio).detach()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
    "k3+": _k3_plus,
}


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
