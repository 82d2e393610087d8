"""Sampler/trainer mismatch corrections on hand-computed ratios: truncated and masked importance
sampling, per token and per sequence, their metrics, and TRL's *_mask modes reproduced."""

import math

import numpy as np
import pytest
import torch

from reinforge.algorithms.losses import LossInputs, PolicyLossSettings, ppo_clip_loss
from reinforge.train.loop.update import combine

# two sequences; trainer-old minus sampler log-ratios by hand, the last token of row 1 padding
LOG_RHO = np.array([[math.log(1.5), math.log(0.4), 0.0], [math.log(3.0), math.log(0.9), 7.0]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = np.array([2.0, -1.0])


def run(**settings) -> tuple[np.ndarray, dict]:
    """grad of the loss w.r.t. logp (on policy: ratio 1, so grad = -A * w / N_tok) and metrics."""
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    sampler = old - torch.tensor(LOG_RHO)
    x = LossInputs(
        logp,
        old,
        torch.tensor(ADV),
        torch.tensor(MASK),
        5.0,
        2.0,
        sampler_logprobs_BT=sampler,
    )
    loss, metrics = ppo_clip_loss(x, PolicyLossSettings(**settings))
    loss.backward()
    weights = -logp.grad.numpy() * 5.0 / ADV[:, None]
    return weights * MASK, {k: float(v) for k, v in metrics.items()}


RHO = np.exp(LOG_RHO) * MASK
SEQ_RHO = np.exp((LOG_RHO * MASK).sum(1, keepdims=True)) * MASK  # [0.6, 2.7] on each token


def test_token_tis_truncates_each_ratio():
    w, m = run(tis_cap=2.0)
    assert np.allclose(w, np.minimum(RHO, 2.0) * MASK)
    assert math.isclose(m["tis_weight_mean"], np.minimum(RHO, 2.0).sum() / 5)
    assert math.isclose(m["is_ratio_max"], 3.0) and math.isclose(m["is_ratio_min"], 0.4)
    assert math.isclose(m["is_ratio_mean"], RHO.sum() / 5)


def test_sequence_tis_truncates_the_product_of_ratios():
    w, _ = run(tis_cap=2.0, tis_level="sequence")
    assert np.allclose(w, np.minimum(SEQ_RHO, 2.0) * MASK)  # 0.6 kept, 2.7 -> 2
    assert np.allclose(w[:, 0], [0.6, 2.0])


def test_token_mis_drops_tokens_outside_the_bounds():
    w, m = run(mis_low=0.5, mis_high=2.0)
    keep = (RHO >= 0.5) & (RHO <= 2.0) & (MASK > 0)  # drops rho 0.4 and 3.0
    assert np.allclose(w, keep.astype(float))
    assert math.isclose(m["mis_masked_frac"], 2 / 5)


def test_sequence_mis_drops_whole_sequences():
    w, m = run(mis_high=2.0, mis_level="sequence")  # row 1's product 2.7 > 2: all its tokens
    assert np.allclose(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert math.isclose(m["mis_masked_frac"], 2 / 5)


def test_trl_token_mask_is_mis_plus_tis_at_the_upper_bound():
    # TRL's token_mask: w = rho where C_min <= rho <= C_max, else 0
    w, _ = run(mis_low=0.5, mis_high=2.0, tis_cap=2.0)
    trl = np.where((RHO >= 0.5) & (RHO <= 2.0), RHO, 0.0) * MASK
    assert np.allclose(w, trl)


@pytest.mark.parametrize("settings", [{"mis_low": 2.0, "mis_high": 1.0}, {"tis_cap": 0.0}])
def test_bad_bounds_are_refused(settings):
    with pytest.raises(ValueError):
        PolicyLossSettings(**settings)


def test_micro_batch_metrics_combine_by_sum_min_and_max():
    assert combine("is_ratio_min", 0.4, 0.7) == 0.4
    assert combine("is_ratio_max", 0.4, 0.7) == 0.7
    assert combine("mis_masked_frac", 0.25, 0.5) == 0.75
    assert combine("loss", None, 1.5) == 1.5
