"""Format rewards: tag order, regex matches and DAPO's overlong penalty, on exact values."""

from __future__ import annotations

import pytest

from reinforge.errors import ConfigError
from reinforge.rewards.format import (
    format_reward,
    make_regex_reward,
    make_tags_reward,
    overlong_penalty,
    regex_score,
    tags_score,
)
from reinforge.types import Message, Task

TASK = Task(id="t", messages=(Message("user", "1+1?"),), answer="2")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>1+1 is 2</think><answer>2</answer>", 1.0),
        ("<think>\nsum\n</think>\n\n<answer> 2 </answer>\n", 1.0),
        ("Sure. <think>x</think> so <answer>2</answer> done", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>2</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x<answer>2</answer></think>", 0.0),  # answer inside think
        ("<think>x</think>", 0.0),  # answer missing
        ("<think>x<answer>2</answer>", 0.0),  # think never closed
        ("</think>x<think><answer>2</answer>", 0.0),  # closed before opened
        ("<think>a</think><think>b</think><answer>2</answer>", 0.0),  # think twice
        ("<think>a</think><answer>2</answer><answer>3</answer>", 0.0),  # answer twice
        ("2", 0.0),
    ],
)
def test_format_reward_wants_think_then_answer(completion, expected):
    assert format_reward(completion, TASK) == expected


def test_tags_score_with_other_tags():
    text = "<plan>p</plan><code>c</code><answer>a</answer>"
    assert tags_score(text, ["plan", "code", "answer"]) == 1.0
    assert tags_score(text, ["code", "plan"]) == 0.0
    reward = make_tags_reward(["plan", "answer"])
    assert reward(text, TASK) == 1.0
    assert reward("<answer>a</answer>", TASK) == 0.0


@pytest.mark.parametrize(
    ("tags", "message"),
    [([], "at least one"), (["<think>"], "without angle brackets"), (["a", "a"], "repeat")],
)
def test_make_tags_reward_rejects_bad_tags(tags, message):
    with pytest.raises(ConfigError, match=message):
        make_tags_reward(tags)


def test_regex_score_searches_or_matches_whole():
    assert regex_score("result: 42", r"\d+") == 1.0
    assert regex_score("result: 42", r"\d+", full=True) == 0.0
    assert regex_score("42", r"\d+", full=True) == 1.0
    assert regex_score("no digits", r"\d+") == 0.0


def test_make_regex_reward():
    reward = make_regex_reward(r"(?s)<answer>\s*-?\d+\s*</answer>$")
    assert reward("thinking...\n<answer> -12 </answer>", TASK) == 1.0
    assert reward("<answer>twelve</answer>", TASK) == 0.0
    assert reward("<answer>12</answer> trailing", TASK) == 0.0
    assert make_regex_reward(r"\d+", full=True)("12", TASK) == 1.0


def test_make_regex_reward_rejects_bad_pattern():
    with pytest.raises(ConfigError, match=r"'\(unclosed' is not a valid regular expression"):
        make_regex_reward("(unclosed")


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        (0, 0.0),
        (50, 0.0),
        (80, 0.0),
        (81, -0.05),
        (90, -0.5),
        (95, -0.75),
        (100, -1.0),
        (500, -1.0),
    ],
)
def test_overlong_penalty_is_linear_over_the_buffer(num_tokens, expected):
    assert overlong_penalty(num_tokens, max_len=100, buffer=20) == pytest.approx(expected)


def test_overlong_penalty_with_buffer_equal_to_max_len():
    assert overlong_penalty(0, max_len=8, buffer=8) == 0.0
    assert overlong_penalty(2, max_len=8, buffer=8) == -0.25
    assert overlong_penalty(8, max_len=8, buffer=8) == -1.0


@pytest.mark.parametrize(
    ("max_len", "buffer", "message"),
    [(0, 1, "max_len must be >= 1"), (100, 0, "buffer=25"), (100, 101, "buffer=25")],
)
def test_overlong_penalty_rejects_bad_settings(max_len, buffer, message):
    with pytest.raises(ConfigError, match=message):
        overlong_penalty(10, max_len=max_len, buffer=buffer)
