"""DAPO's data-side helpers: dynamic-sampling keep mask, soft overlong punishment, truncation
mask."""

import pytest
import torch

from reinforge.algorithms.dapo import (
    filter_zero_variance_groups,
    mask_truncated,
    overlong_penalty,
    zero_variance_fraction,
)


def test_zero_variance_groups_are_dropped():
    rewards = torch.tensor(
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5, 0.5000001], [2.0, 2.0, 2.0]]
    )
    keep = filter_zero_variance_groups(rewards)
    assert keep.tolist() == [False, False, True, True, False]
    assert zero_variance_fraction(rewards) == pytest.approx(3 / 5)
    # a tolerance treats near-ties as ties
    assert filter_zero_variance_groups(rewards, atol=1e-3).tolist() == [0, 0, 1, 0, 0]


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # L_max = 20, buffer 4: free up to 16, then -1/4 per token, -1 at and beyond 20
    penalty = overlong_penalty(lengths, max_length=20, buffer_length=4)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    halved = overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=0.5)
    assert halved.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]


def test_overlong_penalty_paper_setting():
    # DAPO: L_max 20480, L_cache 4096 -> free up to 16384
    penalty = overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096)
    assert penalty.tolist() == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("buffer", [0, 21])
def test_overlong_buffer_must_fit_the_budget(buffer):
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([5]), max_length=20, buffer_length=buffer)


def test_truncated_completions_leave_the_loss():
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = mask_truncated(mask, ["stop", "length", "stop"])
    assert out.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
