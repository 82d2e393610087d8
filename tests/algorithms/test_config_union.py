"""`[algorithm]` as a union on `name`: each algorithm takes only its own settings, and a foreign
one is refused naming the algorithm that has it; new settings reach the resolved section."""

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.errors import ConfigError


def algorithm(*overrides: str):
    return load_config(TrainConfig, None, list(overrides)).algorithm


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        algorithm(*overrides)
    return str(e.value)


@pytest.mark.parametrize("key,value", [("gamma", "0.9"), ("value_clip", "0.1"), ("lam", "0.9")])
def test_value_model_settings_under_grpo_name_ppo(key, value):
    message = error_of(f"algorithm.{key}={value}")
    assert f"has no setting {key!r}" in message and "name = 'ppo'" in message


def test_ema_decay_under_ppo_names_the_sequence_algorithms():
    message = error_of("algorithm.name=ppo", "algorithm.ema_decay=0.5")
    assert "name = 'grpo'" in message


def test_token_level_advantage_under_grpo_points_to_its_algorithm():
    assert "name = 'ppo'" in error_of("algorithm.advantage=gae")
    assert "name = 'reinforce_pp_token'" in error_of("algorithm.advantage=reinforce_pp_token")


def test_settings_without_effect_are_refused():
    assert "advantage = 'ema_baseline'" in error_of("algorithm.ema_decay=0.5")
    assert "use one of 'batch', 'none'" in error_of(
        "algorithm.advantage=reinforce_pp", "algorithm.scale_rewards=group"
    )
    assert "set tis_cap" in error_of("algorithm.tis_level=sequence")
    assert "mis_low = 0.5" in error_of("algorithm.mis_low=2.0", "algorithm.mis_high=1.0")
    assert "kl_placement = 'loss'" in error_of(
        "algorithm.name=rloo", "algorithm.kl_importance_correction=true"
    )


def test_each_algorithm_resolves_its_own_settings():
    ppo = algorithm("algorithm.name=ppo", "algorithm.gamma=0.99")
    assert (ppo.advantage, ppo.gamma, ppo.lam, ppo.value_clip) == ("gae", 0.99, 0.95, 0.2)
    assert ppo.uses_value_model and ppo.origins()["gamma"] == "set (preset ppo: 1.0)"
    rpp = algorithm("algorithm.name=reinforce_pp_token", "algorithm.gamma=0.95")
    assert (rpp.advantage, rpp.gamma, rpp.kl_placement, rpp.scale_rewards) == (
        "reinforce_pp_token",
        0.95,
        "reward_token",
        "batch",
    )
    assert not hasattr(rpp, "lam") and not rpp.uses_value_model
    grpo = algorithm("algorithm.scale_rewards=batch", "algorithm.advantage_eps=1e-4")
    assert (grpo.scale_rewards, grpo.advantage_eps) == ("batch", 1e-4)
    # an estimator chosen over the preset's keeps a std division at its own level
    assert algorithm("algorithm.advantage=ema_baseline").scale_rewards == "batch"
    assert algorithm("algorithm.name=dr_grpo", "algorithm.advantage=rloo").scale_rewards == "none"


def test_new_estimators_and_aggregation_are_accepted():
    a = algorithm(
        "algorithm.kl_estimator=k3+",
        "algorithm.loss_aggregation=token_sum",
        "algorithm.seq_count=all",
        "algorithm.kl_importance_correction=true",
        "algorithm.tis_cap=2.0",
        "algorithm.tis_level=sequence",
        "algorithm.mis_high=3.0",
    )
    assert (a.kl_estimator, a.loss_aggregation, a.seq_count) == ("k3+", "token_sum", "all")


def test_the_resolved_section_loads_back_unchanged():
    """A run's saved config (every field written out) must load again, for every algorithm."""
    import tomllib

    from reinforge.algorithms.table import PRESETS
    from reinforge.config import to_toml

    for name in PRESETS:
        cfg = load_config(
            TrainConfig, None, [f"algorithm.name={name}", "rollout.max_new_tokens=8192"]
        )
        raw = tomllib.loads(to_toml(cfg))
        again = TrainConfig.model_validate(raw)
        assert again.algorithm == cfg.algorithm, name


def test_settings_reach_the_loss():
    from reinforge.train.loop.advantage_step import Algorithm

    a = algorithm(
        "algorithm.tis_cap=2.0",
        "algorithm.mis_low=0.5",
        "algorithm.mis_high=3.0",
        "algorithm.mis_level=sequence",
        "algorithm.kl_importance_correction=true",
    )
    s = Algorithm(a).settings
    assert (s.tis_cap, s.mis_low, s.mis_high, s.mis_level) == (2.0, 0.5, 3.0, "sequence")
    assert s.kl_importance_correction and s.mismatch.is_masking
