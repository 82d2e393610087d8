"""Hand-computed checks of the GRPO pieces the loop uses."""

import math

import torch

from reinforge.algorithms.advantages import grpo_advantages
from reinforge.algorithms.kl import kl_estimate
from reinforge.algorithms.losses import LossInputs, PPOClipSettings, aggregate, ppo_clip_loss


def test_grpo_advantages_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = grpo_advantages(r, "group", eps=0.0 + 1e-12)
    std = math.sqrt(sum((x - 0.5) ** 2 for x in [1, 0, 0, 1]) / 3)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std, atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # zero-variance group: no signal
    assert torch.allclose(grpo_advantages(r, "none")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log_ratio = 1
    assert kl_estimate(lp, ref, "k1").item() == 1.0
    assert kl_estimate(lp, ref, "k2").item() == 0.5
    assert math.isclose(kl_estimate(lp, ref, "k3").item(), math.exp(-1) - 1 + 1, rel_tol=1e-6)
    assert kl_estimate(lp, lp, "k3").item() == 0.0


def inputs(logp, old, adv, mask):
    mask = torch.tensor(mask)
    return LossInputs(
        torch.tensor(logp, requires_grad=True),
        torch.tensor(old),
        torch.tensor(adv),
        mask,
        num_tokens_total=float(mask.sum()),
        num_seqs_total=float(mask.shape[0]),
    )


def test_ppo_clip_hand_computed():
    # token 1: ratio e^0.5 = 1.65 > 1.2 with A>0 -> clipped at 1.2; token 2: ratio 1 -> 1*A
    x = inputs([[0.5, 0.0]], [[0.0, 0.0]], [2.0], [[1.0, 1.0]])
    loss, m = ppo_clip_loss(x, PPOClipSettings(clip_low=0.2, clip_high=0.2))
    assert math.isclose(loss.item(), -(1.2 * 2 + 1.0 * 2) / 2, rel_tol=1e-6)
    assert m["clip_frac"].item() == 0.5
    loss.backward()
    assert x.logprobs_BT.grad[0, 0].item() == 0.0  # clipped token carries no gradient
    assert math.isclose(x.logprobs_BT.grad[0, 1].item(), -2.0 / 2, rel_tol=1e-6)


def test_on_policy_ratio_one_gives_plain_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    x = LossInputs(logp, logp.detach(), torch.tensor([0.7]), torch.ones(1, 3), 3.0, 1.0)
    loss, _ = ppo_clip_loss(x, PPOClipSettings())
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 3), -0.7 / 3))


def test_aggregation_modes_ragged():
    vals = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    x = LossInputs(vals, vals, torch.zeros(2), mask, num_tokens_total=5.0, num_seqs_total=2.0)
    assert math.isclose(aggregate(vals, x, "token_mean").item(), 8.0 / 5, rel_tol=1e-6)
    assert aggregate(vals, x, "seq_mean_token_mean").item() == (1.0 + 4.0) / 2
