"""Issue 23's migrated settings, each against a reference computed here from the formula in plain
Python / numpy (never through reinforge's own functions): KL estimators at the extremes, TRL's
KL importance correction, scale_rewards, token_sum and the two sequence-count conventions,
REINFORCE++ token returns, whitening, the value-clip fraction."""

import math

import numpy as np
import pytest
import torch

from reinforge.algorithms.advantages import (
    grpo_advantages,
    masked_whiten,
    reinforce_pp_token_advantages,
    rloo_advantages,
)
from reinforge.algorithms.kl import kl_estimate
from reinforge.algorithms.losses import LossInputs, PolicyLossSettings, aggregate, ppo_clip_loss
from reinforge.algorithms.value import clipped_value_loss
from reinforge.train.loop.advantage_step import build_step_batch
from reinforge.types import Completion, Group, Task, Trajectory

# ---------------------------------------------------------------------------- KL at the extremes


def kl_value_and_grad(estimator: str, log_ratio: float) -> tuple[float, float]:
    logp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
    kl = kl_estimate(logp, torch.zeros(1, dtype=torch.float64), estimator)
    kl.sum().backward()
    return kl.item(), logp.grad.item()


# (estimator, log-ratio) -> (value, d value / d logp), by hand: k1 = x (grad 1), k2 = x^2/2
# (grad x), abs = |x| (grad sign x), k3 clamped to 10 past |x| ~ 2.6 / 11 (grad 0 there),
# k3+ = k3's value with k2's gradient x
EXTREMES = {
    ("k1", -25.0): (-25.0, 1.0),
    ("k1", 25.0): (25.0, 1.0),
    ("k2", -25.0): (312.5, -25.0),
    ("k2", 25.0): (312.5, 25.0),
    ("abs", -25.0): (25.0, -1.0),
    ("abs", 25.0): (25.0, 1.0),
    ("k3", -25.0): (10.0, 0.0),
    ("k3", 25.0): (10.0, 0.0),
    ("k3+", -25.0): (10.0, -25.0),
    ("k3+", 25.0): (10.0, 25.0),
}


@pytest.mark.parametrize("estimator,log_ratio", sorted(EXTREMES))
def test_kl_estimators_at_log_ratio_25_are_finite_with_the_right_gradient(estimator, log_ratio):
    value, grad = kl_value_and_grad(estimator, log_ratio)
    want_value, want_grad = EXTREMES[(estimator, log_ratio)]
    assert math.isfinite(value) and math.isfinite(grad)
    assert math.isclose(value, want_value, rel_tol=1e-12)
    assert math.isclose(grad, want_grad, rel_tol=1e-12, abs_tol=1e-12)
    # descending the KL never moves the policy further from the reference
    assert grad * log_ratio >= 0.0 or estimator == "k1"


def test_k3_inside_the_clamps_and_k3_plus_straight_through():
    x = -0.5  # k3 = e^0.5 - 1 - 0.5, d/dx = 1 - e^0.5; k3+ keeps the value, takes k2's grad x
    k3 = math.exp(0.5) - 1.5
    assert np.allclose(kl_value_and_grad("k3", x), (k3, 1.0 - math.exp(0.5)))
    assert np.allclose(kl_value_and_grad("k3+", x), (k3, x))


def test_kl_loss_term_pulls_back_at_minus_25_with_k3_plus():
    # the policy gave a token 25 nats less than the reference: k3+ pushes logp up (grad < 0)
    logp = torch.tensor([[-30.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-5.0]], dtype=torch.float64)
    x = LossInputs(
        logp, logp.detach(), torch.zeros(1), torch.ones(1, 1), 1.0, 1.0, ref_logprobs_BT=ref
    )
    loss, metrics = ppo_clip_loss(x, PolicyLossSettings(kl_coef=0.1, kl_estimator="k3+"))
    loss.backward()
    assert math.isclose(loss.item(), 0.1 * 10.0) and math.isclose(logp.grad.item(), 0.1 * -25.0)
    assert math.isclose(metrics["kl_ref"].item(), 10.0)


# ----------------------------------------------------- TRL's KL with the importance correction


def test_kl_importance_correction_reproduces_trl_value_and_gradient():
    logp_v, old_v, ref_v, beta = [-1.0, -2.0], [-1.3, -1.8], [-0.8, -2.5], 0.04
    logp = torch.tensor([logp_v], dtype=torch.float64, requires_grad=True)
    x = LossInputs(
        logp,
        torch.tensor([old_v], dtype=torch.float64),
        torch.zeros(1, dtype=torch.float64),  # no policy-gradient term: the KL alone
        torch.ones(1, 2, dtype=torch.float64),
        2.0,
        1.0,
        ref_logprobs_BT=torch.tensor([ref_v], dtype=torch.float64),
    )
    settings = PolicyLossSettings(
        kl_coef=beta, aggregation="token_mean", kl_importance_correction=True
    )
    loss, metrics = ppo_clip_loss(x, settings)
    loss.backward()
    # by hand: k3 = e^(ref - logp) - (ref - logp) - 1, w = e^(logp - old), term = beta * k3 * w;
    # d/dlogp (k3 * w) = (1 - e^(ref - logp)) * w + k3 * w
    k3 = [math.exp(r - p) - (r - p) - 1 for p, r in zip(logp_v, ref_v)]
    w = [math.exp(p - o) for p, o in zip(logp_v, old_v)]
    want_loss = beta * sum(k * wi for k, wi in zip(k3, w)) / 2
    want_grad = [
        beta * ((1 - math.exp(r - p)) * wi + k * wi) / 2
        for p, r, k, wi in zip(logp_v, ref_v, k3, w)
    ]
    assert math.isclose(loss.item(), want_loss, rel_tol=1e-12)
    assert np.allclose(logp.grad.numpy()[0], want_grad, rtol=1e-12)
    # TRL logs the token mean of the corrected k3; ours is the plain estimator's
    assert math.isclose(metrics["kl_ref_trl"].item(), sum(k * wi for k, wi in zip(k3, w)) / 2)
    assert math.isclose(metrics["kl_ref"].item(), sum(k3) / 2, rel_tol=1e-12)


# ----------------------------------------------------------------------- scale_rewards and eps

REWARDS = np.array([[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.4, 0.4], [1.0, 1.0, 1.0, 1.0]])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_scale_rewards_as_trl(scale):
    eps = 1e-4  # TRL's
    centred = REWARDS - REWARDS.mean(axis=1, keepdims=True)
    std = {
        "group": REWARDS.std(axis=1, ddof=1, keepdims=True),
        "batch": REWARDS.std(ddof=1),  # of the raw rewards, the whole batch
        "none": None,
    }[scale]
    want = centred if std is None else centred / (std + eps)
    got = grpo_advantages(torch.tensor(REWARDS), scale, eps)
    assert np.allclose(got.numpy(), want, atol=1e-12)
    assert torch.equal(got[2], torch.zeros(4, dtype=torch.float64))  # equal rewards: exactly 0


def test_rloo_batch_scale():
    n = REWARDS.shape[1]
    loo = REWARDS - (REWARDS.sum(axis=1, keepdims=True) - REWARDS) / (n - 1)
    want = loo / (REWARDS.std(ddof=1) + 1e-6)
    assert np.allclose(rloo_advantages(torch.tensor(REWARDS), "batch", 1e-6).numpy(), want)


# ---------------------------------------------------- aggregation: token_sum and the row count

LOSS = np.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 1.0, 0.0]])
MASK = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])  # row 1: no loss token


def agg(mode: str, num_seqs: float) -> float:
    x = LossInputs(
        torch.zeros(3, 3), torch.zeros(3, 3), torch.zeros(3), torch.tensor(MASK), 5.0, num_seqs
    )
    return aggregate(torch.tensor(LOSS), x, mode).item()


def test_token_sum_and_both_sequence_counts():
    assert math.isclose(agg("token_sum", 2.0), (LOSS * MASK).sum())
    per_row_mean = (LOSS * MASK).sum(1) / np.maximum(MASK.sum(1), 1.0)
    has_tokens = MASK.sum(1) > 0
    verl = per_row_mean[has_tokens].sum() / has_tokens.sum()  # rows with tokens
    trl = per_row_mean.mean()  # TRL grpo: every row, an empty one adds 0
    assert math.isclose(agg("seq_mean_token_mean", 2.0), verl)
    assert math.isclose(agg("seq_mean_token_mean", 3.0), trl)
    assert not math.isclose(verl, trl)


def trajectory(num_tokens: int, finish: str) -> Trajectory:
    task = Task("t-0", (), "")
    completion = Completion(list(range(num_tokens)), [-0.5] * num_tokens, finish)
    return Trajectory(task, [1, 2], completion, reward=1.0)


@pytest.mark.parametrize("seq_count,want", [("with_tokens", 2.0), ("all", 3.0)])
def test_seq_count_setting_reaches_the_step_batch(seq_count, want):
    from reinforge.config import TrainConfig, load_config

    a = load_config(
        TrainConfig, None, ["algorithm.mask_truncated=true", f"algorithm.seq_count={seq_count}"]
    ).algorithm
    trajs = [trajectory(3, "stop"), trajectory(4, "length"), trajectory(2, "stop")]
    batch = build_step_batch([Group(trajs[0].task, trajs)], a, "cpu")
    assert batch.num_tokens == 5.0 and batch.num_seqs == want


# ------------------------------------------------------------- REINFORCE++ token and whitening


def verl_style_whiten(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    valid = values[mask > 0]
    mean, var = valid.mean(), valid.var(ddof=1)
    return (values - mean) / math.sqrt(var + 1e-8) * mask


def test_reinforce_pp_token_discounted_whitened_returns():
    rewards = np.array([[0.0, -0.1, 1.0, 0.0], [-0.2, 0.0, 0.0, 0.5]])
    mask = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    gamma = 0.9
    returns = np.zeros_like(rewards)
    for b in range(2):
        running = 0.0
        for t in reversed(range(4)):
            running = rewards[b, t] + gamma * running
            returns[b, t] = running
            running *= mask[b, t]
    want = verl_style_whiten(returns, mask)
    got = reinforce_pp_token_advantages(torch.tensor(rewards), torch.tensor(mask), gamma)
    assert np.allclose(got.numpy(), want, atol=1e-12)
    unwhitened = reinforce_pp_token_advantages(
        torch.tensor(rewards), torch.tensor(mask), gamma, False
    )
    assert np.allclose(unwhitened.numpy(), returns * mask, atol=1e-12)


def test_masked_whiten_uses_rsqrt_of_var_plus_eps():
    values = np.array([[0.3, 0.1, 9.0], [0.2, 0.25, 0.0]])
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = masked_whiten(torch.tensor(values), torch.tensor(mask)).numpy()
    assert np.allclose(got, verl_style_whiten(values, mask), atol=1e-12)
    tiny = np.array([[1.0, 1.0 + 1e-5]])  # var 5e-11 << eps: eps dominates, as in verl
    got = masked_whiten(torch.tensor(tiny), torch.ones(1, 2, dtype=torch.float64)).numpy()
    assert np.allclose(got, verl_style_whiten(tiny, np.ones((1, 2))), atol=1e-9)


# ----------------------------------------------------------------------- value-clip fraction


def test_value_clip_fraction_counts_only_clamped_values_in_float32():
    gen = torch.Generator().manual_seed(0)
    # V much smaller than V_old, |V - V_old| < 0.1 < the clip: V_old + (V - V_old) rounds off V
    old = torch.rand(1, 4096, generator=gen) * 0.1
    values = torch.rand(1, 4096, generator=gen) * 1e-3
    returns = values.clone()  # V is exact: any rounding of a rebuilt V shows as an error
    mask = torch.ones(1, 4096)
    # the old count: V_old + clamp(V - V_old) rebuilt in float32 disagrees with V on some tokens
    rebuilt = old + (values - old).clamp(-0.2, 0.2)
    assert ((rebuilt - returns).square() > (values - returns).square()).any()
    _, metrics = clipped_value_loss(values, old, returns, mask, 4096.0, clip_eps=0.2)
    assert metrics["value_clip_frac"].item() == 0.0
    old = torch.rand(1, 4096, generator=gen) * 10
    moved = old.clone()
    moved[0, :1024] += 1.0  # a quarter moved by 1 > 0.2 towards nothing: clipped, returns = old
    _, metrics = clipped_value_loss(moved, old, old, mask, 4096.0, clip_eps=0.2)
    assert metrics["value_clip_frac"].item() == 0.0  # clipped error is the smaller: not binding
    _, metrics = clipped_value_loss(moved, old, old + 5.0, mask, 4096.0, clip_eps=0.2)
    assert math.isclose(metrics["value_clip_frac"].item(), 0.25)  # V moved 1 toward R: binding


def test_reinforce_pp_token_preset_wires_gamma_into_the_step():
    from reinforge.config import TrainConfig, load_config
    from reinforge.train.loop.advantage_step import Algorithm, assign_advantages

    a = load_config(
        TrainConfig,
        None,
        ["algorithm.name=reinforce_pp_token", "algorithm.gamma=0.5", "algorithm.kl_coef=0"],
    ).algorithm
    trajs = [trajectory(3, "stop"), trajectory(2, "stop")]
    trajs[1].reward = 0.0
    batch = build_step_batch([Group(trajs[0].task, trajs)], a, "cpu")
    assign_advantages(batch, Algorithm(a), max_new_tokens=4)
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    returns = np.array([[0.25, 0.5, 1.0], [0.0, 0.0, 0.0]])  # reward 1 on the last token, gamma 0.5
    assert np.allclose(batch.advantages.numpy(), verl_style_whiten(returns, mask), atol=1e-6)
