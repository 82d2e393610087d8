"""LoRA generation over a merged copy: W_gen = W_base + scaling * B @ A per adapted projection,
built once per change of the weights, so a decode step runs plain linear layers instead of
base + scaling * B(A(x)) (two small products beside each base product, on every one of the 196
adapted projections of a 7B with "all-linear").

`MergedAdapters` holds one buffer per adapted projection that the dense forward reads (attention
q/k/v/o, a dense MLP's gate/up/down, the LM head), in the engine's dtype; every other weight is
the model's own tensor (nothing else is copied). A layer's q/k/v copies, and its gate/up copies,
are row views of one buffer (with the base biases joined beside them), so the decode runs each
group as one product (`fused`), as it does for plain weights laid out by `engine.layout`: 4
products a layer instead of 7 (on E1's 0.5B shape that layout was 1.13x, session 21).
`refresh` rebuilds the buffers in place (their addresses stay: a captured CUDA graph reads the
new values with no recapture), and only when the weights may have changed since the last build. The engine learns that from three signals:

- any optimizer's `step` in this process (a global `torch.optim` post-step hook: the fused AdamW
  on CUDA updates A/B without bumping their version counters);
- a tensor's version counter or address (`copy_`, `load_state_dict`, an in-place edit, a
  parameter replaced);
- `note_weights_changed()`, for writes that bypass both (a collective into `.data`: the
  disaggregated generator's weight receive, `rollout.sources.receive_weights`).

A layer whose adapter is disabled (`with peft_model.disable_adapter():`, the KL reference) or
merged by PEFT into its base weight is read through the adapters path (`lora_forward.linear`),
which then reads the base weights alone; the copy is left as it is and never touches the base.
Not merged (they stay on the adapters path): LoRA layers with a bias on A or B (PEFT's
`lora_bias`), and a mixture of experts' MLP (experts, router, shared expert: `engine.moe`).

Modes (`MODES`): "merged", "adapters" (the unmerged path), or "auto", which a trainer's memory
planner resolves (`train.planner`); without a plan, `resolve_mode` decides from the free memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from reinforge.engine import layout
from reinforge.engine.lora_forward import causal_lm, is_lora_layer, linear

MODES = ("auto", "merged", "adapters")
SETTING = "rollout.lora_generation"

# bumped by every optimizer step in the process and by `note_weights_changed`
_weights_epoch = 0
_hook_registered = False


def note_weights_changed() -> None:
    """Tell every merged copy in this process that the model's weights changed in a way no
    version counter records (e.g. a collective writing into `param.data`)."""
    global _weights_epoch
    _weights_epoch += 1


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    note_weights_changed()


def _register_optimizer_hook() -> None:
    global _hook_registered
    if not _hook_registered:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_on_optimizer_step)
        _hook_registered = True


def mergeable_layers(model) -> list[Any]:
    """The LoRA layers the dense forward reads through `ForwardOps.linear`, that a merged copy
    can stand for (no LoRA bias); none for a model without the paged forward."""
    from reinforge.engine.qwen_forward import unsupported_reason

    if unsupported_reason(model) is not None:
        return []
    lm = causal_lm(model)
    projections = [lm.lm_head]
    for layer in lm.model.layers:
        attn = layer.self_attn
        projections += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if not hasattr(layer.mlp, "experts"):
            projections += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
    return [p for p in projections if is_lora_layer(p) and not _has_lora_bias(p)]


def mergeable_groups(model, layers: list[Any]) -> list[list[Any]]:
    """Each decoder layer's q/k/v, and its dense MLP's gate/up, where every one is in `layers`
    (mergeable) and their base weights share a dtype, device and input width."""
    if not layers:
        return []
    mergeable = {id(p) for p in layers}
    found = []
    for layer in causal_lm(model).model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        candidates = [[attn.q_proj, attn.k_proj, attn.v_proj]]
        if not hasattr(mlp, "experts"):
            candidates.append([mlp.gate_proj, mlp.up_proj])
        for group in candidates:
            bases = [m.base_layer.weight for m in group if id(m) in mergeable]
            if len(bases) == len(group) and (
                len({(b.dtype, b.device, b.shape[1:]) for b in bases}) == 1
            ):
                found.append(group)
    return found


def _has_lora_bias(proj) -> bool:
    return any(
        proj.lora_A[name].bias is not None or proj.lora_B[name].bias is not None
        for name in proj.lora_A
    )


def mergeable_params(model) -> int:
    """Parameters of the copy (the memory planner's count, from a meta-device model)."""
    return sum(p.base_layer.weight.numel() for p in mergeable_layers(model))


def merged_bytes(model) -> int:
    """Bytes of the copy: every mergeable projection's weight, in the model's dtype."""
    return sum(
        p.base_layer.weight.numel() * p.base_layer.weight.itemsize for p in mergeable_layers(model)
    )


def resolve_mode(
    mode: str, model, kv_cache_bytes: int | None, free_bytes: int | None, reserve_bytes: int
) -> str:
    """The mode ("merged" or "adapters") for `mode` without a memory plan. "auto": merged off CUDA
    (`free_bytes` None: host memory), and on CUDA when the copy fits in the free memory beside a
    given KV pool and the reserve, or, with no pool size given (the pool then takes the rest),
    when it takes at most half of the memory the pool would otherwise get."""
    if mode not in MODES:
        raise ValueError(f"{SETTING} = {mode!r} is unknown; use one of {list(MODES)}")
    need = merged_bytes(model)
    if mode != "auto" or need == 0:
        return "adapters" if need == 0 else mode
    if free_bytes is None:
        return "merged"
    room = free_bytes - reserve_bytes
    if kv_cache_bytes is not None:
        return "merged" if need <= room - kv_cache_bytes else "adapters"
    return "merged" if 2 * need <= room else "adapters"


class MergedAdapters:
    """The generation copy of a PEFT model's adapted projections (see the module docstring)."""

    def __init__(self, model):
        self.layers = mergeable_layers(model)
        self.weights: dict[int, torch.Tensor] = {}  # id(layer) -> W_gen, once built
        # q/k/v and gate/up of a layer, where all are mergeable: their copies are built as row
        # views of one buffer, so a group runs as one product (`fused`), as plain weights do
        self.groups = mergeable_groups(model, self.layers)
        self.group_biases: dict[int, torch.Tensor] = {}  # id(group's first) -> its biases, joined
        # what this generate reads: the enabled layers' copies (set by `refresh`)
        self.reading: dict[int, torch.Tensor] = {}
        self.key: tuple | None = None  # what the weights were built from
        self.num_builds = 0
        _register_optimizer_hook()

    @property
    def num_bytes(self) -> int:
        return sum(w.numel() * w.itemsize for w in self.weights.values())

    def linear(self, x: torch.Tensor, proj: Any) -> torch.Tensor:
        """`lora_forward.linear`, with an enabled, mergeable layer read from its merged copy."""
        weight = self.reading.get(id(proj))
        if weight is None:
            return linear(x, proj)
        return F.linear(x, weight, proj.base_layer.bias)

    def fused(self, mods: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`layout.fused_weight` for the merged copies: the copy spanning a group whose every
        projection this generate reads from the copy (one buffer, `_allocate`), with the group's
        joined bias copy; for any other group, the model's own layout (None for LoRA layers:
        one by one)."""
        weights = [self.reading.get(id(m)) for m in mods]
        if any(w is None for w in weights):
            return layout.fused_weight(mods)
        weight = layout._span(weights)
        if weight is None:
            return None
        if all(m.base_layer.bias is None for m in mods):
            return weight, None
        bias = self.group_biases.get(id(mods[0]))
        return (weight, bias) if bias is not None else None

    def graph_key(self) -> tuple:
        """The buffers' addresses, the weights' and the groups' joined biases': what a captured
        graph reads. (Without the biases, a copy released and built again with its weights back
        at their addresses but a bias elsewhere kept graphs that read the freed bias: NaN
        sampler logprobs from the second step of the 0.5b shape's LoRA run, s30d, once the pool's
        restore no longer dropped the graphs on its own.)"""
        weights = tuple(w.data_ptr() for w in self.weights.values())
        return weights + tuple(b.data_ptr() for b in self.group_biases.values())

    def refresh(self) -> bool:
        """Before a generate: build the copy again if the weights may have changed since the
        last build (in place, into the same buffers), and read it for the layers whose adapter
        is on; True if it was built. No build while every layer's adapter is off."""
        enabled = [layer for layer in self.layers if not (layer.disable_adapters or layer.merged)]
        built = False
        if enabled:
            key = self._source_key()
            if key != self.key or len(self.weights) != len(self.layers):
                # normal tensors even under a caller's inference_mode: they are written again
                with torch.inference_mode(False), torch.no_grad():
                    self._build()
                self.key, built = key, True
                self.num_builds += 1
        self.reading = {id(layer): self.weights[id(layer)] for layer in enabled}
        return built

    def _build(self) -> None:
        self._allocate()
        for group in self.groups:
            joined = self.group_biases.get(id(group[0]))
            if joined is not None:
                torch.cat([m.base_layer.bias.detach() for m in group], out=joined)
        for layer in self.layers:
            base = layer.base_layer.weight
            out = self.weights[id(layer)]
            out.copy_(base)
            for name in layer.active_adapters:
                if name not in layer.lora_A:
                    continue
                a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
                out.addmm_(b.to(out.dtype), a.to(out.dtype), alpha=layer.scaling[name])

    def _allocate(self) -> None:
        """The copies' buffers, where missing or no longer the base's shape and dtype: a group's
        in one tensor, its projections' copies back to back as row views."""
        grouped = {id(m) for group in self.groups for m in group}
        for group in self.groups:
            bases = [m.base_layer.weight for m in group]
            if (
                all(self._fits(m) for m in group)
                and layout._span([self.weights[id(m)] for m in group]) is not None
            ):
                continue
            whole = torch.empty(
                (sum(b.shape[0] for b in bases), *bases[0].shape[1:]),
                dtype=bases[0].dtype,
                device=bases[0].device,
            )
            for m, rows in zip(group, whole.split([b.shape[0] for b in bases])):
                self.weights[id(m)] = rows
        for group in self.groups:
            biases = [m.base_layer.bias for m in group]
            if all(b is not None for b in biases):  # (copied in `_build`: a few KB)
                joined = self.group_biases.get(id(group[0]))
                need = sum(b.shape[0] for b in biases)
                if joined is None or joined.shape[0] != need or joined.dtype != biases[0].dtype:
                    self.group_biases[id(group[0])] = biases[0].new_empty(need)
        for layer in self.layers:
            if id(layer) not in grouped and not self._fits(layer):
                self.weights[id(layer)] = torch.empty_like(layer.base_layer.weight)

    def _fits(self, layer) -> bool:
        out, base = self.weights.get(id(layer)), layer.base_layer.weight
        return out is not None and out.shape == base.shape and out.dtype == base.dtype

    def release(self) -> None:
        """Free the buffers (between generates, with the KV pool); `refresh` builds them again."""
        self.weights.clear()
        self.group_biases.clear()
        self.reading = {}
        self.key = None

    def _source_key(self) -> tuple:
        parts: list = [_weights_epoch]
        for layer in self.layers:
            tensors = [layer.base_layer.weight]
            if layer.base_layer.bias is not None:  # (a group's biases are copied too)
                tensors.append(layer.base_layer.bias)
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    tensors += [layer.lora_A[name].weight, layer.lora_B[name].weight]
            parts.append(tuple(layer.active_adapters))
            parts.append(tuple(layer.scaling.get(n) for n in layer.active_adapters))
            parts += [(t.data_ptr(), t._version) for t in tensors]
        return tuple(parts)
