"""PEFT LoRA in the paged forward: base + scaling * B(A(x)) per adapted projection, from the live
tensors.

The trainer wraps its model with PEFT (`train.policy.lora`), which swaps each targeted `nn.Linear` for a
`peft.tuners.lora.Linear` holding the original as `base_layer` and the adapters' A/B `nn.Linear`s
in `lora_A` / `lora_B`. `linear` reads those modules' parameters on every call, exactly as PEFT's
own forward combines them (the input cast to A's dtype, the sum in the wider dtype, cast back), so
nothing is merged or copied: an optimizer step on A/B is seen by the next generate, and so is
`with peft_model.disable_adapter():` (the KL reference), which flips each layer's
`disable_adapters`. Dropout is the identity at inference and is skipped. (The engine can instead
decode from a copy with the adapters merged in, rebuilt when the weights change: `lora_merge`.)

A CUDA graph bakes in the Python decisions taken at capture (adapter on or off, which adapters,
their scaling), so `adapter_state` summarises them and the graphs are captured again when it
changes. What this forward does not implement (LoRA variants such as DoRA, adapters on the
embedding, other PEFT wrappers) is reported by `unsupported_reason`, and the engine falls back to
the model's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def causal_lm(model):
    """The transformers model under a PEFT wrapper (PEFT injects its layers into it in place), or
    `model` itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if get_base_model is not None else model


def is_lora_layer(module: Any) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def linear(x: torch.Tensor, proj: Any) -> torch.Tensor:
    """`proj(x)` from its parameters: a plain `nn.Linear`, or a PEFT LoRA layer over one."""
    if not is_lora_layer(proj):
        return F.linear(x, proj.weight, proj.bias)
    base = proj.base_layer
    out = F.linear(x, base.weight, base.bias)
    if proj.disable_adapters or proj.merged:  # merged: the update is in the base weight
        return out
    dtype = out.dtype
    for name in proj.active_adapters:
        if name not in proj.lora_A:
            continue
        a, b = proj.lora_A[name], proj.lora_B[name]
        delta = F.linear(F.linear(x.to(a.weight.dtype), a.weight, a.bias), b.weight, b.bias)
        out = out + delta * proj.scaling[name]
    return out.to(dtype)


def lora_layers(model) -> list[Any]:
    return [module for module in causal_lm(model).modules() if is_lora_layer(module)]


def adapter_state(model) -> tuple:
    """What a captured graph fixed about the adapters: per LoRA layer, whether it applies them,
    and which ones with what scaling."""
    return tuple(
        (
            bool(layer.disable_adapters or layer.merged),
            tuple((name, layer.scaling[name]) for name in layer.active_adapters),
        )
        for layer in lora_layers(model)
    )


def prepare_adapters(model) -> None:
    """As PEFT's forward does for a disabled layer whose adapter is merged into its weight:
    unmerge it (in place), so the base weight is the base again."""
    for layer in lora_layers(model):
        if layer.disable_adapters and layer.merged:
            layer.unmerge()


def unsupported_reason(model) -> str | None:
    """Why the paged forward cannot apply this model's adapters, or None."""
    lm = causal_lm(model)
    copies = [name for name, module in lm.named_modules() if hasattr(module, "original_module")]
    if copies:  # PEFT's modules_to_save: the forward would read the original, not the copy
        return f"PEFT modules_to_save wrappers ({', '.join(copies[:3])}) are not read"
    inner = lm.model
    if is_lora_layer(inner.embed_tokens) or not isinstance(inner.embed_tokens, torch.nn.Embedding):
        return f"the embedding is wrapped ({type(inner.embed_tokens).__name__})"
    projections = [("lm_head", lm.lm_head)]
    for i, layer in enumerate(inner.layers):
        mlp_parts = [("mlp", layer.mlp)]
        if hasattr(layer.mlp, "experts"):  # MoE: the routed experts are read by engine.moe
            mlp_parts = [("mlp.shared_expert", getattr(layer.mlp, "shared_expert", None))]
            if hasattr(layer.mlp, "shared_expert_gate"):
                projections.append(
                    (f"layers.{i}.mlp.shared_expert_gate", layer.mlp.shared_expert_gate)
                )
        for part, module in (("self_attn", layer.self_attn), *mlp_parts):
            if module is None:
                continue
            names = ("gate_proj", "up_proj", "down_proj")
            if part == "self_attn":
                names = ("q_proj", "k_proj", "v_proj", "o_proj")
            for name in names:
                projections.append((f"layers.{i}.{part}.{name}", getattr(module, name)))
    for name, proj in projections:
        base = proj.base_layer if is_lora_layer(proj) else proj
        if type(base) is not torch.nn.Linear:
            return f"{name} is a {type(proj).__name__}, not a linear layer or a LoRA layer over one"
        if is_lora_layer(proj):
            variants = [a for a in proj.active_adapters if getattr(proj, "lora_variant", {}).get(a)]
            if variants or any(getattr(proj, "use_dora", {}).get(a) for a in proj.active_adapters):
                return f"{name} uses a LoRA variant (DoRA or similar) for adapters {variants}"
    return None
