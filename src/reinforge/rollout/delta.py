"""The env reply's token delta, rendered from a short stand-in of the history.

`episodes.environment_delta` finds the ids the chat template adds after the model's turn by
rendering the whole conversation twice; over a multi-turn episode that is quadratic host work
(session 10's bench: half the wall time). The delta depends on the history only through the
template's handling of the last assistant turn and the messages after it, in every template
reinforge has met (Qwen2.5, Qwen3, Llama 3.1): so `DeltaRenderer` renders a stand-in
conversation, three fixed messages and the model's last turn as generated, with the env's
messages appended, and takes the same suffix. Its cost no longer grows with the episode.

Exact by check: an episode's first env reply is also rendered in full, and the two deltas
compared; where they differ (a template whose reply rendering reads earlier history, or the tool
schemas), the episode keeps the full render for every turn and counts it
(`delta_full_renders`). A template's re-rendering of history is checked on the full render of
the first reply, then on the stand-in's last assistant turn (what Qwen3 re-renders).
"""

from __future__ import annotations

from reinforge.data.chat import render_ids
from reinforge.types import Message

# Two exchanges before the model's turn: a history of another length than any episode's first
# reply has (one or two messages before it), so the check on that reply sees a template that
# numbers messages or reads their count.
STAND_IN = (
    Message("user", "Go on."),
    Message("assistant", "Going on."),
    Message("user", "Go on."),
)


class DeltaRenderer:
    """One per episode: the env reply's ids after each assistant turn."""

    def __init__(self) -> None:
        self.is_checked = False
        self.is_exact = False

    def delta(
        self,
        tokenizer,
        conversation: list[Message],
        env_messages: list[Message],
        tools,
        ended_with_stop: bool,
    ) -> tuple[tuple[list[int], bool] | None, bool]:
        """(`environment_delta`'s answer, whether the full conversation was rendered)."""
        assert conversation and conversation[-1].role == "assistant"
        if self.is_checked and not self.is_exact:
            return environment_delta(
                tokenizer, conversation, env_messages, tools, ended_with_stop
            ), True
        stand_in = [*STAND_IN, conversation[-1]]
        short = environment_delta(tokenizer, stand_in, env_messages, None, ended_with_stop)
        if self.is_checked:
            return short, False
        full = environment_delta(tokenizer, conversation, env_messages, tools, ended_with_stop)
        self.is_checked = True
        self.is_exact = short is not None and full is not None and short[0] == full[0]
        return full, True


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
    base = render_ids(tokenizer, conversation, False, tools)
    nxt = render_ids(tokenizer, conversation + list(env_messages), True, tools)
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
