"""The update's forward from the engine's records (issue 26): no first forward through the layers.

A checkpointed micro-batch runs its layers forward once keeping only each layer's input, then
per layer, in the backward, recomputes it with activations kept and backpropagates. When the
engine recorded the residual stream after every layer for every token of the micro-batch
(`engine.records`: on policy, same weights, one update per rollout), that first forward is
already done: each layer's output is its record. Here the forward only embeds the tokens and
hands each layer's record on as its output (`_FromRecord`, nothing computed), the final norm
and the loss read the last one, and the backward recomputes each layer from its input (the
record before it, or the embedding) and backpropagates through it, exactly as a reentrant
checkpoint does. The arithmetic per micro-batch falls from two forwards and a backward to one
of each. Each layer's records are read when its backward needs them, straight from the engine's
pinned host rows (`HiddenStore.read_layer`: on CUDA a kernel reads host memory over the bus, the
next layer's read queued beside the current layer's compute), so the device holds no
checkpoints at all: one layer's activations and two layers' records at a time.

The LM head's forward goes too (`engine_stats`): the engine's sampler kept, beside each row it
sampled a token from, the log-sum-exp and entropy of that distribution at the rollout's
temperature. A target's logprob is then its own logit less the log-sum-exp, and the head's
backward needs nothing else of the forward (it recomputes the logits slice by slice as before):
no [tokens, vocab] product in the forward. Targets the loss does not read (an environment's
tokens, never sampled) carry none and get no gradient.

The numbers: logprobs and gradients are the trainer's own at the engine's hidden states, which
differ from the trainer's forward by the two kernels' rounding (bf16); in float32 they match the
plain path (`tests/train/test_records.py`). A micro-batch with a sequence whose records are
missing, stale or for other ids runs the plain forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def sequence_rows(
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    hidden: Any,
    loss_mask: Sequence[float] | None = None,
):
    """The host rows of each position of prompt + completion, or None when the records cannot
    serve: none, stale (the weights changed), over the store's room, for other ids, or with a
    needed position missing.

    Needed: every position up to the one that predicts the last sampled token (the last with a
    loss-mask entry above 0; the last token when there is no mask), and the ids through that
    token must be the engine's. Later positions read the zero row: the last token's output
    predicts nothing, and a multi-turn episode's trailing environment tokens (its final reply,
    which the engine never computed) are masked out of the loss, and causal attention keeps them
    from every position before."""
    if hidden is None or not hidden.valid or hidden.token_ids is None:
        return None
    num_prompt = len(prompt_ids)
    n = num_prompt + len(completion_ids)
    engine_ids = hidden.token_ids
    need = n - 1
    if loss_mask is not None and (len(engine_ids) < n or hidden.length < need):
        # trailing tokens the engine never computed: masked environment tokens, or not served
        last = next((j for j in range(len(loss_mask) - 1, -1, -1) if loss_mask[j] > 0), -1)
        need = num_prompt + last
    if len(engine_ids) < need + 1 or engine_ids[:num_prompt] != list(prompt_ids):
        return None
    if engine_ids[num_prompt : need + 1] != list(completion_ids[: need + 1 - num_prompt]):
        return None
    if hidden.length < need or (hidden.rows_P[:need] <= 0).any():
        return None
    rows = np.zeros(n, dtype=np.int64)
    rows[:need] = hidden.rows_P[:need]
    return rows


def record_fields(
    chosen,
    rows_of: list[tuple[int, int]],
    length: int,
    target_positions: Sequence[int],
    mask: Sequence[float],
) -> dict:
    """`PackedBatch`'s record fields for a packed row (`pack_one`'s layout: `rows_of` gives each
    sequence's prompt and completion start, `target_positions` the row position that predicts
    each target, `mask` the targets' loss mask): its rows and their store, or none unless every
    sequence's records serve and come from one store; and the LM head's statistics at each
    target (`engine_stats`) where they serve."""
    if all(getattr(s, "hidden", None) is None for s in chosen):
        return {}
    rows, store = packed_record_rows(chosen, rows_of, length)
    if rows is None:
        return {}
    fields = {"record_rows_L": torch.from_numpy(rows), "record_store": store}
    stats_K2 = engine_stats(store, rows[np.asarray(target_positions, dtype=np.int64)], mask)
    if stats_K2 is not None:
        fields["record_stats_K2"] = torch.from_numpy(stats_K2)
    return fields


def engine_stats(store, rows_K: np.ndarray, mask: Sequence[float]) -> np.ndarray | None:
    """[K, 2] float32: the log-sum-exp and entropy the engine sampled each target from
    (`HiddenStore.stats_of`), NaN for targets the loss does not read (a multi-turn episode's
    environment tokens, never sampled); None unless every target the loss reads has them, at
    the trainer's temperature. With them the LM head's forward computes no logits: a target's
    logprob is its own logit less the log-sum-exp (`packing.logprobs`)."""
    if not store.stats_serve():
        return None
    stats_K2 = store.stats_of(rows_K)
    read_K = np.asarray(mask, dtype=np.float32) > 0
    if not np.isfinite(stats_K2[read_K]).all():
        return None
    stats_K2[~read_K] = np.nan
    return stats_K2


def packed_record_rows(chosen, rows_of: list[tuple[int, int]], length: int):
    """(rows [length], store) for a packed row (`pack_one`'s layout: `rows_of` gives each
    sequence's prompt and completion start), or (None, None) unless every sequence's records
    serve and come from one store."""
    if not chosen or any(getattr(s, "hidden", None) is None for s in chosen):
        return None, None
    stores = {id(s.hidden.store) for s in chosen}
    if len(stores) != 1:
        return None, None
    out = np.zeros(length, dtype=np.int64)
    for s, (prompt_row, completion_row) in zip(chosen, rows_of):
        rows = sequence_rows(s.prompt_ids, s.completion_ids, s.hidden, s.loss_mask)
        if rows is None:
            return None, None
        num_prompt = len(s.prompt_ids)
        out[prompt_row : prompt_row + num_prompt] = rows[:num_prompt]
        out[completion_row : completion_row + len(s.completion_ids)] = rows[num_prompt:]
    return out, chosen[0].hidden.store


@contextlib.contextmanager
def unchecked(layer):
    """`layer` called without transformers' gradient checkpointing (its recompute is ours)."""
    before = getattr(layer, "gradient_checkpointing", False)
    layer.gradient_checkpointing = False
    try:
        yield
    finally:
        layer.gradient_checkpointing = before


class _FromRecord(torch.autograd.Function):
    """A layer whose output is its record: the forward computes nothing; the backward runs the
    layer from its input (the embedding, or the record before it, gathered then) with
    activations kept and backpropagates through it. Only the last layer's output is read in the
    forward (by the final norm): the others hand on a placeholder without memory."""

    @staticmethod
    def forward(ctx, input_1LH, call, saved_input, output):
        """`saved_input`: the input itself (the embedding) or a function that gathers it;
        `output`: a function that gathers the record, or None (a placeholder)."""
        ctx.call = call
        if callable(saved_input):
            ctx.gather = saved_input
        else:
            ctx.gather = None
            ctx.save_for_backward(input_1LH)
        if output is None:
            return input_1LH.new_zeros(()).expand(input_1LH.shape)
        return output()

    @staticmethod
    def backward(ctx, grad_1LH):
        saved = ctx.gather() if ctx.gather is not None else ctx.saved_tensors[0]
        x = saved.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.call(x)
        torch.autograd.backward(out, grad_1LH)
        return x.grad, None, None, None


_streams: dict = {}  # per device: the stream the records are read on, a layer ahead


class _LayerReader:
    """Layer k's records in the row's order, [1, L, H] (`HiddenStore.read_layer`). On CUDA the
    read of the next layer needed is queued ahead on a stream of its own, beside the current
    layer's compute (a captured graph holds both streams)."""

    def __init__(self, store, rows_L: torch.Tensor, dtype: torch.dtype):
        self.store, self.rows_L, self.dtype = store, rows_L, dtype
        self.ahead: dict[int, torch.Tensor] = {}
        self.side = None
        if rows_L.is_cuda:
            self.side = _streams.setdefault(rows_L.device, torch.cuda.Stream(rows_L.device))

    def read(self, k: int) -> torch.Tensor:
        if k in self.ahead:
            assert self.side is not None
            torch.cuda.current_stream(self.rows_L.device).wait_stream(self.side)
            out = self.ahead.pop(k)
        else:
            out = self.store.read_layer(self.rows_L, k)
        return out[None].to(self.dtype)

    def prefetch(self, k: int) -> None:
        if self.side is None or k < 0 or k in self.ahead:
            return
        L, H = self.rows_L.shape[0], self.store.row_shape[1]
        out = torch.empty((L, H), dtype=self.store.dtype, device=self.rows_L.device)
        self.side.wait_stream(torch.cuda.current_stream(self.rows_L.device))
        with torch.cuda.stream(self.side):
            self.store.read_layer(self.rows_L, k, out)
        self.ahead[k] = out


def recorded_hidden_states(model, batch, attention_kwargs: dict) -> torch.Tensor:
    """Final (normed) hidden states of the packed row, [L, H], from the engine's records of its
    rows (`batch.record_rows_L` in `batch.record_store`; module docstring);
    `attention_kwargs`: `packed_attention_kwargs(model, batch)`."""
    decoder = model.get_decoder()
    layers = list(decoder.layers)
    store = batch.record_store
    assert store.row_shape[0] == len(layers), (store.row_shape, len(layers))
    kwargs = dict(attention_kwargs)
    mask = kwargs.pop("attention_mask", None)
    position_ids = batch.position_ids_L[None]
    hidden = decoder.embed_tokens(batch.input_ids_L[None])
    position_embeddings = decoder.rotary_emb(hidden, position_ids)
    layer_kwargs = {
        # (a varlen implementation reads the segments from the kwargs; a mask implementation
        # takes the 4-D mask as the decoder would pass it)
        "attention_mask": mask if mask is not None and mask.dim() == 4 else None,
        "position_embeddings": position_embeddings,
        "position_ids": position_ids,
        **kwargs,
    }
    reader = _LayerReader(store, batch.record_rows_L, hidden.dtype)
    backward = torch.is_grad_enabled()

    def input_of(k: int):  # layer k's input (record k - 1), read in its backward
        def read():
            out = reader.read(k - 1)
            if backward:  # (after the read: its wait must not take the next one in)
                reader.prefetch(k - 2)  # the next layer's input, while this one recomputes
            return out

        return read

    last = len(layers) - 1

    def output_of_last():
        out = reader.read(last)
        if backward:
            reader.prefetch(last - 1)  # the last layer's input, read first in the backward
        return out

    for k, layer in enumerate(layers):
        hidden = _FromRecord.apply(
            hidden,
            _layer_call(layer, layer_kwargs),
            hidden if k == 0 else input_of(k),
            output_of_last if k == last else None,
        )
    return decoder.norm(hidden)[0]


def _layer_call(layer, kwargs: dict):
    def call(x):
        with unchecked(layer):
            out = layer(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    return call
