"""`[task] name = "verifiers"`: environments written with verifiers' own classes (a SingleTurnEnv
with a rubric, a MultiTurnEnv game, a ToolEnv) played through reinforge's Env protocol and scored
by their rubrics, and one trained through the CLI. Skipped when the `verifiers` extra is missing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verifiers", reason="verifiers (the `verifiers` extra) not installed")

from reinforge.config.envs import VerifiersTaskConfig
from reinforge.envs.base import EnvState
from reinforge.envs.sources import ENV_TASKS
from reinforge.errors import ConfigError
from reinforge.types import Message

from .conftest import TINY_RUN, cli

HERE = "tests/envs/user_envs/verifiers_envs.py"


def build(function: str, **kw):
    cfg = VerifiersTaskConfig(env=f"{HERE}:{function}", **kw)
    return ENV_TASKS["verifiers"](cfg)


def play(env_tasks, task, replies: list[str]) -> tuple[EnvState, object]:
    state = env_tasks.env.reset(task)
    for i, reply in enumerate(replies):
        result = env_tasks.env.step(state, Message("assistant", reply))
        if result.done:
            assert i == len(replies) - 1, f"ended after {i + 1} of {len(replies)} replies"
            return state, result
        state.messages += result.messages
    raise AssertionError("the episode did not end")


def test_single_turn_rows_held_out_and_rubric_score():
    tasks = build("load_sums", num_eval=10, seed=1)
    eval_ids = {t.messages[-1].content for t in tasks.eval_tasks()}
    train = [tasks.train_task(i) for i in range(30)]  # one epoch
    assert len(eval_ids) == 10 and not eval_ids & {t.messages[-1].content for t in train}
    task = train[0]
    assert task.messages[-1].role == "user" and task.messages[-1].content.endswith("=")
    _, right = play(tasks, task, [task.answer])
    _, wrong = play(tasks, task, ["x"])
    assert right.rewards["reward"] == 1.0 and right.rewards["exact"] == 1.0
    assert wrong.rewards["reward"] == 0.0
    assert tasks.max_turns == 1 and "exact" in tasks.env.reward_components


def test_multi_turn_game_replies_until_found_or_out_of_turns():
    tasks = build("load_guess", num_eval=5)
    task = next(t for t in (tasks.train_task(i) for i in range(25)) if t.answer == "6")
    state, result = play(tasks, task, ["3", "8", "6"])
    assert [m.content for m in state.messages if m.role == "user"][-2:] == ["higher", "lower"]
    assert result.rewards["reward"] == 1.0
    assert state.info["vf"]["guesses"] == 3 and result.rewards["num_turns"] == 3
    _, lost = play(tasks, task, ["1", "2", "3", "4"])  # max_turns = 4, never found
    assert lost.rewards["reward"] == 0.0


def test_tool_env_gets_the_model_tool_calls():
    tasks = build("load_tool_env", num_eval=2)
    assert tasks.tool_schemas[0]["function"]["name"] == "add"
    task = tasks.train_task(0)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    state, result = play(tasks, task, [call, "5"])
    assert [m.role for m in state.messages[-3:]] == ["assistant", "tool", "assistant"]
    tool_reply = state.messages[-2]
    assert tool_reply.content == "5" and tool_reply.tool_call_id.startswith("call_")
    assert result.rewards["reward"] == 1.0


def test_mistakes_are_config_errors():
    with pytest.raises(ConfigError, match="has no 'load_sumz'"):
        build("load_sumz")
    with pytest.raises(ConfigError, match="all held out"):
        build("load_sums", num_eval=100)
    with pytest.raises(ConfigError, match="vf-no-such-env"):
        ENV_TASKS["verifiers"](VerifiersTaskConfig(env="vf-no-such-env"))


def test_trains_through_the_cli(tmp_path):
    overrides = [o for o in TINY_RUN if not o.startswith("task.")]
    cfg = tmp_path / "vf.toml"
    cfg.write_text(
        f'[task]\nname = "verifiers"\nenv = "{HERE}:load_guess"\nnum_eval = 4\nmax_context = 200\n'
        'rewards = [{name = "env"}, {name = "num_turns", weight = 0.0}]\n'
    )
    result = cli(
        "train",
        str(cfg),
        *overrides,
        f"run.output_dir={tmp_path}",
        "run.name=vf",
        "run.max_steps=2",
        "sft.steps=0",
        "eval.every=2",
        "checkpoint.every=0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "vf" / "metrics.jsonl").open()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2  # the rubric's functions are components, logged each step
    assert all(1 <= r["reward_num_turns"] <= 4 and "reward_env" in r for r in steps), steps[-1]


def test_the_libraries_own_reasoning_gym_env():
    """verifiers ships ReasoningGymEnv (a SingleTurnEnv whose rubric calls reasoning-gym's
    score_answer on the <answer> field): played and scored through reinforge unchanged."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym (the `reasoning` extra) missing")
    args = {"gym": "chain_sum", "num_train_examples": 12, "num_eval_examples": 4}
    tasks = ENV_TASKS["verifiers"](
        VerifiersTaskConfig(env="verifiers:ReasoningGymEnv", env_args=args)
    )
    assert len(tasks.eval_tasks()) == 4
    task = tasks.train_task(0)
    assert task.messages[0].role == "system" and "<answer>" in task.messages[0].content
    rg_index = int(task.info["vf_input"]["answer"])  # the env keeps the item's index as answer
    gold = tasks.env.vf_env.rg_dataset[rg_index]["answer"]
    _, right = play(tasks, task, [f"<answer>{gold}</answer>"])
    _, wrong = play(tasks, task, ["<answer>no</answer>"])
    assert right.rewards["reward"] == 1.0 and wrong.rewards["reward"] == 0.0
