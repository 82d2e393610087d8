"""Rewards: plain functions `(completion: str, task: Task) -> float`; `task.answer` holds the truth.

- `math`: `math_reward` and `math_rewards` (batch) check the final answer with math-verify in
  worker processes under a hard timeout; `MathVerifier` is the pool behind them.
- `format`: `format_reward` (think then answer tags), `tags_score`, `regex_score`,
  `make_tags_reward`, `make_regex_reward`, and `overlong_penalty` (DAPO length shaping, on token
  counts).
- `mix`: `RewardMix` combines named rewards with weights and reports each component;
  `load_callable` loads a custom reward from `"module:function"` or `"path/to/file.py:function"`.

`BUILTIN_REWARDS` is the registry a mix resolves names against by default. Importing this
package is cheap: math-verify and sympy load only in the math workers.
"""

from reinforge.rewards.format import (
    format_reward,
    make_regex_reward,
    make_tags_reward,
    overlong_penalty,
    regex_score,
    tags_score,
)
from reinforge.rewards.math import MathVerifier, default_verifier, math_reward, math_rewards
from reinforge.rewards.mix import RewardFn, RewardMix, RewardScore, RewardSpec, load_callable

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "format": format_reward,
}

__all__ = [
    "BUILTIN_REWARDS",
    "MathVerifier",
    "RewardFn",
    "RewardMix",
    "RewardScore",
    "RewardSpec",
    "default_verifier",
    "format_reward",
    "load_callable",
    "make_regex_reward",
    "make_tags_reward",
    "math_reward",
    "math_rewards",
    "overlong_penalty",
    "regex_score",
    "tags_score",
]
