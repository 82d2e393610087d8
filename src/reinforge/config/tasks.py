"""The built-in generated tasks' sections (arithmetic, countdown, random_tokens) and `TaskConfig`,
the union of every `[task]` variant, told apart by `name`.

Dataset tasks (config/data.py) and environment tasks (config/envs.py) keep their sections in
their own modules; this one joins them into the union the roots in config.py hold.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from reinforge.config.data import DatasetTaskConfig
from reinforge.config.envs import (
    AgentTaskConfig,
    GameTaskConfig,
    HtmlTaskConfig,
    SearchTaskConfig,
    ToolArithmeticTaskConfig,
    ToolsTaskConfig,
    UserEnvTaskConfig,
    VerifiersTaskConfig,
)
from reinforge.config.rewards import ScoredTask


class ArithmeticTaskConfig(ScoredTask):
    name: Literal["arithmetic"] = "arithmetic"
    """Multi-digit arithmetic: `a op b` with a numeric answer."""
    min_digits: int = Field(1, ge=1, le=12)
    """Fewest digits of an operand."""
    max_digits: int = Field(2, ge=1, le=12)
    """Most digits of an operand."""
    operations: list[Literal["+", "-", "*"]] = ["+", "-"]
    """Operations to draw from."""
    sentence_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of SFT reference solutions written as a sentence ("The answer is 133.") instead of
    the bare number the checker accepts: a format habit SFT teaches and RL has to unlearn, as with
    real SFT data whose style differs from what the verifier wants."""
    partial_credit: float = Field(0.0, ge=0.0, lt=1.0)
    """Reward for a wrong answer, scaled by the fraction of its digits (aligned from the right) that
    match; 0 gives a plain 0/1 reward. Credit for the digits a wrong answer got right tells RL which
    tokens to blame. Accuracy always counts exact answers only."""
    num_eval: int = Field(200, ge=1, le=100_000)
    """Held-out tasks scored before and after training (never used for training)."""
    seed: int = Field(1234, ge=0)
    """Seed of the task generator (independent of `run.seed`)."""

    @model_validator(mode="after")
    def _digits_ordered(self) -> ArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"min_digits={self.min_digits} is above max_digits={self.max_digits}; "
                f"set max_digits >= {self.min_digits}"
            )
        return self


class CountdownTaskConfig(ScoredTask):
    name: Literal["countdown"] = "countdown"
    """Countdown: combine the given numbers with + - * / to reach the target."""
    num_numbers: int = Field(3, ge=2, le=6)
    """How many numbers each task gives."""
    max_number: int = Field(20, ge=2, le=1000)
    """Largest given number."""
    num_eval: int = Field(200, ge=1, le=100_000)
    """Held-out tasks scored before and after training (never used for training)."""
    seed: int = Field(1234, ge=0)
    """Seed of the task generator (independent of `run.seed`)."""


class RandomTokensTaskConfig(ScoredTask):
    name: Literal["random_tokens"] = "random_tokens"
    """Benchmark workload: prompts of random words `t0 t1 ...` (one token each with the word-level
    tokenizer of `model.path = "shape:..."`), reward (len(completion text) mod 7) / 6, as the
    TRL peer of bench/grpo_bench.py scores it. Measures speed, not learning."""
    prompt_tokens: int = Field(128, ge=1, le=1_000_000)
    """Words per prompt."""
    vocab_words: int = Field(32_000, ge=2)
    """Prompts draw words t0 .. t{vocab_words - 1}; keep it at most the model's vocabulary size
    less 3 (the shape tokenizer's UNK, PAD and EOS)."""
    num_eval: int = Field(8, ge=1, le=100_000)
    """Held-out prompts scored before and after training."""
    seed: int = Field(1234, ge=0)
    """Seed of the prompt generator (independent of `run.seed`)."""


class ReasoningGymTaskConfig(ScoredTask):
    name: Literal["reasoning_gym"] = "reasoning_gym"
    """reasoning-gym's procedural datasets (the `reasoning` extra), each item scored by the
    library's own `score_answer` on the answer extracted from the completion."""
    datasets: dict[str, float]
    """Dataset names with their sampling weights, e.g. {chain_sum = 1.0, gcd = 0.5}: every
    training task and held-out task draws its dataset by weight. Any name of
    `reasoning_gym.factory.DATASETS`; a misspelt one is refused with the closest names."""
    dataset_config: dict[str, dict[str, Any]] = {}
    """Per-dataset settings of the library's config class, e.g. {chain_sum = {min_terms = 2,
    max_terms = 2, max_digits = 1}}; an unknown key is refused with the class's fields. `seed`
    and `size` are reinforge's (task.seed), not settable here."""
    extract: Literal["whole", "last_line", "answer_tag", "regex"] = "answer_tag"
    """Which part of the completion is the answer scored: "whole" (the text, stripped),
    "last_line" (its last non-empty line), "answer_tag" (inside the last <answer>...</answer>,
    as reasoning-gym's own prompts ask) or "regex" (answer_regex's last match). A completion
    without one scores 0. SFT solutions are written in the same form."""
    answer_regex: str | None = None
    """With extract = "regex": the pattern; its first group (or the whole match) of the last
    match is the answer, e.g. 'answer is (-?\\d+)' (a TOML literal string keeps the backslash)."""
    system_prompt: str = (
        "Answer with the final answer alone inside <answer></answer>, e.g. <answer>42</answer>."
    )
    """The system message before each question; "" for none (the question alone). Write one
    that asks for the form task.extract takes."""
    question_after: dict[str, str] = {}
    """Per dataset, a marker in its questions: the model sees only the text after the marker's
    last occurrence (the library's instructions before it dropped), for models with a short
    context, e.g. {shortest_path = "in the following grid:"}. A question without the marker is
    refused by name. Scoring and the held-out split use the whole question."""
    partial_credit: bool = False
    """false (default): a score under 1 is a reward of 0, the criterion pass@k and the held-out
    accuracy count by. true: train on the library's partial scores as they come (the default
    scorer gives len(answer) / len(reply) when the answer is inside a longer reply, palindrome
    0.05 for any palindrome, spell_backward the share of letters in place); the run's note says
    when the mean reward is mostly partial credit. Off by default from the learning suite: with
    it on, RL lowered palindrome_generation's held-out pass@1 by 8.0 points (2 seeds; 1.5 off)
    and trained caesar_cipher to a reward of 0.99 with 1% of samples passing."""
    num_eval: int = Field(200, ge=1, le=100_000)
    """Held-out tasks scored before and after training; no training task has the question of a
    held-out one."""
    seed: int = Field(1234, ge=0)
    """Seed of the task draws (independent of `run.seed`)."""

    @model_validator(mode="after")
    def _datasets_and_extraction(self) -> ReasoningGymTaskConfig:
        if not self.datasets:
            raise ValueError("task.datasets is empty; name at least one, e.g. {chain_sum = 1.0}")
        bad = {n: w for n, w in self.datasets.items() if not w > 0}
        if bad:
            raise ValueError(f"task.datasets weights must be above 0, got {bad}; e.g. 1.0")
        for setting in ("dataset_config", "question_after"):
            stray = sorted(set(getattr(self, setting)) - set(self.datasets))
            if stray:
                raise ValueError(
                    f"task.{setting} names {stray}, which task.datasets does not list "
                    f"({sorted(self.datasets)}); add them to task.datasets or remove their "
                    f"settings"
                )
        empty = sorted(n for n, marker in self.question_after.items() if not marker.strip())
        if empty:
            raise ValueError(
                f"task.question_after: an empty marker for {empty}; give the text after which "
                f'the question starts, e.g. {{shortest_path = "in the following grid:"}}'
            )
        if (self.extract == "regex") != (self.answer_regex is not None):
            raise ValueError(
                f'task.answer_regex={self.answer_regex!r} goes with task.extract = "regex" '
                f"(got {self.extract!r}); set both, e.g. answer_regex = 'answer is (-?\\d+)'"
            )
        if self.answer_regex is not None:
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise ValueError(f"task.answer_regex={self.answer_regex!r}: {e}") from None
        return self


TaskConfig = Annotated[
    ArithmeticTaskConfig
    | CountdownTaskConfig
    | RandomTokensTaskConfig
    | ReasoningGymTaskConfig
    | DatasetTaskConfig
    | ToolArithmeticTaskConfig
    | HtmlTaskConfig
    | SearchTaskConfig
    | GameTaskConfig
    | ToolsTaskConfig
    | UserEnvTaskConfig
    | AgentTaskConfig
    | VerifiersTaskConfig,
    Field(discriminator="name"),
]
