"""`[task] name = "dataset"` as the config reads it: mistakes named with their fix, and what each
command needs of a row (an answer for RL and eval, a solution for SFT) decided by the command."""

import pytest

from reinforge.config import EvalConfig, SFTConfig, TrainConfig, load_config
from reinforge.errors import ConfigError
from reinforge.tasks import task_source_for

from .conftest import write_csv, write_jsonl


def dataset(*settings: str) -> list[str]:
    return ["task.name=dataset", *settings]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dataset(), 'task.path is required with task.name = "dataset"'),
        (
            dataset("task.path=a.jsonl", "task.eval_path=b.jsonl", "task.eval_fraction=0.1"),
            "task.eval_path and task.eval_fraction both choose the evaluation tasks",
        ),
        (dataset("task.path=a.jsonl", "task.columns.anwser=x"), "did you mean 'answer'?"),
        (dataset("task.path=a.jsonl", "task.on_bad_row=ignore"), "task.on_bad_row"),
        (["task.path=a.jsonl"], "'path' belongs in [model] or [task] with name = 'dataset'"),
    ],
)
def test_config_mistakes_name_the_setting(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, None, overrides)
    assert message in str(err.value)


def test_the_command_decides_whether_rows_need_answers_and_solutions(tmp_path):
    chats = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"prompt": "hi", "completion": "hello"}, {"prompt": "bye", "completion": "see you"}],
    )
    settings = dataset(f"task.path={chats}")
    sft = task_source_for(load_config(SFTConfig, None, settings))
    assert len(sft.train) == 2 and not sft.can_score  # SFT: no answers needed, none to score
    with pytest.raises(ConfigError, match=r"no answer column .* task.require_answer = false"):
        task_source_for(load_config(TrainConfig, None, settings))

    quiz = write_csv(tmp_path / "quiz.csv", ["question", "answer"], [["1+1", "2"]])
    rl_only = dataset(f"task.path={quiz}", "task.reward=exact_match")
    assert task_source_for(load_config(EvalConfig, None, rl_only)).can_score
    with pytest.raises(ConfigError, match=r"no solution column .* task.columns.solution"):
        task_source_for(load_config(TrainConfig, None, [*rl_only, "sft.steps=2"]))


def test_several_files_train_together_with_their_own_data_sources(tmp_path):
    a = write_csv(tmp_path / "algebra.csv", ["question", "answer"], [["x+1=2", "1"], ["2x=4", "2"]])
    b = write_jsonl(
        tmp_path / "trivia.jsonl", [{"prompt": "Capital of France?", "answer": "Paris"}]
    )
    cfg = load_config(
        TrainConfig,
        None,
        dataset(
            f'task.path=["{a}", "{b}"]',
            'task.reward_by_source={"algebra" = "math", "trivia" = "exact_match"}',
        ),
    )
    tasks = task_source_for(cfg)
    assert [t.info["data_source"] for t in tasks.train] == ["algebra", "algebra", "trivia"]
    assert len({t.id for t in tasks.train}) == 3  # ids stay unique across files
    assert tasks.rewards.names == {"algebra": "math", "trivia": "exact_match"}
    assert tasks.reward("Paris", tasks.train[2]) == 1.0
