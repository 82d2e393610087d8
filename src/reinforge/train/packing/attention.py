"""Attention for packed rows: the implementations a packed forward can use, their kernels, and
the masks, all over `Segments` (the query segments of a row and each segment's keys; see
`train.packing.PackedBatch`).

Attention never crosses segments' key lists. What enforces it depends on the model's attention
implementation, chosen once by `select_packed_attention(model)`:
- "reinforge_varlen" (CUDA, torch >= 2.10, bf16/fp16 weights; what "auto" picks there):
  `torch.nn.attention.varlen.varlen_attn`, registered in transformers' `AttentionInterface`. The
  boundaries travel as `cu_seq_lens_q/k` and `max_length_q/k` kwargs (the names transformers'
  flash-attention path uses) and, with shared prompts, the keys' row positions as
  `reinforge_key_index` (the kernel gathers K and V into each segment's key list, and flash
  attention's causal diagonal sits at the last key); no mask is built. Calls without those kwargs
  (e.g. `generate`) fall through to transformers' SDPA path, so the model stays usable.
- "reinforge_varlen_padded" (what "auto" picks elsewhere: the CPU, fp32 weights, older torch):
  the same wiring; the kernel lays the row out as right-padded sequences `[S, H, T, D]` and runs
  causal SDPA on them, so attention costs S*T^2 (T the longest sequence) instead of the mask
  path's L^2; right padding plus causality keeps real queries off the padded keys (shared-prompt
  segments get a [G, 1, Tq, Tk] mask with the diagonal at the last key). Where padding would
  cost more than a dense mask (one long sequence among many short ones) it uses the mask.
  On the quickstart's SFT step (2-core CPU, 64 sequences of <= 44 tokens): 0.73 s against the
  mask path's 0.96 s at its best micro-batch size.
- "reinforge_varlen_reference": the same wiring with a per-sequence SDPA loop as the kernel, on
  any device. Slow; it exists to check the wiring.
- "sdpa" (`prefer="mask"`): a boolean mask `[1, 1, L, L]` (True = attend; block-diagonal causal
  without shared prompts), which transformers 5 passes to SDPA as-is. L*L bytes, L^2 work.
- "eager" (a model loaded with it keeps it): the same mask in additive form (0 or the dtype's
  minimum), as eager attention adds it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from reinforge.engine.varlen import torch_varlen_attn, varlen_causal

VARLEN = "reinforge_varlen"
VARLEN_REFERENCE = "reinforge_varlen_reference"
VARLEN_PADDED = "reinforge_varlen_padded"
VARLEN_IMPLEMENTATIONS = (VARLEN, VARLEN_REFERENCE, VARLEN_PADDED)
MASK_IMPLEMENTATIONS = ("sdpa", "eager")

KEY_INDEX_KWARG = "reinforge_key_index"
KEY_FIRST_KWARG = "reinforge_key_first"
KEY_EXTRA_KWARG = "reinforge_key_extra"


@dataclass(frozen=True)
class Segments:
    """What a packed attention kernel needs: the query segments, and each segment's keys."""

    cu_q_G1: torch.Tensor  # [G+1] int32, row offsets of the segments
    max_q: int
    cu_k_G1: torch.Tensor  # [G+1] int32, offsets into the key stream (cu_q_G1 when no sharing)
    max_k: int
    key_index_J: torch.Tensor | None  # [J] long: the key stream as row positions; None: the row
    # `key_references(key_index_J)`: where the gradient of the key stream is summed back without
    # atomic adds (None: torch's index_select, whose backward adds every key atomically)
    key_first_L: torch.Tensor | None = None
    key_extra_E: torch.Tensor | None = None

    @property
    def num_segments(self) -> int:
        return self.cu_q_G1.numel() - 1

    def keys(self, x_LHD: torch.Tensor) -> torch.Tensor:
        """Keys or values laid out as the key stream, [J, H, D]."""
        if self.key_index_J is None:
            return x_LHD
        if self.key_first_L is None:
            return x_LHD.index_select(0, self.key_index_J)
        return _GatherKeys.apply(x_LHD, self.key_index_J, self.key_first_L, self.key_extra_E)


def key_references(key_index_J: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a key stream `key_index_J` (row positions) over a row of `length` positions, every one
    of which is some segment's key: (first_L, extra_E): the first stream entry of each row
    position, and the stream entries that repeat a position (a shared prompt's keys in its
    second to last sample's segments, spare keys of a padded shape). CPU tensors, long."""
    keys_J = key_index_J.numpy()
    positions, first_L = np.unique(keys_J, return_index=True)
    assert positions.size == length and positions[0] == 0 and positions[-1] == length - 1, (
        "every row position is some segment's key"
    )
    repeated_J = np.ones(keys_J.size, dtype=bool)
    repeated_J[first_L] = False
    return torch.from_numpy(first_L.astype(np.int64)), torch.from_numpy(
        np.flatnonzero(repeated_J).astype(np.int64)
    )


class _GatherKeys(torch.autograd.Function):
    """`x_LHD.index_select(0, index_J)` for a key stream, with a backward that reads instead of
    adding atomically: a row position's gradient is its first entry's, plus (an `index_add_`
    over the repeats only) the entries that repeat it. torch's own backward adds every entry of
    the stream atomically (G1's update, H200: 588 calls, 57 us each, 34 ms a step)."""

    @staticmethod
    def forward(ctx, x_LHD, index_J, first_L, extra_E):
        ctx.save_for_backward(index_J, first_L, extra_E)
        return x_LHD.index_select(0, index_J)

    @staticmethod
    def backward(ctx, grad_JHD):
        index_J, first_L, extra_E = ctx.saved_tensors
        grad_LHD = grad_JHD.index_select(0, first_L)
        if extra_E.numel():
            grad_LHD.index_add_(
                0, index_J.index_select(0, extra_E), grad_JHD.index_select(0, extra_E)
            )
        return grad_LHD, None, None, None


def segment_key_mask(seg: Segments, device) -> torch.Tensor:
    """[L, J] bool over the key stream: query i may attend key j iff both belong to one segment
    and j's offset in the segment's keys is at most i's offset plus (keys - queries) of that
    segment (causal, the diagonal aligned to the last key)."""
    cu_q, cu_k = (x.to(device=device, dtype=torch.long) for x in (seg.cu_q_G1, seg.cu_k_G1))
    sizes_q, sizes_k = cu_q.diff(), cu_k.diff()
    segments = torch.arange(seg.num_segments, device=device)
    seg_q = torch.repeat_interleave(segments, sizes_q)
    seg_k = torch.repeat_interleave(segments, sizes_k)
    reach_q = torch.arange(seg_q.numel(), device=device) - cu_q[seg_q] + (sizes_k - sizes_q)[seg_q]
    offset_k = torch.arange(seg_k.numel(), device=device) - cu_k[seg_k]
    return (seg_q[:, None] == seg_k[None, :]) & (offset_k[None, :] <= reach_q[:, None])


def segment_mask(seg: Segments, length: int, device) -> torch.Tensor:
    """[L, L] bool over the row (True = attend): `segment_key_mask` with the keys put back at
    their row positions. Without shared prompts, the block-diagonal causal mask."""
    allowed_LJ = segment_key_mask(seg, device)
    assert allowed_LJ.shape[0] == length
    if seg.key_index_J is None:
        return allowed_LJ
    rows, cols = allowed_LJ.nonzero(as_tuple=True)
    allowed_LL = torch.zeros(length, length, dtype=torch.bool, device=device)
    allowed_LL[rows, seg.key_index_J.to(device)[cols]] = True
    return allowed_LL


def plain_segments(cu_seqlens_S1: torch.Tensor) -> Segments:
    """Segments of whole sequences (no shared prompt): keys = the segment's own tokens."""
    longest = int(cu_seqlens_S1.diff().max())
    return Segments(cu_seqlens_S1, longest, cu_seqlens_S1, longest, None)


# ---------------------------------------------------------------------------------------------
# Variable-length attention through transformers' AttentionInterface


def select_packed_attention(model, prefer: str = "auto") -> str:
    """Set the attention implementation packed forwards use, and return its name.

    "auto": `VARLEN` on CUDA when torch has `varlen_attn` and the weights are bf16/fp16, otherwise
    `VARLEN_PADDED` (a model loaded with "eager" keeps it: the mask path). "padded":
    `VARLEN_PADDED`. "reference": `VARLEN_REFERENCE` (any device). "mask": the mask path ("sdpa"
    unless the model uses "eager")."""
    assert prefer in ("auto", "padded", "reference", "mask"), prefer
    param = next(model.parameters())
    current = model.config._attn_implementation
    if prefer == "reference":
        return _set_implementation(model, VARLEN_REFERENCE)
    if prefer == "padded":
        return _set_implementation(model, VARLEN_PADDED)
    if prefer == "mask":
        if current in VARLEN_IMPLEMENTATIONS:
            model.set_attn_implementation("sdpa")
        return model.config._attn_implementation
    if (
        param.device.type == "cuda"
        and param.dtype in (torch.bfloat16, torch.float16)
        and torch_varlen_attn() is not None
    ):
        return _set_implementation(model, VARLEN)
    if current == "eager":
        return current
    return _set_implementation(model, VARLEN_PADDED)


def _set_implementation(model, name: str) -> str:
    register_varlen_attention()
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name
    return name


@functools.cache
def register_varlen_attention() -> None:
    """Register the varlen implementations with transformers (idempotent). Their mask function is
    SDPA's, so unpacked calls with a padding mask behave exactly as "sdpa"."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN, _varlen_attention(_torch_varlen_kernel))
    AttentionInterface.register(VARLEN_REFERENCE, _varlen_attention(reference_varlen_kernel))
    AttentionInterface.register(VARLEN_PADDED, _varlen_attention(padded_varlen_kernel))
    for name in VARLEN_IMPLEMENTATIONS:
        AttentionMaskInterface.register(name, sdpa_mask)


def _varlen_attention(kernel):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def forward(
        module,
        query,  # [B, Hq, L, D]
        key,  # [B, Hkv, L, D]
        value,
        attention_mask,
        dropout: float = 0.0,
        scaling: float | None = None,
        cu_seq_lens_q=None,
        cu_seq_lens_k=None,
        max_length_q=None,
        max_length_k=None,
        **kwargs,
    ):
        key_index = kwargs.pop(KEY_INDEX_KWARG, None)
        key_first = kwargs.pop(KEY_FIRST_KWARG, None)
        key_extra = kwargs.pop(KEY_EXTRA_KWARG, None)
        if cu_seq_lens_q is None:  # not a packed call (generate, a plain forward)
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
        assert query.shape[0] == 1, "a packed micro-batch is one row"
        assert dropout == 0.0, "varlen attention has no dropout"
        assert kwargs.get("sliding_window") is None, "sliding-window layers are not packed"
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        q_LHD, k_LHD, v_LHD = (x[0].transpose(0, 1) for x in (query, key, value))
        seg = Segments(
            cu_seq_lens_q,
            max_length_q,
            cu_seq_lens_k,
            max_length_k,
            key_index,
            key_first,
            key_extra,
        )
        out_LHD = kernel(q_LHD, k_LHD, v_LHD, seg, scale)
        return out_LHD[None], None  # [1, L, Hq, D], as transformers' attention functions return

    return forward


def _torch_varlen_kernel(q_LHD, k_LHD, v_LHD, seg: Segments, scale: float):
    """torch's flash varlen kernel (`engine.varlen.varlen_causal`), causal within each segment
    over its key list (flash attention aligns the diagonal to the last key when a segment has
    more keys than queries, as shared prompts need)."""
    k_JHD, v_JHD = seg.keys(k_LHD), seg.keys(v_LHD)
    return varlen_causal(q_LHD, k_JHD, v_JHD, seg.cu_q_G1, seg.cu_k_G1, seg.max_q, seg.max_k, scale)


def padded_varlen_kernel(q_LHD, k_LHD, v_LHD, seg: Segments, scale: float):
    """Causal attention within each segment as one SDPA call on right-padded rows: queries
    [G, H, Tq, D], keys [G, H, Tk, D]. A real query never sees a padded key (the pads come after
    its reach) and padded queries' outputs are dropped. Costs G*Tq*Tk; where that exceeds the
    row's L*J the dense mask over the key stream is used instead."""
    device = q_LHD.device
    k_JHD, v_JHD = seg.keys(k_LHD), seg.keys(v_LHD)
    length, num_keys, num_segments = q_LHD.shape[0], k_JHD.shape[0], seg.num_segments
    gqa = q_LHD.shape[1] != k_JHD.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if num_segments * seg.max_q * seg.max_k > length * num_keys:
        allowed_11LJ = segment_key_mask(seg, device)[None, None]
        q, k, v = (x.transpose(0, 1)[None] for x in (q_LHD, k_JHD, v_JHD))
        out_1HLD = sdpa(q, k, v, attn_mask=allowed_11LJ, scale=scale, enable_gqa=gqa)
        return out_1HLD[0].transpose(0, 1)
    sizes_q = seg.cu_q_G1.to(device=device, dtype=torch.long).diff()
    sizes_k = seg.cu_k_G1.to(device=device, dtype=torch.long).diff()
    slot_q, slot_k = _slots(sizes_q, seg.max_q), _slots(sizes_k, seg.max_k)
    assert slot_q.numel() == length and slot_k.numel() == num_keys

    def padded(x_XHD, slots, width):
        rows = x_XHD.new_zeros(num_segments * width, *x_XHD.shape[1:]).index_copy(0, slots, x_XHD)
        return rows.view(num_segments, width, *x_XHD.shape[1:]).transpose(1, 2)

    q, k, v = (
        padded(q_LHD, slot_q, seg.max_q),
        *(padded(x, slot_k, seg.max_k) for x in (k_JHD, v_JHD)),
    )
    if seg.key_index_J is None:  # keys = queries: plain causal
        out_GHTD = sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        reach_GT = torch.arange(seg.max_q, device=device) + (sizes_k - sizes_q)[:, None]
        allowed_G1TT = torch.arange(seg.max_k, device=device) <= reach_GT[:, :, None]
        out_GHTD = sdpa(q, k, v, attn_mask=allowed_G1TT[:, None], scale=scale, enable_gqa=gqa)
    out_XHD = out_GHTD.transpose(1, 2).reshape(num_segments * seg.max_q, *q_LHD.shape[1:])
    return out_XHD.index_select(0, slot_q)


def _slots(sizes_G: torch.Tensor, width: int) -> torch.Tensor:
    """Each packed element's slot in right-padded rows of `width`, segment after segment."""
    offsets_T = torch.arange(width, device=sizes_G.device)
    valid_GT = offsets_T[None] < sizes_G[:, None]
    starts_G = torch.arange(sizes_G.numel(), device=sizes_G.device) * width
    return (starts_G[:, None] + offsets_T)[valid_GT]


def reference_varlen_kernel(q_LHD, k_LHD, v_LHD, seg: Segments, scale: float):
    """The varlen contract in plain SDPA, one segment at a time (any device; slow)."""
    num_heads = q_LHD.shape[1]
    k_JHD, v_JHD = (_repeat_heads(seg.keys(x), num_heads) for x in (k_LHD, v_LHD))
    outs = []
    for (q0, q1), (k0, k1) in zip(
        itertools.pairwise(seg.cu_q_G1.tolist()), itertools.pairwise(seg.cu_k_G1.tolist())
    ):
        q = q_LHD[q0:q1].transpose(0, 1)[None]
        k, v = (x[k0:k1].transpose(0, 1)[None] for x in (k_JHD, v_JHD))
        num_q, num_k = q1 - q0, k1 - k0
        allowed_QK = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q)
        out_1HTD = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed_QK, scale=scale
        )
        outs.append(out_1HTD[0].transpose(0, 1))
    return torch.cat(outs)


def _repeat_heads(x_LHD: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x_LHD.repeat_interleave(num_heads // x_LHD.shape[1], dim=1)
