"""`[rollout.branching]`: entropy-adaptive branching of multi-turn episodes (ARPO's rollout).

The rule and the attribution are stated in `reinforge.rollout.branching`; docs/environments.md
shows a config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from reinforge.config.base import Section


class BranchingSection(Section):
    enabled: bool = False
    """Branch multi-turn episodes where the model is unsure after an env reply (ARPO). The budget
    per prompt is rollout.samples_per_prompt: every group still has that many episodes. Runs the
    episodes without a barrier per turn (as rollout.continuous_episodes) on the paged engine."""
    initial_samples: int = Field(2, ge=1, le=1024)
    """Episodes sampled from each prompt at first (ARPO's N); the rest of the budget goes to
    branches, and what branching leaves unspent to fresh samples of the prompt at the end."""
    branch_size: int = Field(2, ge=1, le=1024)
    """Branches started at one branching point (ARPO's Z, the "beam size"), fewer when the
    budget has less left."""
    entropy_window: int = Field(16, ge=1, le=4096)
    """Tokens whose sampler entropy is averaged: the first ones of an episode (its initial
    entropy) and the first ones after each env reply."""
    threshold: float = 0.5
    """Branch when base_probability + entropy_weight x (entropy after the reply - initial
    entropy, nats) exceeds this (ARPO's tau)."""
    base_probability: float = 0.5
    """ARPO's alpha: the branching score with no change of entropy."""
    entropy_weight: float = 1.0
    """ARPO's beta: the weight of the change of entropy (nats) in the score."""
    tools: list[str] = []
    """Branch only after replies to calls of these tools (names as the env's tools have them);
    empty: after any env reply."""
    attribution: Literal["hard", "soft"] = "hard"
    """How shared tokens are credited: "hard" gives a token several branches share the mean
    advantage of those branches; "soft" trains each branch as its own sequence (its prefix
    repeated, with its own advantage). Both count a shared token once per branch in the loss's
    token mean (docs/algorithms.md)."""
