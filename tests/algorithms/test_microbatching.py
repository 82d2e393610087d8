"""Gradient accumulation is exact: splitting a step into micro-batches and summing their losses
gives the full-batch loss and gradient, for every loss and every aggregation mode."""

import itertools

import pytest
import torch

from reinforge.algorithms.losses import AGGREGATIONS, LossInputs, PolicyLossSettings
from reinforge.algorithms.presets import POLICY_LOSSES
from reinforge.algorithms.value import clipped_value_loss

B, T = 5, 7
SPLITS = [[0, 1, 2, 3, 4], [0, 1], [1, 4]]  # micro-batch boundaries: [0:1], [1:4], [4:5], ...


def step_batch():
    g = torch.Generator().manual_seed(7)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b, (start, length) in enumerate([(2, 1), (1, 6), (0, 7), (3, 2), (1, 3)]):
        mask[b, start : start + length] = 1.0
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return {
        "logp": logp,
        "old": old,
        "adv": torch.randn(B, generator=g, dtype=torch.float64),
        "mask": mask,
        "ref": old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "entropy": torch.rand(B, T, generator=g, dtype=torch.float64),
        "sampler": old + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def run(loss_fn, settings, data, rows):
    logp = data["logp"].clone().requires_grad_(True)
    mask = data["mask"]
    loss_sum = torch.zeros((), dtype=torch.float64)
    for lo, hi in itertools.pairwise(rows):
        x = LossInputs(
            logp[lo:hi],
            data["old"][lo:hi],
            data["adv"][lo:hi],
            mask[lo:hi],
            num_tokens_total=float(mask.sum()),
            num_seqs_total=float(B),
            ref_logprobs_BT=data["ref"][lo:hi],
            entropy_BT=data["entropy"][lo:hi],
            sampler_logprobs_BT=data["sampler"][lo:hi],
            token_sum_norm=float(T),
        )
        loss, _ = loss_fn(x, settings)
        loss.backward()
        loss_sum = loss_sum + loss.detach()
    return loss_sum, logp.grad


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batches_sum_to_the_full_batch(loss_name, aggregation):
    data = step_batch()
    settings = PolicyLossSettings(
        clip_low=0.1,
        clip_high=0.15,
        kl_coef=0.05,
        entropy_coef=0.01,
        aggregation=aggregation,
        dual_clip_c=2.0,
        tis_cap=1.5,
    )
    full_loss, full_grad = run(POLICY_LOSSES[loss_name], settings, data, [0, B])
    for split in SPLITS:
        rows = sorted({0, B, *split})
        loss, grad = run(POLICY_LOSSES[loss_name], settings, data, rows)
        assert torch.allclose(loss, full_loss, atol=1e-12), (split, loss, full_loss)
        assert torch.allclose(grad, full_grad, atol=1e-12), split
    assert full_grad.abs().sum() > 0


def test_value_loss_micro_batches_sum_to_the_full_batch():
    data = step_batch()
    returns = data["old"] + 1.0
    old_values = data["ref"]

    def run_value(rows):
        values = data["logp"].clone().requires_grad_(True)
        total = torch.zeros((), dtype=torch.float64)
        for lo, hi in itertools.pairwise(rows):
            loss, _ = clipped_value_loss(
                values[lo:hi],
                old_values[lo:hi],
                returns[lo:hi],
                data["mask"][lo:hi],
                float(data["mask"].sum()),
                clip_eps=0.2,
            )
            loss.backward()
            total = total + loss.detach()
        return total, values.grad

    full_loss, full_grad = run_value([0, B])
    loss, grad = run_value([0, 1, 4, B])
    assert torch.allclose(loss, full_loss, atol=1e-12)
    assert torch.allclose(grad, full_grad, atol=1e-12)
