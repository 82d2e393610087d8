"""An agent written only against the `openai` client trains through the command line: a
multi-turn, tool-offering agent on the micro model, two RL steps, its episodes one sequence each
(nothing re-rendered), every request counted."""

from __future__ import annotations

import json

from reinforge.errors import ExitCode

from ..conftest import cli


def test_a_multi_turn_tool_agent_trains_through_the_cli(tmp_path):
    out = cli(
        "train",
        "configs/agent_calculator.toml",
        f"run.output_dir={tmp_path}",
        "run.name=agent",
        "run.max_steps=2",
        "run.num_threads=1",
        "model.path=builtin:micro",
        "task.agent=tests/agents/agent_files.py:nudging_agent",
        "task.agent_args={turns=3}",
        "task.max_context=256",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8",
        "train.micro_batch_tokens=1024",
        "eval.before_train=false",
        "eval.num_tasks=2",
        "log.tensorboard=false",
        "log.plot=false",
    )
    assert out.returncode == ExitCode.OK, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "agent" / "metrics.jsonl").open()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # 4 episodes of 3 requests, each one sequence: every turn extends the last
        assert r["agent_requests"] == 12 and r["agent_segments"] == 4, r
        assert r["agent_history_breaks"] == 0 and r["agent_failed_raised"] == 0
        assert r["loss"] == r["loss"] and "grad_norm" in r  # a real update ran
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2] and evals[0]["eval_agent_requests"] == 6
