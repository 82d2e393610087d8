"""Our own forward pass for the Qwen2/2.5, Qwen3 and Llama families over the paged KV pool.

It reads the transformers model's parameters in place on every call
(`model.model.layers[i].self_attn.q_proj.weight`, ...) and copies none, so an optimizer step on
the trainer's model is seen by the next generation with nothing to sync. `model` is the
transformers model (`lora_forward.causal_lm` unwraps a PEFT model); projections that PEFT gave a
LoRA adapter apply it from its live A/B tensors (`lora_forward.linear`), or read a generation
copy with the adapter merged in, rebuilt when the weights change (`lora_merge`, through
`ForwardOps.linear`: the one copy the engine makes). The three families
differ only in optional pieces, each taken when the module has it: q/k/v biases (Qwen2),
per-head q/k RMSNorm (Qwen3), and tied embeddings (read through `lm_head`, which then holds the
embedding tensor). RoPE comes from the model's own rotary module, so every rope type transformers
implements (default, linear, llama3, yarn, ...) is honoured as transformers computes it; where the
frequencies do not depend on the call (all but dynamic and longrope) it is tabulated once over
the positions (`rope_table`) and gathered per step, which CUDA graphs need.

Tokens are packed: hidden states are [T, hidden] over all sequences of the step. The small ops
(residual add + RMSNorm, SiLU * up) come from a `ForwardOps`: plain torch by default, fused Triton
kernels on CUDA (`triton_ops`); both round as transformers does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from reinforge.engine import lora_forward, moe
from reinforge.engine.attention import AttentionBackend, AttentionMetadata
from reinforge.engine.layout import fused_weight
from reinforge.engine.lora_forward import causal_lm, is_lora_layer, linear

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", *moe.MOE_MODEL_TYPES)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_config(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
        )


def unsupported_reason(model) -> str | None:
    """Why this model (or PEFT model) cannot take the paged forward, or None when it can."""
    model = causal_lm(model)
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"architecture {config.model_type!r} has no paged forward (only {SUPPORTED_MODEL_TYPES})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb"):
        return "the model has no `model.rotary_emb` module"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in inner.layers):
        return "sliding-window attention is not implemented in the paged forward"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 is not implemented in the paged forward"
    return lora_forward.unsupported_reason(model)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(hidden + delta), hidden + delta): the next op's input and the residual stream
    (written into `residual_out` when given)."""
    if delta is not None:
        hidden = hidden + delta
    if residual_out is not None:
        hidden = residual_out.copy_(hidden)
    return rms_norm(hidden, weight, eps), hidden


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class ForwardOps:
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_mul
    # a projection (LoRA adapters applied), or its merged generation copy (`lora_merge`)
    linear: Callable[[torch.Tensor, Any], torch.Tensor] = linear
    # the (weight, bias) spanning a group of projections (q/k/v, gate/up) run as one product, or
    # None (then one by one): the merged copies' (`lora_merge`); None: the model's own layout
    # (`engine.layout.fused_weight`)
    fused: Callable[[list], tuple[torch.Tensor, torch.Tensor | None] | None] | None = None


TORCH_OPS = ForwardOps()

# rope types whose frequencies transformers recomputes from the positions of each call: their
# cos/sin cannot be tabulated once
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def rope_table(model, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin [length, head_dim] from the model's own rotary module (exactly what it computes
    per call, in the model dtype), or None for a rope type that changes with the positions."""
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") in DYNAMIC_ROPE_TYPES:
        return None
    param = next(model.parameters())
    dummy = torch.empty(0, dtype=param.dtype, device=param.device)
    positions = torch.arange(length, device=param.device)[None]
    with torch.no_grad():
        cos, sin = rotary(dummy, positions)
    return cos[0].contiguous(), sin[0].contiguous()


def apply_rope(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    half = x_THD.shape[-1] // 2
    rotated = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None] + rotated * sin_TD[:, None]


def attention_block(
    attn: Any,  # transformers' attention module: duck-typed, read in place
    x_TE: torch.Tensor,
    cos_TD: torch.Tensor,
    sin_TD: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, pages, block_size, kv_heads, head_dim] of this layer
    meta: AttentionMetadata,
    backend: AttentionBackend,
    shape: ModelShape,
    linear: Callable[[torch.Tensor, Any], torch.Tensor] = linear,
    fused_group: Callable[[list], tuple | None] | None = None,
) -> torch.Tensor:
    T = x_TE.shape[0]
    fused = (fused_group or fused_weight)([attn.q_proj, attn.k_proj, attn.v_proj])
    if fused is not None:  # one product (`engine.layout`): the weights lie back to back
        q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        q, k, v = F.linear(x_TE, *fused).split([q_out, kv_out, kv_out], dim=-1)
        if meta.is_prefill:  # (decode's kernels take the strided rows; prefill's copy them)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        q = q.reshape(T, shape.num_heads, shape.head_dim)
        k = k.reshape(T, shape.num_kv_heads, shape.head_dim)
        v = v.reshape(T, shape.num_kv_heads, shape.head_dim)
    else:
        q = linear(x_TE, attn.q_proj).view(T, shape.num_heads, shape.head_dim)
        k = linear(x_TE, attn.k_proj).view(T, shape.num_kv_heads, shape.head_dim)
        v = linear(x_TE, attn.v_proj).view(T, shape.num_kv_heads, shape.head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3
        q = rms_norm(q, attn.q_norm.weight, shape.rms_norm_eps)
        k = rms_norm(k, attn.k_norm.weight, shape.rms_norm_eps)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if not meta.is_prefill and backend.decode_rope is not None:
        o = backend.decode_rope(q, k, v, cos_TD, sin_TD, k_cache, v_cache, meta, shape.scale)
        return linear(o.reshape(T, shape.num_heads * shape.head_dim), attn.o_proj)
    if backend.rope_write_kv is not None:
        q, k = backend.rope_write_kv(q, k, v, cos_TD, sin_TD, k_cache, v_cache, meta.slot_mapping)
    else:
        q, k = apply_rope(q, cos_TD, sin_TD), apply_rope(k, cos_TD, sin_TD)
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if meta.is_prefill:
        o = backend.prefill(q, k, v, k_cache, v_cache, meta, shape.scale)
    else:
        o = backend.decode(q, k_cache, v_cache, meta, shape.scale)
    return linear(o.reshape(T, shape.num_heads * shape.head_dim), attn.o_proj)


def mlp_block(
    mlp: Any, x_TE: torch.Tensor, ops: ForwardOps, routes_TK: torch.Tensor | None = None
) -> torch.Tensor:
    """`routes_TK`: where a sparse block writes its tokens' chosen experts (routing replay)."""
    if moe.is_moe_block(mlp):  # Qwen3-MoE / Qwen2-MoE: routed experts as grouped products
        out_TE, _, ids_TK = moe.moe_block(mlp, x_TE)
        if routes_TK is not None:
            routes_TK.copy_(ids_TK)
        return out_TE
    lin = ops.linear
    fused = (ops.fused or fused_weight)([mlp.gate_proj, mlp.up_proj])
    if fused is not None:  # one product (`engine.layout`)
        outs = [mlp.gate_proj.out_features, mlp.up_proj.out_features]
        gate, up = F.linear(x_TE, *fused).split(outs, dim=-1)
        return lin(ops.silu_mul(gate, up), mlp.down_proj)
    return lin(ops.silu_mul(lin(x_TE, mlp.gate_proj), lin(x_TE, mlp.up_proj)), mlp.down_proj)


def forward(
    model,
    input_ids_T: torch.Tensor,
    positions_T: torch.Tensor,
    kv_cache: torch.Tensor,  # [layers, 2, pages, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    logits_indices_B: torch.Tensor | None,  # which packed tokens' logits to return (None: all)
    backend: AttentionBackend,
    shape: ModelShape,
    ops: ForwardOps = TORCH_OPS,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # `rope_table`, if it applies
    logits_out: torch.Tensor | None = None,  # [B, vocab] buffer to write the logits into
    routes_out: torch.Tensor | None = None,  # [T, sparse layers, k]: each token's experts
    records_out: torch.Tensor | None = None,  # [T, layers, hidden]: each layer's output
) -> torch.Tensor:
    """Writes the K/V of every given token into the pool; returns logits [B, vocab].
    `records_out`: the residual stream after each layer, for every token (`engine.records`);
    the fused norms write it there, so recording adds no kernel but the last layer's add."""
    inner = model.model
    hidden = F.embedding(input_ids_T, inner.embed_tokens.weight)
    if rope is not None:
        cos_TD, sin_TD = rope[0][positions_T], rope[1][positions_T]
    else:
        cos, sin = inner.rotary_emb(hidden, positions_T[None])
        cos_TD, sin_TD = cos[0], sin[0]
    eps = shape.rms_norm_eps
    delta = None  # the last block's output, not yet added to the residual stream
    num_sparse = 0
    for i, layer in enumerate(inner.layers):
        if records_out is not None and i > 0:  # layer i - 1's output, recorded as it is summed
            x, hidden = ops.add_rms_norm(
                hidden, delta, layer.input_layernorm.weight, eps, records_out[:, i - 1]
            )
        else:
            x, hidden = ops.add_rms_norm(hidden, delta, layer.input_layernorm.weight, eps)
        delta = attention_block(
            layer.self_attn,
            x,
            cos_TD,
            sin_TD,
            kv_cache[i],
            meta,
            backend,
            shape,
            ops.linear,
            ops.fused,
        )
        if records_out is not None:  # (a fresh residual: `hidden` is the record, kept)
            x, hidden = ops.add_rms_norm(
                hidden, delta, layer.post_attention_layernorm.weight, eps, torch.empty_like(x)
            )
        else:
            x, hidden = ops.add_rms_norm(hidden, delta, layer.post_attention_layernorm.weight, eps)
        routes_TK = None
        if routes_out is not None and moe.is_moe_block(layer.mlp):
            routes_TK, num_sparse = routes_out[:, num_sparse], num_sparse + 1
        delta = mlp_block(layer.mlp, x, ops, routes_TK)
    assert delta is not None, "a model with no decoder layer"
    if records_out is not None:  # the last layer's output, for every token
        hidden = torch.add(hidden, delta, out=records_out[:, -1])
        delta = None
    if logits_indices_B is not None:
        hidden = hidden[logits_indices_B]
        delta = None if delta is None else delta[logits_indices_B]
    last, _ = ops.add_rms_norm(hidden, delta, inner.norm.weight, eps)
    head = model.lm_head
    if logits_out is not None and not is_lora_layer(head) and head.bias is None:
        return torch.mm(last, head.weight.t(), out=logits_out)
    logits = ops.linear(last, model.lm_head)
    return logits if logits_out is None else logits_out.copy_(logits)
