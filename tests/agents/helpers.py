"""Agent tasks built directly (no config), over the test agents in `agent_files.py`."""

from __future__ import annotations

from reinforge.engine.base import SamplingParams
from reinforge.envs.agent_task import AgentEnv, AgentTasks, load_agent
from reinforge.envs.env_tasks import EpisodeScorer
from reinforge.rewards.mix import RewardSpec
from reinforge.types import Message, Task

FILES = "tests/agents/agent_files.py"


def agent_tasks(name: str, agent_args=None, components=(), **settings) -> AgentTasks:
    specs = [RewardSpec("env")] + [RewardSpec(c, 0.0) for c in components]
    return AgentTasks(
        "agent",
        None,
        AgentEnv(),
        EpisodeScorer(specs, tuple(components)),
        (),
        max_turns=8,
        max_context=512,
        agent=load_agent(f"{FILES}:{name}", agent_args or {}),
        agent_args=agent_args or {},
        agent_ref=name,
        **settings,
    )


def task(content: str, i: int = 0) -> Task:
    return Task(f"t{i}", (Message("user", content),), answer="")


def greedy(tokenizer, max_new_tokens: int = 8) -> SamplingParams:
    eos = (tokenizer.eos_token_id,)
    return SamplingParams(max_new_tokens, temperature=0.0, stop_token_ids=eos, seed=3)
