"""PPO's value head and clipped value loss."""

import math

import torch

from reinforge.algorithms.value import ValueHead, clipped_value_loss


def test_value_head_shape_and_zero_start():
    head = ValueHead(hidden_size=8)
    values = head(torch.randn(2, 5, 8))
    assert values.shape == (2, 5)
    assert torch.equal(values, torch.zeros(2, 5))
    values.sum().backward()
    assert head.proj.bias.grad.item() == 10.0  # trainable from the first step


def test_clipped_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 0.5, 9.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # last position is padding
    loss, m = clipped_value_loss(values, old, returns, mask, num_tokens_total=3.0, clip_eps=0.2)
    # t0: (1-2)^2 = 1 vs clipped V 0.7: 1.69 -> 1.69 (clipped branch: no gradient)
    # t1: (0-1)^2 = 1 vs clipped V 0.3: 0.49 -> 1 (unclipped: gradient V - R = -1)
    # t2: V = R: 0
    assert math.isclose(loss.item(), 0.5 * (1.69 + 1.0 + 0.0) / 3, rel_tol=1e-6)
    assert math.isclose(m["value_clip_frac"].item(), 1 / 3, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, -1.0 / 3, 0.0, 0.0]]))


def test_unclipped_value_loss():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss, m = clipped_value_loss(
        values, torch.zeros(1, 2), torch.tensor([[2.0, 1.0]]), torch.ones(1, 2), 2.0, clip_eps=None
    )
    assert math.isclose(loss.item(), 0.5 * (1.0 + 1.0) / 2)
    assert "value_clip_frac" not in m
