"""Env tasks through the real command line.

Quick runs on the micro model: a game run with an SFT stage on reference games, RL on multi-turn
episodes and held-out evaluation logs the episode metrics; a tool run whose model never calls a
tool says so in its summary.

The example configs as shipped (slow): `configs/tool_calc.toml` must raise the tool-call rate
and the reward, `configs/tictactoe.toml` the win rate and the reward, between the held-out
evaluations before and after RL. The figures and wall times are printed (pytest -s shows them).
"""

import json
import time

import pytest

from reinforge.errors import ExitCode

from .conftest import cli

MICRO = [
    "model.path=builtin:micro",
    "run.num_threads=1",
    "log.tensorboard=false",
    "log.plot=false",
    "train.micro_batch_tokens=1024",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "run.max_steps=2",
    "task.num_eval=4",
    "task.max_context=256",
]


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_game_run_logs_episode_metrics_after_sft_on_reference_games(tmp_path):
    out = cli(
        "train",
        *MICRO,
        f"run.output_dir={tmp_path}",
        "run.name=game",
        "task.name=game",
        "task.prompt_style=compact",
        'task.cases=[{game="tic_tac_toe",num_random_plies=2}]',  # short games: micro's context
        'task.rewards=[{name="env"},{name="legal_moves",weight=0.1}]',
        "sft.steps=2",
        "sft.batch_size=2",
        "rollout.max_new_tokens=3",
    )
    assert out.returncode == ExitCode.OK, out.stdout[-2000:] + out.stderr[-2000:]
    rows = rows_of(tmp_path / "game")
    assert [r["step"] for r in rows if r.get("phase") == "sft" and "loss" in r] == [1, 2]
    steps = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    for key in (
        "win_rate",
        "forfeit_rate",
        "turns_per_episode",
        "reward_env",
        "reward_legal_moves",
    ):
        assert all(key in r for r in steps), key
    for r in steps:
        assert r["reward_mean"] == pytest.approx(r["reward_env"] + 0.1 * r["reward_legal_moves"])
    evals = [r for r in rows if "eval_win_rate" in r]
    assert [r["step"] for r in evals if r["phase"] == "rl"] == [0, 2]
    samples = [
        json.loads(s) for s in (tmp_path / "game" / "samples.jsonl").read_text().split("\n") if s
    ]
    assert samples and "Moves:" in samples[0]["prompt"]


def test_a_tool_run_whose_model_never_calls_a_tool_says_so(tmp_path):
    out = cli(
        "train",
        *MICRO,
        f"run.output_dir={tmp_path}",
        "run.name=tools",
        "task.name=tool_arithmetic",
        "rollout.max_new_tokens=4",
        "eval.before_train=false",
    )
    assert out.returncode == ExitCode.OK, out.stdout[-2000:] + out.stderr[-2000:]
    assert "TOOLS WERE NEVER CALLED" in out.stdout
    steps = [r for r in rows_of(tmp_path / "tools") if "tool_call_rate" in r]
    assert len(steps) == 2 and all(r["tool_call_rate"] == 0.0 for r in steps)


def run_example(config: str, tmp_path) -> tuple[dict, dict, float]:
    """(held-out metrics before RL, after RL, wall seconds) of `reinforge train CONFIG`."""
    start = time.perf_counter()
    out = cli("train", config, f"run.output_dir={tmp_path}", "run.name=example", timeout=900)
    wall = time.perf_counter() - start
    assert out.returncode == ExitCode.OK, out.stdout[-3000:] + out.stderr[-3000:]
    evals = [
        r for r in rows_of(tmp_path / "example") if r.get("phase") == "rl" and "eval_reward" in r
    ]
    assert evals[0]["step"] == 0 and len(evals) >= 2
    return evals[0], evals[-1], wall


@pytest.mark.example
def test_tool_example_raises_tool_calls_and_reward(tmp_path):
    before, after, wall = run_example("configs/tool_calc.toml", tmp_path)
    keys = ("eval_tool_call_rate", "eval_reward", "eval_accuracy")
    print(
        f"tool_calc in {wall:.0f} s: "
        + ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in keys)
    )
    assert after["eval_tool_call_rate"] >= before["eval_tool_call_rate"] + 0.15
    assert after["eval_reward"] >= before["eval_reward"] + 0.1


@pytest.mark.example
def test_tictactoe_example_raises_win_rate_and_reward(tmp_path):
    before, after, wall = run_example("configs/tictactoe.toml", tmp_path)
    keys = ("eval_win_rate", "eval_forfeit_rate", "eval_reward")
    print(
        f"tictactoe in {wall:.0f} s: "
        + ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in keys)
    )
    assert after["eval_win_rate"] >= before["eval_win_rate"] + 0.1
    assert after["eval_reward"] >= before["eval_reward"] + 0.1
