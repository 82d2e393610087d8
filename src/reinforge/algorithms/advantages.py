"""Advantage estimators: rewards in, advantages out.

Outcome-reward estimators take the step's sequence rewards and share one signature,
`(rewards, scale, eps, group_sizes) -> advantages`, so the loop picks one from
`presets.ADVANTAGES`. The rewards are either a [G prompts, N samples] tensor (groups of equal
size; advantages come back [G, N]) or a flat [B] tensor in group order with `group_sizes` (any
sizes, 1 included; advantages come back [B]):

  grpo                   (r_i - mean_g) / (std + eps)               Shao et al. 2024
                         scale "none": Dr. GRPO                     Liu et al. 2025
  rloo                   r_i - mean_{j != i} r_j                    Kool et al. 2019; Ahmadian et al. 2024
  reinforce_pp           (r - mean_batch) / std_batch               Hu et al. 2025 (REINFORCE++)
  reinforce_pp_baseline  r~ = r_i - mean_g, then r~ / std_batch(r~)   (REINFORCE++ w/ Baseline)

`scale` says which standard deviation divides (TRL's `scale_rewards`): "group" (the group's
rewards), "batch" (the whole step's rewards; for reinforce_pp_baseline, the step's group-centred
rewards, as the paper and verl do) or "none". `SCALES` lists what each estimator accepts. Std is
the unbiased sample std; eps is TRL's 1e-4 or verl's 1e-6 (`algorithm.advantage_eps`).

A group of one sample has no baseline but itself: the group-relative estimators (grpo, rloo, the
group centring of reinforce_pp_baseline) give it 0, as a group of equal rewards. verl gives it
mean 0 and std 1 instead, so its advantage is the raw reward (docs/algorithms.md, "Groups of any
size"). reinforce_pp has no group baseline: a lone sample is one more entry of the batch.

Token-level estimators work on per-token rewards over a ragged mask: `gae_advantages` (PPO, needs
values), `discounted_returns` and `reinforce_pp_token_advantages` (REINFORCE++ with the KL penalty
folded into token rewards). `EMABaseline` is REINFORCE with a running baseline; it holds state, so
it is a small class rather than a registry entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reinforge.algorithms.table import SCALES, Scale

# verl's masked_whiten: (x - mean) * rsqrt(var + 1e-8)
WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class Groups:
    """Which group each entry of a flat [B] reward tensor belongs to (groups are contiguous)."""

    index_B: torch.Tensor  # group number of each entry, int64
    sizes_G: torch.Tensor  # entries per group, float (the divisor of means)
    first_B: torch.Tensor  # position of each entry's group's first entry

    @classmethod
    def of(cls, sizes: Sequence[int], device=None) -> Groups:
        sizes_G = torch.as_tensor(list(sizes), dtype=torch.int64, device=device)
        if sizes_G.numel() == 0 or bool((sizes_G < 1).any()):
            raise ValueError(f"group sizes {list(sizes)}: every group needs 1 or more samples")
        index_B = torch.repeat_interleave(torch.arange(len(sizes_G), device=device), sizes_G)
        starts_G = torch.cumsum(sizes_G, 0) - sizes_G
        return cls(index_B, sizes_G.to(torch.float64), starts_G[index_B])

    def sum(self, values_B: torch.Tensor) -> torch.Tensor:
        """Per-group sums [G] of [B] values."""
        sums_G = torch.zeros(len(self.sizes_G), dtype=values_B.dtype, device=values_B.device)
        return sums_G.index_add(0, self.index_B, values_B)


def grpo_advantages(
    rewards: torch.Tensor,
    scale: Scale = "group",
    eps: float = 1e-6,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rewards [G, N], or [B] with `group_sizes` -> advantages of the same shape: r - mean_g(r),
    divided by the std `scale` names, plus eps. A group whose rewards are all equal, or of one
    sample, gets zero advantage (it carries no signal), and each group's advantages sum to zero,
    whatever the scale."""
    rewards_B, groups, unflatten = _flat(rewards, group_sizes)
    centred_B = _centre_groups(rewards_B, groups)
    return unflatten(_scaled(centred_B, rewards_B, groups, scale, eps))


def rloo_advantages(
    rewards: torch.Tensor,
    scale: Scale = "none",
    eps: float = 1e-6,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740):
    A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_g), n the group's size.
    The baseline of sample i never sees r_i, so the estimator is unbiased; each group's
    advantages sum to zero. A group of one has no other sample to be its baseline: 0. A `scale`
    other than "none" (not in the paper) divides by a std."""
    rewards_B, groups, unflatten = _flat(rewards, group_sizes)
    # r_i - (sum - r_i) / (n - 1) rearranges to n/(n-1) * (r_i - mean_g): one centring, exact zeros
    n_B = groups.sizes_G[groups.index_B]
    factor_B = torch.where(n_B > 1, n_B / (n_B - 1).clamp(min=1.0), torch.zeros_like(n_B))
    centred_B = factor_B.to(rewards_B.dtype) * _centre_groups(rewards_B, groups)
    return unflatten(_scaled(centred_B, rewards_B, groups, scale, eps))


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    scale: Scale = "batch",
    eps: float = 1e-6,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262) with sequence rewards and no group baseline:
    A = (r - mean_batch(r)) / std_batch(r). The whole step's batch is the normaliser, not the
    prompt's group, so a group whose rewards are all equal still gets a (shared) advantage."""
    _check_scale("reinforce_pp", scale)
    rewards_B, groups, unflatten = _flat(rewards, group_sizes)
    return unflatten(_scaled(_centre_batch(rewards_B), rewards_B, groups, scale, eps))


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    scale: Scale = "batch",
    eps: float = 1e-6,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """REINFORCE++ w/ Baseline (Hu et al. 2025), the paper's variant for reasoning with k > 1
    samples per prompt: subtract the group mean, then whiten over the whole batch:
    r~_i = r_i - mean_g(r),  A_i = (r~_i - mean_batch(r~)) / std_batch(r~).
    mean_batch(r~) is 0 up to rounding; each group's advantages sum to zero; a group of one
    has r~ = 0 and counts in std_batch as an entry of 0."""
    _check_scale("reinforce_pp_baseline", scale)
    rewards_B, groups, unflatten = _flat(rewards, group_sizes)
    centred_B = _centre_batch(_centre_groups(rewards_B, groups))
    return unflatten(_scaled(centred_B, centred_B, groups, scale, eps))


def _flat(rewards: torch.Tensor, group_sizes: Sequence[int] | None):
    """(rewards [B], their Groups, a function giving results the input's shape)."""
    if group_sizes is None:
        assert rewards.dim() == 2, "flat rewards need group_sizes"
        shape = rewards.shape
        groups = Groups.of([shape[1]] * shape[0], rewards.device)
        return rewards.flatten(), groups, lambda values_B: values_B.view(shape)
    assert rewards.dim() == 1, "group_sizes go with flat rewards [B]"
    groups = Groups.of(group_sizes, rewards.device)
    assert len(groups.index_B) == rewards.numel(), (list(group_sizes), rewards.numel())
    return rewards, groups, lambda values_B: values_B


def _check_scale(name: str, scale: str) -> None:
    if scale not in SCALES[name]:
        raise ValueError(
            f"scale_rewards = {scale!r} does not apply to advantage = {name!r}; use one of "
            f"{', '.join(SCALES[name])}"
        )


def _scaled(
    centred_B: torch.Tensor, spread_B: torch.Tensor, groups: Groups, scale: Scale, eps: float
) -> torch.Tensor:
    """centred / (std of `spread` + eps): per group or over the batch; as is for none."""
    if scale == "none":
        return centred_B
    if scale == "batch":
        return centred_B / (_batch_std(spread_B) + eps)
    assert scale == "group", scale
    return centred_B / (_group_std(spread_B, groups) + eps)


def _centre_groups(rewards_B: torch.Tensor, groups: Groups) -> torch.Tensor:
    """r - mean_g(r), computed from the shift r - r_first(g) so that a group of equal rewards
    gives exactly 0 (a group of one too): the plain mean of equal float32 values can be off by
    one ulp, and the std division after it would blow that rounding up into a sizeable advantage."""
    shifted_B = rewards_B - rewards_B[groups.first_B]
    means_G = groups.sum(shifted_B) / groups.sizes_G.to(rewards_B.dtype)
    return shifted_B - means_G[groups.index_B]


def _group_std(values_B: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Each entry's group's unbiased std [B]; 0 for a group of one (whose centred value is 0)."""
    centred_B = _centre_groups(values_B, groups)
    dof_G = (groups.sizes_G - 1).clamp(min=1).to(values_B.dtype)
    return (groups.sum(centred_B.square()) / dof_G).sqrt()[groups.index_B]


def _centre_batch(values: torch.Tensor) -> torch.Tensor:
    """values - mean over every entry, shifted like `_centre_groups`."""
    shifted = values - values.flatten()[0]
    return shifted - shifted.mean()


def _batch_std(values: torch.Tensor) -> torch.Tensor:
    return values.std(unbiased=True) if values.numel() > 1 else torch.zeros((), dtype=values.dtype)


# ----------------------------------------------------------------------- token-level estimators


def outcome_token_rewards(rewards_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last completion token: [B] -> [B, T]."""
    is_last_BT = (mask_BT.cumsum(-1) == mask_BT.sum(-1, keepdim=True)) & (mask_BT > 0)
    return rewards_B[:, None] * is_last_BT.to(rewards_B.dtype)


@torch.no_grad()
def gae_advantages(
    token_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) over the mask:

      delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'},   R_t = A_t + V_t

    where t' is the next *masked-in* position (masked positions, such as the prompt and padding,
    are skipped; after a sequence's last token V = 0, the episode ends). Returns (advantages_BT,
    returns_BT), both 0 off the mask and detached: they are targets, not paths for gradient.
    """
    num_steps = token_rewards_BT.shape[1]
    values_BT = values_BT.detach()
    next_value_B = torch.zeros_like(values_BT[:, 0])
    next_adv_B = torch.zeros_like(values_BT[:, 0])
    advantages_T: list[torch.Tensor] = [next_adv_B] * num_steps
    for t in reversed(range(num_steps)):
        is_valid_B = mask_BT[:, t] > 0
        delta_B = token_rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        advantages_T[t] = torch.where(is_valid_B, adv_B, torch.zeros_like(adv_B))
        next_value_B = torch.where(is_valid_B, values_BT[:, t], next_value_B)
        next_adv_B = torch.where(is_valid_B, adv_B, next_adv_B)
    advantages_BT = torch.stack(advantages_T, dim=1)
    return advantages_BT, (advantages_BT + values_BT) * mask_BT


def discounted_returns(
    token_rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """G_t = sum_{k >= 0} gamma^k r_{t+k} over masked-in positions: GAE with V = 0 and lam = 1."""
    returns_BT, _ = gae_advantages(
        token_rewards_BT, torch.zeros_like(token_rewards_BT), mask_BT, gamma, 1.0
    )
    return returns_BT


def masked_whiten(
    values_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """(x - mean) * rsqrt(var + eps) over the masked-in entries of the whole batch, var unbiased;
    0 off the mask. verl's form and eps (1e-8) where it whitens (GAE, REINFORCE++): eps inside
    the root, so a batch of equal values maps to 0 and a spread of s to about 1/s."""
    count = mask_BT.sum()
    valid = values_BT[mask_BT > 0]
    shifted_BT = values_BT - (valid[0] if valid.numel() else 0.0)  # see _centre_groups
    centred_BT = shifted_BT - (shifted_BT * mask_BT).sum() / count.clamp(min=1.0)
    var = (centred_BT.square() * mask_BT).sum() / (count - 1.0).clamp(min=1.0)
    return centred_BT * torch.rsqrt(var + eps) * mask_BT


def reinforce_pp_token_advantages(
    token_rewards_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float = 1.0,
    whiten: bool = True,
    eps: float = WHITEN_EPS,
) -> torch.Tensor:
    """REINFORCE++ as first published (Hu et al. 2025): token rewards that already carry the
    per-token KL penalty (`kl.kl_penalized_token_rewards` on `outcome_token_rewards`), discounted
    returns G_t = sum_{s >= t} gamma^(s-t) r_s over the completion's tokens, whitened over every
    token of the batch (`whiten`)."""
    returns_BT = discounted_returns(token_rewards_BT, mask_BT, gamma)
    return masked_whiten(returns_BT, mask_BT, eps) if whiten else returns_BT


class EMABaseline:
    """REINFORCE with a running baseline (Williams 1992): A = r - b, then
    b <- decay * b + (1 - decay) * mean(r). The advantage uses b from *before* this batch, so the
    baseline never depends on the rewards it is subtracted from. State is one float, saved with
    the checkpoint via state_dict / load_state_dict."""

    def __init__(self, decay: float = 0.9, initial: float = 0.0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA baseline decay={decay} must be in [0, 1)")
        self.decay = decay
        self.value = float(initial)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Rewards of any shape -> advantages of the same shape; updates the baseline."""
        advantages = rewards - self.value
        self.value = self.decay * self.value + (1.0 - self.decay) * float(rewards.mean())
        return advantages

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
