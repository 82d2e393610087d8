"""Agent rollouts in-process with the official `openai` client against the trainer's engine: a
rewritten history breaks the episode into segments (counted), streaming / logprobs / n / token-id
prompts work, and failing agents are counted by reason without stopping the rollout."""

from __future__ import annotations

import pytest
import torch

from reinforge.engine.base import SamplingParams
from reinforge.engine.factory import build_engine
from reinforge.engine.paged import PagedEngine
from reinforge.errors import RunFailure
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.models.tiny import builtin_path
from reinforge.rollout.agents import endpoint_for, play_agents
from reinforge.rollout.trajectories import episode_metrics

from .helpers import agent_tasks, greedy, task


@pytest.fixture(scope="module")
def micro():
    path = str(builtin_path("micro", 0))
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.device("cpu"), torch.float32)
    return build_engine(model, tokenizer, "paged"), tokenizer


def test_a_rewritten_history_breaks_the_episode_into_counted_segments(micro):
    engine, tokenizer = micro
    tasks = agent_tasks("rewriting_agent")
    params = SamplingParams(8, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,), seed=1)
    groups = play_agents(engine, tokenizer, tasks, [task("Hi there"), task("Hello", 1)], 2, params)
    metrics = episode_metrics(groups)
    # per episode: request 1; request 2 (rewritten: a break) with 2 choices; request 3 extends
    # choice 1 of request 2 -> segments [r1], [r2c1 + r3], [r2c2]
    assert [len(g.trajectories) for g in groups] == [6, 6]
    assert metrics["agent_history_breaks"] == 4 and metrics["agent_segments"] == 12
    assert metrics["agent_requests"] == 12
    for g in groups:
        for t in g.trajectories:
            assert t.reward == 0.5
            c = t.completion
            assert len(c.token_ids) == len(c.loss_mask) == len(c.logprobs) and 1 in c.loss_mask


def test_streaming_logprobs_and_token_prompts_are_recorded(micro):
    engine, tokenizer = micro
    tasks = agent_tasks("streaming_agent")
    [group] = play_agents(engine, tokenizer, tasks, [task("Hi")], 1, greedy(tokenizer, 6))
    # the streamed chat turn and the token-id completion: two requests, unrelated prompts
    assert [t.prompt_ids[:3] for t in group.trajectories][1] == [1, 2, 3]
    assert group.trajectories[0].metrics["agent_requests"] == 2


def test_failing_agents_are_counted_by_reason_and_the_rollout_goes_on(micro, capsys):
    engine, tokenizer = micro
    params = greedy(tokenizer, 2)
    hangs = {"hang_s": 3.0}
    tasks = agent_tasks("bad_agent", hangs, timeout_s=1.5, max_failed_share=0.9)
    [group] = play_agents(engine, tokenizer, tasks, [task("Hi")], 6, params)
    metrics = episode_metrics([group])
    for reason in ("raised", "timeout", "bad_return", "no_request"):
        assert metrics[f"agent_failed_{reason}"] == 1, (reason, metrics)
    assert [t.reward for t in group.trajectories] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    for t in group.trajectories[:4]:  # failed: out of the loss
        assert set(t.completion.loss_mask) == {0}
    err = capsys.readouterr().err
    assert "RuntimeError: the agent's own bug" in err and "not a number" in err
    # the same without the hang: dropped from the group, or too many for the run
    dropped = agent_tasks("bad_agent", max_failed_share=0.9, on_failure="drop")
    [group] = play_agents(engine, tokenizer, dropped, [task("Hi")], 6, params)
    assert [t.reward for t in group.trajectories] == [1.0, 1.0, 1.0]
    strict = agent_tasks("bad_agent", max_failed_share=0.4)
    with pytest.raises(RunFailure, match=r"3 of 6 agent calls failed .*max_failed_agent_share"):
        play_agents(engine, tokenizer, strict, [task("Hi")], 6, params)


def test_requests_join_an_open_engine_call_and_sample_as_a_closed_one(micro):
    """With a fixed KV pool the paged engine takes requests while others decode (one session
    for all the turns of all the agents); greedy, each turn is what a closed call samples."""
    _, tokenizer = micro
    fixed = PagedEngine(micro[0].model, tokenizer, num_blocks=256)
    tasks = agent_tasks("nudging_agent", {"turns": 3})
    prompts = [task("What is the weather?"), task("Hi", 1)]
    groups = play_agents(fixed, tokenizer, tasks, prompts, 2, greedy(tokenizer, 8))
    batcher = endpoint_for(fixed, tokenizer).batcher
    assert batcher.is_continuous and batcher.num_requests == 12
    assert batcher.num_calls < 12  # requests shared sessions
    for g in groups:
        assert len(g.trajectories) == 2  # one sequence per episode
        for t in g.trajectories:
            ids, mask = t.completion.token_ids, t.completion.loss_mask
            first = mask.index(0) if 0 in mask else len(mask)
            [[closed]] = fixed.generate([t.prompt_ids], greedy(tokenizer, 8))
            assert ids[:first] == closed.token_ids
