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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from reinforge.engine.base import Engine, SamplingParams
from reinforge.envs.base import Env, EnvState
from reinforge.types import Message, Task


@dataclass
class Episode:
    task: Task
    state: EnvState
    prompt_ids: list[int]
    completion_ids: list[int] = field(
        default_factory=list
    )  # assistant and env ids after the prompt
    loss_mask: list[int] = field(default_factory=list)  # 1 where the sampler produced the id
    logprobs: list[float] = field(default_factory=list)  # sampler logprob, 0.0 on env ids
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: Counter = field(default_factory=Counter)
    num_turns: int = 0
    finish_reason: str = ""  # "done", "max_turns", "context"
    is_done: bool = False

    @property
    def num_ids(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def reward(self) -> float:
        return self.rewards.get("reward", 0.0)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_context: int = 4096


def render(
    tokenizer, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool
) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [_as_template_message(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    )


def _as_template_message(m: Message) -> dict[str, Any]:
    return m.to_dict()


def run_episodes(
    engine: Engine,
    tokenizer,
    env: Env,
    tasks: list[Task],
    samples_per_task: int,
    params: SamplingParams,
    limits: EpisodeLimits,
    render_tools: bool = True,
) -> list[list[Episode]]:
    """`samples_per_task` episodes per task, run turn by turn, all active episodes of a turn
    batched into one engine call per distinct token budget. The env's tool schemas go to the chat
    template (`render_tools=False` leaves them out, for an env whose prompt already describes
    its tools)."""
    tools = getattr(env, "tool_schemas", None) if render_tools else None
    groups: list[list[Episode]] = []
    for task in tasks:
        group = []
        for _ in range(samples_per_task):
            state = env.reset(task)
            group.append(Episode(task, state, render(tokenizer, state.messages, tools, True)))
        groups.append(group)
    episodes = [e for g in groups for e in g]
    for turn in range(limits.max_turns):
        active = [e for e in episodes if not e.is_done and _fits(e, limits)]
        if not active:
            break
        _generate_turn(engine, active, params, limits, seed=params.seed + 7919 * turn)
        for episode in active:
            _step_env(tokenizer, env, episode, tools, turn)
    for e in episodes:
        if not e.is_done:
            e.finish_reason = e.finish_reason or "max_turns"
            e.metrics[f"finish_{e.finish_reason}"] += 1
            e.is_done = True
    return groups


def _fits(e: Episode, limits: EpisodeLimits) -> bool:
    if e.num_ids + 1 > limits.max_context:
        e.is_done, e.finish_reason = True, "context"
        e.metrics["finish_context"] += 1
        return False
    return True


def _generate_turn(
    engine: Engine, active: list[Episode], params: SamplingParams, limits: EpisodeLimits, seed: int
) -> None:
    by_budget: dict[int, list[Episode]] = {}
    for e in active:
        budget = min(limits.max_tokens_per_turn, limits.max_context - e.num_ids)
        by_budget.setdefault(budget, []).append(e)
    for budget, batch in by_budget.items():
        turn_params = SamplingParams(
            max_new_tokens=budget,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            n=1,
            stop_token_ids=params.stop_token_ids,
            stop_strings=params.stop_strings,
            seed=seed + budget,
        )
        outs = engine.generate([e.prompt_ids + e.completion_ids for e in batch], turn_params)
        for e, (completion,) in zip(batch, outs):
            e.completion_ids += completion.token_ids
            e.loss_mask += [1] * len(completion.token_ids)
            e.logprobs += completion.logprobs
            e.state.info["_last_text"] = completion.text
            e.state.info["_last_finish"] = completion.finish_reason


def _step_env(tokenizer, env: Env, e: Episode, tools, turn: int) -> None:
    text = e.state.info.pop("_last_text")
    finish = e.state.info.pop("_last_finish")
    history = list(e.state.messages)
    assistant = Message("assistant", text)
    result = env.step(e.state, assistant)
    e.num_turns = turn + 1
    e.metrics.update({k: v for k, v in result.metrics.items() if v})
    if finish == "length":
        e.metrics["turn_truncated"] += 1
    if result.done:
        e.rewards = dict(result.rewards)
        e.is_done, e.finish_reason = True, "done"
        e.metrics["finish_done"] += 1
        return
    found = environment_delta(
        tokenizer, [*history, assistant], result.messages, tools, ended_with_stop=(finish == "stop")
    )
    assert found is not None, "the chat template does not close turns with the tokenizer's EOS id"
    env_ids, is_prefix_preserving = found
    if not is_prefix_preserving:
        e.metrics["template_rerenders_history"] += 1
    e.completion_ids += env_ids
    e.loss_mask += [0] * len(env_ids)
    e.logprobs += [0.0] * len(env_ids)


def environment_delta(
    tokenizer,
    conversation: list[Message],
    env_messages: list[Message],
    tools,
    ended_with_stop: bool,
) -> tuple[list[int], bool] | None:
    """The ids that follow the model's last generated id when `env_messages` are appended, ending
    with the next assistant turn's generation prompt, and whether the template re-rendered the
    history identically (prefix-preserving). None when the end of the assistant turn cannot be
    found in the new render (a template that does not close turns with the EOS id)."""
    eos = tokenizer.eos_token_id
    base = render(tokenizer, conversation, tools, add_generation_prompt=False)
    nxt = render(tokenizer, conversation + list(env_messages), tools, add_generation_prompt=True)
    # Every message the conversation holds is closed by one EOS id, in both renders: the
    # assistant turn ends at the same-numbered EOS of the new render.
    num_closed = sum(t == eos for t in base)
    closes = [i for i, t in enumerate(nxt) if t == eos]
    if eos is None or num_closed == 0 or len(closes) < num_closed:
        return None
    end = closes[num_closed - 1] + 1
    is_prefix_preserving = nxt[:end] == base[: max(i for i, t in enumerate(base) if t == eos) + 1]
    # A turn cut by the token budget never produced its end-of-turn id: close it for the model.
    close = [] if ended_with_stop else [eos]
    return close + nxt[end:], is_prefix_preserving


def check_episode(tokenizer, episode: Episode, tools=None) -> int | None:
    """Token-in/token-out check: the recorded ids against the template's render of the same
    messages. Returns the index of the first differing id, or None when they agree.

    The recorded ids are what the model saw; a difference means the template renders history
    differently from how it was generated (or the sampler produced a non-canonical tokenization of
    its own text, which is legal and kept)."""
    recorded = episode.prompt_ids + episode.completion_ids
    rendered = render(tokenizer, episode.state.messages, tools, add_generation_prompt=False)
    # Compare over the shared length: a finished episode lacks the template's text after its last
    # end-of-turn id, an unfinished one ends with the next turn's generation prompt.
    return next((i for i, (a, b) in enumerate(zip(recorded, rendered)) if a != b), None)
