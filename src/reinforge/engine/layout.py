"""Each decoder layer's q/k/v projections, and its gate/up projections, laid out in one tensor
each, so that generation can run them as one matrix product instead of three (two).

Why: a decode step of a small model is made of small matrix products (G1's 0.5B shape at 256
sequences: 168 per step, M = 256, K = 896) that run at launch and latency speed, not at the
matmul rate: 1.1 ms of a 2.0 ms step against 0.32 ms of FLOPs (bench/RESULTS.md, the engine's
decode profile). Fused, a layer has four products instead of seven. A concatenated *copy* of
the weights would break the engine's contract of reading the trainer's weights in place (and
cost their memory again); here the modules' parameters become views of one tensor, so the
optimizer, `load_state_dict`, checkpoints and the trainer's own forward (still module by
module) see the same parameters, and the fused product reads exactly the values they hold.

`fuse_projections` runs where a model is loaded, before any optimizer holds its parameters.
`fused_weight` is what the engine asks per layer: the one weight (and bias) spanning a group, or
None where the group is not laid out that way (a model built elsewhere, LoRA on one of them,
FSDP's sharded parameters, a parameter replaced since): the engine then runs the products one
by one, as before.
"""

from __future__ import annotations

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")


def groups(model) -> list[list[torch.nn.Module]]:
    """The projection groups of each decoder layer that may share one tensor: plain
    `nn.Linear`s (not LoRA-wrapped, not quantized) of one dtype and device."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return []
    found = []
    for layer in layers:
        for parent, names in (
            (getattr(layer, "self_attn", None), ATTENTION),
            (getattr(layer, "mlp", None), MLP),
        ):
            mods = [getattr(parent, n, None) for n in names]
            if all(type(m) is torch.nn.Linear for m in mods):
                found.append(mods)
    return found


def fuse_projections(model) -> int:
    """Lay each group's weights (and biases, where all have one) out in one tensor, the
    modules' parameters becoming views of it (values, dtypes, `requires_grad` unchanged).
    Returns the number of groups laid out. Call before an optimizer or a sharding wrapper takes
    the parameters: they are replaced by new `Parameter` objects."""
    count = 0
    for mods in groups(model):
        weights = [m.weight for m in mods]
        if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
            continue
        if any(w.device.type == "meta" for w in weights):
            continue
        _lay_out(mods, "weight")
        biases = [m.bias for m in mods]
        if all(b is not None for b in biases) and len({(b.dtype, b.device) for b in biases}) == 1:
            _lay_out(mods, "bias")
        count += 1
    return count


def _lay_out(mods: list[torch.nn.Module], name: str) -> None:
    params = [getattr(m, name) for m in mods]
    with torch.no_grad():
        whole = torch.cat([p.detach() for p in params])
    start = 0
    for m, p in zip(mods, params):
        rows = p.shape[0]
        view = torch.nn.Parameter(whole[start : start + rows], requires_grad=p.requires_grad)
        setattr(m, name, view)
        start += rows


# `fused_weight`'s answers, by the modules' ids: (what their parameters were then, the spans'
# shapes and strides or None). The prefill asks twice a layer; working it out took 50-150 us of
# host time a call on the GPU hosts (s30b) while the device waited for the prefill's next kernel.
# Only numbers are kept (the views are made anew from the first module's parameters): no tensor
# outlives its model here.
_SPANS: dict[tuple[int, ...], tuple[tuple, tuple | None]] = {}


def fused_weight(mods: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The weight [sum of out features, in features] spanning `mods` (and the bias, where each
    has one), as views of the one tensor their parameters lie in, or None where they do not lie
    back to back in one tensor (then run them one by one)."""
    if not all(type(m) is torch.nn.Linear for m in mods):
        return None
    params = [p for m in mods for p in (m.weight, m.bias) if p is not None]
    if any(type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor for p in params):
        return _fused_weight(mods)  # (a DTensor shard, ...: worked out each time)
    key = tuple(map(id, mods))
    # (the storage too: separate tensors allocated back to back, as after a move away and
    # back, have the same addresses as one laid-out tensor but are no span)
    now = tuple((id(p), p.data_ptr(), p.shape, p.stride(), p.dtype, _storage(p)) for p in params)
    held = _SPANS.get(key)
    if held is None or held[0] != now:
        answer = _fused_weight(mods)
        geometry = None
        if answer is not None:
            weight, bias = answer
            geometry = (weight.shape, weight.stride(), None if bias is None else bias.shape)
        if len(_SPANS) >= 4096:  # (models come and go in one process: tests)
            _SPANS.clear()
        _SPANS[key] = (now, geometry)
        return answer
    geometry = held[1]
    if geometry is None:
        return None
    w_shape, w_stride, b_shape = geometry
    first = mods[0]
    weight = first.weight.detach().as_strided(w_shape, w_stride)
    bias = None if b_shape is None else first.bias.detach().as_strided(b_shape, (1,))
    return weight, bias


def _storage(p: torch.Tensor) -> tuple[int, int]:
    storage = p.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _fused_weight(mods: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    weight = _span([m.weight for m in mods])
    if weight is None:
        return None
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return weight, None
    bias = _span(biases) if all(b is not None for b in biases) else None
    return (weight, bias) if bias is not None else None


def _span(params: list[torch.Tensor]) -> torch.Tensor | None:
    first = params[0]
    if any(type(p.data) is not torch.Tensor for p in params):  # (a DTensor shard, ...)
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for p in params:
        if (
            not p.is_contiguous()
            or p.dtype != first.dtype
            or p.shape[1:] != first.shape[1:]
            or p.data_ptr() != end
            or p.untyped_storage().data_ptr() != storage
        ):
            return None
        end += p.numel() * p.element_size()
    rows = sum(p.shape[0] for p in params)
    shape = (rows, *first.shape[1:])
    return first.detach().as_strided(shape, first.stride())
