"""`[algorithm]`: the algorithm preset and every setting it backs, and `preset_values`, the field
values a preset implies.

A setting left unset takes the preset's value when the section is validated, so after loading
every field holds a concrete value; `origins()` says where each came from.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from reinforge.algorithms.table import (
    PRESETS,
    AdvantageName,
    Aggregation,
    AlgorithmName,
    KLEstimator,
    KLPlacement,
    LossName,
)
from reinforge.config_base import Section

# Preset fields whose "off" value is 0 in the config (TOML has no null): the preset's None maps to it.
_OFF_IS_ZERO = ("dual_clip_c", "overlong_buffer")
# Value-model settings for presets without one, so `advantage = "gae"` works on any preset.
_VALUE_FIELDS = ("gamma", "lam", "value_clip")


def preset_values(name: str) -> dict[str, Any]:
    """The `[algorithm]` field values preset `name` implies (config names, no None)."""
    preset = dict(PRESETS[name])
    values: dict[str, Any] = {
        k: v for k, v in preset.items() if k not in ("aggregation", "value_model")
    }
    values["loss_aggregation"] = preset["aggregation"]
    for key in _OFF_IS_ZERO:
        values[key] = values[key] or 0
    for key in _VALUE_FIELDS:
        if values[key] is None:
            values[key] = PRESETS["ppo"][key]
    values["value_clip"] = values["value_clip"] or 0.0
    values["kl_placement"] = preset["kl_placement"] or "loss"  # inert while kl_coef is 0
    return values


class AlgorithmSection(Section):
    """Every setting left unset takes the value of the preset `name`; set one to override it alone.
    After loading, every field holds a concrete value (`--dry-run` shows each one's origin)."""

    name: AlgorithmName = "grpo"
    """Algorithm preset: grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp or ppo (see
    docs/algorithms.md for each one's paper and values)."""
    advantage: AdvantageName | None = None
    """Advantage estimator: grpo (group mean, optional std), rloo (leave-one-out),
    reinforce_pp (batch-normalised), reinforce_pp_baseline (group mean, batch std), gae (token
    level; trains a value head), ema_baseline (running mean of rewards). Default: the preset's."""
    normalize_std: bool | None = None
    """Divide advantages by a standard deviation: the group's (grpo, rloo), the batch's
    (reinforce_pp*, ema_baseline) or whiten token advantages (gae). Default: the preset's."""
    loss: LossName | None = None
    """Policy loss: ppo_clip (token ratio, clipped), gspo (sequence ratio), cispo (clipped,
    detached IS weight). Default: the preset's."""
    clip_low: float | None = Field(None, ge=0.0, le=1.0)
    """Ratios below 1 - clip_low are clipped (CISPO: 1.0 = no lower bound). Default: the preset's."""
    clip_high: float | None = Field(None, ge=0.0, le=10.0)
    """Ratios above 1 + clip_high are clipped (DAPO's clip-higher: 0.28). Default: the preset's."""
    dual_clip_c: float | None = Field(None, ge=0.0)
    """PPO dual clip: cap a negative-advantage token's loss at -c * A (c > 1; 0 = off). Default:
    the preset's."""
    loss_aggregation: Aggregation | None = None
    """How token losses become one number: token_mean (over all tokens of the step),
    seq_mean_token_mean (per sequence, then over sequences), seq_mean_token_sum_norm (token sums
    over rollout.max_new_tokens, then over sequences), seq_mean_token_sum (token sums, then over
    sequences). Default: the preset's."""
    kl_coef: float | None = Field(None, ge=0.0)
    """Weight of the KL to the reference policy (the policy as RL started; 0 = no reference is
    kept). Default: the preset's."""
    kl_estimator: KLEstimator | None = None
    """KL estimator: k1 (log ratio), k2 (half its square), k3 (Schulman's low-variance,
    non-negative). Default: the preset's."""
    kl_placement: KLPlacement | None = None
    """Where the KL acts: loss (a differentiated loss term), reward_token (a per-token reward
    penalty; needs advantage = gae) or reward_sequence (summed over the completion and taken off
    its reward). Ignored while kl_coef is 0. Default: the preset's."""
    entropy_coef: float | None = Field(None, ge=0.0)
    """Weight of an entropy bonus (entropy is always reported). Default: the preset's."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal) and sample
    more prompts until the step has rollout.prompts_per_step informative groups. Default: the
    preset's."""
    max_sampling_rounds: int = Field(4, ge=1, le=1000)
    """Most rollout rounds per step under dynamic sampling; if the batch is still short after
    them, it is filled with the dropped groups (they carry no advantage) and the metric
    `filled_groups` says how many."""
    overlong_buffer: int | None = Field(None, ge=0)
    """DAPO's soft overlong punishment: the reward falls linearly from 0 to -1 over the last this
    many tokens before rollout.max_new_tokens (0 = off). Default: the preset's."""
    mask_truncated: bool | None = None
    """Leave completions cut off by rollout.max_new_tokens out of the loss (overlong filtering).
    Default: the preset's."""
    tis_cap: float = Field(0.0, ge=0.0)
    """Truncated importance sampling: weight each token's policy-gradient term by
    min(pi_trainer / pi_sampler, tis_cap), correcting for sampler/trainer mismatch (0 = off; the
    mismatch KL `kl_sampler` is reported either way)."""
    gamma: float | None = Field(None, ge=0.0, le=1.0)
    """GAE discount (advantage = gae only). Default: the preset's, else PPO's."""
    lam: float | None = Field(None, ge=0.0, le=1.0)
    """GAE lambda (advantage = gae only). Default: the preset's, else PPO's."""
    value_clip: float | None = Field(None, ge=0.0)
    """Clip of the value loss: V may move at most this far from its old value (advantage = gae
    only; 0 = unclipped). Default: the preset's, else PPO's."""
    value_lr: float | None = Field(None, gt=0.0, le=1.0)
    """Learning rate of the value head (advantage = gae only; it has its own AdamW parameter group
    and the policy's schedule). Default: optim.lr."""
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0)
    """Decay of the running reward baseline (advantage = ema_baseline only)."""
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Old-policy logprobs for the ratio: the trainer's own forward (detached; ratio exactly 1 on
    policy) or the sampler's. Their KL is reported either way."""

    @model_validator(mode="before")
    @classmethod
    def _take_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("name", "grpo") not in PRESETS:
            return data  # field validation reports an unknown name
        given = {k: v for k, v in data.items() if v is not None}
        return {**preset_values(given.get("name", "grpo")), **given}

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmSection:
        if 0.0 < self.dual_clip_c <= 1.0:
            raise ValueError(
                f"dual_clip_c = {self.dual_clip_c} must be above 1 (it caps the loss at c times "
                "the advantage); use e.g. dual_clip_c = 3.0, or 0 to turn it off"
            )
        if self.kl_coef > 0 and self.kl_placement == "reward_token" and not self.uses_value_model:
            raise ValueError(
                f"kl_placement = 'reward_token' needs token-level advantages, but advantage = "
                f"{self.advantage!r} gives one per sequence; use kl_placement = 'reward_sequence' "
                "(or 'loss'), or advantage = 'gae'"
            )
        return self

    @property
    def uses_value_model(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def origins(self) -> dict[str, str]:
        """Where each preset-backed field's value came from: the preset, or a setting."""
        origins = {}
        for key, value in preset_values(self.name).items():
            if getattr(self, key) != value:
                origins[key] = f"set (preset {self.name}: {value!r})"
            elif key in _VALUE_FIELDS and PRESETS[self.name][key] is None:
                origins[key] = f"preset ppo ({self.name} has no value model)"
            else:
                origins[key] = f"preset {self.name}"
        return origins
