"""Per-token KL(policy || reference) estimators from sampled tokens (Schulman, "Approximating KL
divergence", 2020), with log_ratio = logp_policy - logp_ref:

  k1 = log_ratio                    unbiased, high variance, can be negative
  k2 = 0.5 * log_ratio^2            biased, low variance
  k3 = exp(-log_ratio) - 1 + log_ratio   unbiased, low variance, always >= 0
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3"
) -> torch.Tensor:
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    assert estimator == "k3", estimator
    # clamp keeps exp finite when a token was essentially impossible under the policy
    return torch.exp((-log_ratio).clamp(max=20.0)) - 1.0 + log_ratio
