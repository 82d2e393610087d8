import pytest

from reinforge.config import SFTConfig, TrainConfig, load_config
from reinforge.config_docs import render
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
