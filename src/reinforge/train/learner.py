"""What RL trains and reads besides the data: the policy, its KL reference, the value head, the
optimizer and schedule, and the algorithm's own state. Built once per run (restored from the
checkpoint when resuming), saved with every checkpoint.

`score_with_models` is the trainer's no-grad pass before advantages: the reference's logprobs
(when kl_coef > 0; the same numbers whether the KL goes into the loss or the rewards) and the
value head's old values (GAE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reinforge.algorithms.value import ValueHead
from reinforge.checkpoint import TrainerState, load_extra_state, load_optimizer, restore_rng
from reinforge.config import TrainConfig
from reinforge.run import RunContext
from reinforge.train.advantage_step import Algorithm, StepBatch
from reinforge.train.common import load_model, model_source
from reinforge.train.forward import completion_rows, micro_batches
from reinforge.train.optim import build_optimizer
from reinforge.train.session import Policy
from reinforge.train.value import build_value_head, head_values


@dataclass
class Learner:
    policy: Policy
    algorithm: Algorithm
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: torch.nn.Module | None = None  # frozen copy of the policy as RL started
    value_head: ValueHead | None = None

    def checkpoint_state(self) -> dict:
        """What resume needs beyond the model, optimizer and RNG."""
        state: dict = {"algorithm": self.algorithm.state_dict()}
        if self.value_head is not None:
            state["value_head"] = self.value_head.state_dict()
        return state


def build_learner(
    cfg: TrainConfig, ctx: RunContext, policy: Policy, ckpt: Path | None, state: TrainerState
) -> Learner:
    a, o = cfg.algorithm, cfg.optim
    algorithm = Algorithm(a)
    reference = load_reference(cfg, ctx, policy) if a.uses_reference else None
    value_head = build_value_head(policy.model, policy.device) if a.uses_value_model else None
    value_groups = []
    if value_head is not None:
        value_lr = a.value_lr or o.lr
        value_groups.append(
            {"params": list(value_head.parameters()), "lr": value_lr, "weight_decay": 0.0}
        )
    optimizer, scheduler = build_optimizer(
        policy.model,
        o.lr,
        o.betas,
        o.eps,
        o.weight_decay,
        o.warmup_steps,
        cfg.run.max_steps,
        o.schedule,
        o.min_lr_ratio,
        extra_param_groups=value_groups,
    )
    learner = Learner(policy, algorithm, optimizer, scheduler, reference, value_head)
    if ckpt is not None and state.phase == "rl" and state.step > 0:
        extra = load_extra_state(ckpt)
        algorithm.load_state_dict(extra["algorithm"])
        if value_head is not None:
            value_head.load_state_dict(extra["value_head"])
        load_optimizer(ckpt, optimizer, scheduler)
        restore_rng(ckpt)
    return learner


def load_reference(cfg: TrainConfig, ctx: RunContext, policy: Policy) -> torch.nn.Module:
    """The frozen KL reference: the policy as RL started (after any SFT stage)."""
    sft_final = ctx.run_dir / "checkpoints" / "sft_final"
    source = str(sft_final) if sft_final.exists() else policy.source
    if not sft_final.exists() and ctx.resume:
        source = model_source(cfg.model.path, cfg.run.seed)
    ref = load_model(source, policy.device, next(policy.model.parameters()).dtype)
    ref.eval().requires_grad_(False)
    return ref


@torch.no_grad()
def score_with_models(cfg: TrainConfig, learner: Learner, batch: StepBatch) -> None:
    """Fill `batch.ref_BT` and `batch.old_values_BT` where the algorithm needs them."""
    if learner.reference is None and learner.value_head is None:
        return
    temperature = cfg.rollout.temperature or 1.0
    shape = batch.mask_BT.shape
    if learner.reference is not None:
        batch.ref_BT = torch.zeros(shape, device=batch.mask_BT.device)
    if learner.value_head is not None:
        batch.old_values_BT = torch.zeros(shape, device=batch.mask_BT.device)
    for idx in micro_batches(len(batch.trajs), cfg.train.micro_batch_size):
        prompts = [batch.trajs[i].prompt_ids for i in idx]
        completions = [batch.trajs[i].completion.token_ids for i in idx]
        if batch.ref_BT is not None:
            rows = completion_rows(learner.reference, prompts, completions, temperature)
            batch.ref_BT[idx, : rows.logprobs_ST.shape[1]] = rows.logprobs_ST
        if batch.old_values_BT is not None:
            rows = completion_rows(
                learner.policy.model, prompts, completions, temperature, with_hidden=True
            )
            values_ST = head_values(learner.value_head, rows.hidden_STH)
            batch.old_values_BT[idx, : values_ST.shape[1]] = values_ST
    if batch.old_values_BT is not None:
        batch.old_values_BT *= batch.mask_BT
