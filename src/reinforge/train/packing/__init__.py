"""Padding-free packing: micro-batches by token budget (here and `plan`), the packed attention
paths (`attention`), the packed forward (`forward`) and the chunked LM-head logprobs
(`logprobs`). It may import `engine` (the varlen kernels), `distributed` and below; nothing else
in `train`.

Padding-free packing: variable-length sequences in token-budgeted micro-batches, and the
forward of one packed micro-batch through a HF causal LM.

Contract
- `pack(seqs, max_tokens)` splits a step's sequences (prompt ids + completion ids) into as few
  micro-batches as the token budget allows, balanced by token count, and lays each out as ONE row
  of concatenated tokens: no padding anywhere, `position_ids` restart at 0 per sequence and
  `cu_segments` marks the boundaries. A sequence is never split.
- Shared prompts: sequences with the same prompt ids (a GRPO group's n samples) are planned into
  one micro-batch where they fit and hold the prompt ONCE: the prompt is a segment of its own and
  each completion a segment that attends to the prompt's keys and then its own (positions go on
  from the prompt's). A group of 8 samples of a 30-token prompt and 5-token answers is 70 tokens
  instead of 280; values and gradients equal those of the sequences run one by one (the prompt's
  hidden states are the same in every copy; their gradients add up). Exact equality of the prompt
  ids is what counts: nothing is assumed about groups.
- Per-token data lives in the "K layout": the micro-batch's completion tokens, sequence after
  sequence (K = their total). `target_positions_K[k]` is the row position whose output predicts
  completion token k (the target at position t is token t + 1), so the LM head
  runs on K positions only, never on prompts. `targets_K`, `mask_K` (the loss mask) and every
  per-token extra (e.g. the sampler's logprobs) share this layout; per-sequence extras (e.g. the
  advantage) are `[S]`.
- `unpack(x_K, batch)` gives each sequence its values back; `batch.rows(x_K)` lays them out as
  right-padded `[S, T]` rows (T = longest completion), the shape `algorithms.losses` takes.
- Routing replay: a sequence's recorded experts (`PackSequence.routes`, one row per position of
  prompt + completion, a prefix of them) follow their tokens into the row (`routes_TNK`; -1 on
  rows without one); a shared prompt takes its members' rows (equal when the engine prefilled it
  once). The forward hands them to the model's sparse blocks (`engine.moe.set_replay`).
- `forward.packed_logprobs(model, batch, temperature)` is the forward: final hidden states of
  the row, then the chunked LM head of `train.packing.logprobs` on the K target positions. Tests
  check it against full logits over right-padded rows (`tests/padded_reference.py`).

Which sequences share a micro-batch is `train.packing.plan`'s (plain Python over lengths).
Attention stays inside each segment's keys: `train.packing.attention` (the implementations, the
kernels, the masks); `forward.packed_attention_kwargs` hands a micro-batch's boundaries to them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from reinforge.train.packing.attention import key_references
from reinforge.train.packing.plan import plan_shared_micro_batches
from reinforge.train.packing.records import record_fields


@dataclass(frozen=True)
class PackSequence:
    """One sequence to train on. `loss_mask`, and every list in `token_values`, has one entry per
    completion token (a multi-turn trajectory masks its environment tokens with 0)."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    loss_mask: Sequence[float] | None = None  # None: every completion token counts
    token_values: Mapping[str, Sequence[float]] = field(default_factory=dict)
    seq_values: Mapping[str, float] = field(default_factory=dict)
    # routing replay: [P, sparse layers, k] experts of the first P positions of prompt +
    # completion (`Completion.routes`); None: the model routes this sequence itself
    routes: Any = None
    # the engine's records of its residual streams (`Completion.hidden`); None: not recorded
    hidden: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class PackedBatch:
    """One micro-batch: a single row of L tokens holding S sequences with K completion tokens.

    Attention runs over G segments of the row. A sequence whose prompt no other sequence of the
    micro-batch shares is one segment (prompt + completion, keys = itself, causal). Sequences
    that share a prompt (a GRPO group) hold it once: the prompt is a segment of its own, and each
    completion is a segment whose keys are the prompt's tokens followed by its own, causal with
    the diagonal aligned to the last key. `key_index_J` lists each segment's keys as row
    positions, segment after segment (None: no prompt is shared, every segment's keys are its
    own tokens and `cu_keys_G1` is `cu_segments_G1`)."""

    input_ids_L: torch.Tensor  # [L] long
    position_ids_L: torch.Tensor  # [L] long: a token's position in its own sequence
    cu_segments_G1: torch.Tensor  # [G+1] int32, row offsets of the attention segments
    max_segment: int  # the longest segment (queries)
    target_positions_K: torch.Tensor  # [K] long: the row position that predicts token k
    targets_K: torch.Tensor  # [K] long
    mask_K: torch.Tensor  # [K] float, the loss mask
    values_K: dict[str, torch.Tensor]  # per-token extras, [K] float each
    seq_values_S: dict[str, torch.Tensor]  # per-sequence extras, [S] float each
    rows_index_ST: torch.Tensor  # [S, T] long: index into K of row s, column j (0 where padded)
    rows_valid_ST: torch.Tensor  # [S, T] bool
    num_completion_tokens: tuple[int, ...]  # per sequence
    indices: tuple[int, ...]  # each sequence's index in the list given to `pack`
    key_index_J: torch.Tensor | None = None  # [J] long: row positions of each segment's keys
    cu_keys_G1: torch.Tensor | None = None  # [G+1] int32, offsets into key_index_J
    max_keys: int = 0  # the most keys of one segment (= max_segment when nothing is shared)
    # with a key index: its `attention.key_references` (first entry of each row position [L], and
    # the entries that repeat one [J - L]), for a backward without atomic adds
    key_first_L: torch.Tensor | None = None
    key_extra_E: torch.Tensor | None = None
    routes_TNK: torch.Tensor | None = None  # [L, sparse layers, k] int16 recorded experts, -1: none
    # the engine's records (`train.packing.records`): each position's row in their store's
    # host rows ([L] long, 0: zeros), which the forward reads layer by layer
    record_rows_L: torch.Tensor | None = None
    record_store: Any = None
    # and the LM head's log-sum-exp and entropy at each target, [K, 2] float32 (NaN: a target
    # the loss does not read), which spare the head's forward its logits (`records.engine_stats`)
    record_stats_K2: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_L.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.indices)

    @property
    def mask_ST(self) -> torch.Tensor:
        return self.rows(self.mask_K)

    def rows(self, x_K: torch.Tensor) -> torch.Tensor:
        """Per-token values as right-padded [S, T] rows (zeros past each completion); keeps grad."""
        gathered_ST = x_K[self.rows_index_ST]
        return torch.where(self.rows_valid_ST, gathered_ST, torch.zeros_like(gathered_ST))

    def to(self, device) -> PackedBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = to_device(value, device)
            elif isinstance(value, dict):
                value = {k: to_device(v, device) for k, v in value.items()}
            moved[f.name] = value
        return PackedBatch(**moved)


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """`x` on `device`. A CPU tensor bound for a GPU goes through pinned memory without waiting:
    a copy from pageable memory synchronizes the host with the GPU, draining its queue (G1's
    profile, session 15: 108 of the update's 220 synchronizations were these copies). The pinned
    buffer is held by torch's host allocator until the copy has run."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def unpack(x_K: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Per-token values back per sequence: one [num_completion_tokens] tensor each."""
    return list(torch.split(x_K, list(batch.num_completion_tokens)))


# ---------------------------------------------------------------------------------------------
# Laying out one micro-batch


def pack(
    seqs: Sequence[PackSequence],
    max_tokens: int,
    min_micro_batches: int = 1,
    share_prompts: bool = True,
) -> list[PackedBatch]:
    """The step's sequences as packed micro-batches (CPU tensors; move each with `.to(device)`)."""
    plan = plan_shared_micro_batches(
        [s.prompt_ids for s in seqs],
        [len(s.completion_ids) for s in seqs],
        max_tokens,
        min_micro_batches,
        share_prompts,
    )
    return [pack_one(seqs, indices, share_prompts) for indices in plan]


def pack_one(
    seqs: Sequence[PackSequence], indices: Sequence[int], share_prompts: bool = True
) -> PackedBatch:
    """Lay out sequences `indices` of `seqs` as one packed row (see `PackedBatch`); sequences
    with equal prompt ids share one copy of the prompt unless `share_prompts` is False."""
    chosen = [seqs[i] for i in indices]
    value_names = _common_keys([s.token_values for s in chosen])
    seq_names = _common_keys([s.seq_values for s in chosen])
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, s in enumerate(chosen):
        assert len(s.prompt_ids) >= 1, "a sequence needs a prompt token to predict its first one"
        groups.setdefault(tuple(s.prompt_ids) if share_prompts else (j,), []).append(j)
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    keys: list[list[range]] = []  # per segment: its keys' row positions
    targets_of: list[list[int]] = [[] for _ in chosen]  # per sequence: its target positions
    rows_of: list[tuple[int, int]] = [(0, 0)] * len(chosen)  # per sequence: (prompt, completion)
    shared = False
    for members in groups.values():
        first = chosen[members[0]]
        num_prompt = len(first.prompt_ids)
        if len(members) == 1:  # one segment: prompt + completion, keys = itself
            start = len(ids)
            rows_of[members[0]] = (start, start + num_prompt)
            ids.extend(first.prompt_ids)
            ids.extend(first.completion_ids)
            positions.extend(range(len(ids) - start))
            cu.append(len(ids))
            keys.append([range(start, len(ids))])
            last = start + num_prompt - 1
            targets_of[members[0]] = list(range(last, last + len(first.completion_ids)))
            continue
        shared = True
        prompt = range(len(ids), len(ids) + num_prompt)
        ids.extend(first.prompt_ids)
        positions.extend(range(num_prompt))
        cu.append(len(ids))
        keys.append([prompt])
        for j in members:
            completion = chosen[j].completion_ids
            rows_of[j] = (prompt.start, len(ids))
            if not completion:
                continue
            start = len(ids)
            # the first token is predicted from the prompt's last position, the rest from the
            # completion's own
            targets_of[j] = [prompt[-1], *range(start, start + len(completion) - 1)]
            ids.extend(completion)
            positions.extend(range(num_prompt, num_prompt + len(completion)))
            cu.append(len(ids))
            keys.append([prompt, range(start, len(ids))])
    target_positions = [t for targets in targets_of for t in targets]
    mask: list[float] = []
    values: dict[str, list[float]] = {name: [] for name in value_names}
    for s in chosen:
        num_completion = len(s.completion_ids)
        loss_mask = [1.0] * num_completion if s.loss_mask is None else list(s.loss_mask)
        assert len(loss_mask) == num_completion, "one loss-mask entry per completion token"
        mask.extend(loss_mask)
        for name in value_names:
            assert len(s.token_values[name]) == num_completion, f"{name}: one per completion token"
            values[name].extend(s.token_values[name])
    counts = [len(s.completion_ids) for s in chosen]
    width = max(counts, default=0)
    offsets = torch.tensor([0, *counts]).cumsum(0)[:-1]
    columns_T = torch.arange(width)
    valid_ST = columns_T[None, :] < torch.tensor(counts)[:, None]
    index_ST = torch.where(valid_ST, offsets[:, None] + columns_T[None, :], 0)
    cu_G1 = torch.tensor(cu, dtype=torch.int32)
    max_segment = int(cu_G1.diff().max()) if len(cu) > 1 else 0
    key_index_J = cu_keys_G1 = key_first_L = key_extra_E = None
    max_keys = max_segment
    if shared:
        key_index_J = _longs([k for ranges in keys for r in ranges for k in r])
        sizes = [sum(len(r) for r in ranges) for ranges in keys]
        cu_keys_G1 = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32)
        max_keys = int(cu_keys_G1.diff().max())
        key_first_L, key_extra_E = key_references(key_index_J, len(ids))
    return PackedBatch(
        input_ids_L=_longs(ids),
        position_ids_L=_longs(positions),
        cu_segments_G1=cu_G1,
        max_segment=max_segment,
        target_positions_K=_longs(target_positions),
        targets_K=_longs([t for s in chosen for t in s.completion_ids]),
        mask_K=_floats(mask),
        values_K={k: _floats(v) for k, v in values.items()},
        seq_values_S={
            k: torch.tensor([s.seq_values[k] for s in chosen], dtype=torch.float32)
            for k in seq_names
        },
        rows_index_ST=index_ST,
        rows_valid_ST=valid_ST,
        num_completion_tokens=tuple(counts),
        indices=tuple(indices),
        key_index_J=key_index_J,
        cu_keys_G1=cu_keys_G1,
        max_keys=max_keys,
        key_first_L=key_first_L,
        key_extra_E=key_extra_E,
        routes_TNK=packed_routes(chosen, rows_of, len(ids)),
        **record_fields(chosen, rows_of, len(ids), target_positions, mask),
    )


def _longs(values: list[int]) -> torch.Tensor:
    """An int64 tensor of a Python list, through numpy: a third of `torch.tensor`'s time on a
    micro-batch's ~17k ids (1.0 -> 0.28 ms each on a 2-core CPU; the first micro-batch's packing
    is on the update's critical path)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _floats(values: list[float]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.float32))


def packed_routes(
    chosen: Sequence[PackSequence], rows_of: list[tuple[int, int]], length: int
) -> torch.Tensor | None:
    """The sequences' recorded routes at their row positions ([length, sparse layers, k] int16,
    -1 where none), or None when no sequence has any. `rows_of`: each sequence's (prompt,
    completion) start rows."""
    recorded = [s.routes for s in chosen if s.routes is not None]
    if not recorded:
        return None
    routes_TNK = torch.full((length, *recorded[0].shape[1:]), -1, dtype=torch.int16)
    for s, (prompt_row, completion_row) in zip(chosen, rows_of):
        if s.routes is None:
            continue
        own_PNK = torch.as_tensor(s.routes).to(torch.int16)
        num_prompt = len(s.prompt_ids)
        assert own_PNK.shape[0] <= s.num_tokens, "routes for more positions than tokens"
        prompt_PNK, completion_PNK = own_PNK[:num_prompt], own_PNK[num_prompt:]
        routes_TNK[prompt_row : prompt_row + len(prompt_PNK)] = prompt_PNK
        routes_TNK[completion_row : completion_row + len(completion_PNK)] = completion_PNK
    return routes_TNK


def _common_keys(dicts: list[Mapping]) -> list[str]:
    names = sorted(dicts[0]) if dicts else []
    assert all(sorted(d) == names for d in dicts), "every sequence carries the same extras"
    return names
