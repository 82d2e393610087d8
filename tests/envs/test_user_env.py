"""`[task] name = "env"`: a user's env file outside the package trains through the CLI; its
mistakes are config errors before any model loads; an env that raises fails its episode only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reinforge.config import TrainConfig, load_config
from reinforge.engine.simple import SimpleEngine
from reinforge.errors import ConfigError, ExitCode, RunFailure
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.rollout.sampling import sampling_params
from reinforge.rollout.trajectories import episode_metrics, play
from reinforge.tasks import build_task_source
from tests.conftest import cli

ENV_FILE = Path(__file__).parent / "user_envs" / "lookup_env.py"
ENV = [
    "task.name=env",
    f"task.env={ENV_FILE}:make_env",
    "task.max_turns=3",
    "task.max_context=240",
    "task.eval_fraction=0.2",
]


def _env_tasks(*overrides: str):
    return build_task_source(load_config(TrainConfig, None, [*ENV, *overrides]).task)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(builtin_path("micro", 0)))


@pytest.fixture(scope="module")
def engine(tok):
    torch.manual_seed(0)
    model = load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)
    return SimpleEngine(model, tok)


def test_a_user_env_file_trains_through_the_cli(tmp_path):
    out = cli(
        "train",
        *ENV,
        "model.path=builtin:micro",
        'task.rewards=[{name = "env"}, {name = "looked_up", weight = 0.5}]',
        "sft.steps=3",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=80",
        "eval.num_tasks=2",
        "run.max_steps=2",
        "run.num_threads=1",
        f"run.output_dir={tmp_path}",
        "run.name=user_env",
        "log.tensorboard=false",
        "log.plot=false",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "32 training tasks, 8 held-out; rewards: scored by the env" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "user_env" / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("phase", "rl") == "rl" and "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # each component, the env's own counters and the episode metrics, logged
        assert {"reward_env", "reward_looked_up", "lookups", "turns_per_episode"} <= r.keys()
    assert any("eval_reward_looked_up" in r for r in rows)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("tests/envs/user_envs/missing.py:make_env", "does not exist"),
        (f"{ENV_FILE}:make_envv", 'did you mean "make_env"'),
        (f"{ENV_FILE}:not_an_env", "has no reset() or step()"),
        (f"{ENV_FILE}:reset_returns_a_dict", "returned dict, not an EnvState"),
        ("no_such_installed_env", "neither a path nor an installed env"),
    ],
)
def test_env_mistakes_are_config_errors_naming_the_fix(env, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _env_tasks(f"task.env={env}")


def test_wrong_env_args_and_unknown_components_are_config_errors():
    with pytest.raises(ConfigError, match=r"could not be called with task\.env_args"):
        _env_tasks("task.env_args={colour = 'red'}")
    with pytest.raises(ConfigError, match="looked_upp"):
        _env_tasks('task.rewards=[{name = "looked_upp"}]')


def test_an_env_that_raises_fails_its_episode_not_the_step(tok, engine):
    tasks = _env_tasks("task.env_args={fail_on = 'key k3?'}")
    every = [*tasks.source.train, *tasks.source.eval]
    failing = next(t for t in every if t.info["key"] == "k3")
    batch = [failing, *[t for t in every if t.info["key"] in ("k4", "k5")]]
    params = sampling_params(tok, max_new_tokens=8, temperature=1.0, n=2, seed=1)
    groups = play(engine, tok, tasks, batch, 2, params)
    broken = [t for g in groups for t in g.trajectories if t.metrics.get("env_errors")]
    assert len(broken) == 2  # both samples of the failing task
    for t in broken:
        assert t.reward == 0.0 and not any(t.completion.loss_mask)
    assert episode_metrics(groups)["env_errors"] == 2.0
    with pytest.raises(RunFailure, match="failed all 2 episodes"):
        play(engine, tok, tasks, batch[:1], 2, params)


class RecordingEngine:
    """The real engine, with each generate call's prompt count and n written down."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n))
        return self.engine.generate(prompts, params)


def test_a_groups_first_turn_is_one_prompt_with_n_samples(tok, engine):
    tasks = _env_tasks()
    batch = [tasks.train_task(i) for i in range(3)]
    recording = RecordingEngine(engine)
    params = sampling_params(tok, max_new_tokens=40, temperature=1.0, n=4, seed=3)
    groups = play(recording, tok, tasks, batch, 4, params)
    assert recording.calls[0] == (3, 4)  # three prompts, four samples each: pages shared
    assert all(n == 1 for _, n in recording.calls[1:])  # later turns differ per episode
    assert [len(g.trajectories) for g in groups] == [4, 4, 4]


def test_the_worked_example_runs_as_its_config_says(tmp_path):
    """docs/environments.md's example (examples/html_extraction/env.py, public API only) through
    configs/env_html.toml, shrunk to the tiny model and a step: rows from its generator, SFT on its
    demonstrations, episodes calling its BeautifulSoup tool, its counters logged."""
    out = cli(
        "train",
        "configs/env_html.toml",
        "model.path=builtin:tiny",
        "sft.steps=2",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "eval.num_tasks=2",
        "eval.headroom_tasks=0",
        "run.max_steps=1",
        "run.num_threads=1",
        f"run.output_dir={tmp_path}",
        "run.name=example",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    assert "60 held-out" in out.stdout and "rewards: scored by the env" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "example" / "metrics.jsonl").open()]
    step = next(r for r in rows if r.get("step") == 1 and "reward_mean" in r)
    assert {
        "tool_call_rate",
        "malformed_calls",
        "tool_errors",
        "turns_per_episode",
        "reward_env",
    } <= step.keys()
