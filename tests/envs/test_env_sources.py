"""Env tasks from `[task]`: every variant builds through one table, mistakes name the fix, and an
episode's reward is the weighted sum of its named components."""

import typing

import pytest

from reinforge.config import TaskConfig, TrainConfig, load_config
from reinforge.config.envs import ENV_TASK_CONFIGS
from reinforge.envs.env_tasks import EnvTasks, EpisodeScorer
from reinforge.envs.sources import ENV_TASKS
from reinforge.errors import ConfigError
from reinforge.tasks import build_task_source
from reinforge.types import Message, Task

TASK = Task("t", (Message("user", "q"),), answer="42")


def test_every_env_variant_of_task_has_one_builder():
    names = {c.model_fields["name"].default for c in ENV_TASK_CONFIGS}
    assert names == set(ENV_TASKS)
    union_names = {
        v.model_fields["name"].default for v in typing.get_args(typing.get_args(TaskConfig)[0])
    }
    assert names <= union_names


# "env", "tools", "agent" and "verifiers" have no defaults to build: they name the user's factory,
# agent, environment or data (tests/envs/test_user_env.py, test_tools_task.py, tests/agents/,
# tests/test_verifiers.py)
@pytest.mark.parametrize("name", sorted(set(ENV_TASKS) - {"env", "tools", "agent", "verifiers"}))
def test_each_env_task_builds_with_its_defaults_and_plays_one_step(name):
    cfg = load_config(TrainConfig, None, [f"task.name={name}"])
    tasks = build_task_source(cfg.task)
    assert isinstance(tasks, EnvTasks) and len(tasks.eval_tasks()) == cfg.task.num_eval
    state = tasks.env.reset(tasks.train_task(0))
    result = tasks.env.step(state, Message("assistant", "I do not know."))
    assert result.done or result.messages  # an answer, or a reply (a game asks again)
    assert tasks.uses_tools == (name != "game")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["task.name=game", "task.num_eval=9", 'task.cases=[{game="tic_tac_toe"},{}]'],
            "multiple of the 2 cases (held-out games are split evenly); e.g. num_eval = 8",
        ),
        (["task.name=search", "task.num_eval=10"], "multiple of 3"),
        (
            ["task.name=tool_arithmetic", "task.min_digits=3", "task.max_digits=2"],
            "max_digits >= 3",
        ),
        (["task.name=game", "task.reward_mode=win"], "reward_mode"),
        (["task.name=game", "task.max_turn=3"], "did you mean 'max_turns'"),
        (["task.name=arithmetic", "task.max_turns=3"], "belongs in [task] with name = "),
        (["task.name=tool_arithmetic", 'task.sandbox={backend="docker"}'], "sandbox.backend"),
        (
            ["task.name=game", "algorithm.name=dapo", "algorithm.overlong_buffer=2"],
            "runs multi-turn episodes",
        ),
    ],
)
def test_config_mistakes_name_the_setting_and_a_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, overrides)
    assert message in str(e.value)


def test_an_unknown_opponent_or_game_is_refused_when_the_source_is_built():
    cfg = load_config(TrainConfig, None, ["task.name=game", 'task.cases=[{game="chess"}]'])
    with pytest.raises(ConfigError, match="game 'chess' is unknown"):
        build_task_source(cfg.task)


def brevity(completion: str, task: Task) -> float:
    return 1.0 / (1 + len(completion))


def test_scorer_sums_weighted_env_and_text_components():
    specs = [
        {"name": "env", "weight": 1.0},
        {"name": "legal_moves", "weight": 0.1},
        {"name": "format", "weight": 0.5},
        {"name": f"{__name__}:brevity", "weight": 2.0},
    ]
    scorer = EpisodeScorer(_specs(specs), ("outcome", "legal_moves"))
    text = "<think>a</think><answer>b</answer>"
    total, parts = scorer.score({"reward": 1.0, "legal_moves": 3.0}, text, TASK)
    assert parts == {
        "env": 1.0,
        "legal_moves": 3.0,
        "format": 1.0,
        f"{__name__}:brevity": pytest.approx(1 / 35),
    }
    assert total == pytest.approx(1.0 + 0.3 + 0.5 + 2 / 35)


def test_scorer_gives_zero_for_an_episode_the_env_never_judged():
    scorer = EpisodeScorer(_specs([{"name": "env"}]), ())
    assert scorer.score({}, "cut off by the context limit", TASK) == (0.0, {"env": 0.0})


def test_scorer_refuses_unknown_components_naming_the_known_ones():
    with pytest.raises(ConfigError, match="legal_moves") as e:
        EpisodeScorer(_specs([{"name": "env"}, {"name": "legal_move"}]), ("outcome", "legal_moves"))
    assert "did you mean" in str(e.value)
    with pytest.raises(ConfigError, match="is empty"):
        EpisodeScorer([], ())


def _specs(dicts):
    from reinforge.config.rewards import RewardWeight

    return [RewardWeight(**d) for d in dicts]
