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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from reinforge.engine.lora_forward import causal_lm
from reinforge.engine.moe import is_moe_block, moe_block

LOG_ATTRIBUTE = "reinforge_router_log"


@dataclass
class RouterLog:
    num_experts: int
    top_k: int
    config_coef: float  # the checkpoint's router_aux_loss_coef
    is_collecting: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)  # per block, [T, E]


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
    for block in blocks:
        block.forward = partial(grouped_block_forward, block, log)
    setattr(causal_lm(model), LOG_ATTRIBUTE, log)
    return log


def grouped_block_forward(block, log: RouterLog, hidden_BLH: torch.Tensor) -> torch.Tensor:
    x_TH = hidden_BLH.reshape(-1, hidden_BLH.shape[-1])
    out_TH, logits_TE, _ = moe_block(block, x_TH)
    if log.is_collecting and torch.is_grad_enabled():
        log.logits.append(logits_TE)
    return out_TH.view_as(hidden_BLH)


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
