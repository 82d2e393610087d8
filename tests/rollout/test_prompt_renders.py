"""A task's samples render their prompt once (`episodes._open`'s cache): the chat template and
the tokenizer cost 0.8 ms an episode on a 2-core CPU, eight times per G1 prompt before."""

from __future__ import annotations

import itertools

import torch
from transformers import AutoTokenizer

from reinforge.engine.base import SamplingParams
from reinforge.engine.simple import SimpleEngine
from reinforge.envs.base import EnvState, SingleTurnEnv
from reinforge.models.loading import load_model
from reinforge.models.tiny import builtin_path
from reinforge.rollout.episodes import EpisodeLimits, render, run_episodes
from reinforge.types import Message, Task


class CountingTokenizer:
    """The real tokenizer, counting chat-template renders."""

    def __init__(self, tokenizer):
        self._tokenizer, self.renders = tokenizer, 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class NumberedEnv(SingleTurnEnv):
    """Each reset adds a system message of its own: no two samples share a prompt."""

    def __init__(self):
        super().__init__(reward_fn=lambda completion, task: 0.0)
        self.counter = itertools.count()

    def reset(self, task: Task) -> EnvState:
        messages = [Message("system", f"episode {next(self.counter)}"), *task.messages]
        return EnvState(task=task, messages=messages)


def episodes(env, tokenizer, samples: int):
    model = load_model(str(builtin_path("micro", 0)), torch.device("cpu"), torch.float32)
    tasks = [Task(f"t{i}", (Message("user", f"question {i}"),), answer="1") for i in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True)
    limits = EpisodeLimits(max_turns=1, max_tokens_per_turn=3, max_context=512)
    return run_episodes(
        SimpleEngine(model, tokenizer), tokenizer, env, tasks, samples, params, limits
    )


def test_samples_of_a_task_render_its_prompt_once_each_with_its_own_ids():
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(builtin_path("micro", 0)))
    groups = episodes(SingleTurnEnv(reward_fn=lambda completion, task: 0.0), tokenizer, 4)
    assert tokenizer.renders == 3  # one per task, not 12
    for group in groups:
        expected = render(tokenizer._tokenizer, group[0].messages[:1], None, True)
        assert all(e.prompt_ids == expected for e in group)
        assert len({id(e.prompt_ids) for e in group}) == len(group)  # not one shared list


def test_samples_whose_prompts_differ_render_each_their_own():
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(builtin_path("micro", 0)))
    groups = episodes(NumberedEnv(), tokenizer, 4)
    assert tokenizer.renders == 12
    prompts = [tuple(e.prompt_ids) for g in groups for e in g]
    assert len(set(prompts)) == 12
    for g in groups:
        for e in g:
            assert e.prompt_ids == render(tokenizer._tokenizer, e.messages[:2], None, True)
