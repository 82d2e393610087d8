"""From scored groups to what the loss needs: the step's rows, reward shaping, advantages.

`Algorithm` turns the resolved `[algorithm]` section into callables once per run: the advantage
estimator from `ESTIMATORS` (the `presets.ADVANTAGES` functions plus those that are not plain
functions of sequence rewards: the token-level REINFORCE++ and GAE, which also needs values, and
the EMA baseline, which holds state), the policy loss
from `presets.POLICY_LOSSES`, and its settings. No branch in the loop names an algorithm.

Order within a step (docs/algorithms.md, "Wiring into the loop"):
1. `build_step_batch`: completion rows of the step, the loss mask (env tokens of multi-turn
   episodes out of it; truncated completions too when `mask_truncated`), the sampler's logprobs.
2. (the trainer fills reference logprobs and old values: `learner.score_with_models`)
3. `assign_advantages`: shape rewards (DAPO's overlong penalty; a sequence KL penalty), then
   the estimator: one advantage per sequence [B], or per token [B, T] with GAE returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from reinforge.algorithms.advantages import (
    EMABaseline,
    gae_advantages,
    masked_whiten,
    outcome_token_rewards,
    reinforce_pp_token_advantages,
)
from reinforge.algorithms.dapo import mask_truncated, overlong_penalty
from reinforge.algorithms.kl import kl_penalized_rewards, kl_penalized_token_rewards
from reinforge.algorithms.losses import PolicyLossSettings
from reinforge.algorithms.presets import ADVANTAGES, POLICY_LOSSES
from reinforge.config import AlgorithmSection
from reinforge.distributed import gather_rows, rank, sum_over_ranks, world_size
from reinforge.rollout.branching import shared_token_advantages
from reinforge.train.packing import to_device
from reinforge.types import Group, Trajectory


@dataclass
class StepBatch:
    """The step's trajectories and their per-token data as completion rows [B, T] (see
    `train.packing.forward`), B = the sum of the group sizes, in group order. Groups may differ in size
    (a group of one included: `advantages` says what each estimator gives it)."""

    trajs: list[Trajectory]
    group_sizes: list[int]
    mask_BT: torch.Tensor  # the loss mask
    sampler_BT: torch.Tensor  # the sampler's logprob of each token
    ref_BT: torch.Tensor | None = None  # the KL reference's logprobs (when kl_coef > 0)
    old_values_BT: torch.Tensor | None = None  # the value head's, before the update (GAE)
    advantages: torch.Tensor | None = None  # [B], or [B, T] for token-level estimators
    returns_BT: torch.Tensor | None = None  # value targets (GAE)
    num_tokens: float = 0.0  # loss tokens of the whole step, over every rank
    num_seqs: float = 0.0  # sequences (with a loss token, or all: seq_count), over every rank

    @property
    def prompts(self) -> list[list[int]]:
        return [t.prompt_ids for t in self.trajs]

    @property
    def completions(self) -> list[list[int]]:
        return [t.completion.token_ids for t in self.trajs]

    @property
    def routes(self) -> list:
        """Each trajectory's recorded experts (`Completion.routes`; None where not recorded)."""
        return [t.completion.routes for t in self.trajs]

    @property
    def hidden(self) -> list | None:
        """Each trajectory's engine records (`Completion.hidden`), or None when none has any."""
        hidden = [t.completion.hidden for t in self.trajs]
        return hidden if any(h is not None for h in hidden) else None

    def rewards_B(self) -> torch.Tensor:
        return torch.tensor([t.reward for t in self.trajs], dtype=torch.float32)


def build_step_batch(groups: list[Group], a: AlgorithmSection, device) -> StepBatch:
    trajs = [t for g in groups for t in g.trajectories]
    group_sizes = [len(g.trajectories) for g in groups]
    assert trajs and min(group_sizes) >= 1, f"a step of empty groups: sizes {group_sizes}"
    # built and counted on the host, then sent: the device is idle here, so a plain copy waits
    # for nothing (with pinned copies the step's batch took 40 ms on two GPU hosts, s25c and
    # s25e, against 23 with plain ones on a third, s25a: which of host or copy, not yet measured)
    sampler_BT = to_rows([t.completion.logprobs for t in trajs])
    mask_BT = to_rows([loss_mask(t) for t in trajs])
    if a.mask_truncated:
        mask_BT = mask_truncated(mask_BT, [t.completion.finish_reason for t in trajs])
    batch = StepBatch(trajs, group_sizes, mask_BT.to(device), sampler_BT.to(device))
    # The losses divide by the step's counts; in a distributed run, the global step's.
    batch.num_tokens = sum_over_ranks(float(mask_BT.sum()))
    if a.seq_count == "all":  # TRL: every row counts, an empty one adds 0 to the sum
        batch.num_seqs = sum_over_ranks(float(mask_BT.shape[0]))
    else:  # verl: rows with at least one loss token
        batch.num_seqs = sum_over_ranks(float((mask_BT.sum(-1) > 0).sum()))
    return batch


def select_rows(step_B: torch.Tensor, idx: list[int], width: int | None = None) -> torch.Tensor:
    """Rows `idx` of a step tensor ([B] or [B, T]; the first `width` columns when given), the
    index sent without waiting: indexing a GPU tensor with a list copies the list from pageable
    memory, which waits for the device (G1, session 25: the GPU idled once per micro-batch)."""
    index = to_device(torch.tensor(idx, dtype=torch.long), step_B.device)
    rows = step_B.index_select(0, index)
    return rows if width is None else rows[:, :width]


def loss_mask(traj: Trajectory) -> Sequence[float]:
    """1 for each completion id the sampler produced, 0 for env ids inside a multi-turn episode
    (tool outputs, game boards: the model never chose them, so they carry no loss and no KL)."""
    c = traj.completion
    if c.loss_mask is None:
        return np.ones(len(c.token_ids), dtype=np.float32)
    assert len(c.loss_mask) == len(c.token_ids) == len(c.logprobs), "mask and ids out of step"
    return c.loss_mask


def to_rows(values: Sequence[Sequence[float]]) -> torch.Tensor:
    """Ragged per-token values as left-aligned float32 rows [B, T] (CPU), zeros past each end:
    one conversion of all of them (G1's 256 x 512 on this project's 2-core CPU: 4 ms; a tensor
    per row took 19-22). Rows that are all numpy arrays (single-turn loss masks) are joined as
    arrays: iterating them element by element took 7 ms of G1's step batch, joining them 0.1."""
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    rows_BT = np.zeros((len(values), int(lengths.max(initial=0))), dtype=np.float32)
    if values and all(isinstance(v, np.ndarray) for v in values):
        flat = np.concatenate(values).astype(np.float32, copy=False)
    else:
        flat = np.fromiter(
            itertools.chain.from_iterable(values), dtype=np.float32, count=int(lengths.sum())
        )
    rows_BT[np.arange(rows_BT.shape[1])[None, :] < lengths[:, None]] = flat  # row by row
    return torch.from_numpy(rows_BT)


# --------------------------------------------------------------------------------- estimators


class GroupEstimator:
    """A `presets.ADVANTAGES` function: sequence rewards [B] of groups of any size -> one
    advantage per sequence."""

    def __init__(self, a: AlgorithmSection) -> None:
        self.fn, self.scale, self.eps = ADVANTAGES[a.advantage], a.scale_rewards, a.advantage_eps

    def __call__(self, rewards_B: torch.Tensor, batch: StepBatch) -> None:
        # An agent's episode split into segments (Trajectory.segment) is one sample of its group:
        # the estimator sees each episode once, and its segments share the episode's advantage.
        episode_B = torch.tensor([t.segment == 0 for t in batch.trajs]).cumsum(0) - 1
        assert int(episode_B[0]) == 0, "a step's first trajectory starts an episode"
        starts = [i for i, t in enumerate(batch.trajs) if t.segment == 0]
        episode_sizes = [
            sum(t.segment == 0 for t in group) for group in _split(batch.trajs, batch.group_sizes)
        ]
        all_E, first = gather_flat(rewards_B[starts])  # batch statistics: the global batch's
        sizes, _ = gather_flat(torch.tensor(episode_sizes))
        advantages_E = self.fn(all_E, self.scale, self.eps, group_sizes=sizes.tolist())
        batch.advantages = advantages_E[first : first + len(starts)][episode_B]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _split(items: list, sizes: list[int]) -> list[list]:
    """`items` cut into consecutive runs of `sizes`."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [items[a : a + n] for a, n in zip(starts, sizes)]


def gather_flat(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(every rank's 1-D `values` concatenated in rank order, where this rank's start): the
    ranks' counts may differ (groups of any size)."""
    if world_size() == 1:
        return values, 0
    counts = gather_rows(torch.tensor([values.numel()])).tolist()
    padded = torch.zeros(max(counts), dtype=values.dtype)
    padded[: values.numel()] = values
    parts = gather_rows(padded[None])
    return torch.cat([parts[r, :count] for r, count in enumerate(counts)]), sum(counts[: rank()])


class EMAEstimator(GroupEstimator):
    """REINFORCE with a running baseline (Williams 1992), optionally over the batch std."""

    def __init__(self, a: AlgorithmSection) -> None:
        self.baseline, self.scale, self.eps = (
            EMABaseline(a.ema_decay),
            a.scale_rewards,
            a.advantage_eps,
        )

    def __call__(self, rewards_B: torch.Tensor, batch: StepBatch) -> None:
        all_B, first = gather_flat(rewards_B)  # every rank moves its baseline by the global batch
        advantages_B = self.baseline.advantages(all_B)
        if self.scale == "batch" and advantages_B.numel() > 1:
            advantages_B = advantages_B / (all_B.std() + self.eps)
        batch.advantages = advantages_B[first : first + len(rewards_B)]

    def state_dict(self) -> dict:
        return self.baseline.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.baseline.load_state_dict(state)


class TokenEstimator(GroupEstimator):
    """Token-level advantages: each completion's reward on its last token, an optional per-token
    KL penalty (kl_placement = reward_token), then `token_advantages`."""

    def __init__(self, a: AlgorithmSection) -> None:
        self.kl_token_coef = a.kl_coef if a.kl_placement == "reward_token" else 0.0
        self.kl_estimator, self.whiten = a.kl_estimator, a.scale_rewards == "batch"
        self.gamma = a.gamma

    def __call__(self, rewards_B: torch.Tensor, batch: StepBatch) -> None:
        mask_BT = batch.mask_BT
        token_rewards_BT = outcome_token_rewards(rewards_B.to(mask_BT.device), mask_BT)
        if self.kl_token_coef > 0:
            assert batch.ref_BT is not None, "a KL reward penalty needs reference logprobs"
            token_rewards_BT = kl_penalized_token_rewards(
                token_rewards_BT,
                batch.sampler_BT,
                batch.ref_BT,
                mask_BT,
                self.kl_token_coef,
                self.kl_estimator,
            )
        self.token_advantages(token_rewards_BT, batch)

    def token_advantages(self, token_rewards_BT: torch.Tensor, batch: StepBatch) -> None:
        """REINFORCE++: discounted returns, whitened over the step's tokens."""
        batch.advantages = reinforce_pp_token_advantages(
            token_rewards_BT, batch.mask_BT, self.gamma, self.whiten
        )


class GAEEstimator(TokenEstimator):
    """PPO: GAE over the value head's old values, whitened advantages, value targets."""

    def __init__(self, a: AlgorithmSection) -> None:
        super().__init__(a)
        self.lam = a.lam

    def token_advantages(self, token_rewards_BT: torch.Tensor, batch: StepBatch) -> None:
        assert batch.old_values_BT is not None, "GAE needs the value head's old values"
        mask_BT = batch.mask_BT
        advantages_BT, batch.returns_BT = gae_advantages(
            token_rewards_BT, batch.old_values_BT, mask_BT, self.gamma, self.lam
        )
        batch.advantages = masked_whiten(advantages_BT, mask_BT) if self.whiten else advantages_BT


ESTIMATORS: dict[str, type[GroupEstimator]] = {
    **{name: GroupEstimator for name in ADVANTAGES},
    "gae": GAEEstimator,
    "reinforce_pp_token": TokenEstimator,
    "ema_baseline": EMAEstimator,
}


class Algorithm:
    """The resolved `[algorithm]` section as callables, built once per run; holds the
    estimator's state (the EMA baseline), which checkpoints save."""

    def __init__(self, a: AlgorithmSection) -> None:
        self.section = a
        self.estimator = ESTIMATORS[a.advantage](a)
        self.policy_loss = POLICY_LOSSES[a.loss]
        self.settings = PolicyLossSettings(
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            kl_coef=a.kl_coef if a.kl_placement == "loss" else 0.0,  # else: in the rewards
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
            aggregation=a.loss_aggregation,
            dual_clip_c=a.dual_clip_c or None,
            tis_cap=a.tis_cap or None,
            tis_level=a.tis_level,
            mis_low=a.mis_low or None,
            mis_high=a.mis_high or None,
            mis_level=a.mis_level,
            kl_importance_correction=a.kl_importance_correction,
        )

    def state_dict(self) -> dict:
        return {"estimator": self.estimator.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state["estimator"])


# ----------------------------------------------------------------------------------- the step


def assign_advantages(
    batch: StepBatch, algorithm: Algorithm, max_new_tokens: int
) -> dict[str, float]:
    """Shape the rewards, run the estimator, and give each trajectory its (mean) advantage."""
    rewards_B, metrics = shaped_rewards(batch, algorithm.section, max_new_tokens)
    algorithm.estimator(rewards_B, batch)
    assert batch.advantages is not None
    # branches' shared tokens: the mean of their advantages (rollout.branching, hard)
    batch.advantages = shared_token_advantages(
        batch.advantages, batch.trajs, batch.mask_BT.shape[1]
    )
    advantages = batch.advantages
    if advantages.dim() == 2:  # per token: report each sequence's mean
        per_seq_B = (advantages * batch.mask_BT).sum(-1) / batch.mask_BT.sum(-1).clamp(min=1.0)
    else:
        per_seq_B = advantages
    for traj, adv in zip(batch.trajs, per_seq_B.tolist()):
        traj.advantage = adv
    metrics["advantage_abs_mean"] = float(per_seq_B.abs().mean())
    return metrics


def shaped_rewards(
    batch: StepBatch, a: AlgorithmSection, max_new_tokens: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """The task rewards [B] plus DAPO's overlong penalty and a sequence-level KL penalty (RLOO:
    r - beta * sum_t KL_t, from the sampler's logprobs against the reference's), as configured."""
    rewards_B = batch.rewards_B()
    metrics: dict[str, float] = {}
    if a.overlong_buffer:
        lengths_B = torch.tensor([t.num_completion_tokens for t in batch.trajs])
        penalty_B = overlong_penalty(lengths_B, max_new_tokens, a.overlong_buffer)
        rewards_B = rewards_B + penalty_B
        metrics["overlong_penalty"] = float(penalty_B.mean())
    if a.kl_coef > 0 and a.kl_placement == "reward_sequence":
        assert batch.ref_BT is not None, "a KL reward penalty needs reference logprobs"
        mask_BT = batch.mask_BT
        penalized_B = kl_penalized_rewards(
            rewards_B.to(mask_BT.device),
            batch.sampler_BT,
            batch.ref_BT,
            mask_BT,
            a.kl_coef,
            a.kl_estimator,
        ).cpu()
        metrics["kl_penalty"] = float((rewards_B - penalized_B).mean())
        rewards_B = penalized_B
    return rewards_B, metrics
