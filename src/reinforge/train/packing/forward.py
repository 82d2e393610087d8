"""The trainer's one forward: per-token logprobs of completions, through packed micro-batches.

A micro-batch's sequences are packed into one row with no padding (`train.packing`: attention
stays inside each sequence; the samples of one prompt hold the prompt once), the decoder runs
once, and the LM head runs in chunks on the completion positions only (`train.packing.logprobs`), so no
[tokens, vocab] logits ever exist. `micro_batches` splits a step into micro-batches of at most
`train.micro_batch_tokens` tokens, balanced by token count, a group's samples together.

Rows layout: row s holds sequence s's completion tokens left-aligned, zeros past its end, [S, T]
with T the longest completion of the micro-batch. The step's per-token data (loss mask, sampler
logprobs, reference logprobs, values, advantages) are kept in the same layout for the whole step
([B, T_step], see `advantage_step.StepBatch`), so a micro-batch takes its rows with
`step_BT[indices, :T]` and the losses never see prompts or padding.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reinforge.distributed import max_over_ranks
from reinforge.engine.moe import set_replay
from reinforge.errors import ConfigError
from reinforge.sharding import PACKED_FORWARD, in_lockstep
from reinforge.train.packing import PackedBatch, PackSequence, pack_one
from reinforge.train.packing.attention import (
    KEY_EXTRA_KWARG,
    KEY_FIRST_KWARG,
    KEY_INDEX_KWARG,
    MASK_IMPLEMENTATIONS,
    VARLEN_IMPLEMENTATIONS,
    Segments,
    segment_mask,
)
from reinforge.train.packing.hidden import final_hidden_states, lm_head_weight
from reinforge.train.packing.logprobs import DEFAULT_CHUNK_SIZE, chunked_logprobs
from reinforge.train.packing.plan import plan_shared_micro_batches


@dataclass
class Rows:
    logprobs_ST: torch.Tensor  # float32, with grad when the forward had it
    entropy_ST: torch.Tensor  # float32, with grad when the forward had it
    valid_ST: torch.Tensor  # bool: a completion token (False past each completion's end)
    hidden_STH: torch.Tensor | None  # final hidden states at the positions predicting each token


def micro_batches(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    max_tokens: int,
    share_prompts: bool = True,
    lockstep: bool = True,
) -> list[list[int]]:
    """Indices of the sequences in each micro-batch (each sorted), at most `max_tokens` tokens
    per micro-batch, a group's shared prompt counted once (its sequences are kept together where
    they fit); a sequence longer than that is a `ConfigError` naming the setting. `lockstep`
    (`sharding.in_lockstep` of the model: FSDP): as many micro-batches on every rank."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    completion_lengths = [len(c) for c in completions]
    plan = plan_shared_micro_batches(
        prompts, completion_lengths, max_tokens, share_prompts=share_prompts
    )
    return equal_micro_batches(plan, lengths) if lockstep else plan


def equal_micro_batches(batches: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """`batches`, split further until every rank has as many as the rank with the most: under
    FSDP each forward is a collective (a rank with fewer would wait forever). The largest
    micro-batch is split in two, by tokens; every rank holds the same number of sequences, so
    there are always enough to split. One process: unchanged."""
    want = max_over_ranks(len(batches))
    batches = [list(b) for b in batches]
    while len(batches) < want:
        splittable = [b for b in batches if len(b) > 1]
        assert splittable, "fewer sequences on this rank than micro-batches on another"
        largest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        batches.remove(largest)
        prefix_tokens = list(itertools.accumulate(lengths[i] for i in largest))
        cut = bisect.bisect_left(prefix_tokens, prefix_tokens[-1] / 2) + 1
        cut = min(cut, len(largest) - 1)  # both halves keep a sequence
        batches += [largest[:cut], largest[cut:]]
    return batches


def completion_rows(
    model,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    with_hidden: bool = False,
    share_prompts: bool = True,
    routes: Sequence | None = None,
) -> Rows:
    """Logprob and entropy of each completion token under `model` (and the final hidden states
    for a value head), as completion rows; the sequences form one packed micro-batch. `routes`:
    each sequence's recorded experts (`Completion.routes`, or None) for routing replay."""
    device = next(model.parameters()).device
    seqs = completion_sequences(prompts, completions, routes)
    batch = pack_one(seqs, range(len(seqs)), share_prompts)
    return packed_rows(model, batch.to(device), temperature, with_hidden)


def completion_sequences(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    routes: Sequence | None = None,
    hidden: Sequence | None = None,
    loss_masks: Sequence | None = None,
) -> list[PackSequence]:
    """`hidden`: each sequence's engine records (`Completion.hidden`, or None); `loss_masks`:
    each completion's loss mask (`Completion.loss_mask`: None counts every token)."""
    routes = routes if routes is not None else [None] * len(prompts)
    hidden = hidden if hidden is not None else [None] * len(prompts)
    masks = loss_masks if loss_masks is not None else [None] * len(prompts)
    return [
        PackSequence(p, c, loss_mask=m, routes=r, hidden=h)
        for p, c, r, h, m in zip(prompts, completions, routes, hidden, masks)
    ]


def packed_rows(model, batch: PackedBatch, temperature: float, with_hidden: bool = False) -> Rows:
    """`completion_rows` of a micro-batch already packed (and on the model's device)."""
    # An FSDP-sharded model runs the same function as a registered forward method, which gathers
    # the root's parameters (the LM head among them) around it.
    forward = getattr(model, PACKED_FORWARD, None)
    if forward is not None:
        hidden_KH, logprobs_K, entropy_K = forward(batch, temperature)
    else:
        hidden_KH, logprobs_K, entropy_K = packed_logprobs(model, batch, temperature)
    return Rows(
        batch.rows(logprobs_K),
        batch.rows(entropy_K),
        batch.rows_valid_ST,
        hidden_KH[batch.rows_index_ST] if with_hidden else None,
    )


def packed_logprobs(
    model, batch: PackedBatch, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
):
    """(final hidden states at the target positions [K, H], logprob [K], entropy [K]) of the
    packed row's targets, float32 logprobs and entropies, all with grad."""
    hidden_LH = packed_hidden_states(model, batch)
    hidden_KH = hidden_LH.index_select(0, batch.target_positions_K)
    # one process or a replica: the head gradient goes straight into .grad (no [V, H] buffer
    # beside the layers' backward); under FSDP2 the gathered weight's gradient is FSDP's to reduce
    logprobs_K, entropy_K = chunked_logprobs(
        hidden_KH,
        lm_head_weight(model),
        batch.targets_K,
        temperature,
        chunk_size,
        weight_grad_in_place=not in_lockstep(model),
        stats_N2=batch.record_stats_K2,  # the engine's: no logits in the forward
    )
    return hidden_KH, logprobs_K, entropy_K


def packed_hidden_states(model, batch: PackedBatch) -> torch.Tensor:
    """Final (normed) hidden states of the packed row, [L, H]; no logits are computed. The
    batch's recorded routes, or none, are what the model's sparse blocks replay from now until
    the next packed forward (the backward's recomputation included)."""
    set_replay(model, batch.routes_TNK)
    if batch.record_rows_L is not None:
        from reinforge.train.packing.records import recorded_hidden_states

        return recorded_hidden_states(model, batch, packed_attention_kwargs(model, batch))
    hidden_1LH = final_hidden_states(
        model,
        batch.input_ids_L[None],
        position_ids=batch.position_ids_L[None],
        **packed_attention_kwargs(model, batch),
    )
    return hidden_1LH[0]


def packed_attention_kwargs(model, batch: PackedBatch) -> dict:
    """What keeps attention inside each segment, for the model's attention implementation."""
    implementation = model.config._attn_implementation
    length = batch.num_tokens
    device = batch.input_ids_L.device
    if implementation in VARLEN_IMPLEMENTATIONS:
        shared = batch.key_index_J is not None
        return {
            # All ones: transformers sees no padding and builds no mask; the kernel gets the
            # boundaries from cu_seq_lens.
            "attention_mask": torch.ones(1, length, dtype=torch.long, device=device),
            "cu_seq_lens_q": batch.cu_segments_G1,
            "cu_seq_lens_k": batch.cu_keys_G1 if shared else batch.cu_segments_G1,
            "max_length_q": batch.max_segment,
            "max_length_k": batch.max_keys,
            KEY_INDEX_KWARG: batch.key_index_J,
            KEY_FIRST_KWARG: batch.key_first_L,
            KEY_EXTRA_KWARG: batch.key_extra_E,
        }
    if implementation not in MASK_IMPLEMENTATIONS:
        raise ConfigError(
            f"the model's attention implementation {implementation!r} is not supported for packed "
            f"training; load the model with attn_implementation='sdpa' (or call "
            f"select_packed_attention(model) on CUDA)"
        )
    allowed_11LL = segment_mask(batch_segments(batch), length, device)[None, None]
    if implementation == "sdpa":
        return {"attention_mask": allowed_11LL}
    dtype = next(model.parameters()).dtype
    additive = torch.zeros(allowed_11LL.shape, dtype=dtype, device=device)
    return {"attention_mask": additive.masked_fill_(~allowed_11LL, torch.finfo(dtype).min)}


def batch_segments(batch: PackedBatch) -> Segments:
    shared = batch.key_index_J is not None
    return Segments(
        cu_q_G1=batch.cu_segments_G1,
        max_q=batch.max_segment,
        cu_k_G1=batch.cu_keys_G1 if shared else batch.cu_segments_G1,
        max_k=batch.max_keys,
        key_index_J=batch.key_index_J,
        key_first_L=batch.key_first_L,
        key_extra_E=batch.key_extra_E,
    )
