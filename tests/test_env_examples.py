"""Env tasks through the real command line.

Quick runs on the micro model: a game run with an SFT stage on reference games, RL on multi-turn
episodes and held-out evaluation logs the episode metrics; a tool run whose model never calls a
tool says so in its summary.

The example configs (slow): `configs/tool_calc.toml` as shipped must raise the held-out
tool-call rate and reward; `configs/tictactoe.toml`, shortened, must teach readable moves and log
the game metrics; as shipped, on a GPU (marker `gpu`, about 2 minutes on an H100), raise the
held-out win rate; with its CPU-sized RL steps (12 minutes: marker `example`, out of the default
run, `pytest -m example`) keep the model playing. The figures and wall times are printed (pytest
-s shows them).
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


def run_example(config: str, tmp_path, *overrides: str) -> tuple[list[dict], list[dict], float]:
    """(RL step rows, held-out evaluation rows, wall seconds) of `reinforge train CONFIG`."""
    start = time.perf_counter()
    out = cli(
        "train",
        config,
        f"run.output_dir={tmp_path}",
        "run.name=ex",
        *overrides,
        timeout=900,
        fresh=True,
    )
    wall = time.perf_counter() - start
    assert out.returncode == ExitCode.OK, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [r for r in rows_of(tmp_path / "ex") if r.get("phase") == "rl"]
    return [r for r in rows if "reward_mean" in r], [r for r in rows if "eval_reward" in r], wall


# The shipped examples, run as a user runs them (`reinforge train CONFIG`), with held-out
# evaluation before and after RL.


@pytest.mark.slow
def test_tool_example_raises_the_tool_call_rate_and_the_reward(tmp_path):
    """configs/tool_calc.toml: SFT teaches the calculator call but the greedy policy answers at
    once (reward 0.5: a guess); RL on the env's exact-match reward makes it call the tool.
    Measured (2-core CPU, about 3 minutes; seeds 0, 1 and 2 alike): held-out tool-call rate
    0.0 -> 1.0, reward 0.5 -> 1.0."""
    steps, evals, wall = run_example("configs/tool_calc.toml", tmp_path)
    before, after = evals[0], evals[-1]
    keys = ("eval_tool_call_rate", "eval_reward", "eval_malformed_calls")
    print(
        f"tool_calc in {wall:.0f} s: " + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in keys)
    )
    assert [r["step"] for r in evals] == [0, len(steps)]
    assert after["eval_tool_call_rate"] >= before["eval_tool_call_rate"] + 0.5
    assert after["eval_reward"] >= before["eval_reward"] + 0.25
    assert after["eval_malformed_calls"] == 0 and after["eval_token_mismatches"] == 0
    assert steps[-1]["tool_call_rate"] > steps[0]["tool_call_rate"]  # sampled, in training


@pytest.mark.slow
def test_tictactoe_example_teaches_readable_moves(tmp_path):
    """configs/tictactoe.toml with a third of its SFT, two RL steps of 8 positions and 64
    held-out games: the reference games teach the move format (one cell number) and some play;
    every step logs the game metrics and the weighted reward mix. The whole config's rise is the
    GPU test below."""
    steps, evals, wall = run_example(
        "configs/tictactoe.toml",
        tmp_path,
        "run.max_steps=2",
        "sft.steps=100",
        "rollout.prompts_per_step=8",
        "task.num_eval=64",
    )
    print(f"tictactoe (SFT 100, 2 RL steps) in {wall:.0f} s: {steps} {evals}")
    before = evals[0]
    assert before["eval_malformed_moves"] <= 2  # every move readable: one cell number
    assert before["eval_forfeit_rate"] < 0.8 and before["eval_win_rate"] > 0.05
    for key in ("win_rate", "forfeit_rate", "illegal_moves", "turns_per_episode"):
        assert all(key in r for r in steps), key
    assert all(
        r["reward_mean"] == pytest.approx(r["reward_env"] + 0.2 * r["reward_legal_moves"])
        for r in steps
    )


@pytest.mark.gpu
def test_tictactoe_example_raises_the_win_rate_on_a_gpu(tmp_path):
    """configs/tictactoe.toml as shipped, on CUDA: 24 GRPO steps of 64 positions x 8 games raise
    the held-out win rate (256 games at temperature 1). Measured on an H100 (runs there are not
    bit-reproducible): +0.07 to +0.17 over seeds 0-5, forfeits down in each; the bar is below
    the lowest, above the evaluation's noise (about 0.03 for 256 games)."""
    steps, evals, wall = run_example("configs/tictactoe.toml", tmp_path, "run.device=cuda")
    before, after = evals[0], evals[-1]
    keys = ("eval_win_rate", "eval_forfeit_rate", "eval_reward")
    print(
        f"tictactoe on CUDA in {wall:.0f} s: "
        + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in keys)
    )
    assert [r["step"] for r in evals] == [0, len(steps)] and len(steps) == 24
    assert after["eval_win_rate"] >= before["eval_win_rate"] + 0.04
    assert after["eval_reward"] > before["eval_reward"]
    assert after["eval_forfeit_rate"] <= before["eval_forfeit_rate"] + 0.02


@pytest.mark.example
def test_tictactoe_example_keeps_playing_through_rl(tmp_path):
    """configs/tictactoe.toml with CPU-sized RL steps (8 positions x 8 games, lr 3e-4; about 12
    minutes on 2 cores, so out of the default run: `pytest -m example`). These do not reliably
    raise the win rate (measured over 10 runs: -0.06 to +0.08, forfeits after RL at most 0.59,
    wins at least 0.26; see the config), so this checks what holds: RL does not collapse the
    player, as optim.lr 1e-3 / 2e-3 at this batch did on seed 0 (wins 0.05 / 0.02, forfeits
    0.82 / 0.91)."""
    steps, evals, wall = run_example(
        "configs/tictactoe.toml", tmp_path, "rollout.prompts_per_step=8", "optim.lr=3e-4"
    )
    before, after = evals[0], evals[-1]
    keys = ("eval_win_rate", "eval_forfeit_rate", "eval_reward")
    print(
        f"tictactoe in {wall:.0f} s: " + ", ".join(f"{k} {before[k]} -> {after[k]}" for k in keys)
    )
    assert [r["step"] for r in evals] == [0, len(steps)]
    assert before["eval_win_rate"] > 0.15  # SFT taught part of the play
    assert after["eval_forfeit_rate"] <= 0.7
    assert after["eval_win_rate"] >= max(0.15, before["eval_win_rate"] - 0.15)
