"""The trainer's mixture-of-experts blocks: grouped experts in the forward and backward, and the
router's load-balancing loss.

transformers 5 already computes the experts of `qwen3_moe` / `qwen2_moe` as grouped products
(`experts_implementation="grouped_mm"`, its default), which is sound for full fine-tuning; but
under PEFT LoRA on the experts its `ParamWrapper` adds `B A` to the whole stacked weight of every
layer on every forward (and autograd keeps that [E, 2I, H] sum per layer for the backward: about
1.2 GB a layer on Qwen3-30B-A3B). `install_grouped_moe` points each sparse block's forward at
`engine.moe.moe_block` instead: the same grouped products, with the adapters applied through their
low-rank factors, the same function the engine decodes with (so sampler and trainer route alike).

Each block's router logits of a grad-enabled forward are kept in the model's `RouterLog` while it
is collecting (`begin_micro_batch` .. `router_aux_loss`), for the load-balancing loss
(transformers' `load_balancing_loss_func`, over the micro-batch's packed tokens).

Routing replay (`algorithm.routing_replay`): a packed forward whose batch carries the engine's
recorded experts (`engine.moe.set_replay`, from `train.packing`) sends each token to them instead
of its own top-k; the gate weights are this router's probabilities at those ids (renormalised
when the config's `norm_topk_prob`), so the router keeps its gradient. The micro-batch's forward
counts the (token, layer) pairs whose own top-k set differs from the replayed one
(`replay_metrics`: `routing_replay_changed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from reinforge.engine.lora_forward import causal_lm
from reinforge.engine.moe import REPLAY_ATTRIBUTE, RoutingReplay, is_moe_block, moe_block
from reinforge.errors import ConfigError

LOG_ATTRIBUTE = "reinforge_router_log"


@dataclass
class RouterLog:
    num_experts: int
    top_k: int
    config_coef: float  # the checkpoint's router_aux_loss_coef
    is_collecting: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)  # per block, [T, E]
    replay: RoutingReplay = field(default_factory=RoutingReplay)


def sparse_blocks(model) -> list:
    return [layer.mlp for layer in causal_lm(model).model.layers if is_moe_block(layer.mlp)]


def install_grouped_moe(model) -> RouterLog | None:
    """Route every sparse block of `model` (or of the model under a PEFT wrapper) through
    `engine.moe.moe_block`; returns the log of router logits, or None for a dense model."""
    blocks = sparse_blocks(model)
    if not blocks:
        return None
    config = causal_lm(model).config
    log = RouterLog(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        config_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
    )
    for index, block in enumerate(blocks):
        block.forward = partial(grouped_block_forward, block, log, index)
    setattr(causal_lm(model), LOG_ATTRIBUTE, log)
    setattr(causal_lm(model), REPLAY_ATTRIBUTE, log.replay)
    return log


def grouped_block_forward(
    block, log: RouterLog, index: int, hidden_BLH: torch.Tensor
) -> torch.Tensor:
    """Sparse block `index` (among the sparse ones) over the forward's tokens."""
    x_TH = hidden_BLH.reshape(-1, hidden_BLH.shape[-1])
    replay_TK = log.replay.layer(index, x_TH.shape[0])
    out_TH, logits_TE, _ = moe_block(block, x_TH, replay_TK)
    if torch.is_grad_enabled():
        if log.is_collecting:
            log.logits.append(logits_TE)
        if replay_TK is not None and log.replay.is_counting:
            log.replay.count(logits_TE, replay_TK)
    return out_TH.view_as(hidden_BLH)


def dense_refusal(model_type: str) -> str:
    return (
        f"algorithm.routing_replay = true, but the model ({model_type!r}) is dense: it has no "
        "experts to replay; set algorithm.routing_replay = false (it is for mixture-of-experts "
        "models: qwen3_moe, qwen2_moe)"
    )


def check_routing_replay(model, enabled: bool, engine_choice: str) -> bool:
    """`algorithm.routing_replay` against the model: a dense model, or an engine that cannot
    record routes (`rollout.engine = "simple"`, or a model without the paged forward), is a
    `ConfigError`. Returns whether the engine should record."""
    if not enabled:
        return False
    from reinforge.engine.qwen_forward import unsupported_reason

    if not sparse_blocks(model):
        raise ConfigError(dense_refusal(causal_lm(model).config.model_type))
    needs = "algorithm.routing_replay = true needs the paged engine to record each token's experts"
    reason = unsupported_reason(model)
    if reason is not None:
        raise ConfigError(f"{needs}, but {reason}; set algorithm.routing_replay = false")
    if engine_choice == "simple":
        raise ConfigError(
            f"{needs}, but rollout.engine = 'simple' records none; set rollout.engine = 'auto' "
            "(or 'paged'), or algorithm.routing_replay = false"
        )
    return True


def router_log(model) -> RouterLog | None:
    return getattr(causal_lm(model), LOG_ATTRIBUTE, None)


def aux_coef(model, setting: float | None) -> float:
    """`algorithm.router_aux_coef`, or the checkpoint's when unset; 0 for a dense model."""
    log = router_log(model)
    if log is None:
        return 0.0
    return log.config_coef if setting is None else setting


def begin_micro_batch(model, setting: float | None) -> None:
    """Collect the next forward's router logits when the loss will use them."""
    log = router_log(model)
    if log is not None:
        log.logits.clear()
        log.is_collecting = aux_coef(model, setting) > 0
        log.replay.is_counting = True  # counts only where the forward replays routes


def replay_metrics(model) -> dict[str, float]:
    """The (token, layer) pairs of the forward since `begin_micro_batch` that replayed a route,
    and how many of them this router would have sent to another top-k set; summed over
    micro-batches and ranks, then `routing_replay_ratio` divides them. Empty without replay."""
    log = router_log(model)
    if log is None:
        return {}
    changed, pairs = log.replay.take_counts()
    if not pairs:
        return {}
    return {"routing_replay_changed_pairs": changed, "routing_replay_pairs": float(pairs)}


def routing_replay_ratio(totals: dict[str, float]) -> None:
    """`routing_replay_changed`: the share of replayed (token, layer) pairs whose own top-k set
    differs (per layer, averaged: every layer sees the same tokens), in place of the counts."""
    if "routing_replay_pairs" in totals:
        pairs = totals.pop("routing_replay_pairs")
        totals["routing_replay_changed"] = totals.pop("routing_replay_changed_pairs") / pairs


def router_aux_loss(model, setting: float | None) -> torch.Tensor | None:
    """coef * the load-balancing loss of the forward since `begin_micro_batch` (None when off);
    the log stops collecting, so a recomputation in the backward (activation checkpointing)
    keeps nothing."""
    log = router_log(model)
    if log is None or not log.is_collecting:
        return None
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    log.is_collecting = False
    logits, log.logits = tuple(log.logits), []
    assert logits, "a sparse model's forward passed no router"
    loss = load_balancing_loss_func(logits, log.num_experts, log.top_k)
    return aux_coef(model, setting) * loss
