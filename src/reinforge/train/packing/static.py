"""One shape for every micro-batch of a step, so that one CUDA graph can replay them all
(`train.loop.graphs`).

A captured graph replays fixed tensor shapes and fixed integers: the row length L, the number
of attention segments G, the key stream's length J, the targets K, the rows S x T, and the
longest segment's query and key counts that the varlen kernel takes as integers. `common_shape`
takes the largest of each over the step's micro-batches; `pad_packed` brings one micro-batch to
it without changing any real token's logprob or gradient:

- the row is extended by pad tokens (id 0, position 0) in segments of their own, none longer
  than the longest real one (`pad_chunk`: the kernel's bound), so every position of the row lies
  in a segment: a position outside every segment is never written by the kernel and could hold
  NaN, and NaN times a zero gradient is still NaN in the weights' gradients;
- with shared prompts, keys past the pad tokens' own (the shape's key stream is longer) fill
  segments of their own with no queries, none longer than `pad_chunk`;
- the segment offsets are then repeated up to G: empty segments, which no kernel reads;
- targets past the real ones predict token 0 from the last row position; no row points at them
  and their loss mask is 0;
- rows past the real sequences, and columns past each micro-batch's longest completion, are
  invalid (mask 0) and read target 0.

The padded tokens cost compute: `common_shape` is taken over micro-batches of similar size (the
trainer runs a much smaller last one as it is). A graph kept across steps takes it with room
(`room`), and a later micro-batch replays it where it `fits`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from reinforge.train.packing import PackedBatch
from reinforge.train.packing.attention import key_references


@dataclass(frozen=True)
class PackedShape:
    tokens: int  # L
    segments: int  # G
    keys: int  # J (the key stream: every micro-batch gets a key index when one shares a prompt)
    targets: int  # K
    seqs: int  # S
    width: int  # T
    max_segment: int
    max_keys: int
    shared: bool  # a key index (shared prompts) in some micro-batch
    records: tuple[int, ...] | None = None  # [layers, hidden] of the engine's records, or None
    record_stats: bool = False  # the engine's LM-head statistics too (`records.engine_stats`)


def common_shape(
    batches: Sequence[PackedBatch],
    tokens: int | None = None,
    room: float = 1.0,
    targets_room: float = 1.0,
) -> PackedShape:
    """The smallest shape every one of `batches` pads to (to `tokens` tokens where given); with
    `room` > 1, that much more of each bound but the tokens (`targets_room` for the targets, at
    most one per token): a shape later micro-batches may fit too (`fits`)."""
    assert batches, "no micro-batches"
    assert all(b.routes_TNK is None for b in batches), "recorded routes are not padded"
    largest = max(b.num_tokens for b in batches)
    assert tokens is None or tokens >= largest, (tokens, largest)
    tokens = largest if tokens is None else tokens

    def grow(n: int, factor: float = room) -> int:
        return max(n, math.ceil(n * factor))

    shared = any(b.key_index_J is not None for b in batches)
    max_segment = grow(max(max(b.max_segment for b in batches), 1))
    max_keys = grow(max(max(b.max_keys for b in batches), 1))
    keys = grow(max(_num_keys(b) + tokens - b.num_tokens for b in batches)) if shared else 0
    shape = PackedShape(
        tokens=tokens,
        segments=0,
        keys=keys,
        targets=min(tokens, grow(max(int(b.targets_K.numel()) for b in batches), targets_room)),
        seqs=grow(max(int(b.rows_index_ST.shape[0]) for b in batches)),
        width=grow(max(int(b.rows_index_ST.shape[1]) for b in batches)),
        max_segment=max_segment,
        max_keys=max_keys,
        shared=shared,
        records=_record_shape(batches),
        record_stats=all(b.record_stats_K2 is not None for b in batches),
    )
    return replace(shape, segments=grow(max(_segments_needed(b, shape) for b in batches)))


def _record_shape(batches: Sequence[PackedBatch]) -> tuple[int, ...] | None:
    """A graph reads records only when every micro-batch it was built from has them."""
    if all(b.record_rows_L is not None for b in batches):
        return tuple(batches[0].record_store.row_shape)
    return None


def fits(b: PackedBatch, shape: PackedShape) -> bool:
    """Whether `b` pads to `shape` (`pad_packed`)."""
    shared = b.key_index_J is not None
    return (
        b.routes_TNK is None
        and (b.record_rows_L is None) == (shape.records is None)
        and (b.record_stats_K2 is not None or not shape.record_stats)
        and b.num_tokens <= shape.tokens
        and (shape.shared or not shared)
        and (not shape.shared or _num_keys(b) + shape.tokens - b.num_tokens <= shape.keys)
        and int(b.targets_K.numel()) <= shape.targets
        and int(b.rows_index_ST.shape[0]) <= shape.seqs
        and int(b.rows_index_ST.shape[1]) <= shape.width
        and b.max_segment <= shape.max_segment
        and b.max_keys <= shape.max_keys
        and _segments_needed(b, shape) <= shape.segments
    )


def pad_chunk(shape: PackedShape) -> int:
    """The longest segment of pad tokens or spare keys: within the kernel's bounds on queries
    and keys."""
    return min(shape.max_segment, shape.max_keys) if shape.shared else shape.max_segment


def _segments_needed(b: PackedBatch, shape: PackedShape) -> int:
    """`b`'s segments padded to `shape`: its own, the pad tokens' and the spare keys' (`pad_packed`)."""
    chunk = pad_chunk(shape)
    pad = shape.tokens - b.num_tokens
    spare = shape.keys - _num_keys(b) - pad if shape.shared else 0
    return _num_segments(b) + -(-pad // chunk) + -(-spare // chunk)


def _num_segments(b: PackedBatch) -> int:
    return int(b.cu_segments_G1.numel()) - 1


def _num_keys(b: PackedBatch) -> int:
    return b.num_tokens if b.key_index_J is None else int(b.key_index_J.numel())


def _cat(x: torch.Tensor, *tails: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, *(t.to(x.dtype) for t in tails)])


def _offsets(
    cu_G1: torch.Tensor, end: int, pad: int, spare: int, segments: int, chunk: int
) -> torch.Tensor:
    """Offsets `cu_G1` (ending at `end`), then `pad` tokens and then `spare` keys in segments of at
    most `chunk`, then empty ones up to `segments`."""

    def chunks(start: int, n: int) -> torch.Tensor:
        return start + torch.arange(chunk, n + chunk, chunk).clamp(max=n)

    pads = chunks(end, pad)
    spares = chunks(end + pad, spare)
    filled = cu_G1.numel() + pads.numel() + spares.numel()
    assert filled <= segments + 1, (filled, segments)
    empty = torch.full((segments + 1 - filled,), end + pad + spare)
    return _cat(cu_G1, pads, spares, empty)


def pad_packed(b: PackedBatch, shape: PackedShape) -> PackedBatch:
    """`b` laid out in `shape` (CPU tensors, before `.to(device)`); real tokens' logprobs and
    gradients unchanged (module docstring)."""
    length, pad = b.num_tokens, shape.tokens - b.num_tokens
    assert pad >= 0 and b.routes_TNK is None
    zeros = torch.zeros(pad, dtype=torch.long)
    chunk = pad_chunk(shape)
    key_index_J = cu_keys_G1 = key_first_L = key_extra_E = None
    spare = 0
    if shape.shared:
        own_J = b.key_index_J if b.key_index_J is not None else torch.arange(length)
        own_cu = b.cu_keys_G1 if b.cu_keys_G1 is not None else b.cu_segments_G1
        # keys past the pad tokens' own: segments with no queries hold them (every key of the
        # stream then belongs to a segment, as the padded kernel expects)
        spare = shape.keys - own_J.numel() - pad
        # (spread over the row: no position collects them all in the backward's adds)
        spare_J = torch.arange(spare) % shape.tokens
        key_index_J = _cat(own_J, torch.arange(length, shape.tokens), spare_J)
        cu_keys_G1 = _offsets(own_cu, int(own_J.numel()), pad, spare, shape.segments, chunk)
        key_first_L, key_extra_E = key_references(key_index_J, shape.tokens)
    num_targets = int(b.targets_K.numel())
    extra = shape.targets - num_targets
    seqs, width = b.rows_index_ST.shape
    index_ST = torch.zeros(shape.seqs, shape.width, dtype=b.rows_index_ST.dtype)
    index_ST[:seqs, :width] = b.rows_index_ST
    valid_ST = torch.zeros(shape.seqs, shape.width, dtype=torch.bool)
    valid_ST[:seqs, :width] = b.rows_valid_ST

    def pad_k(x_K: torch.Tensor) -> torch.Tensor:
        return _cat(x_K, torch.zeros(extra))

    def pad_s(x_S: torch.Tensor) -> torch.Tensor:
        return _cat(x_S, torch.zeros(shape.seqs - x_S.numel()))

    return replace(
        b,
        input_ids_L=_cat(b.input_ids_L, zeros),
        position_ids_L=_cat(b.position_ids_L, zeros),
        # (its first empty segments are the spare keys': no queries)
        cu_segments_G1=_offsets(b.cu_segments_G1, length, pad, 0, shape.segments, chunk),
        max_segment=shape.max_segment,
        target_positions_K=_cat(b.target_positions_K, torch.full((extra,), shape.tokens - 1)),
        targets_K=pad_k(b.targets_K),
        mask_K=pad_k(b.mask_K),
        values_K={k: pad_k(v) for k, v in b.values_K.items()},
        seq_values_S={k: pad_s(v) for k, v in b.seq_values_S.items()},
        rows_index_ST=index_ST,
        rows_valid_ST=valid_ST,
        key_index_J=key_index_J,
        cu_keys_G1=cu_keys_G1,
        max_keys=shape.max_keys if shape.shared else shape.max_segment,
        key_first_L=key_first_L,
        key_extra_E=key_extra_E,
        # pad tokens read the zero row
        record_rows_L=None
        if b.record_rows_L is None or shape.records is None
        else _cat(b.record_rows_L, zeros),
        # pad targets are not read
        record_stats_K2=None
        if not shape.record_stats
        else torch.cat([b.record_stats_K2, torch.full((extra, 2), float("nan"))]),
    )


def pad_rows(x: torch.Tensor | None, shape: PackedShape) -> torch.Tensor | None:
    """Per-sequence [S] or per-token [S, T] step data of one micro-batch, zero-padded to the
    shape's rows (padded rows and columns carry mask 0, so zeros are never read as data)."""
    if x is None:
        return None
    if x.dim() == 1:
        return _cat(x, torch.zeros(shape.seqs - x.shape[0]))
    out = torch.zeros(shape.seqs, shape.width, dtype=x.dtype, device=x.device)
    out[: x.shape[0], : x.shape[1]] = x[:, : shape.width]
    return out
