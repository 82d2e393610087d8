"""A task's samples render their prompt once (`episodes.open_episodes`): the chat template and
the tokenizer cost 0.8 ms an episode on a 2-core CPU, eight times per G1 prompt before; and the
distinct prompts of a step are rendered in one chat-template call (one batched encode)."""

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
    """The real tokenizer, counting chat-template calls and the conversations they render."""

    def __init__(self, tokenizer):
        self._tokenizer, self.renders, self.calls = tokenizer, 0, 0

    def apply_chat_template(self, conversation, *args, **kwargs):
        self.calls += 1
        batched = bool(conversation) and isinstance(conversation[0], list)
        self.renders += len(conversation) if batched else 1
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)

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
    assert tokenizer.calls == 1  # all three in one call
    for group in groups:
        expected = render(tokenizer._tokenizer, group[0].messages[:1], None, True)
        assert all(e.prompt_ids == expected for e in group)
        assert len({id(e.prompt_ids) for e in group}) == len(group)  # not one shared list


def test_samples_whose_prompts_differ_render_each_their_own():
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(builtin_path("micro", 0)))
    groups = episodes(NumberedEnv(), tokenizer, 4)
    assert tokenizer.renders == 12 and tokenizer.calls == 1
    prompts = [tuple(e.prompt_ids) for g in groups for e in g]
    assert len(set(prompts)) == 12
    for g in groups:
        for e in g:
            assert e.prompt_ids == render(tokenizer._tokenizer, e.messages[:2], None, True)


def test_a_failed_reset_is_counted_and_the_others_still_open():
    """An env whose reset raises for one task: that task's episodes are failed at `reset`
    (rendered from the task's own messages) and the rest open and run."""

    class Flaky(SingleTurnEnv):
        def reset(self, task: Task) -> EnvState:
            if task.id == "t1":
                raise RuntimeError("no board for t1")
            return super().reset(task)

    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(builtin_path("micro", 0)))
    groups = episodes(Flaky(reward_fn=lambda completion, task: 0.0), tokenizer, 2)
    failed = [e for g in groups for e in g if e.error]
    assert [e.task.id for e in failed] == ["t1", "t1"]
    assert all("reset: RuntimeError: no board for t1" in e.error for e in failed)
    assert all(e.metrics["env_errors"] == 1 for e in failed)
    expected = render(tokenizer._tokenizer, list(failed[0].task.messages), None, True)
    assert failed[0].prompt_ids == expected
    assert all(not e.error and e.completion_ids for g in groups for e in g if e.task.id != "t1")
