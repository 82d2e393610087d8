"""Mixture-of-experts blocks (transformers' `qwen3_moe` and `qwen2_moe`) as grouped matrix
products, for the paged engine and the trainer alike.

A sparse block holds a router (`gate.weight` [E, H]) and the routed experts as two stacked
parameters (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); `qwen2_moe` adds a
shared expert (a dense MLP) scaled by `sigmoid(shared_expert_gate(x))`. Each token picks its
top-k experts; the (token, expert) pairs are sorted by expert and every projection is one grouped
product over the segments (`torch._grouped_mm` / `F.grouped_mm` where the build has it, else a
padded batched product): no loop over experts, no host sync, so a decode step captures in a CUDA
graph. The numerics follow transformers' own grouped implementation (softmax in float32, top-k
weights renormalised when `norm_topk_prob`, cast to the model dtype; the pairs summed per token).

Weights are read in place on every call. PEFT LoRA on the experts (`target_parameters`, a
`ParamWrapper` per stacked parameter, nested when both are adapted) is applied as two more grouped
products through the low-rank factors (`x A_e^T B_e^T * scaling`), never by materialising
`W + B A` for all experts as PEFT's own forward does. A router adapted by PEFT (its 2-D `weight`
through a `ParamWrapper`: PEFT's "all-linear" includes it) adds `x A^T B^T * scaling` to its
logits; a shared expert's linear layers take their LoRA through `lora_forward.linear`.

Routing replay (`algorithm.routing_replay`): the paged engine records the top-k experts of every
token it computes at each sparse layer (`RouteRecord`, per sequence on the host, uint8 for up to
256 experts), and the trainer's forward replays them (`RoutingReplay`, set per packed forward):
`moe_block(block, x, ids_TK)` sends each token to the given experts, weighted by this router's
probabilities at those ids, so the router still gets gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from reinforge.engine.lora_forward import causal_lm, is_lora_layer, linear

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_moe_block(mlp: Any) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


@dataclass(frozen=True)
class LowRank:
    """One adapter on a stacked expert parameter: delta_e = scaling * B_e @ A_e."""

    a_EIR: torch.Tensor  # A_e^T: [experts, in, rank]
    b_ERO: torch.Tensor  # B_e^T: [experts, rank, out]
    scaling: float


def active_adapters(wrapper: Any) -> list[str]:
    """The adapters a PEFT layer applies now (none when disabled or merged into the weight)."""
    if wrapper.disable_adapters or wrapper.merged:
        return []
    return [name for name in wrapper.active_adapters if name in wrapper.lora_A]


def unwrap_experts(experts: Any) -> tuple[Any, dict[str, list[LowRank]]]:
    """The transformers experts module under PEFT's `ParamWrapper`s, and the active adapters on
    each of its stacked parameters."""
    adapters: dict[str, list[LowRank]] = {name: [] for name in EXPERT_PARAMS}
    module = experts
    while is_lora_layer(module):
        adapters[module.parameter_name] += [low_rank(module, a) for a in active_adapters(module)]
        module = module.base_layer
    return module, adapters


def router_logits(gate: Any, x_TH: torch.Tensor) -> torch.Tensor:
    """x W^T over the router's live weight, plus PEFT's low-rank update where it adapts it."""
    if not is_lora_layer(gate):
        return F.linear(x_TH, gate.weight)
    logits_TE = F.linear(x_TH, gate.get_base_layer().weight)
    for name in active_adapters(gate):
        a, b = gate.lora_A[name].weight, gate.lora_B[name].weight
        delta = F.linear(F.linear(x_TH.to(a.dtype), a), b) * gate.scaling[name]
        logits_TE = logits_TE + delta.to(logits_TE.dtype)
    return logits_TE


def low_rank(wrapper: Any, name: str) -> LowRank:
    """PEFT's layout for a stacked [E, out, in] parameter: lora_A [E*r, in] (expert-major rows)
    and lora_B [out, r*E] (expert-minor columns)."""
    num_experts = wrapper.num_experts
    weight_a = wrapper.lora_A[name].weight
    weight_b = wrapper.lora_B[name].weight
    param = wrapper.get_param()
    assert weight_a.shape[-1] == param.shape[-1], "A reads the [experts, out, in] weight's input"
    a_ERI = weight_a.reshape(num_experts, -1, weight_a.shape[-1])
    b_ORE = weight_b.reshape(weight_b.shape[0], -1, num_experts)
    # in the stacked weight's dtype, as PEFT's ParamWrapper computes (float32 factors would also
    # leave bfloat16's grouped kernel for the padded fallback)
    dtype = param.dtype
    a_EIR = a_ERI.to(dtype).transpose(1, 2)  # a transposed view, as the base weights are read
    b_ERO = b_ORE.permute(2, 1, 0).to(dtype).contiguous()
    return LowRank(a_EIR, b_ERO, wrapper.scaling[name])


def has_grouped_mm(weight: torch.Tensor) -> bool:
    """Whether this build multiplies grouped segments natively for `weight`'s device and dtype
    (CUDA kernels take bfloat16 on compute capability 8.0 and later)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if weight.device.type == "cpu":
        return True
    if weight.device.type == "cuda":
        return (
            weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(weight.device)[0] >= 8
        )
    return False


def is_aligned(x_SI: torch.Tensor, w_EIO: torch.Tensor) -> bool:
    """CUDA's grouped kernel takes operands whose strides and widths are multiples of 16 bytes
    (a small LoRA rank in bfloat16 is not: rank 4 is 8 bytes); the CPU kernel takes any."""
    if w_EIO.device.type == "cpu":
        return True
    size = w_EIO.element_size()
    strides = [st for t in (x_SI, w_EIO) for st in t.stride() if st != 1]
    widths = (x_SI.shape[1], w_EIO.shape[2])
    return all(n * size % 16 == 0 for n in (*strides, *widths)) and all(
        t.data_ptr() % 16 == 0 for t in (x_SI, w_EIO)
    )


def grouped_mm(
    x_SI: torch.Tensor,
    w_EIO: torch.Tensor,
    offsets_E: torch.Tensor,  # int32: end of each expert's segment in the sorted rows
    ids_S: torch.Tensor,  # each row's expert (sorted)
    capacity: int,  # most rows one expert can get (the token count: an expert once per token)
) -> torch.Tensor:
    """Row segment e of `x` times `w[e]`, for every expert at once: [S, O]."""
    x_SI = x_SI.to(w_EIO.dtype)
    if has_grouped_mm(w_EIO) and is_aligned(x_SI, w_EIO):
        mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        return mm(x_SI, w_EIO, offs=offsets_E)
    return padded_mm(x_SI, w_EIO, offsets_E, ids_S, capacity)


def padded_mm(
    x_SI: torch.Tensor,
    w_EIO: torch.Tensor,
    offsets_E: torch.Tensor,
    ids_S: torch.Tensor,
    capacity: int,
) -> torch.Tensor:
    """`grouped_mm` without the native kernel: each expert's rows in a [capacity, I] slot of a
    zero buffer, one batched product (E / k times the useful work, still no loop or sync)."""
    starts_E = torch.cat([offsets_E.new_zeros(1), offsets_E[:-1]])
    slot_S = torch.arange(ids_S.shape[0], device=ids_S.device) - starts_E[ids_S]
    padded_ECI = x_SI.new_zeros(w_EIO.shape[0], capacity, x_SI.shape[1])
    padded_ECI = padded_ECI.index_put((ids_S, slot_S), x_SI)
    return torch.bmm(padded_ECI, w_EIO)[ids_S, slot_S]


def grouped_linear(
    x_SI: torch.Tensor,
    weight_EOI: torch.Tensor,
    adapters: list[LowRank],
    offsets_E: torch.Tensor,
    ids_S: torch.Tensor,
    capacity: int,
) -> torch.Tensor:
    """Each row through its expert's linear map (with its LoRA adapters): [S, O]."""
    out = grouped_mm(x_SI, weight_EOI.transpose(1, 2), offsets_E, ids_S, capacity)
    for adapter in adapters:
        low = grouped_mm(x_SI, adapter.a_EIR, offsets_E, ids_S, capacity)
        delta = grouped_mm(low, adapter.b_ERO, offsets_E, ids_S, capacity)
        out = out + (delta * adapter.scaling).to(out.dtype)
    return out


def route(
    gate: Any, x_TH: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router logits [T, E], top-k weights [T, k] in the model dtype, top-k ids [T, k])."""
    logits_TE = router_logits(gate, x_TH)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    weights_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return logits_TE, weights_TK.to(logits_TE.dtype), ids_TK


def experts_forward(
    experts: Any, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), as grouped products: [T, H]."""
    module, adapters = unwrap_experts(experts)
    num_tokens, top_k = ids_TK.shape
    num_experts = module.gate_up_proj.shape[0]
    ids_S, order_S = torch.sort(ids_TK.reshape(-1), stable=True)
    # counts by histc: no host sync, so a decode step can be captured in a graph
    counts_E = torch.histc(ids_S.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
    rows = (offsets_E, ids_S, num_tokens)
    x_SH = x_TH[order_S // top_k]
    gate_up = grouped_linear(x_SH, module.gate_up_proj, adapters["gate_up_proj"], *rows)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = grouped_linear(
        module.act_fn(gate) * up, module.down_proj, adapters["down_proj"], *rows
    )
    hidden = hidden * weights_TK.reshape(-1)[order_S, None]
    out_SH = torch.empty_like(hidden).index_copy_(0, order_S, hidden)
    return out_SH.view(num_tokens, top_k, -1).sum(dim=1).to(x_TH.dtype)


def moe_block(
    block: Any, x_TH: torch.Tensor, ids_TK: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sparse block over packed tokens: (output [T, H], router logits [T, E], chosen ids
    [T, k]). `ids_TK` replays given expert choices (routing replay) instead of the router's top-k;
    their weights still come from this router's probabilities, renormalised as configured."""
    gate = block.gate
    router = gate.get_base_layer() if is_lora_layer(gate) else gate
    logits_TE, weights_TK, top_ids_TK = route(gate, x_TH, router.top_k, router.norm_topk_prob)
    if ids_TK is not None:
        # a row of -1 has no recorded route (a position the sampler never computed): its own
        ids_TK = torch.where(ids_TK >= 0, ids_TK, top_ids_TK)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK = probs_TE.gather(1, ids_TK)
        if router.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        weights_TK = weights_TK.to(logits_TE.dtype)
    else:
        ids_TK = top_ids_TK
    out_TH = experts_forward(block.experts, x_TH, ids_TK, weights_TK)
    shared = getattr(block, "shared_expert", None)
    if shared is not None:  # qwen2_moe
        dense = linear(
            F.silu(linear(x_TH, shared.gate_proj)) * linear(x_TH, shared.up_proj),
            shared.down_proj,
        )
        out_TH = out_TH + torch.sigmoid(linear(x_TH, block.shared_expert_gate)) * dense
    return out_TH, logits_TE, ids_TK


# ------------------------------------------------------------------------------- routing replay


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds an expert id: uint8 up to 256 experts."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def sparse_layer_count(model) -> int:
    """How many decoder layers of `model` (a transformers model, PEFT unwrapped) are sparse."""
    return sum(is_moe_block(layer.mlp) for layer in model.model.layers)


class RouteRecord:
    """The experts each position of one sequence was routed to, on the host: [positions, sparse
    layers, k], written as the engine's steps compute positions (a prefill a span, a decode one
    row; a recomputed position is overwritten). Allocated for `capacity` positions (the
    sequence's longest), grown by doubling past it (a session's continued sequence)."""

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype, capacity: int = 0):
        self.rows_PNK = np.zeros((capacity, num_layers, top_k), dtype=dtype)
        self.length = 0  # positions 0 .. length - 1 are written

    def write(self, start: int, rows_SNK: np.ndarray) -> None:
        assert start <= self.length, "routes are written without a gap"
        end = start + rows_SNK.shape[0]
        if end > self.rows_PNK.shape[0]:
            shape = (max(end, 2 * self.rows_PNK.shape[0]), *self.rows_PNK.shape[1:])
            grown = np.zeros(shape, dtype=self.rows_PNK.dtype)
            grown[: self.length] = self.rows_PNK[: self.length]
            self.rows_PNK = grown
        self.rows_PNK[start:end] = rows_SNK
        self.length = max(self.length, end)

    def prefix(self, num_positions: int) -> np.ndarray:
        """A copy of the first `num_positions` positions' routes."""
        assert num_positions <= self.length, (num_positions, self.length)
        return self.rows_PNK[:num_positions].copy()

    def fork(self, num_positions: int) -> RouteRecord:
        child = RouteRecord(*self.rows_PNK.shape[1:], dtype=self.rows_PNK.dtype)
        child.write(0, self.rows_PNK[: min(num_positions, self.length)])
        return child


def record_routes(routes_TNK: torch.Tensor, spans: list[tuple[list[Any], int, int]]) -> None:
    """A finished step's routes (on the host) into its sequences' `RouteRecord`s: span (seqs,
    start, end) is the next end - start rows, positions start .. end - 1 of every one of seqs (a
    prefill's rows go to each member of the group, whose prompt they are)."""
    rows_TNK = routes_TNK.numpy()
    offset = 0
    for seqs, start, end in spans:
        rows = rows_TNK[offset : offset + end - start]
        offset += end - start
        for seq in seqs:
            if seq.routes is None:
                longest = seq.num_prompt_tokens + seq.params.max_new_tokens
                seq.routes = RouteRecord(*rows_TNK.shape[1:], rows_TNK.dtype, longest)
            seq.routes.write(start, rows)
    assert offset == rows_TNK.shape[0], "one route row per computed token"


@dataclass
class RoutingReplay:
    """The trainer's side: the recorded experts of the packed row the next forward computes
    ([tokens, sparse layers, k], -1 where a token has none), and the count of (token, layer)
    pairs whose own top-k set differs from the replayed one."""

    routes_TNK: torch.Tensor | None = None
    num_routed: int = 0  # tokens of `routes_TNK` with a recorded route
    is_counting: bool = False  # count in the next grad-enabled forward (not its recomputation)
    num_changed: torch.Tensor | None = None  # summed on the device: no sync per layer
    num_pairs: int = 0

    def layer(self, index: int, num_tokens: int) -> torch.Tensor | None:
        if self.routes_TNK is None:
            return None
        assert self.routes_TNK.shape[0] == num_tokens, (
            f"replayed routes for {self.routes_TNK.shape[0]} tokens, the forward has {num_tokens}"
        )
        return self.routes_TNK[:, index].long()

    def count(self, logits_TE: torch.Tensor, replay_TK: torch.Tensor) -> None:
        """Add this layer's tokens with a recorded route whose own top-k set is another."""
        own_TK = torch.topk(logits_TE.detach(), replay_TK.shape[1], dim=-1).indices
        has_route_T = replay_TK[:, 0] >= 0
        differs_T = (own_TK.sort(-1).values != replay_TK.sort(-1).values).any(-1)
        changed = (differs_T & has_route_T).sum()
        self.num_changed = changed if self.num_changed is None else self.num_changed + changed
        self.num_pairs += self.num_routed

    def take_counts(self) -> tuple[float, int]:
        """(changed pairs, pairs) counted since the last call; counting stops until asked again."""
        changed = 0.0 if self.num_changed is None else float(self.num_changed)
        counts = (changed, self.num_pairs)
        self.num_changed, self.num_pairs, self.is_counting = None, 0, False
        return counts


REPLAY_ATTRIBUTE = "reinforge_routing_replay"


def set_replay(model, routes_TNK: torch.Tensor | None) -> None:
    """The recorded experts the next forward of `model` replays (None: it routes itself). They
    stay set through the backward, whose activation recomputation must route alike."""
    replay = getattr(causal_lm(model), REPLAY_ATTRIBUTE, None)
    if replay is None:
        assert routes_TNK is None, "recorded routes for a model without sparse blocks"
        return
    replay.routes_TNK = routes_TNK
    replay.num_routed = 0 if routes_TNK is None else int((routes_TNK[:, 0, 0] >= 0).sum())
