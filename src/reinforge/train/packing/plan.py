"""Assigning a step's sequences to token-budgeted micro-batches: plain Python over lengths.

- `plan_micro_batches(lengths, max_tokens, min_micro_batches)`: as few micro-batches as
  first-fit-decreasing needs (at least `min_micro_batches`: the same count on every data-parallel
  rank), token counts balanced longest first; a sequence is never split.
- `plan_shared_micro_batches(prompts, completion_lengths, ...)`: the same over prompt groups, so
  that `train.packing.pack_one` can hold a shared prompt once per micro-batch.

A budget shorter than the longest sequence is the user's setting (`train.micro_batch_tokens`) and
is refused with the length that would work.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from reinforge.errors import ConfigError

BUDGET_SETTING = "train.micro_batch_tokens"


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1
) -> list[list[int]]:
    """Indices of the sequences in each micro-batch: each micro-batch holds at most `max_tokens`
    tokens, there are as few as first-fit-decreasing needs (at least `min_micro_batches`, e.g. the
    same count on every data-parallel rank, capped at one sequence each), and token counts are
    balanced: longest first, each into the least-loaded micro-batch."""
    if not lengths:
        return []
    _check_longest(lengths, max_tokens)
    first_fit = _first_fit_decreasing(lengths, max_tokens)
    lowest = min(max(min_micro_batches, math.ceil(sum(lengths) / max_tokens)), len(lengths))
    for count in range(lowest, max(lowest, len(first_fit)) + 1):
        bins = _balanced(lengths, count, max_tokens)
        if bins is not None:
            return bins
    return first_fit  # balancing found no fit at FFD's count (rare): keep FFD's bins


def _longest_first(lengths: Sequence[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _longest_first(lengths):
        slot = next((b for b, load in enumerate(loads) if load + lengths[i] <= capacity), None)
        if slot is None:
            bins.append([])
            loads.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        loads[slot] += lengths[i]
    return [sorted(b) for b in bins]


def _balanced(lengths: Sequence[int], count: int, capacity: int) -> list[list[int]] | None:
    """Longest-processing-time assignment to `count` bins; None if a sequence does not fit in the
    least-loaded bin (then it fits in none)."""
    heap = [(0, b) for b in range(count)]
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in _longest_first(lengths):
        load, b = heapq.heappop(heap)
        if load + lengths[i] > capacity:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins if b]


def plan_shared_micro_batches(
    prompts: Sequence[Sequence[int]],
    completion_lengths: Sequence[int],
    max_tokens: int,
    min_micro_batches: int = 1,
    share_prompts: bool = True,
) -> list[list[int]]:
    """`plan_micro_batches` over prompt groups: sequences with the same prompt ids go to one
    micro-batch where they fit (the prompt counted once), so `pack_one` can run the prompt once
    for all of them; a group too large for one micro-batch is split in as few parts as it takes.
    Where whole groups leave more micro-batches than their tokens need (large groups fill a
    budget coarsely: 3 groups of 4,224 tokens in 16,384), groups are split to fill each
    micro-batch, each part carrying its own copy of the prompt, if that saves micro-batches.
    Each micro-batch's indices come sorted."""
    lengths = [len(p) + c for p, c in zip(prompts, completion_lengths)]
    if not share_prompts:
        return plan_micro_batches(lengths, max_tokens, min_micro_batches)
    _check_longest(lengths, max_tokens)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    units: list[list[int]] = []
    unit_tokens: list[int] = []
    for members in groups.values():
        prompt_len = len(prompts[members[0]])
        for part in _parts(members, prompt_len, completion_lengths, max_tokens):
            units.append(part)
            unit_tokens.append(prompt_len + sum(completion_lengths[i] for i in part))
    bins = [
        [i for u in b for i in units[u]]
        for b in plan_micro_batches(unit_tokens, max_tokens, min_micro_batches)
    ]
    if len(bins) > max(min_micro_batches, math.ceil(sum(unit_tokens) / max_tokens)):
        by_size = sorted(groups.values(), key=lambda m: -sum(lengths[i] for i in m))
        filled = _filled(by_size, prompts, completion_lengths, max_tokens)
        if min_micro_batches <= len(filled) < len(bins):
            bins = _evened(filled, by_size, prompts, completion_lengths, max_tokens)
    return [sorted(b) for b in bins]


def _evened(
    filled: list[list[int]],
    groups: list[list[int]],
    prompts: Sequence[Sequence[int]],
    completion_lengths: Sequence[int],
    max_tokens: int,
) -> list[list[int]]:
    """`_filled`'s micro-batches (each filled to `max_tokens`, the last one with what is left)
    refilled as as many micro-batches of about equal size. A small last one costs as much host
    work as a full one, and a CUDA graph of the update replays only micro-batches of similar size
    (`train.loop.graphs`): launched beside it, it adds its activations to the kept graph's pool.
    First `_spread` (each micro-batch filled to its share of what is left, to the nearest
    sequence); where that needs a micro-batch more or overflows, the smallest budget under which
    `_filled` needs no more micro-batches (which can still leave the last one small: G1's 256
    completions of 512 tokens at 10,240 tokens fill 13 micro-batches of 19 and a last of 9)."""
    count = len(filled)
    spread = _spread(groups, prompts, completion_lengths, count, max_tokens)
    if spread is not None:
        return spread

    def tokens(b: list[int]) -> int:
        prompt_ids = {tuple(prompts[i]) for i in b}
        return sum(completion_lengths[i] for i in b) + sum(len(p) for p in prompt_ids)

    longest = max(len(prompts[i]) + completion_lengths[i] for b in filled for i in b)
    budget = max(longest, math.ceil(sum(tokens(b) for b in filled) / count))
    step = max(1, max_tokens // 100)
    while budget < max_tokens:
        evened = _filled(groups, prompts, completion_lengths, budget)
        if len(evened) <= count:
            return evened
        budget += step
    return filled


def _spread(
    groups: list[list[int]],
    prompts: Sequence[Sequence[int]],
    completion_lengths: Sequence[int],
    count: int,
    max_tokens: int,
) -> list[list[int]] | None:
    """Next fit with splitting into `count` micro-batches, each taking sequences while its load
    stays nearer to its share of the tokens left (left / micro-batches left, recomputed as it
    goes) than without them; the last takes the rest. A sequence that opens a part of its group
    brings the prompt's tokens with it. None where that needs more than `count` micro-batches
    or one exceeds `max_tokens`."""
    left = sum(len(prompts[g[0]]) + sum(completion_lengths[i] for i in g) for g in groups)
    bins: list[list[int]] = [[]]
    load = 0
    for members in groups:
        prompt_len = len(prompts[members[0]])
        prompt_in_bin = False
        for n, i in enumerate(members):
            cost = completion_lengths[i] + (0 if prompt_in_bin else prompt_len)
            share = (load + left) / (count - len(bins) + 1)
            last = len(bins) == count
            if bins[-1] and not last and (load + cost > max_tokens or load + cost / 2 > share):
                bins.append([])
                load, prompt_in_bin = 0, False
                cost = completion_lengths[i] + prompt_len
                if n > 0:
                    left += prompt_len  # the group's prompt again, for this part
            bins[-1].append(i)
            load += cost
            left -= cost
            prompt_in_bin = True
    loads = [
        sum(completion_lengths[i] for i in b) + sum(len(p) for p in {tuple(prompts[i]) for i in b})
        for b in bins
    ]
    if len(bins) > count or max(loads) > max_tokens:
        return None
    return bins


def _parts(
    members: list[int], prompt_len: int, completion_lengths: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """A group's members in order, cut into as few parts as fit `max_tokens` each (with the
    prompt once per part)."""
    parts: list[list[int]] = [[]]
    load = prompt_len
    for i in members:
        if parts[-1] and load + completion_lengths[i] > max_tokens:
            parts.append([])
            load = prompt_len
        parts[-1].append(i)
        load += completion_lengths[i]
    return parts


def _filled(
    groups: list[list[int]],
    prompts: Sequence[Sequence[int]],
    completion_lengths: Sequence[int],
    max_tokens: int,
) -> list[list[int]]:
    """Next fit with splitting: each micro-batch takes the next group's members while they fit;
    a group that overflows goes on in the next micro-batch with another copy of its prompt."""
    bins: list[list[int]] = [[]]
    load = 0
    for members in groups:
        prompt_len = len(prompts[members[0]])
        pending = list(members)
        while pending:
            if load + prompt_len + completion_lengths[pending[0]] > max_tokens:
                bins.append([])
                load = 0
            load += prompt_len
            while pending and load + completion_lengths[pending[0]] <= max_tokens:
                i = pending.pop(0)
                bins[-1].append(i)
                load += completion_lengths[i]
    return [b for b in bins if b]


def _check_longest(lengths: Sequence[int], max_tokens: int) -> None:
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ConfigError(
            f"{BUDGET_SETTING} = {max_tokens} is shorter than the longest sequence "
            f"({longest} tokens, prompt + completion); use {BUDGET_SETTING} >= {longest} or a "
            "smaller rollout.max_new_tokens"
        )
