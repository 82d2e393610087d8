"""What RL trains and reads besides the data: the policy, its KL reference, the value head, the
optimizer and schedule, and the algorithm's own state. Built once per run (restored from the
checkpoint when resuming), saved with every checkpoint.

`score_with_models` is the trainer's no-grad pass before advantages: the reference's logprobs
(when kl_coef > 0; the same numbers whether the KL goes into the loss or the rewards) and the
value head's old values (GAE). The reference is the policy with its LoRA adapter disabled, or,
for full fine-tuning, a frozen copy.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reinforge.algorithms.value import ValueHead
from reinforge.checkpoint import TrainerState, load_extra_state, load_optimizer, restore_rng
from reinforge.checkpoint.files import Saved
from reinforge.config import TrainConfig
from reinforge.models.loading import load_model, model_source
from reinforge.run import RunContext
from reinforge.sharding import in_lockstep, is_replicated, shard_model
from reinforge.train.loop.advantage_step import Algorithm, StepBatch
from reinforge.train.loop.engine_records import start_records
from reinforge.train.loop.graphs import graph_blocker, share_memory
from reinforge.train.loop.session import Policy
from reinforge.train.packing.attention import select_packed_attention
from reinforge.train.packing.forward import completion_rows, micro_batches, packed_logprobs
from reinforge.train.policy.model import SFT_FINAL
from reinforge.train.policy.optim import STATE_DTYPES, build_optimizer
from reinforge.train.policy.value import build_value_head, head_values

# The KL reference's forward: `with reference() as model: ...`
Reference = Callable[[], AbstractContextManager[torch.nn.Module]]


@dataclass
class Learner:
    policy: Policy
    algorithm: Algorithm
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: Reference | None = None  # the policy as RL started
    value_head: ValueHead | None = None
    # keys of the questions RL trained on (diagnostics.question_repeats), kept across a resume
    questions_seen: set[int] = field(default_factory=set)
    graphs_failed: bool = False  # a CUDA graph capture of the update failed (train.loop.graphs)
    graphs_noted: bool = False  # the run was told why train.cuda_graphs has no effect
    update_graph: object | None = None  # train.cuda_graphs = "run": the kept UpdateGraph
    grad_buffers: dict | None = None  # ... and the step's gradients' buffers (graphs.flat_grads)
    mempool: object | None = None  # torch.cuda.MemPool shared by the KV pool and the update graph
    grad_bytes_in_mempool: int = 0  # the step's gradient buffer's bytes, where it is in `mempool`

    def checkpoint_state(self) -> dict:
        """What resume needs beyond the model, optimizer and RNG."""
        state: dict = {"algorithm": self.algorithm.state_dict()}
        if self.value_head is not None:
            state["value_head"] = self.value_head.state_dict()
        state["questions_seen"] = torch.tensor(sorted(self.questions_seen), dtype=torch.int64)
        return state


def build_learner(
    cfg: TrainConfig, ctx: RunContext, policy: Policy, ckpt: Path | None, state: TrainerState
) -> Learner:
    a, o = cfg.algorithm, cfg.optim
    algorithm = Algorithm(a)
    reference = reference_of(cfg, ctx, policy) if a.uses_reference else None
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
        state_dtype=STATE_DTYPES[o.state_dtype],
    )
    learner = Learner(policy, algorithm, optimizer, scheduler, reference, value_head)
    if graph_blocker(cfg, learner) is None:  # the KV pool and the update's graphs take turns
        share_memory(learner)
    start_records(cfg, learner)  # the update from the engine's forward, where it applies
    if ckpt is not None and state.phase == "rl" and state.step > 0:
        extra = load_extra_state(ckpt)
        algorithm.load_state_dict(extra["algorithm"])
        if value_head is not None:
            value_head.load_state_dict(extra["value_head"])
        if "questions_seen" in extra:  # not in checkpoints written before it existed
            learner.questions_seen.update(extra["questions_seen"].tolist())
        load_optimizer(ckpt, Saved(policy.model, policy.tokenizer, state, optimizer, scheduler))
        restore_rng(ckpt)
    return learner


def reference_of(cfg: TrainConfig, ctx: RunContext, policy: Policy) -> Reference:
    """The KL reference, the policy as RL started (after any SFT stage): under LoRA the policy
    itself with its adapter disabled (no second copy of the weights), else a frozen copy."""
    if cfg.model.lora.rank:
        from reinforge.train.policy.lora import adapter_disabled

        return lambda: adapter_disabled(policy.model)
    sft_final = ctx.run_dir / "checkpoints" / SFT_FINAL
    source = str(sft_final) if sft_final.exists() else policy.source
    if not sft_final.exists() and ctx.resume:
        source = model_source(cfg.model.path, cfg.run.seed)
    frozen = load_model(source, policy.device, next(policy.model.parameters()).dtype)
    frozen.eval().requires_grad_(False)
    select_packed_attention(frozen, "auto")
    # under torchrun: sharded (or replicated) like the policy
    frozen = shard_model(
        frozen,
        trainable=False,
        replicate=is_replicated(policy.model),
        packed_forward=packed_logprobs,
    )
    return lambda: nullcontext(frozen)


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
    share = cfg.train.share_prompts
    tokens = learner.policy.setup.memory.micro_batch_tokens
    lockstep = in_lockstep(learner.policy.model)
    for idx in micro_batches(batch.prompts, batch.completions, tokens, share, lockstep):
        prompts = [batch.prompts[i] for i in idx]
        completions = [batch.completions[i] for i in idx]
        if learner.reference is not None:
            with learner.reference() as reference:
                rows = completion_rows(
                    reference, prompts, completions, temperature, share_prompts=share
                )
            batch.ref_BT[idx, : rows.logprobs_ST.shape[1]] = rows.logprobs_ST
        if batch.old_values_BT is not None:
            rows = completion_rows(
                learner.policy.model,
                prompts,
                completions,
                temperature,
                with_hidden=True,
                share_prompts=share,
            )
            values_ST = head_values(learner.value_head, rows.hidden_STH)
            batch.old_values_BT[idx, : values_ST.shape[1]] = values_ST
    if batch.old_values_BT is not None:
        batch.old_values_BT *= batch.mask_BT
