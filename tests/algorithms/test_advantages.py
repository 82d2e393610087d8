"""Advantage estimators on hand-computed numbers, plus the properties each method promises."""

import math

import pytest
import torch

from reinforge.algorithms.advantages import (
    EMABaseline,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_token_advantages,
    rloo_advantages,
)
from reinforge.algorithms.presets import ADVANTAGES
from reinforge.algorithms.table import SCALES


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b).double(), atol=tol
    )


def test_rloo_hand_computed_with_ties_and_zero_variance():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 5.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    adv = rloo_advantages(r)
    # i=0 of group 0: 1 - (0 + 0 + 1) / 3
    assert close(adv[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # ties: each 2 sees the baseline (2 + 5 + 2) / 3 = 3; the 5 sees 2
    assert close(adv[1], [-1.0, -1.0, 3.0, -1.0])
    assert torch.equal(adv[2], torch.zeros(4))
    assert close(adv.sum(1), torch.zeros(3))  # leave-one-out advantages sum to zero per group
    assert close(adv, 4 / 3 * (r - r.mean(1, keepdim=True)))  # = N/(N-1) * (r - mean)


def test_rloo_groups_of_one_get_zero():
    # no other sample to be the baseline (verl: the raw reward; docs/algorithms.md)
    assert torch.equal(rloo_advantages(torch.tensor([[3.0], [1.0]])), torch.zeros(2, 1))


def test_reinforce_pp_normalises_over_the_batch():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # batch mean 0.75; centred [0.25, -0.75, 0.25, 0.25]; unbiased var = 0.75 / 3 -> std 0.5
    assert close(reinforce_pp_advantages(r), [[0.5, -1.5], [0.5, 0.5]])
    # a zero-variance *group* still gets a shared advantage: the batch is the baseline
    assert reinforce_pp_advantages(r)[1, 0].item() > 0
    assert close(reinforce_pp_advantages(r, "none"), [[0.25, -0.75], [0.25, 0.25]])


def test_reinforce_pp_baseline_subtracts_group_mean_then_batch_std():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    std = math.sqrt((0.25 + 0.25) / 3)  # centred [0.5, -0.5, 0, 0], unbiased over 4 entries
    assert close(reinforce_pp_baseline_advantages(r), [[0.5 / std, -0.5 / std], [0.0, 0.0]])


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_equal_rewards_give_zero_advantage(name):
    r = torch.full((3, 4), 0.7)
    for scale in SCALES[name]:
        assert torch.allclose(ADVANTAGES[name](r, scale, 1e-6), torch.zeros(3, 4), atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_relative_advantages_sum_to_zero_per_group(name):
    r = torch.rand(5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for scale in SCALES[name]:
        assert close(ADVANTAGES[name](r, scale, 1e-6).sum(1), torch.zeros(5), tol=1e-9)


def test_reinforce_pp_sums_to_zero_over_the_batch_not_the_group():
    r = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = reinforce_pp_advantages(r)
    assert abs(adv.sum().item()) < 1e-9
    assert abs(adv[1].sum().item()) > 0.1


def test_grpo_single_sample_groups_are_centred_to_zero():
    assert torch.equal(grpo_advantages(torch.tensor([[3.0], [1.0]])), torch.zeros(2, 1))


def test_ema_baseline_hand_computed_and_checkpointable():
    baseline = EMABaseline(decay=0.5, initial=0.0)
    assert close(baseline.advantages(torch.tensor([1.0, 3.0])), [1.0, 3.0])  # b = 0 before
    assert baseline.value == 1.0  # 0.5 * 0 + 0.5 * mean(1, 3)
    state = baseline.state_dict()
    assert state == {"value": 1.0}
    restored = EMABaseline(decay=0.5)
    restored.load_state_dict(state)
    assert close(restored.advantages(torch.tensor([1.0, 1.0])), [0.0, 0.0])
    assert close(baseline.advantages(torch.tensor([1.0, 1.0])), [0.0, 0.0])
    assert restored.value == baseline.value == 1.0
    with pytest.raises(ValueError):
        EMABaseline(decay=1.0)


def test_outcome_token_rewards_land_on_the_last_completion_token():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]).float()
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    expected = torch.zeros(3, 6)
    expected[0, 4], expected[1, 1] = 2.0, -1.0
    assert torch.equal(out, expected)


def test_gae_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=1.0, lam=0.5)
    # t2: 1 - 0.7 = 0.3; t1: 0.7 - 0.6 + 0.5 * 0.3 = 0.25; t0: 0.6 - 0.5 + 0.5 * 0.25 = 0.225
    assert close(adv, [[0.225, 0.25, 0.3]])
    assert close(ret, [[0.725, 0.85, 1.0]])


def gae_reference(rewards, values, gamma, lam):
    """The textbook recursion over one sequence's valid tokens, in plain Python."""
    out, next_value, next_adv = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        next_value, out[t] = values[t], next_adv
    return out


def test_gae_matches_hand_unrolled_loop_on_ragged_rows():
    g = torch.Generator().manual_seed(1)
    # (prompt offset, completion length): length 1, a long one, one full row, one empty row
    spans = [(2, 1), (1, 7), (0, 9), (0, 0)]
    mask = torch.zeros(4, 9, dtype=torch.float64)
    for b, (start, length) in enumerate(spans):
        mask[b, start : start + length] = 1.0
    r = torch.randn(4, 9, generator=g, dtype=torch.float64)
    v = torch.randn(4, 9, generator=g, dtype=torch.float64)
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    for b, (start, length) in enumerate(spans):
        span = slice(start, start + length)
        expected = gae_reference(r[b, span].tolist(), v[b, span].tolist(), 0.9, 0.8)
        assert close(adv[b, span], expected, tol=1e-12)
        assert close(ret[b, span], torch.tensor(expected) + v[b, span], tol=1e-12)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_is_detached_from_the_value_model():
    v = torch.zeros(1, 2, requires_grad=True)
    adv, ret = gae_advantages(torch.ones(1, 2), v, torch.ones(1, 2))
    assert not adv.requires_grad and not ret.requires_grad


def test_discounted_returns_skip_masked_positions():
    r = torch.tensor([[9.0, 1.0, 2.0, 9.0, 4.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])  # the 9s are masked out and must not count
    # G = [1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4]
    assert close(discounted_returns(r, mask, gamma=0.5), [[0.0, 3.0, 4.0, 0.0, 4.0]])


def test_masked_whiten_and_reinforce_pp_token_advantages():
    rewards = torch.tensor([[0.0, 0.5], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # returns: [0.5, 0.5] and [2, -]; mean 1, unbiased var (0.25 + 0.25 + 1) / 2 = 0.75
    std = math.sqrt(0.75)
    expected = [[-0.5 / std, -0.5 / std], [1.0 / std, 0.0]]
    assert close(reinforce_pp_token_advantages(rewards, mask), expected)
    values = torch.tensor([[0.5, 0.5], [2.0, 123.0]])
    assert close(masked_whiten(values, mask), expected)


def test_equal_values_whiten_to_exact_zero():
    # float32 means of equal values can be off by an ulp; whitening must not blow that up
    values = torch.full((3, 5), 0.7)
    assert torch.equal(masked_whiten(values, torch.ones(3, 5)), torch.zeros(3, 5))
    rewards = outcome_token_rewards(torch.full((3,), 0.7), torch.ones(3, 5))
    assert torch.equal(reinforce_pp_token_advantages(rewards, torch.ones(3, 5)), torch.zeros(3, 5))
