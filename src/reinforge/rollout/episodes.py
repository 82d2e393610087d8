"""Multi-turn rollouts, token-in/token-out.

An episode's record is the exact ids the model saw and produced: the opening prompt as the chat
template renders it, then for each turn the ids the sampler generated (loss mask 1, with their
sampler logprobs) followed by the ids of the environment's reply (loss mask 0). Nothing is ever
re-tokenized from text: the environment's reply enters as the *delta* the chat template adds
when its messages are appended to the conversation.

How the delta is found: render the conversation with the environment's messages appended (and
the next generation prompt), find where the assistant turn just generated ends in that render
(its end-of-turn id: every message closes with one), and take everything after it. The model's
own ids for that turn stay as generated, even where the template would render its text
differently.

Qwen2.5 and Llama 3.1 re-render history identically (prefix-preserving). Qwen3's does not: it
renders a final assistant turn with an empty `<think></think>` block that it drops once a tool
reply follows, and it strips the reasoning of assistant turns before the last user message. A
trainer that re-rendered the conversation each turn would train on ids the model never saw;
reinforge keeps the ids it saw, appends only the delta, and counts each turn where the template
re-rendered history (`template_rerenders_history`), so the difference is visible, not silent.

Limits are checked before each generation: `max_turns`, `max_tokens_per_turn`, and the total
context; an episode that would overflow ends with `finish_reason = "context"`, counted, never
silently truncated.

A group's first turn is one prompt with n samples: the samples of a task open with the same ids
(when the env's `reset` gives each the same messages), so the engine prefills the prompt once and
the n sequences share its KV pages. Later turns differ per episode and go one sequence each. A
single-turn task is the case of one turn.

An env that raises (in `reset` or `step`, a tool it runs, a parser given hostile text) fails that
episode, never the step: the episode ends with `finish_reason = "env_error"`, its tokens out of
the loss, reward 0, counted as `env_errors` with the first error kept for the summary.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from reinforge.data.chat import render_ids, render_prompts
from reinforge.engine.base import Engine, SamplingParams
from reinforge.envs.base import Env, EnvState, StepResult
from reinforge.rollout.delta import DeltaRenderer, environment_delta  # noqa: F401 (public here)
from reinforge.types import Completion, Message, Task


@dataclass
class Episode:
    task: Task
    state: EnvState | None  # None when the env's reset failed
    prompt_ids: list[int]
    completion_ids: list[int] = field(
        default_factory=list
    )  # assistant and env ids after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1 where the sampler produced the id
    logprobs: list[float] = field(default_factory=list)  # sampler logprob, 0.0 on env ids
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: Counter = field(default_factory=Counter)
    num_turns: int = 0
    finish_reason: str = ""  # "done", "max_turns", "context", "env_error"
    is_done: bool = False
    turns: list[Completion] = field(default_factory=list)  # the engine's output of each turn
    error: str | None = None  # the env's exception, when it raised
    delta: DeltaRenderer = field(default_factory=DeltaRenderer, repr=False)
    # a branch (rollout.branching): (its parent's index in the group, the parent's completion
    # tokens when it branched); (None, 0) for an episode sampled from the prompt
    lineage: tuple[int | None, int] = (None, 0)

    @property
    def num_ids(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def reward(self) -> float:
        return self.rewards.get("reward", 0.0)

    @property
    def messages(self) -> list[Message]:
        return self.state.messages if self.state is not None else list(self.task.messages)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_context: int = 4096


def render(
    tokenizer, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool
) -> list[int]:
    return render_ids(tokenizer, messages, add_generation_prompt, tools)


def run_episodes(
    engine: Engine,
    tokenizer,
    env: Env,
    tasks: list[Task],
    samples_per_task: int,
    params: SamplingParams,
    limits: EpisodeLimits,
    render_tools: bool = True,
    share_first_turn: bool = True,
    env_workers: int = 1,
) -> list[list[Episode]]:
    """`samples_per_task` episodes per task, run turn by turn: the first turn one prompt per
    task with `samples_per_task` samples (pages shared), later turns all active episodes batched
    into one engine call per distinct token budget. The env's tool schemas go to the chat
    template (`render_tools=False` leaves them out, for an env whose prompt already describes
    its tools). `params.first_prompt_index` numbers the tasks as in a step split across ranks.
    `share_first_turn=False` sends every episode alone from the start (a benchmark's baseline).
    The env steps of a turn run on `env_workers` threads; the token bookkeeping after them runs
    here, in order (a tokenizer is not shared across threads)."""
    tools = getattr(env, "tool_schemas", None) if render_tools else None
    groups = open_episodes(env, tokenizer, tasks, samples_per_task, tools)
    episodes = [e for g in groups for e in g]
    for turn in range(limits.max_turns):
        active = [e for e in episodes if not e.is_done and _fits(e, limits)]
        if not active:
            break
        if turn == 0:
            _generate_first_turn(engine, groups, params, limits, share_first_turn)
        else:
            seed = params.seed + 7919 * turn
            _generate_turn(engine, active, params, limits, seed, params.first_prompt_index)
        results = _run_env_steps(env, active, env_workers)
        for episode, result in zip(active, results, strict=True):
            _take_step(tokenizer, episode, result, tools, turn)
    for e in episodes:
        if not e.is_done:
            e.finish_reason = e.finish_reason or "max_turns"
            e.metrics[f"finish_{e.finish_reason}"] += 1
            e.is_done = True
    return groups


def open_episodes(
    env: Env, tokenizer, tasks: list[Task], samples_per_task: int, tools
) -> list[list[Episode]]:
    """`samples_per_task` fresh episodes of each task: every env reset first, then each distinct
    prompt rendered once, all of them in one chat-template call (one batched tokenizer call:
    G1's 32 prompts took 32 calls, 12 ms of the 2-core CPU, while the GPU waits)."""
    states: list[list[tuple[Task, Any]]] = []
    for task in tasks:
        row = []
        for _ in range(samples_per_task):
            try:
                row.append((task, env.reset(task)))
            except Exception as error:  # the env's failure: this episode's, counted
                row.append((task, error))
        states.append(row)
    keys: dict[str, list[Message]] = {}  # each distinct prompt, by its messages' JSON
    by_identity: dict[tuple[int, ...], str] = {}  # (the same message objects: one JSON)

    def key_of(messages) -> str:
        identity = tuple(map(id, messages))
        key = by_identity.get(identity)
        if key is None:
            key = by_identity[identity] = json.dumps(messages, sort_keys=True, default=repr)
            keys.setdefault(key, messages)
        return key

    opened = [
        [
            (task, state, key_of(task.messages if isinstance(state, Exception) else state.messages))
            for task, state in row
        ]
        for row in states
    ]
    rendered = dict(zip(keys, render_many(tokenizer, list(keys.values()), tools), strict=True))
    groups = []
    for row in opened:
        group = []
        for task, state, key in row:
            if isinstance(state, Exception):
                episode = Episode(task, None, list(rendered[key]))
                _fail(episode, state, "reset")
            else:  # each episode extends its own ids
                episode = Episode(task, state, list(rendered[key]))
            group.append(episode)
        groups.append(group)
    return groups


def render_many(tokenizer, conversations: list[list[Message]], tools) -> list[list[int]]:
    """The ids of each conversation's prompt (`render`), in one chat-template call."""
    if len(conversations) <= 1:
        return [render(tokenizer, c, tools, True) for c in conversations]
    return render_prompts(tokenizer, conversations, tools)


def _open(
    env: Env, tokenizer, task: Task, tools, renders: dict[str, list[int]] | None = None
) -> Episode:
    """A fresh episode of `task`. `renders`: prompts already rendered by this caller, by their
    messages, so a task's samples render their (usually equal) prompt once: the chat template
    and the tokenizer took 0.8 ms an episode on a 2-core CPU, 0.2 s of G1's 256 a step (about
    0.08 s of each step on the GPU machines' hosts, 3% of the step)."""
    try:
        state = env.reset(task)
    except Exception as error:  # the env's failure: this episode's, counted
        episode = Episode(task, None, render(tokenizer, list(task.messages), tools, True))
        _fail(episode, error, "reset")
        return episode
    if renders is None:
        return Episode(task, state, render(tokenizer, state.messages, tools, True))
    key = json.dumps(state.messages, sort_keys=True, default=repr)
    if key not in renders:
        renders[key] = render(tokenizer, state.messages, tools, True)
    return Episode(task, state, list(renders[key]))  # each episode extends its own ids


def _fail(e: Episode, error: Exception, where: str) -> None:
    e.error = f"{where}: {type(error).__name__}: {error}"
    e.rewards = {}
    e.is_done, e.finish_reason = True, "env_error"
    e.metrics["env_errors"] += 1
    e.loss_mask = [0] * len(e.loss_mask)  # the env's fault: nothing here is the model's to learn


def _fits(e: Episode, limits: EpisodeLimits) -> bool:
    if e.num_ids + 1 > limits.max_context:
        e.is_done, e.finish_reason = True, "context"
        e.metrics["finish_context"] += 1
        return False
    return True


def _budget(e: Episode, limits: EpisodeLimits) -> int:
    return min(limits.max_tokens_per_turn, limits.max_context - e.num_ids)


def _generate_first_turn(
    engine: Engine,
    groups: list[list[Episode]],
    params: SamplingParams,
    limits: EpisodeLimits,
    share: bool = True,
) -> None:
    """Each task's episodes as one prompt with n samples, where they open alike (else one
    prompt each); one engine call per (budget, n), prompt i of a call numbered as its task."""
    calls: dict[tuple[int, int], list[tuple[int, list[Episode]]]] = {}
    for index, group in enumerate(groups):
        live = [e for e in group if not e.is_done]
        if share and live and all(e.prompt_ids == live[0].prompt_ids for e in live):
            units = [live]
        else:
            units = [[e] for e in live]
        for unit in units:
            calls.setdefault((_budget(unit[0], limits), len(unit)), []).append((index, unit))
    for (budget, n), units in calls.items():
        call_params = _with(params, max_new_tokens=budget, n=n, seed=params.seed)
        call_params = _with(call_params, first_prompt_index=params.first_prompt_index + units[0][0])
        outs = engine.generate([unit[0].prompt_ids for _, unit in units], call_params)
        for (_, unit), completions in zip(units, outs, strict=True):
            for e, completion in zip(unit, completions, strict=True):
                _record(e, completion)


def _generate_turn(
    engine: Engine,
    active: list[Episode],
    params: SamplingParams,
    limits: EpisodeLimits,
    seed: int,
    first_prompt_index: int,
) -> None:
    by_budget: dict[int, list[Episode]] = {}
    for e in active:
        by_budget.setdefault(_budget(e, limits), []).append(e)
    for budget, batch in by_budget.items():
        turn_params = _with(params, max_new_tokens=budget, n=1, seed=seed + budget)
        turn_params = _with(turn_params, first_prompt_index=first_prompt_index)
        outs = engine.generate([e.prompt_ids + e.completion_ids for e in batch], turn_params)
        for e, (completion,) in zip(batch, outs):
            _record(e, completion)


def _with(params: SamplingParams, **changes) -> SamplingParams:
    return dataclasses.replace(params, **changes)


def _record(e: Episode, completion: Completion) -> None:
    e.completion_ids += completion.token_ids
    e.loss_mask += [1] * len(completion.token_ids)
    e.logprobs += completion.logprobs
    e.turns.append(completion)


def _run_env_steps(env: Env, active: list[Episode], workers: int) -> list:
    """Each active episode's `_env_step` on its last turn (the exception an env raises fails
    that episode alone)."""
    if workers <= 1 or len(active) <= 1:
        return [_env_step(env, e) for e in active]
    with ThreadPoolExecutor(min(workers, len(active)), thread_name_prefix="env") as pool:
        return list(pool.map(lambda e: _env_step(env, e), active))


def _env_step(env: Env, e: Episode) -> tuple[list[Message], StepResult | Exception]:
    """(the conversation before this turn, what the env answered or raised)."""
    assert e.state is not None, "an episode whose reset failed is done before its first turn"
    history = list(e.state.messages)
    try:
        result = env.step(e.state, Message("assistant", e.turns[-1].text))
        if not isinstance(result, StepResult):
            raise TypeError(f"step() returned {type(result).__name__}, not a StepResult")
    except Exception as error:  # the env's (or its tool's, or its parser's) failure
        return history, error
    return history, result


def _take_step(tokenizer, e: Episode, stepped, tools, turn: int) -> None:
    history, result = stepped
    completion = e.turns[-1]
    e.num_turns = turn + 1
    if completion.finish_reason == "length":
        e.metrics["turn_truncated"] += 1
    if isinstance(result, Exception):
        _fail(e, result, "step")
        return
    e.metrics.update({k: v for k, v in result.metrics.items() if v})
    if result.done:
        e.rewards = dict(result.rewards)
        e.is_done, e.finish_reason = True, "done"
        e.metrics["finish_done"] += 1
        return
    assistant = Message("assistant", completion.text)
    found, is_full = e.delta.delta(
        tokenizer,
        [*history, assistant],
        result.messages,
        tools,
        ended_with_stop=(completion.finish_reason == "stop"),
    )
    assert found is not None, "the chat template does not close turns with the tokenizer's EOS id"
    env_ids, is_prefix_preserving = found
    if not is_prefix_preserving:
        e.metrics["template_rerenders_history"] += 1
    if is_full and e.delta.is_checked and not e.delta.is_exact:
        e.metrics["delta_full_renders"] += 1
    e.completion_ids += env_ids
    e.loss_mask += [0] * len(env_ids)
    e.logprobs += [0.0] * len(env_ids)


def check_episode(tokenizer, episode: Episode, tools=None) -> int | None:
    """Token-in/token-out check: the recorded ids against the template's render of the same
    messages. Returns the index of the first differing id, or None when they agree.

    The recorded ids are what the model saw; a difference means the template renders history
    differently from how it was generated (or the sampler produced a non-canonical tokenization of
    its own text, which is legal and kept)."""
    recorded = episode.prompt_ids + episode.completion_ids
    rendered = render(tokenizer, episode.messages, tools, add_generation_prompt=False)
    # Compare over the shared length: a finished episode lacks the template's text after its last
    # end-of-turn id, an unfinished one ends with the next turn's generation prompt.
    return next((i for i, (a, b) in enumerate(zip(recorded, rendered)) if a != b), None)
