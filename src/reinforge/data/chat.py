"""A conversation as token ids with the loss on the assistant's turns, cut from the chat template.

SFT trains on what the model generates: each assistant turn's text and the end-of-turn token
that closes it. The spans come from the template itself, by rendering prefixes of the
conversation: the tokens between `render(messages[:i], add_generation_prompt=True)` and
`render(messages[:i + 1])` are assistant turn i. A span is cut after its first end-of-turn id,
since what a template writes after it (ChatML's newline after `<|im_end|>`) is never generated.

This needs a template whose render of the whole conversation starts with its render of each
prefix. One that rewrites earlier turns (Qwen3 adds an empty think block to the last assistant
turn only) cannot be cut this way; it is refused at the first turn where the prefix differs,
rather than trained with masks over the wrong tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from reinforge.errors import ConfigError
from reinforge.types import Message


@dataclass(frozen=True)
class ChatExample:
    ids: list[int]  # the conversation through the end of its last assistant turn
    loss_mask: list[int]  # 1 on assistant-turn tokens, 0 elsewhere; len(ids)
    spans: list[tuple[int, int]]  # [start, end) of each assistant turn in ids

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens before the first assistant turn (never in the loss)."""
        return self.spans[0][0]


def render_ids(
    tokenizer,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> list[int]:
    """The chat template's ids for `messages` (and the tool schemas `tools`, which templates
    with tool support show the model)."""
    return list(
        tokenizer.apply_chat_template(
            [m.to_dict() for m in messages],
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
    )


def render_prompts(
    tokenizer, conversations: Sequence[Sequence[Message]], tools: list[dict] | None = None
) -> list[list[int]]:
    """`render_prompt` of each conversation, in one chat-template call (the template renders each
    and the tokenizer encodes them all in one batch: what it does for one, many at a time)."""
    out = tokenizer.apply_chat_template(
        [[m.to_dict() for m in messages] for messages in conversations],
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert len(out) == len(conversations), "one prompt per conversation"
    return [list(ids) for ids in out]


def render_prompt(tokenizer, messages: Sequence[Message], tools: list[dict] | None = None):
    """Token ids of the chat-formatted prompt, ending where the assistant's reply begins."""
    return render_ids(tokenizer, messages, add_generation_prompt=True, tools=tools)


def eos_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn: the tokenizer's EOS (none when it has no EOS)."""
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def chat_example(
    tokenizer, messages: Sequence[Message], end_of_turn_ids: Collection[int], tools=None
) -> ChatExample:
    """`messages` rendered by the tokenizer's chat template (with the tool schemas `tools`,
    and an assistant message's recorded `tool_calls` as the template writes them), with a loss
    mask on every assistant turn (its text, its tool calls and its end-of-turn token)."""
    turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
    assert turns and turns[0] > 0, "an SFT conversation needs a prompt and an assistant turn"
    full = render_ids(tokenizer, messages, add_generation_prompt=False, tools=tools)
    spans = []
    for i in turns:
        start = len(_prefix_of(full, tokenizer, messages, i, True, tools))
        end = len(_prefix_of(full, tokenizer, messages, i + 1, False, tools))
        assert end > start, f"the template renders assistant turn {i} as no tokens"
        cut = next(
            (k + 1 for k, t in enumerate(full[start:end]) if t in end_of_turn_ids), end - start
        )
        spans.append((start, start + cut))
    ids = full[: spans[-1][1]]
    loss_mask = [0] * len(ids)
    for start, end in spans:
        loss_mask[start:end] = [1] * (end - start)
    return ChatExample(ids, loss_mask, spans)


def _prefix_of(
    full: list[int],
    tokenizer,
    messages: Sequence[Message],
    count: int,
    add_generation_prompt: bool,
    tools=None,
) -> list[int]:
    """The render of `messages[:count]`, checked to be where `full` starts."""
    ids = render_ids(tokenizer, messages[:count], add_generation_prompt, tools)
    if full[: len(ids)] != ids:
        at = next(
            (k for k, (a, b) in enumerate(zip(full, ids)) if a != b), min(len(full), len(ids))
        )
        raise ConfigError(
            f"the chat template renders the first {count} messages of a conversation differently "
            f"from how it renders them inside the whole conversation (from token {at}: "
            f"{tokenizer.decode(ids[at : at + 12])!r} vs {tokenizer.decode(full[at : at + 12])!r}), "
            "so the assistant turns cannot be cut from it for the SFT loss; use a tokenizer whose "
            "template renders history unchanged (model.tokenizer), or give each conversation "
            "one assistant turn (one row per turn)"
        )
    return ids
