"""Format rewards: the shape of a completion, not its correctness.

- `tags_score(text, tags)`: 1.0 when each tag opens and closes exactly once and the tags come in
  the given order, one closed before the next opens (`<think>...</think>` then
  `<answer>...</answer>`); else 0.0. Text around and between the tags is allowed.
- `regex_score(text, pattern)`: 1.0 when the pattern matches, else 0.0.
- `overlong_penalty(num_tokens, max_len, buffer)`: DAPO's overlong reward shaping, 0 up to
  `max_len - buffer` tokens, then falling linearly to -1 at `max_len` (and -1 beyond). It takes
  token counts, not text, so the trainer adds it from the trajectory's length.

`format_reward` is the `(completion, task) -> float` reward for think-then-answer;
`make_tags_reward` and `make_regex_reward` build rewards for other tags and patterns, checking
their settings once, up front.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from reinforge.errors import ConfigError
from reinforge.types import Task

THINK_ANSWER = ("think", "answer")
_TAG_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def tags_score(text: str, tags: Sequence[str] = THINK_ANSWER) -> float:
    """1.0 if every tag appears exactly once as `<tag>...</tag>`, in order, else 0.0."""
    previous_close = 0
    for tag in tags:
        opening, closing = f"<{tag}>", f"</{tag}>"
        if text.count(opening) != 1 or text.count(closing) != 1:
            return 0.0
        start, end = text.index(opening), text.index(closing)
        if start < previous_close or end < start + len(opening):
            return 0.0
        previous_close = end + len(closing)
    return 1.0


def format_reward(completion: str, task: Task) -> float:
    """1.0 for `<think>...</think>` followed by `<answer>...</answer>`, else 0.0."""
    return tags_score(completion, THINK_ANSWER)


def make_tags_reward(tags: Sequence[str]) -> Callable[[str, Task], float]:
    """A reward that is `tags_score(completion, tags)`."""
    tags = tuple(tags)
    if not tags:
        raise ConfigError('tags must name at least one tag; try tags = ["think", "answer"]')
    for tag in tags:
        if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
            raise ConfigError(
                f"tags holds {tag!r}, which is not a tag name; give bare names without angle "
                'brackets, e.g. tags = ["think", "answer"]'
            )
    if len(set(tags)) != len(tags):
        raise ConfigError(f"tags {list(tags)} repeat a name; list each tag once")

    def reward(completion: str, task: Task) -> float:
        return tags_score(completion, tags)

    return reward


def regex_score(text: str, pattern: str | re.Pattern[str], full: bool = False) -> float:
    """1.0 if `pattern` matches somewhere in `text` (or the whole of it, with `full`), else 0.0."""
    match = re.fullmatch(pattern, text) if full else re.search(pattern, text)
    return 1.0 if match else 0.0


def make_regex_reward(pattern: str, full: bool = False) -> Callable[[str, Task], float]:
    """A reward that is `regex_score(completion, pattern, full)`, with the pattern compiled once.
    Flags go inline in the pattern, e.g. `(?s)` to let `.` match newlines."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"pattern {pattern!r} is not a valid regular expression ({e}); "
            r"for example pattern = '<answer>\s*-?\d+\s*</answer>'"
        ) from e

    def reward(completion: str, task: Task) -> float:
        return regex_score(completion, compiled, full)

    return reward


def overlong_penalty(num_tokens: int, max_len: int, buffer: int) -> float:
    """0.0 up to `max_len - buffer` tokens, then linear down to -1.0 at `max_len`; -1.0 past it.

    With max_len=100 and buffer=20: 80 tokens -> 0.0, 90 -> -0.5, 100 and more -> -1.0.
    """
    if max_len < 1:
        raise ConfigError(f"max_len must be >= 1 token, got {max_len}; e.g. max_len=4096")
    if not 1 <= buffer <= max_len:
        raise ConfigError(
            f"buffer must be between 1 and max_len={max_len} tokens, got {buffer}; "
            f"e.g. buffer={max(1, max_len // 4)}"
        )
    assert num_tokens >= 0, f"negative length {num_tokens}"
    num_over = num_tokens - (max_len - buffer)
    if num_over <= 0:
        return 0.0
    return -min(1.0, num_over / buffer)
