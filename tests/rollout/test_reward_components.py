"""`[[task.rewards]]` on a plain dataset: each weighted component logged per step and per sample;
a component that raises scores 0 and is counted, in evaluation too."""

from __future__ import annotations

import json

import pytest
import torch

from reinforge.config import ArithmeticTaskConfig
from reinforge.config.rewards import RewardWeight
from reinforge.engine.simple import SimpleEngine
from reinforge.envs.env_tasks import single_turn_tasks
from reinforge.errors import ExitCode
from reinforge.eval import evaluate
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.tasks.arithmetic import ArithmeticTasks
from tests.conftest import cli

REWARDS = """
def reflection(completion, task):
    return 1.0 if "wait" in completion.lower() else 0.25

def broken(completion, task):
    raise RuntimeError("this reward is broken")
"""


def test_a_dataset_with_three_weighted_components_logs_each(tmp_path):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(24)]
    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    rewards = (
        '[{name = "env", weight = 1.0}, {name = "format", weight = 0.5}, '
        f'{{name = "reflection", weight = 0.5, function = "{tmp_path / "my_rewards.py"}:reflection"}}]'
    )
    out = cli(
        "train",
        "model.path=builtin:micro",
        "task.name=dataset",
        f"task.path={data}",
        "task.reward=exact_match",
        f"task.rewards={rewards}",
        "task.eval_fraction=0.25",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "eval.num_tasks=4",
        "run.max_steps=2",
        "run.num_threads=1",
        f"run.output_dir={tmp_path}",
        "run.name=components",
        "log.tensorboard=false",
        "log.plot=false",
    )
    assert out.returncode == ExitCode.OK, out.stdout + out.stderr
    run = tmp_path / "components"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [m for m in metrics if "reward_mean" in m]
    assert len(steps) == 2
    for m in steps:  # every component, raw; the reward is their weighted sum
        assert 0.25 <= m["reward_reflection"] <= 1.0
        assert {"reward_env", "reward_format"} <= m.keys()
        weighted = m["reward_env"] + 0.5 * m["reward_format"] + 0.5 * m["reward_reflection"]
        assert m["reward_mean"] == pytest.approx(weighted)
    assert any("eval_reward_reflection" in m for m in metrics)
    samples = [json.loads(line) for line in (run / "samples.jsonl").open()]
    assert samples and set(samples[0]["rewards"]) == {"env", "format", "reflection"}


def test_a_raising_component_scores_zero_and_is_counted_in_evaluation(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    source = ArithmeticTasks(ArithmeticTaskConfig(max_digits=1, num_eval=4))
    specs = [
        RewardWeight(name="env"),
        RewardWeight(name="broken", weight=1.0, function=f"{tmp_path / 'my_rewards.py'}:broken"),
    ]
    tasks = single_turn_tasks(source, specs)
    tok = load_tokenizer(str(builtin_path("micro", 0)))
    torch.manual_seed(0)
    model = load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)
    result = evaluate(SimpleEngine(model, tok), tok, tasks, source.eval_tasks(), 4, 0)
    assert result.num_tasks == 4
    assert result.episode_metrics["reward_errors"] == 4.0  # one per sample, none fatal
    assert result.episode_metrics["reward_broken"] == 0.0
    assert all(row["rewards"]["broken"] == 0.0 for row in result.samples)
