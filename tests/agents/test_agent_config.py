"""`[task] name = "agent"` mistakes fail before any model loads, naming the setting and a fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from reinforge.config import TrainConfig
from reinforge.envs.agent_task import load_agent
from reinforge.errors import ConfigError

FILES = "tests/agents/agent_files.py"


def config(**task) -> TrainConfig:
    return TrainConfig.model_validate(
        {"task": {"name": "agent", "path": "examples/agents/questions.jsonl", **task}}
    )


def test_an_agent_task_config_reads_and_refuses_what_does_not_apply():
    cfg = config(agent=f"{FILES}:nudging_agent", agent_args={"turns": 2})
    assert cfg.task.agent_timeout_s == 300 and cfg.rollout.max_concurrent_agents == 64
    with pytest.raises(ValidationError, match=r'names no function: write "path/to/agent\.py:run"'):
        config(agent="nudging_agent")
    with pytest.raises(ValidationError, match=r"task\.reward and task\.reward_by_source do not"):
        config(agent=f"{FILES}:nudging_agent", reward="math")
    with pytest.raises(ValidationError, match=r"task\.path is required"):
        TrainConfig.model_validate({"task": {"name": "agent", "agent": f"{FILES}:x"}})


def test_a_wrong_agent_function_is_named_with_the_fix():
    with pytest.raises(ConfigError, match='did you mean "nudging_agent"'):
        load_agent(f"{FILES}:nudging_agnt", {})
    with pytest.raises(ConfigError, match=r"cannot be called as run\(agent, \*\*task.agent_args"):
        load_agent(f"{FILES}:nudging_agent", {"turn": 2})
    assert load_agent(f"{FILES}:bad_agent", {"hang_s": 1.0}).__name__ == "bad_agent"
