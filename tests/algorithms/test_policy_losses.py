"""PPO clip (clip-higher, dual clip), GSPO and CISPO on hand-computed numbers: values, which
tokens get gradient, and how much."""

import math

import pytest
import torch

from reinforge.algorithms.losses import (
    AGGREGATIONS,
    LossInputs,
    PolicyLossSettings,
    aggregate,
    cispo_loss,
    gspo_loss,
    ppo_clip_loss,
)
from reinforge.algorithms.presets import POLICY_LOSSES

LN2 = math.log(2.0)


def per_sequence_tokens(log_ratios, advantages):
    """One token per sequence: B sequences of length 1, old logprob 0, logprob = log ratio."""
    logp = torch.tensor([[lr] for lr in log_ratios], dtype=torch.float64, requires_grad=True)
    n = float(len(log_ratios))
    x = LossInputs(
        logp,
        torch.zeros_like(logp).detach(),
        torch.tensor(advantages, dtype=torch.float64),
        torch.ones_like(logp).detach(),
        num_tokens_total=n,
        num_seqs_total=n,
    )
    return logp, x


def test_ppo_clip_higher_hand_computed_and_zero_gradient_tokens():
    # ratio, A:   2,+1 (above 1.28: clipped)  0.5,+1 (below: unclipped)  0.5,-1 (below: clipped)
    #             2,-1 (above, A<0: unclipped, pessimistic)  e^30,+1 (far out, clipped, finite)
    logp, x = per_sequence_tokens([LN2, -LN2, -LN2, LN2, 30.0], [1.0, 1.0, -1.0, -1.0, 1.0])
    loss, m = ppo_clip_loss(x, PolicyLossSettings(clip_low=0.2, clip_high=0.28))
    token_losses = [-1.28, -0.5, 0.8, 2.0, -1.28]
    assert math.isclose(loss.item(), sum(token_losses) / 5, rel_tol=1e-9)
    assert math.isclose(m["clip_frac"].item(), 3 / 5)
    loss.backward()
    # d(-r A)/d logp = -r A where unclipped; 0 where the clipped branch is taken
    expected_grad = [0.0, -0.5 / 5, 0.0, 2.0 / 5, 0.0]
    assert torch.allclose(logp.grad[:, 0], torch.tensor(expected_grad, dtype=torch.float64))
    assert torch.isfinite(logp.grad).all()


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # A = -1 everywhere; ratios 2 (loss 2 < c = 3: kept), e^5 = 148 (capped at 3), 0.5 (clipped)
    logp, x = per_sequence_tokens([LN2, 5.0, -LN2], [-1.0, -1.0, -1.0])
    loss, m = ppo_clip_loss(x, PolicyLossSettings(dual_clip_c=3.0))
    assert math.isclose(loss.item(), (2.0 + 3.0 + 0.8) / 3, rel_tol=1e-9)
    assert math.isclose(m["dual_clip_frac"].item(), 1 / 3)
    loss.backward()
    assert torch.allclose(logp.grad[:, 0], torch.tensor([2.0 / 3, 0.0, 0.0], dtype=torch.float64))
    # without the dual clip the far token dominates with gradient e^5 / 3
    logp2, x2 = per_sequence_tokens([LN2, 5.0, -LN2], [-1.0, -1.0, -1.0])
    ppo_clip_loss(x2, PolicyLossSettings())[0].backward()
    assert math.isclose(logp2.grad[1, 0].item(), math.exp(5.0) / 3, rel_tol=1e-9)


def test_dual_clip_leaves_positive_advantages_alone():
    _, x = per_sequence_tokens([5.0, -LN2], [1.0, 1.0])
    with_dual, _ = ppo_clip_loss(x, PolicyLossSettings(dual_clip_c=3.0))
    without, _ = ppo_clip_loss(x, PolicyLossSettings())
    assert with_dual.item() == without.item() == (-1.2 - 0.5) / 2


def gspo_batch():
    # seq 0: log ratios [0.1, 0.3] -> s = e^0.2 = 1.22 > 1.2, A = +1: clipped
    # seq 1: log ratios [0.05, -0.05, 0] -> s = 1, A = -2: unclipped
    # seq 2: one token, log ratio ln 0.5 -> s = 0.5 < 0.8, A = -1: clipped
    old = torch.zeros(3, 4, dtype=torch.float64)
    logp = torch.tensor(
        [[0.1, 0.3, 0.0, 0.0], [0.05, -0.05, 0.0, 0.0], [-LN2, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
        requires_grad=True,
    )
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, -1.0], dtype=torch.float64)
    return logp, LossInputs(logp, old, adv, mask, 6.0, 3.0)


def test_gspo_hand_computed_sequence_ratio_and_clipping():
    logp, x = gspo_batch()
    s = PolicyLossSettings(clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean")
    loss, m = gspo_loss(x, s)
    # per-sequence losses: -min(1.2214, 1.2) * 1, -1 * -2, -min(0.5 * -1, 0.8 * -1)
    assert math.isclose(loss.item(), (-1.2 + 2.0 + 0.8) / 3, rel_tol=1e-9)
    assert math.isclose(m["clip_frac"].item(), 2 / 3)
    assert math.isclose(m["seq_ratio_mean"].item(), (math.exp(0.2) + 1.0 + 0.5) / 3, rel_tol=1e-9)
    loss.backward()
    # clipped sequences: no gradient on any of their tokens; seq 1: -A * s / |y| / S = 2 / 3 / 3
    expected = torch.zeros(3, 4, dtype=torch.float64)
    expected[1, :3] = 2.0 / 9
    assert torch.allclose(logp.grad, expected)


def test_gspo_token_form_equals_the_sequence_form_value_and_gradient():
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(4, 6, dtype=torch.float64)
    for b, length in enumerate([1, 6, 3, 4]):
        mask[b, :length] = 1.0
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    noise = 0.02 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5], dtype=torch.float64)
    settings = PolicyLossSettings(clip_low=0.01, clip_high=0.012, aggregation="seq_mean_token_mean")

    logp = (old + noise).requires_grad_(True)
    loss, _ = gspo_loss(LossInputs(logp, old, adv, mask, float(mask.sum()), 4.0), settings)
    loss.backward()

    logp_ref = (old + noise).requires_grad_(True)
    seq_ratio = torch.exp(((logp_ref - old) * mask).sum(-1) / mask.sum(-1))
    clipped = seq_ratio.clamp(1 - 0.01, 1 + 0.012)
    reference = -torch.minimum(seq_ratio * adv, clipped * adv).mean()
    reference.backward()
    assert math.isclose(loss.item(), reference.item(), rel_tol=1e-12)
    assert torch.allclose(logp.grad, logp_ref.grad, atol=1e-12)
    assert (logp.grad.abs().sum(-1) == 0).any()  # some sequence was clipped...
    assert (logp.grad.abs().sum(-1) > 0).any()  # ...and some was not


def test_cispo_hand_computed_every_token_keeps_its_gradient():
    # ratios 2 (A +1), 0.5 (A -1), e^3 = 20.1 (A +1, weight capped at 1 + 5 = 6)
    logp, x = per_sequence_tokens([LN2, -LN2, 3.0], [1.0, -1.0, 1.0])
    loss, m = cispo_loss(x, PolicyLossSettings(clip_low=1.0, clip_high=5.0))
    weights, advs = [2.0, 0.5, 6.0], [1.0, -1.0, 1.0]
    logps = [LN2, -LN2, 3.0]
    expected_loss = sum(-w * a * lp for w, a, lp in zip(weights, advs, logps)) / 3
    assert math.isclose(loss.item(), expected_loss, rel_tol=1e-9)
    assert math.isclose(m["clip_frac"].item(), 1 / 3)
    loss.backward()
    expected_grad = [-w * a / 3 for w, a in zip(weights, advs)]
    assert torch.allclose(logp.grad[:, 0], torch.tensor(expected_grad, dtype=torch.float64))


def test_cispo_weight_is_stop_gradient():
    # inside the clip range the weight is the raw ratio 1.5; were it differentiated the gradient
    # would gain A * log pi * d(ratio)/d logp = 1.5 * log(1.5) on top of 1.5
    logp, x = per_sequence_tokens([math.log(1.5)], [1.0])
    cispo_loss(x, PolicyLossSettings(clip_low=0.2, clip_high=5.0))[0].backward()
    assert math.isclose(logp.grad.item(), -1.5, rel_tol=1e-12)
    # a finite lower clip applies to the weight: ratio 0.5 -> weight 0.8
    logp, x = per_sequence_tokens([-LN2], [1.0])
    cispo_loss(x, PolicyLossSettings(clip_low=0.2, clip_high=5.0))[0].backward()
    assert math.isclose(logp.grad.item(), -0.8, rel_tol=1e-12)


def ragged_on_policy_batch(length: int = 300):
    """Three sequences of lengths 1, `length` and 4 in a [3, length] grid, padding after the short
    ones holding junk logprobs; old logprobs equal the current ones (ratio exactly 1)."""
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(3, length, generator=g, dtype=torch.float64) * 3
    logp.requires_grad_(True)
    mask = torch.zeros(3, length, dtype=torch.float64)
    for b, num_tokens in enumerate([1, length, 4]):
        mask[b, :num_tokens] = 1.0
    adv = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    x = LossInputs(logp, logp.detach(), adv, mask, float(mask.sum()), 3.0, token_sum_norm=length)
    return logp, x


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_on_policy_ratio_one_gives_the_plain_policy_gradient(name, aggregation):
    # ratio exactly 1: every loss reduces to REINFORCE, grad = -A_b * (the token's aggregation
    # weight) on the sequence's tokens, nothing on padding, whatever the sequence's length
    logp, x = ragged_on_policy_batch(length=300)
    settings = PolicyLossSettings(clip_low=3e-4, clip_high=4e-4, aggregation=aggregation)
    POLICY_LOSSES[name](x, settings)[0].backward()
    lengths = torch.tensor([1.0, 300.0, 4.0], dtype=torch.float64)
    weight_B = {
        "token_mean": torch.full((3,), 1 / 305, dtype=torch.float64),
        "token_sum": torch.ones(3, dtype=torch.float64),
        "seq_mean_token_mean": 1 / (lengths * 3),
        "seq_mean_token_sum_norm": torch.full((3,), 1 / (300 * 3), dtype=torch.float64),
        "seq_mean_token_sum": torch.full((3,), 1 / 3, dtype=torch.float64),
    }[aggregation]
    expected = -(x.advantages_B * weight_B)[:, None] * x.mask_BT
    assert torch.allclose(logp.grad, expected, rtol=1e-12, atol=0.0)
    assert torch.all(logp.grad[x.mask_BT == 0] == 0)


def test_ppo_ratios_far_outside_the_clip_range():
    # ratio e^30 (A +1: clipped; A -1: pessimistic branch, capped by the dual clip) and e^-30
    # (A +1: unclipped, a vanishing gradient; A -1: clipped at 0.8)
    logp, x = per_sequence_tokens([30.0, -30.0, -30.0, 30.0], [1.0, 1.0, -1.0, -1.0])
    loss, m = ppo_clip_loss(x, PolicyLossSettings(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0))
    tiny = math.exp(-30.0)
    assert math.isclose(loss.item(), (-1.28 - tiny + 0.8 + 3.0) / 4, rel_tol=1e-12)
    assert m["clip_frac"].item() == 2 / 4 and m["dual_clip_frac"].item() == 1 / 4
    loss.backward()
    expected = torch.tensor([0.0, -tiny / 4, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(logp.grad[:, 0], expected, rtol=1e-12, atol=0.0)


def test_log_ratios_beyond_the_overflow_guard_saturate_without_gradient():
    # exp(50) would overflow float32; the log ratio is capped at MAX_LOG_RATIO = 20, so a token
    # whose pessimistic branch is that far out contributes e^20 * |A| and no gradient
    logp = torch.tensor([[50.0]], requires_grad=True)
    x = LossInputs(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 1.0, 1.0)
    loss, _ = ppo_clip_loss(x, PolicyLossSettings())
    assert math.isclose(loss.item(), math.exp(20.0), rel_tol=1e-6)
    loss.backward()
    assert logp.grad.item() == 0.0


def test_gspo_sequence_ratios_far_outside_the_clip_range():
    # seq 0: two tokens at log ratio 30, A +1 -> s = e^30, clipped at 1 + 4e-4
    # seq 1: one token at -30, A +1 -> s = e^-30, unclipped: loss -e^-30, a vanishing gradient
    # seq 2: three tokens at -30, A -1 -> s = e^-30, clipped at 1 - 3e-4
    old = torch.zeros(3, 3, dtype=torch.float64)
    logp = torch.tensor(
        [[30.0, 30.0, 0.0], [-30.0, 0.0, 0.0], [-30.0, -30.0, -30.0]],
        dtype=torch.float64,
        requires_grad=True,
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    settings = PolicyLossSettings(clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean")
    loss, m = gspo_loss(LossInputs(logp, old, adv, mask, 6.0, 3.0), settings)
    tiny = math.exp(-30.0)
    assert math.isclose(loss.item(), (-(1 + 4e-4) - tiny + (1 - 3e-4)) / 3, rel_tol=1e-12)
    assert math.isclose(m["clip_frac"].item(), 2 / 3)
    loss.backward()
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 0] = -tiny / 3  # -A * s / |y| / num_seqs
    assert torch.allclose(logp.grad, expected, rtol=1e-12, atol=0.0)


def test_cispo_ratios_far_outside_the_clip_range_keep_their_gradient():
    # weights: e^30 capped at 1 + 5 = 6; e^-30 (no floor: clip_low = 1.0); e^50 -> log ratio
    # capped at 20 by the overflow guard, then at 6
    logp, x = per_sequence_tokens([30.0, -30.0, 50.0], [1.0, 1.0, -1.0])
    loss, m = cispo_loss(x, PolicyLossSettings(clip_low=1.0, clip_high=5.0))
    weights, advs, logps = [6.0, math.exp(-30.0), 6.0], [1.0, 1.0, -1.0], [30.0, -30.0, 50.0]
    expected_loss = sum(-w * a * lp for w, a, lp in zip(weights, advs, logps)) / 3
    assert math.isclose(loss.item(), expected_loss, rel_tol=1e-12)
    assert math.isclose(m["clip_frac"].item(), 2 / 3)
    loss.backward()
    expected_grad = torch.tensor([-w * a / 3 for w, a in zip(weights, advs)], dtype=torch.float64)
    assert torch.allclose(logp.grad[:, 0], expected_grad, rtol=1e-12, atol=0.0)


def test_per_token_advantages_are_used_token_by_token():
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    adv_BT = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    x = LossInputs(logp, logp.detach(), adv_BT, torch.ones(1, 3, dtype=torch.float64), 3.0, 1.0)
    loss, _ = ppo_clip_loss(x, PolicyLossSettings())
    assert math.isclose(loss.item(), -(1.0 - 2.0 + 3.0) / 3)
    loss.backward()
    assert torch.allclose(logp.grad, -adv_BT / 3)


def test_aggregation_modes_hand_computed_ragged():
    # lengths 5 and 1; this micro-batch is part of a step with 12 tokens in 4 sequences
    vals = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [7.0, 9.0, 9.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    x = LossInputs(vals, vals, torch.zeros(2), mask, 12.0, 4.0, token_sum_norm=10.0)
    expected = {
        "token_mean": (15 + 7) / 12,
        "seq_mean_token_mean": (15 / 5 + 7 / 1) / 4,
        "seq_mean_token_sum_norm": (15 + 7) / (10 * 4),
        "seq_mean_token_sum": (15 + 7) / 4,
    }
    # each mode's per-token gradient weight: what a token counts for
    weights = {
        "token_mean": [1 / 12, 1 / 12],
        "seq_mean_token_mean": [1 / (5 * 4), 1 / (1 * 4)],
        "seq_mean_token_sum_norm": [1 / 40, 1 / 40],
        "seq_mean_token_sum": [1 / 4, 1 / 4],
    }
    for mode, value in expected.items():
        vals.grad = None
        out = aggregate(vals, x, mode)
        assert math.isclose(out.item(), value, rel_tol=1e-6), mode
        out.backward()
        expected_grad = torch.tensor(weights[mode])[:, None] * mask
        assert torch.allclose(vals.grad, expected_grad), mode


def test_sum_norm_without_its_constant_is_a_clear_error():
    x = LossInputs(torch.ones(1, 2), torch.ones(1, 2), torch.zeros(1), torch.ones(1, 2), 2.0, 1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate(x.logprobs_BT, x, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(x.logprobs_BT, x, "seq_sum")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dual_clip_c": 1.0},
        {"clip_low": 1.5},
        {"clip_high": -0.1},
        {"tis_cap": 0.0},
        {"aggregation": "mean"},
        {"kl_estimator": "k4"},
    ],
)
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        PolicyLossSettings(**kwargs)


def test_kl_loss_term_and_entropy_bonus_gradients():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([[0.5, 0.7]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    x = LossInputs(
        logp,
        logp.detach(),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        2.0,
        1.0,
        ref_logprobs_BT=ref,
        entropy_BT=entropy,
    )
    s = PolicyLossSettings(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = ppo_clip_loss(x, s)
    # A = 0: loss = 0.1 * mean(k1) - 0.01 * mean(H) = 0.1 * (0.5 - 1) / 2 - 0.01 * 1.2 / 2
    assert math.isclose(loss.item(), 0.1 * -0.25 - 0.01 * 0.6, rel_tol=1e-9)
    assert math.isclose(m["kl_ref"].item(), -0.25) and math.isclose(m["entropy"].item(), 0.6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), 0.1 / 2, dtype=torch.float64))
    assert torch.allclose(entropy.grad, torch.full((1, 2), -0.01 / 2, dtype=torch.float64))
