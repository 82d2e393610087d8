"""Padding-free packing: variable-length sequences in token-budgeted micro-batches, and the
forward of one packed micro-batch through a HF causal LM.

Contract
- `pack(seqs, max_tokens)` splits a step's sequences (prompt ids + completion ids) into as few
  micro-batches as the token budget allows, balanced by token count, and lays each out as ONE row
  of concatenated tokens: no padding anywhere, `position_ids` restart at 0 per sequence and
  `cu_seqlens` marks the boundaries. A sequence is never split.
- Per-token data lives in the "K layout": the micro-batch's completion tokens, sequence after
  sequence (K = their total). `target_positions_K[k]` is the row position whose output predicts
  completion token k (as in `pad_batch`: the target at position t is token t + 1), so the LM head
  runs on K positions only, never on prompts. `targets_K`, `mask_K` (the loss mask) and every
  per-token extra (e.g. the sampler's logprobs) share this layout; per-sequence extras (e.g. the
  advantage) are `[S]`.
- `unpack(x_K, batch)` gives each sequence its values back; `batch.rows(x_K)` lays them out as
  right-padded `[S, T]` rows (T = longest completion), the shape `algorithms.losses` takes.
- `packed_logprobs(model, batch, temperature)` is the forward: final hidden states of the row,
  then the chunked LM head of `train.logprobs` on the K target positions. It replaces
  `pad_batch` + `token_logprobs` in the RL update.

Attention never crosses sequences. What enforces it depends on the model's attention
implementation, chosen once by `select_packed_attention(model)`:
- "reinforge_varlen" (CUDA, torch >= 2.10, bf16/fp16 weights; what "auto" picks there):
  `torch.nn.attention.varlen.varlen_attn`, registered in transformers' `AttentionInterface`. The
  boundaries travel as `cu_seq_lens_q/k` and `max_length_q/k` kwargs (the names transformers'
  flash-attention path uses); no mask is built. Calls without those kwargs (e.g. `generate`)
  fall through to transformers' SDPA path, so the model stays usable for anything else.
- "reinforge_varlen_padded" (what "auto" picks elsewhere: the CPU, fp32 weights, older torch):
  the same wiring; the kernel lays the row out as right-padded sequences `[S, H, T, D]` and runs
  causal SDPA on them, so attention costs S*T^2 (T the longest sequence) instead of the mask
  path's L^2; right padding plus causality keeps real queries off the padded keys. Where padding
  would cost more than the mask (one long sequence among many short ones) it uses the mask.
  On the quickstart's SFT step (2-core CPU, 64 sequences of <= 44 tokens): 0.73 s against the
  mask path's 0.96 s at its best micro-batch size.
- "reinforge_varlen_reference": the same wiring with a per-sequence SDPA loop as the kernel, on
  any device. Slow; it exists to check the wiring.
- "sdpa" (`prefer="mask"`): a boolean block-diagonal causal mask `[1, 1, L, L]` (True = attend),
  which transformers 5 passes to SDPA as-is. L*L bytes and L^2 attention work.
- "eager" (a model loaded with it keeps it): the same mask in additive form (0 or the dtype's
  minimum), as eager attention adds it.
"""

from __future__ import annotations

import functools
import heapq
import inspect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from reinforge.errors import ConfigError
from reinforge.train.logprobs import (
    DEFAULT_CHUNK_SIZE,
    chunked_logprobs,
    final_hidden_states,
    lm_head_weight,
)

VARLEN = "reinforge_varlen"
VARLEN_REFERENCE = "reinforge_varlen_reference"
VARLEN_PADDED = "reinforge_varlen_padded"
VARLEN_IMPLEMENTATIONS = (VARLEN, VARLEN_REFERENCE, VARLEN_PADDED)
MASK_IMPLEMENTATIONS = ("sdpa", "eager")
BUDGET_SETTING = "train.micro_batch_tokens"


@dataclass(frozen=True)
class PackSequence:
    """One sequence to train on. `loss_mask`, and every list in `token_values`, has one entry per
    completion token (a multi-turn trajectory masks its environment tokens with 0)."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    loss_mask: Sequence[float] | None = None  # None: every completion token counts
    token_values: Mapping[str, Sequence[float]] = field(default_factory=dict)
    seq_values: Mapping[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def sequences_from_trajectories(trajs) -> list[PackSequence]:
    """RL trajectories as pack inputs: sampler logprobs per token, the advantage per sequence."""
    return [
        PackSequence(
            t.prompt_ids,
            t.completion.token_ids,
            token_values={"sampler_logprobs": t.completion.logprobs},
            seq_values={"advantage": t.advantage},
        )
        for t in trajs
    ]


@dataclass
class PackedBatch:
    """One micro-batch: a single row of L tokens holding S sequences with K completion tokens."""

    input_ids_L: torch.Tensor  # [L] long
    position_ids_L: torch.Tensor  # [L] long, 0 at each sequence start
    cu_seqlens_S1: torch.Tensor  # [S+1] int32, row offsets of the sequences
    max_seqlen: int
    target_positions_K: torch.Tensor  # [K] long: the row position that predicts token k
    targets_K: torch.Tensor  # [K] long
    mask_K: torch.Tensor  # [K] float, the loss mask
    values_K: dict[str, torch.Tensor]  # per-token extras, [K] float each
    seq_values_S: dict[str, torch.Tensor]  # per-sequence extras, [S] float each
    rows_index_ST: torch.Tensor  # [S, T] long: index into K of row s, column j (0 where padded)
    rows_valid_ST: torch.Tensor  # [S, T] bool
    num_completion_tokens: tuple[int, ...]  # per sequence
    indices: tuple[int, ...]  # each sequence's index in the list given to `pack`

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
                value = value.to(device)
            elif isinstance(value, dict):
                value = {k: v.to(device) for k, v in value.items()}
            moved[f.name] = value
        return PackedBatch(**moved)


def unpack(x_K: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Per-token values back per sequence: one [num_completion_tokens] tensor each."""
    return list(torch.split(x_K, list(batch.num_completion_tokens)))


# ---------------------------------------------------------------------------------------------
# Assigning sequences to micro-batches (plain Python over lengths)


def plan_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1
) -> list[list[int]]:
    """Indices of the sequences in each micro-batch: each micro-batch holds at most `max_tokens`
    tokens, there are as few as first-fit-decreasing needs (at least `min_micro_batches`, e.g. the
    same count on every data-parallel rank, capped at one sequence each), and token counts are
    balanced: longest first, each into the least-loaded micro-batch."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ConfigError(
            f"{BUDGET_SETTING} = {max_tokens} is shorter than the longest sequence "
            f"({longest} tokens, prompt + completion); use {BUDGET_SETTING} >= {longest} or a "
            "smaller rollout.max_new_tokens"
        )
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


# ---------------------------------------------------------------------------------------------
# Laying out one micro-batch


def pack(
    seqs: Sequence[PackSequence], max_tokens: int, min_micro_batches: int = 1
) -> list[PackedBatch]:
    """The step's sequences as packed micro-batches (CPU tensors; move each with `.to(device)`)."""
    plan = plan_micro_batches([s.num_tokens for s in seqs], max_tokens, min_micro_batches)
    return [pack_one(seqs, indices) for indices in plan]


def pack_one(seqs: Sequence[PackSequence], indices: Sequence[int]) -> PackedBatch:
    chosen = [seqs[i] for i in indices]
    value_names = _common_keys([s.token_values for s in chosen])
    seq_names = _common_keys([s.seq_values for s in chosen])
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    target_positions: list[int] = []
    mask: list[float] = []
    values: dict[str, list[float]] = {name: [] for name in value_names}
    for s in chosen:
        num_prompt, num_completion = len(s.prompt_ids), len(s.completion_ids)
        assert num_prompt >= 1, "a sequence needs a prompt token to predict its first completion"
        start = len(ids)
        ids.extend(s.prompt_ids)
        ids.extend(s.completion_ids)
        positions.extend(range(num_prompt + num_completion))
        cu.append(len(ids))
        target_positions.extend(
            range(start + num_prompt - 1, start + num_prompt - 1 + num_completion)
        )
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
    input_ids_L = torch.tensor(ids, dtype=torch.long)
    target_positions_K = torch.tensor(target_positions, dtype=torch.long)
    return PackedBatch(
        input_ids_L=input_ids_L,
        position_ids_L=torch.tensor(positions, dtype=torch.long),
        cu_seqlens_S1=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(s.num_tokens for s in chosen),
        target_positions_K=target_positions_K,
        targets_K=input_ids_L[target_positions_K + 1],
        mask_K=torch.tensor(mask, dtype=torch.float32),
        values_K={k: torch.tensor(v, dtype=torch.float32) for k, v in values.items()},
        seq_values_S={
            k: torch.tensor([s.seq_values[k] for s in chosen], dtype=torch.float32)
            for k in seq_names
        },
        rows_index_ST=index_ST,
        rows_valid_ST=valid_ST,
        num_completion_tokens=tuple(counts),
        indices=tuple(indices),
    )


def _common_keys(dicts: list[Mapping]) -> list[str]:
    names = sorted(dicts[0]) if dicts else []
    assert all(sorted(d) == names for d in dicts), "every sequence carries the same extras"
    return names


# ---------------------------------------------------------------------------------------------
# The forward of a packed micro-batch


def packed_logprobs(
    model, batch: PackedBatch, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of each completion token, [K] float32 each, both with grad."""
    hidden_LH = packed_hidden_states(model, batch)
    hidden_KH = hidden_LH.index_select(0, batch.target_positions_K)
    return chunked_logprobs(
        hidden_KH, lm_head_weight(model), batch.targets_K, temperature, chunk_size
    )


def packed_hidden_states(model, batch: PackedBatch) -> torch.Tensor:
    """Final (normed) hidden states of the packed row, [L, H]; no logits are computed."""
    hidden_1LH = final_hidden_states(
        model,
        batch.input_ids_L[None],
        position_ids=batch.position_ids_L[None],
        **packed_attention_kwargs(model, batch),
    )
    return hidden_1LH[0]


def packed_attention_kwargs(model, batch: PackedBatch) -> dict:
    """What keeps attention inside each sequence, for the model's attention implementation."""
    implementation = model.config._attn_implementation
    length = batch.num_tokens
    device = batch.input_ids_L.device
    if implementation in VARLEN_IMPLEMENTATIONS:
        return {
            # All ones: transformers sees no padding and builds no mask; the kernel gets the
            # boundaries from cu_seq_lens.
            "attention_mask": torch.ones(1, length, dtype=torch.long, device=device),
            "cu_seq_lens_q": batch.cu_seqlens_S1,
            "cu_seq_lens_k": batch.cu_seqlens_S1,
            "max_length_q": batch.max_seqlen,
            "max_length_k": batch.max_seqlen,
        }
    if implementation not in MASK_IMPLEMENTATIONS:
        raise ConfigError(
            f"the model's attention implementation {implementation!r} is not supported for packed "
            f"training; load the model with attn_implementation='sdpa' (or call "
            f"select_packed_attention(model) on CUDA)"
        )
    allowed_11LL = block_causal_mask(batch.cu_seqlens_S1, length, device)
    if implementation == "sdpa":
        return {"attention_mask": allowed_11LL}
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(allowed_11LL.shape, dtype=dtype, device=device)
    return {"attention_mask": additive.masked_fill_(~allowed_11LL, torch.finfo(dtype).min)}


def block_causal_mask(cu_seqlens_S1: torch.Tensor, length: int, device) -> torch.Tensor:
    """[1, 1, L, L] bool: query i may attend key j iff both are in one sequence and j <= i."""
    sizes_S = (cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]).to(device=device, dtype=torch.long)
    seq_of_L = torch.repeat_interleave(torch.arange(len(sizes_S), device=device), sizes_S)
    assert seq_of_L.numel() == length
    index_L = torch.arange(length, device=device)
    same_LL = seq_of_L[:, None] == seq_of_L[None, :]
    return (same_LL & (index_L[None, :] <= index_L[:, None]))[None, None]


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
        and _torch_varlen() is not None
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
        # Self-attention: keys share the queries' boundaries (cu_seq_lens_k is the same tensor).
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        q_LHD, k_LHD, v_LHD = (x[0].transpose(0, 1) for x in (query, key, value))
        out_LHD = kernel(q_LHD, k_LHD, v_LHD, cu_seq_lens_q, max_length_q, scale)
        return out_LHD[None], None  # [1, L, Hq, D], as transformers' attention functions return

    return forward


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _varlen_options() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def _torch_varlen_kernel(q_LHD, k_LHD, v_LHD, cu_S1, max_len: int, scale: float):
    """torch's flash varlen kernel, causal within each sequence. Its keyword names moved between
    torch releases (`is_causal` in 2.10, `window_size` later), so they are read off its signature."""
    options = _varlen_options()
    kwargs: dict = {}
    if "window_size" in options:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q_LHD.shape[1] != k_LHD.shape[1]:
        if "enable_gqa" in options:
            kwargs["enable_gqa"] = True
        else:
            k_LHD, v_LHD = (_repeat_heads(x, q_LHD.shape[1]) for x in (k_LHD, v_LHD))
    if "scale" in options:
        kwargs["scale"] = scale
    else:
        assert math.isclose(scale, q_LHD.shape[-1] ** -0.5), "kernel has no scale argument"
    return _torch_varlen()(
        q_LHD.contiguous(),
        k_LHD.contiguous(),
        v_LHD.contiguous(),
        cu_S1,
        cu_S1,
        max_len,
        max_len,
        **kwargs,
    )


def padded_varlen_kernel(q_LHD, k_LHD, v_LHD, cu_S1, max_len: int, scale: float):
    """Causal attention within each sequence as one SDPA call on right-padded rows [S, H, T, D]:
    a real query never sees a padded key (the pads come after it), and padded queries' outputs are
    dropped. Costs S*T^2; where that exceeds the row's L^2 the block-diagonal mask is used."""
    length, num_seqs = q_LHD.shape[0], cu_S1.numel() - 1
    gqa = q_LHD.shape[1] != k_LHD.shape[1]
    if num_seqs * max_len * max_len > length * length:
        mask_11LL = block_causal_mask(cu_S1, length, q_LHD.device)
        q, k, v = (x.transpose(0, 1)[None] for x in (q_LHD, k_LHD, v_LHD))
        out_1HLD = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask_11LL, scale=scale, enable_gqa=gqa
        )
        return out_1HLD[0].transpose(0, 1)
    cu_S1 = cu_S1.to(device=q_LHD.device, dtype=torch.long)
    offsets_T = torch.arange(max_len, device=q_LHD.device)
    valid_ST = offsets_T[None] < cu_S1.diff()[:, None]
    # each packed token's slot in the padded rows: sequence after sequence, as in the row
    slot_L = (torch.arange(num_seqs, device=q_LHD.device)[:, None] * max_len + offsets_T)[valid_ST]
    assert slot_L.numel() == length

    def padded(x_LHD):
        rows = x_LHD.new_zeros(num_seqs * max_len, *x_LHD.shape[1:]).index_copy(0, slot_L, x_LHD)
        return rows.view(num_seqs, max_len, *x_LHD.shape[1:]).transpose(1, 2)

    out_SHTD = torch.nn.functional.scaled_dot_product_attention(
        padded(q_LHD), padded(k_LHD), padded(v_LHD), is_causal=True, scale=scale, enable_gqa=gqa
    )
    out_XHD = out_SHTD.transpose(1, 2).reshape(num_seqs * max_len, *q_LHD.shape[1:])
    return out_XHD.index_select(0, slot_L)


def reference_varlen_kernel(q_LHD, k_LHD, v_LHD, cu_S1, max_len: int, scale: float):
    """The varlen contract in plain SDPA, one sequence at a time (any device; slow)."""
    num_heads = q_LHD.shape[1]
    k_LHD, v_LHD = (_repeat_heads(x, num_heads) for x in (k_LHD, v_LHD))
    bounds = cu_S1.tolist()
    outs = []
    for start, end in itertools.pairwise(bounds):
        q, k, v = (x[start:end].transpose(0, 1)[None] for x in (q_LHD, k_LHD, v_LHD))
        out_1HTD = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale
        )
        outs.append(out_1HTD[0].transpose(0, 1))
    return torch.cat(outs)


def _repeat_heads(x_LHD: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x_LHD.repeat_interleave(num_heads // x_LHD.shape[1], dim=1)
