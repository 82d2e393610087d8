"""Presets resolve through the registries and run end to end on a toy step."""

import pytest
import torch

from reinforge.algorithms.advantages import (
    gae_advantages,
    masked_whiten,
    outcome_token_rewards,
    reinforce_pp_token_advantages,
)
from reinforge.algorithms.kl import kl_penalized_token_rewards
from reinforge.algorithms.losses import AGGREGATIONS, LossInputs
from reinforge.algorithms.presets import ADVANTAGES, POLICY_LOSSES, PRESETS, Preset
from reinforge.config import TrainConfig, load_config
from reinforge.train.loop.advantage_step import Algorithm

EXPECTED = {
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "cispo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_token",
    "ppo",
}
TOKEN_LEVEL = {"gae", "reinforce_pp_token"}


def test_every_preset_is_complete_and_resolves():
    assert set(PRESETS) == EXPECTED
    for name, preset in PRESETS.items():
        assert set(preset) == Preset.__required_keys__, name
        assert preset["advantage"] in ADVANTAGES or preset["advantage"] in TOKEN_LEVEL, name
        assert preset["loss"] in POLICY_LOSSES, name
        assert preset["aggregation"] in AGGREGATIONS, name
        assert (preset["advantage"] == "gae") == preset["value_model"], name
        assert (preset["kl_placement"] is None) == (preset["kl_coef"] == 0.0), name
        loss_settings(name)  # validates clip ranges, dual clip, estimator


def test_paper_values_stay_put():
    dapo, gspo, dr = PRESETS["dapo"], PRESETS["gspo"], PRESETS["dr_grpo"]
    assert (dapo["clip_low"], dapo["clip_high"], dapo["aggregation"]) == (0.2, 0.28, "token_mean")
    assert dapo["dynamic_sampling"] and dapo["overlong_buffer"] == 4096
    assert (gspo["clip_low"], gspo["clip_high"], gspo["loss"]) == (3e-4, 4e-4, "gspo")
    assert dr["scale_rewards"] == "none" and dr["aggregation"] == "seq_mean_token_sum_norm"
    assert PRESETS["grpo"]["kl_coef"] == 0.04 and PRESETS["grpo"]["kl_estimator"] == "k3"
    assert PRESETS["cispo"]["clip_low"] == 1.0  # no lower bound on the IS weight


def loss_settings(name: str):
    """The loss settings a run with `algorithm.name = name` hands its loss."""
    return Algorithm(
        load_config(
            TrainConfig, None, [f"algorithm.name={name}", "rollout.max_new_tokens=8192"]
        ).algorithm
    ).settings


def test_kl_reaches_the_loss_only_when_placed_there():
    assert loss_settings("grpo").kl_coef == 0.04
    assert loss_settings("ppo").kl_coef == 0.0  # penalty lives in the reward
    assert loss_settings("rloo").kl_coef == 0.0


def toy_step(num_groups=2, group_size=4, length=5):
    g = torch.Generator().manual_seed(11)
    rewards_GN = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4]])
    mask = torch.zeros(num_groups * group_size, length)
    for b in range(num_groups * group_size):
        mask[b, : 1 + b % length] = 1.0
    old = -torch.rand(num_groups * group_size, length, generator=g)
    logp = (old + 0.01 * torch.randn(old.shape, generator=g)).requires_grad_(True)
    ref = old + 0.05 * torch.randn(old.shape, generator=g)
    return rewards_GN, mask, old, logp, ref


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_runs_end_to_end(name):
    preset = PRESETS[name]
    rewards_GN, mask, old, logp, ref = toy_step()
    if preset["advantage"] in TOKEN_LEVEL:  # rewards -> KL penalty -> GAE or REINFORCE++
        token_rewards = kl_penalized_token_rewards(
            outcome_token_rewards(rewards_GN.flatten(), mask), old, ref, mask, preset["kl_coef"]
        )
        if preset["value_model"]:
            adv, _ = gae_advantages(
                token_rewards, torch.zeros_like(old), mask, preset["gamma"], preset["lam"]
            )
            advantages = masked_whiten(adv, mask)
        else:
            advantages = reinforce_pp_token_advantages(token_rewards, mask, preset["gamma"])
    else:
        advantages = ADVANTAGES[preset["advantage"]](
            rewards_GN, preset["scale_rewards"], 1e-6
        ).flatten()
    x = LossInputs(
        logp,
        old,
        advantages,
        mask,
        float(mask.sum()),
        float(mask.shape[0]),
        ref_logprobs_BT=ref,
        token_sum_norm=float(mask.shape[1]),
    )
    loss, metrics = POLICY_LOSSES[preset["loss"]](x, loss_settings(name))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().sum() > 0
    assert all(torch.isfinite(torch.as_tensor(v)) for v in metrics.values())


def test_table_names_match_the_registries():
    """The config validates names from `table` (no torch); each must have its function here."""
    from typing import get_args

    from reinforge.algorithms.kl import KL_ESTIMATORS
    from reinforge.algorithms.table import AdvantageName, Aggregation, KLEstimator, LossName

    assert set(get_args(AdvantageName)) == set(ADVANTAGES) | TOKEN_LEVEL | {"ema_baseline"}
    assert set(get_args(LossName)) == set(POLICY_LOSSES)
    assert set(get_args(Aggregation)) == set(AGGREGATIONS)
    assert set(get_args(KLEstimator)) == set(KL_ESTIMATORS)
