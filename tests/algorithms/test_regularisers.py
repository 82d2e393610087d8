"""KL as a reward penalty, and the rollout/trainer mismatch metric and TIS correction."""

import math

import pytest
import torch

from reinforge.algorithms.kl import kl_estimate, kl_penalized_rewards, kl_penalized_token_rewards
from reinforge.algorithms.losses import LossInputs, PolicyLossSettings, ppo_clip_loss
from reinforge.algorithms.mismatch import MismatchCorrection, mismatch_kl, mismatch_weights

# three completion tokens and one padding position with junk logprobs that must not count
LOGP = torch.tensor([[-1.0, -1.0, -1.0, -9.0]])
REF = torch.tensor([[-1.5, -1.2, -1.0, -0.1]])  # k1 = [0.5, 0.2, 0.0, junk]
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_kl_as_token_reward_penalty():
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    out = kl_penalized_token_rewards(token_rewards, LOGP, REF, MASK, beta=0.1, estimator="k1")
    assert torch.allclose(out, torch.tensor([[-0.05, -0.02, 1.0, 0.0]]))


def test_kl_as_sequence_reward_penalty():
    out = kl_penalized_rewards(torch.tensor([1.0]), LOGP, REF, MASK, beta=0.1, estimator="k1")
    assert math.isclose(out.item(), 1.0 - 0.1 * 0.7, rel_tol=1e-6)
    k3 = kl_penalized_rewards(torch.tensor([1.0]), LOGP, REF, MASK, beta=1.0, estimator="k3")
    expected = 1.0 - sum(math.exp(-d) - 1 + d for d in (0.5, 0.2, 0.0))
    assert math.isclose(k3.item(), expected, rel_tol=1e-6)


def test_reward_penalties_carry_no_gradient():
    logp = LOGP.clone().requires_grad_(True)
    assert not kl_penalized_rewards(torch.ones(1), logp, REF, MASK, 0.1).requires_grad
    assert not kl_penalized_token_rewards(torch.ones(1, 4), logp, REF, MASK, 0.1).requires_grad


def test_unknown_kl_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(LOGP, REF, "k9")


def test_mismatch_kl_hand_computed():
    sampler = torch.tensor([[-1.0, -2.0, -5.0]])
    trainer = torch.tensor([[-1.5, -2.0, -0.1]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    k3 = math.exp(-0.5) - 1 + 0.5  # log(sampler / trainer) = 0.5 on the first token, 0 on the next
    assert math.isclose(mismatch_kl(sampler, trainer, mask).item(), k3 / 2, rel_tol=1e-6)
    step_total = mismatch_kl(sampler, trainer, mask, num_tokens_total=4.0)
    assert math.isclose(step_total.item(), k3 / 4, rel_tol=1e-6)
    assert mismatch_kl(sampler, sampler, mask).item() == 0.0


def test_tis_weights_are_capped_and_detached():
    old = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    sampler = torch.tensor([[-2.0, -1.0, -0.5]])
    w, _ = mismatch_weights(old, sampler, torch.ones(1, 3), MismatchCorrection(tis_cap=2.0), 3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, math.exp(-0.5)]]))  # e^1 capped at 2
    assert not w.requires_grad


def test_tis_multiplies_the_policy_gradient_per_token():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    sampler = torch.tensor([[-1.0 - math.log(1.5), -1.0 + 50.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    x = LossInputs(
        logp,
        logp.detach(),
        torch.tensor([2.0], dtype=torch.float64),
        mask,
        3.0,
        1.0,
        sampler_logprobs_BT=sampler,
    )
    loss, m = ppo_clip_loss(x, PolicyLossSettings(tis_cap=2.0))
    weights = torch.tensor([[1.5, math.exp(-50.0), 1.0]], dtype=torch.float64)
    assert math.isclose(m["tis_weight_mean"].item(), weights.sum().item() / 3, rel_tol=1e-9)
    loss.backward()
    assert torch.allclose(logp.grad, -2.0 * weights / 3)


def test_tis_without_sampler_logprobs_is_a_clear_error():
    logp = torch.zeros(1, 2)
    x = LossInputs(logp, logp, torch.ones(1), torch.ones(1, 2), 2.0, 1.0)
    with pytest.raises(ValueError, match="sampler_logprobs_BT"):
        ppo_clip_loss(x, PolicyLossSettings(tis_cap=2.0))
