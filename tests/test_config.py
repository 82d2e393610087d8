import pytest

from reinforge.config import SFTConfig, TrainConfig, load_config
from reinforge.config.docs import render
from reinforge.errors import ConfigError

from .conftest import REPO


def error_of(*overrides: str, root=TrainConfig, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(root, path, list(overrides))
    return str(info.value)


def test_defaults_load_and_overrides_apply():
    cfg = load_config(
        TrainConfig,
        None,
        ["rollout.temperature=0.7", "run.name=abc", 'rollout.stop_strings=["\\n"]'],
    )
    assert (
        cfg.rollout.temperature == 0.7
        and cfg.run.name == "abc"
        and cfg.rollout.stop_strings == ["\n"]
    )


def test_misplaced_key_names_its_section():
    msg = error_of("rollout.warmup_steps=3")
    assert (
        "[rollout] has no setting 'warmup_steps'" in msg
        and "[optim]" in msg
        and "move it there" in msg
    )


def test_top_level_key_names_its_section():
    msg = error_of("max_new_tokens=3")
    assert "belongs in [rollout]" in msg


def test_typo_suggests_closest_key():
    msg = error_of("rollout.max_tokens=3")
    assert "did you mean 'max_new_tokens'" in msg


def test_unknown_section_suggests_closest():
    assert "did you mean [rollout]" in error_of("rollouts.temperature=1")


def test_bad_value_names_setting_and_a_working_value():
    msg = error_of("rollout.temperature=-1")
    assert "rollout.temperature" in msg and "got -1" in msg and "rollout.temperature = 1.0" in msg


def test_a_seed_past_64_bit_seeds_is_a_config_error():
    msg = error_of(f"run.seed={2**70}")
    assert "run.seed" in msg and "less than or equal to 4294967295" in msg and f"got {2**70}" in msg
    assert load_config(TrainConfig, None, [f"run.seed={2**32 - 1}"]).run.seed == 2**32 - 1


def test_task_union_variant_keys():
    cfg = load_config(TrainConfig, None, ['task.name="countdown"', "task.num_numbers=4"])
    assert cfg.task.name == "countdown" and cfg.task.num_numbers == 4
    msg = error_of("task.num_numbers=4")  # an arithmetic task has no num_numbers
    assert "with name = 'countdown'" in msg
    assert "did you mean 'countdown'" in error_of('task.name="countdwn"')


def test_cross_field_rule():
    assert "set max_digits >= 3" in error_of("task.min_digits=3")


def test_sft_root_refuses_rl_sections():
    assert "unknown section [rollout]" in error_of(
        root=SFTConfig, path=REPO / "configs" / "quickstart.toml"
    )


def test_config_file_errors(tmp_path):
    assert "does not exist" in error_of(path=tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=1")
    assert "not valid TOML" in error_of(path=bad)


def test_every_field_documented_and_reference_up_to_date():
    text = render()  # asserts every field has a docstring
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == text, (
        "docs/config.md is stale: run `reinforge config-docs -o docs/config.md`"
    )


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    load_config(TrainConfig, path)


# ----------------------------------------------------------------------------- [algorithm]


def test_algorithm_preset_resolves_to_concrete_values():
    a = load_config(TrainConfig, None, ["algorithm.name=dapo", "rollout.max_new_tokens=8192"])
    a = a.algorithm
    assert (a.clip_low, a.clip_high, a.loss_aggregation) == (0.2, 0.28, "token_mean")
    assert a.dynamic_sampling and a.overlong_buffer == 4096
    assert a.kl_coef == 0.0 and a.dual_clip_c == 0.0 and not a.uses_reference
    grpo = load_config(TrainConfig, None, []).algorithm
    assert (grpo.name, grpo.kl_coef, grpo.loss_aggregation) == ("grpo", 0.04, "seq_mean_token_mean")
    assert grpo.uses_reference and not grpo.uses_value_model
    ppo = load_config(TrainConfig, None, ["algorithm.name=ppo"]).algorithm
    assert ppo.uses_value_model and (ppo.gamma, ppo.lam, ppo.value_clip) == (1.0, 0.95, 0.2)


def test_algorithm_field_override_keeps_the_rest_of_the_preset():
    a = load_config(
        TrainConfig,
        None,
        ["algorithm.name=gspo", "algorithm.clip_high=1e-3", "algorithm.kl_coef=0.1"],
    ).algorithm
    assert (a.loss, a.clip_low, a.clip_high) == ("gspo", 3e-4, 1e-3)
    assert a.kl_coef == 0.1 and a.kl_placement == "loss"  # a KL switched on goes into the loss
    origins = a.origins()
    assert origins["clip_low"] == "preset gspo"
    assert origins["clip_high"] == "set (preset gspo: 0.0004)"


def test_algorithm_mistakes_name_the_fix():
    assert "set algorithm.overlong_buffer = 3" in error_of("algorithm.name=dapo")
    assert "use e.g. dual_clip_c = 3.0" in error_of("algorithm.dual_clip_c=0.5")
    assert "advantage = 'gae'" in error_of("algorithm.kl_placement=reward_token")
    assert "'ppo'" in error_of("algorithm.name=trpo")


def test_dry_run_shows_the_resolved_algorithm_and_where_each_value_came_from(tmp_path):
    from reinforge.errors import ExitCode

    from .conftest import TINY_RUN, cli

    out = cli(
        "train",
        *TINY_RUN,
        "--dry-run",
        f"run.output_dir={tmp_path}",
        "algorithm.name=dapo",
        "algorithm.overlong_buffer=2",
        "algorithm.clip_high=0.3",
    )
    assert out.returncode == ExitCode.OK, out.stderr
    assert 'name = "dapo"' in out.stdout
    assert "clip_low = 0.2  # preset dapo" in out.stdout
    assert "clip_high = 0.3  # set (preset dapo: 0.28)" in out.stdout
    assert "overlong_buffer = 2  # set (preset dapo: 4096)" in out.stdout
    assert "dynamic_sampling = true  # preset dapo" in out.stdout


def test_a_run_saved_by_an_earlier_version_loads_with_what_it_trained_with(tmp_path):
    """Configs saved before [algorithm] became a union hold every algorithm's settings (and
    normalize_std); resume and eval read them, a hand-written config with them is refused."""
    from reinforge.config.load import read_saved_config

    saved = tmp_path / "config.toml"
    saved.write_text(
        '[algorithm]\nname = "grpo"\nnormalize_std = false\ngamma = 1.0\nlam = 0.95\n'
        "value_clip = 0.2\nkl_coef = 0.0\n\n[rollout]\nprompts_per_step = 8\n"
    )
    cfg = load_config(TrainConfig, None, base=read_saved_config(saved))
    assert cfg.algorithm.name == "grpo" and cfg.algorithm.scale_rewards == "none"
    assert cfg.rollout.prompts_per_step == 8
    with pytest.raises(ConfigError, match="normalize_std"):
        load_config(TrainConfig, saved)
