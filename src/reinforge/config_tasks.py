"""The built-in generated tasks' sections (arithmetic, countdown, random_tokens) and `TaskConfig`,
the union of every `[task]` variant, told apart by `name`.

Dataset tasks (config_data.py) and environment tasks (config_envs.py) keep their sections in
their own modules; this one joins them into the union the roots in config.py hold.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from reinforge.config_data import DatasetTaskConfig
from reinforge.config_envs import (
    AgentTaskConfig,
    GameTaskConfig,
    HtmlTaskConfig,
    SearchTaskConfig,
    ToolArithmeticTaskConfig,
    ToolsTaskConfig,
    UserEnvTaskConfig,
)
from reinforge.config_rewards import ScoredTask


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


TaskConfig = Annotated[
    ArithmeticTaskConfig
    | CountdownTaskConfig
    | RandomTokensTaskConfig
    | DatasetTaskConfig
    | ToolArithmeticTaskConfig
    | HtmlTaskConfig
    | SearchTaskConfig
    | GameTaskConfig
    | ToolsTaskConfig
    | UserEnvTaskConfig
    | AgentTaskConfig,
    Field(discriminator="name"),
]
