"""Rewards for loaded rows: per data_source (verl's names, overrides, ability), one for all, or a
user's function; unknown sources and learned reward models fail at load time."""

from __future__ import annotations

import pytest

from reinforge.data import DatasetSpec, load_dataset_tasks
from reinforge.data.rewards import exact_match_reward
from reinforge.errors import ConfigError
from reinforge.rewards import math_reward

from .conftest import write_jsonl


def rows(*sources_and_abilities):
    return [
        {"prompt": f"q{i}", "answer": "1", "data_source": source, "ability": ability}
        for i, (source, ability) in enumerate(sources_and_abilities)
    ]


def test_auto_picks_by_source_name_prefix_ability_and_override(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        rows(
            ("openai/gsm8k", "math"),
            ("aime_2024", "math"),
            ("my_algebra", "math"),
            ("my_quiz", "trivia"),
        ),
    )
    tasks = load_dataset_tasks(
        DatasetSpec(path=str(path), reward_by_source={"my_quiz": "exact_match"})
    )
    assert tasks.rewards.by_source == {
        "openai/gsm8k": math_reward,
        "aime_2024": math_reward,
        "my_algebra": math_reward,
        "my_quiz": exact_match_reward,
    }
    quiz = next(t for t in tasks.train if t.info["data_source"] == "my_quiz")
    assert tasks.reward(" 1 ", quiz) == 1.0


def test_unknown_sources_fail_at_load_with_the_settings_to_use(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(("my_quiz", "trivia")))
    with pytest.raises(ConfigError, match=r"my_quiz.*reward_by_source"):
        load_dataset_tasks(DatasetSpec(path=str(path)))


def test_learned_reward_model_rows_are_refused_unless_mapped(tmp_path):
    row = {
        "prompt": [{"role": "user", "content": "Write a poem."}],
        "data_source": "openai/gsm8k",
        "reward_model": {"style": "model", "ground_truth": "n/a"},
    }
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(ConfigError, match="learned reward model"):
        load_dataset_tasks(DatasetSpec(path=str(path)))
    mapped = DatasetSpec(path=str(path), reward_by_source={"openai/gsm8k": "format"})
    assert load_dataset_tasks(mapped).rewards.names == {"openai/gsm8k": "format"}


def test_a_users_reward_function_scores_every_row(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def length(completion, task):\n    return float(len(completion) == len(task.answer))\n"
    )
    path = write_jsonl(tmp_path / "d.jsonl", rows(("a", None), ("b", None)))
    tasks = load_dataset_tasks(
        DatasetSpec(path=str(path), reward="my_reward.py:length", base_dir=str(tmp_path))
    )
    assert [tasks.reward("x", t) for t in tasks.train] == [1.0, 1.0]
    with pytest.raises(ConfigError, match="is not a reward"):
        load_dataset_tasks(DatasetSpec(path=str(path), reward="exact"))


def test_exact_match_ignores_only_whitespace():
    from reinforge.types import Task

    task = Task(id="t", messages=(), answer="New  York")
    assert exact_match_reward("\nNew York ", task) == 1.0
    assert exact_match_reward("new york", task) == 0.0
