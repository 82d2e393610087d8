"""Entropy-adaptive branching of multi-turn episodes (ARPO's rollout) and the attribution of
advantages to the tokens branches share.

The rule, per prompt with a budget of M episodes (`rollout.samples_per_prompt`):

1. `initial_samples` N episodes are sampled from the prompt (one prefill, pages shared). The
   initial entropy H0 of each is the mean of the sampler's entropy over its first
   `entropy_window` tokens.
2. After each env reply (a tool result; `tools` limits it to replies to those tools), the
   episode's next turn records the entropy of its first `entropy_window` tokens, H. With
   dH = mean(H) - H0 (nats), the episode branches when
   `base_probability + entropy_weight * dH > threshold`: `branch_size` new episodes (fewer
   when the budget has less left) start from the same point, right after the env reply, each a
   copy of the episode so far (its env state deep-copied) sampling its own continuation. The
   engine forks the sequence: the branches share the history's KV pages and compute nothing of
   it again. Branches branch again after later replies, within the budget.
3. When every episode of the prompt has ended with the budget not spent, the rest is filled as
   ARPO does: M minus the episodes so far fresh episodes from the prompt (trajectory-level
   samples, no branching of their own left to fill).

H0 and H are the entropy in nats of the distribution the sampler draws from (temperature
applied, before top-p / top-k); dH is their raw difference, not normalised (ARPO divides a sum
of differences by the vocabulary size; a plain mean difference keeps `threshold` readable in
nats: with the defaults, an episode branches when its entropy after the reply is above its
initial entropy).

Advantage attribution (`attribution`): "soft" trains each branch as its own sequence, its shared
prefix repeated in each, every token with its branch's advantage; "hard" gives every token that
several branches share the mean advantage of the branches sharing it (its own tokens keep its
own). Both keep the prefixes repeated as sequences of the batch: the loss's token-mean counts a
shared token once per branch holding it (sequence-mean: once per sequence), as GRPO would if the
branches were sampled apart; under "hard" the copies of a shared token carry the same advantage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from reinforge.types import Trajectory


@dataclass(frozen=True)
class Branching:
    initial_samples: int = 2
    branch_size: int = 2
    entropy_window: int = 16
    threshold: float = 0.5
    base_probability: float = 0.5
    entropy_weight: float = 1.0
    tools: tuple[str, ...] = ()  # branch after replies to these tools only; () = after any reply
    attribution: str = "hard"

    @classmethod
    def of(cls, section) -> Branching | None:
        """From `[rollout.branching]`; None when it is off."""
        if section is None or not section.enabled:
            return None
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in section.model_dump().items() if k in fields}
        return cls(**{**values, "tools": tuple(values.get("tools", ()))})

    def should_branch(self, window: list[float], initial: float) -> bool:
        """ARPO's branching probability against the threshold, for a window of entropies."""
        if not window:
            return False
        change = sum(window) / len(window) - initial
        return self.base_probability + self.entropy_weight * change > self.threshold

    def branches_after(self, tools_called: set[str]) -> bool:
        """Whether a reply to these tool calls is a branching point (no names known: any reply
        is, when `tools` names none)."""
        return not self.tools or bool(tools_called & set(self.tools))


def tools_called(env, assistant_text: str) -> set[str]:
    """Names of the tools an assistant turn called, for an env that parses calls (ToolEnv's
    `parse`); empty for any other env."""
    parse = getattr(env, "parse", None)
    if parse is None:
        return set()
    return {item.name for item in parse(assistant_text).items if hasattr(item, "name")}


def shared_lengths(lineage: list[tuple[int | None, int]]) -> list[list[int]]:
    """Completion tokens each pair of a group's episodes shares, from their lineage: episode i
    is a branch of episode `lineage[i][0]` (None: sampled from the prompt) taken when that one
    had `lineage[i][1]` completion tokens. A parent comes before its branches."""
    n = len(lineage)
    # ancestors[i]: {ancestor: tokens shared with it}, itself included (unbounded)
    ancestors: list[dict[int, float]] = []
    for i, (parent, at) in enumerate(lineage):
        own: dict[int, float] = {i: float("inf")}
        if parent is not None:
            assert parent < i, "a parent comes before its branches"
            for a, shared in ancestors[parent].items():
                own[a] = min(shared, at)
        ancestors.append(own)
    out = [[0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            common = ancestors[i].keys() & ancestors[j].keys()
            best = max((min(ancestors[i][a], ancestors[j][a]) for a in common), default=0)
            out[i][j] = -1 if best == float("inf") else int(best)  # -1: the whole of itself
    return out


def shared_token_advantages(
    advantages: torch.Tensor, trajs: list[Trajectory], width: int
) -> torch.Tensor:
    """Hard attribution: a token shared by several branches of a group gets the mean advantage of
    the branches sharing it. `advantages`: [B] (or [B, T]) in `trajs`' order (groups back to
    back, each trajectory's `shared_tokens` indexed within its group); returns them unchanged
    when no trajectory carries `shared_tokens` (soft attribution, or no branching), else
    [B, width]."""
    if not any(t.shared_tokens for t in trajs):
        return advantages
    adv_BT = advantages if advantages.dim() == 2 else advantages[:, None].expand(-1, width)
    out_BT = adv_BT.clone()
    start = 0
    while start < len(trajs):
        size = len(trajs[start].shared_tokens) or 1
        group = slice(start, start + size)
        out_BT[group] = _group_mean_over_sharers(adv_BT[group], trajs[group])
        start += size
    return out_BT


def _group_mean_over_sharers(adv_NT: torch.Tensor, trajs: list[Trajectory]) -> torch.Tensor:
    n, width = adv_NT.shape
    if not trajs[0].shared_tokens:
        return adv_NT
    assert all(len(t.shared_tokens) == n for t in trajs), "shared_tokens spans the group"
    positions_T = torch.arange(width, device=adv_NT.device)
    shared_NN = torch.tensor([t.shared_tokens for t in trajs], device=adv_NT.device)
    shared_NN = torch.where(shared_NN < 0, width, shared_NN)  # -1: the whole sequence
    # sharers_NNT[i, j, t]: episode j holds token t of episode i
    sharers_NNT = (positions_T[None, None, :] < shared_NN[:, :, None]).to(adv_NT.dtype)
    summed_NT = (sharers_NNT * adv_NT[None, :, :]).sum(1)
    return summed_NT / sharers_NNT.sum(1).clamp(min=1.0)
