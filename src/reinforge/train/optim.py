"""AdamW with linear warmup and a constant, cosine or linear schedule."""

from __future__ import annotations

import math

import torch


def lr_factor(
    step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float
) -> float:
    """Multiplier of the peak learning rate for the optimizer step with index `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    assert schedule == "cosine", schedule
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model,
    lr: float,
    betas,
    eps: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str,
    min_ratio: float,
    extra_param_groups: list[dict] = (),
):
    """AdamW over the model's trainable parameters (no decay on vectors), plus any extra groups
    (e.g. a value head with its own lr); one schedule scales every group's lr."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert params, "no trainable parameters"
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            *extra_param_groups,
        ],
        lr=lr,
        betas=tuple(betas),
        eps=eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps, total_steps, schedule, min_ratio)
    )
    return optimizer, scheduler
