"""Exact tokens of agent requests, on the micro model tuned to answer the weather question with a
tool call (the server tests' session model): the records hold the ids the engine sampled, and a
tool call with its answer joins into one sequence built from those ids, never re-rendered."""

from __future__ import annotations

import pytest
import torch

from reinforge.engine.factory import build_engine
from reinforge.models.loading import load_model, load_tokenizer
from reinforge.rollout.agents import play_agents

from ..agents.helpers import agent_tasks, greedy, task
from .conftest import WEATHER_CALL, WEATHER_MESSAGES


@pytest.fixture(scope="module")
def tuned(tuned_dir):
    tokenizer = load_tokenizer(str(tuned_dir))
    model = load_model(str(tuned_dir), torch.device("cpu"), torch.float32)
    return build_engine(model, tokenizer, "paged"), tokenizer


def test_a_tool_call_and_its_answer_are_one_sequence_of_the_ids_the_engine_sampled(tuned):
    engine, tokenizer = tuned
    tasks = agent_tasks("weather_agent", components=("called",))
    [group] = play_agents(
        engine, tokenizer, tasks, [task(WEATHER_MESSAGES[0]["content"])], 2, greedy(tokenizer, 120)
    )
    assert len(group.trajectories) == 2  # one segment per episode: nothing re-rendered
    first, _ = group.trajectories
    assert first.rewards == {"env": 1.0, "called": 1.0}
    assert first.metrics["agent_requests"] == 2 and first.metrics["agent_history_breaks"] == 0
    # the first turn's ids are what the engine samples for the prompt alone, stop id included
    [[alone]] = engine.generate([first.prompt_ids], greedy(tokenizer, 120))
    assert tokenizer.decode(alone.token_ids, skip_special_tokens=True) == WEATHER_CALL
    ids, mask = first.completion.token_ids, first.completion.loss_mask
    n = len(alone.token_ids)
    assert ids[:n] == alone.token_ids and mask[:n] == [1] * n
    assert first.completion.logprobs[:n] == pytest.approx(alone.logprobs, abs=1e-4)
    # then the tool's answer, out of the loss, then the second turn as sampled from all of it
    tool_start = n
    tool_end = mask.index(1, tool_start)
    assert "sunny, 21 C" in tokenizer.decode(ids[tool_start:tool_end])
    [[second]] = engine.generate([first.prompt_ids + ids[:tool_end]], greedy(tokenizer, 8))
    assert ids[tool_end:] == second.token_ids and set(mask[tool_end:]) == {1}
