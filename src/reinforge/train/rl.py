"""The RL loop: rollout, score, advantages, policy update, log, save; one step at a time.

`train` reads like its table of contents; each phase is a named helper below it. Generation goes
through the `Engine` interface over the trainer's own model, so a step's new weights are what
the next rollout samples from, with nothing to sync.
"""

from __future__ import annotations

import math
import time

import torch

from reinforge.algorithms.advantages import grpo_advantages
from reinforge.algorithms.kl import kl_estimate
from reinforge.algorithms.losses import LossInputs, PPOClipSettings, ppo_clip_loss
from reinforge.checkpoint import TrainerState, restore_rng
from reinforge.config import TrainConfig
from reinforge.engine.base import SamplingParams
from reinforge.metrics import console, format_line, plot_curves
from reinforge.run import RunContext, Stopped, Summary
from reinforge.tasks import build_task_source
from reinforge.train.common import eos_ids, load_model, pad_batch, render_prompt, token_logprobs
from reinforge.train.optim import build_optimizer
from reinforge.train.session import (
    Policy,
    first_eval_from_log,
    load_policy,
    open_logger,
    progress_bar,
    run_eval,
    save,
    sft_phase,
)
from reinforge.types import Group, Trajectory


def train(cfg: TrainConfig, ctx: RunContext) -> Summary:
    tasks = build_task_source(cfg.task)
    policy, state, ckpt = load_policy(cfg, ctx)
    logger = open_logger(cfg, ctx, state)
    summary = Summary("train", ctx.run_dir, final_step=state.step)
    eval_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    try:
        if cfg.sft.steps > 0 and not state.sft_done:
            if state.phase != "sft":
                summary.sft_eval_before = run_eval(cfg, policy, tasks, eval_tokens).accuracy
                console.print(f"held-out accuracy before SFT: {summary.sft_eval_before:.3f}")
            state = sft_phase(cfg, ctx, policy, tasks, state, ckpt, logger, cfg.sft.steps)
            ckpt = None  # RL starts fresh from the SFT result
        reference = load_reference(cfg, ctx, policy)
        optimizer, scheduler = build_optimizer(
            policy.model,
            cfg.optim.lr,
            cfg.optim.betas,
            cfg.optim.eps,
            cfg.optim.weight_decay,
            cfg.optim.warmup_steps,
            cfg.run.max_steps,
            cfg.optim.schedule,
            cfg.optim.min_lr_ratio,
        )
        if ckpt is not None and state.phase == "rl" and state.step > 0:
            from reinforge.checkpoint import load_optimizer

            load_optimizer(ckpt, optimizer, scheduler)
            restore_rng(ckpt)
        if state.step == 0 and cfg.eval.before_train:
            log_eval(cfg, policy, tasks, logger, 0, eval_tokens, "before RL")
        summary.eval_before = first_eval_from_log(ctx.run_dir)
        start_step = state.step
        with progress_bar(cfg.run.max_steps, state.step, "RL") as advance:
            for step in range(state.step + 1, cfg.run.max_steps + 1):
                metrics = rl_step(
                    cfg, policy, reference, optimizer, scheduler, tasks, state, step, logger
                )
                state.step = summary.final_step = step
                summary.steps_trained = step - start_step
                logger.log(step, metrics)
                console.print(format_line(step, metrics))
                advance()
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.run.max_steps:
                    log_eval(cfg, policy, tasks, logger, step, eval_tokens, f"step {step}")
                if ctx.should_stop and step < cfg.run.max_steps:
                    path = save(
                        ctx,
                        f"step_{step:06d}",
                        policy,
                        optimizer,
                        scheduler,
                        state,
                        cfg.checkpoint.keep_last,
                    )
                    raise Stopped(ctx.stop_signal or "signal", path)
                if (
                    cfg.checkpoint.every
                    and step % cfg.checkpoint.every == 0
                    and step < cfg.run.max_steps
                ):
                    save(
                        ctx,
                        f"step_{step:06d}",
                        policy,
                        optimizer,
                        scheduler,
                        state,
                        cfg.checkpoint.keep_last,
                    )
                    if cfg.log.plot:
                        plot_curves(ctx.run_dir)
        if summary.steps_trained > 0:
            summary.eval_after = log_eval(
                cfg, policy, tasks, logger, state.step, eval_tokens, "after RL"
            )
            save(
                ctx,
                f"step_{state.step:06d}",
                policy,
                optimizer,
                scheduler,
                state,
                cfg.checkpoint.keep_last,
            )
        if cfg.log.plot:
            plot_curves(ctx.run_dir)
    finally:
        logger.close()
    return summary


def rl_step(
    cfg: TrainConfig,
    policy: Policy,
    reference,
    optimizer,
    scheduler,
    tasks,
    state: TrainerState,
    step: int,
    logger,
) -> dict[str, float]:
    start = time.perf_counter()
    batch_tasks = [
        tasks.train_task(state.data_position + i) for i in range(cfg.rollout.prompts_per_step)
    ]
    state.data_position += len(batch_tasks)
    groups = rollout(cfg, policy, batch_tasks, seed=cfg.run.seed * 1_000_003 + step)
    gen_s = time.perf_counter() - start
    score(groups, tasks)
    assign_advantages(groups, cfg)
    train_start = time.perf_counter()
    metrics = update_policy(cfg, policy, reference, optimizer, scheduler, groups)
    logger.log_samples(step, sample_rows(policy, groups, cfg.log.samples_per_step))
    num_generated = policy.engine.stats.num_generated_tokens
    step_s = time.perf_counter() - start
    return {
        **rollout_metrics(groups),
        **metrics,
        "generate_s": gen_s,
        "train_s": time.perf_counter() - train_start,
        "step_s": step_s,
        "tokens_per_s": num_generated / max(gen_s, 1e-9),
        "lr": scheduler.get_last_lr()[0],
        "data_position": float(state.data_position),
    }


def rollout(cfg: TrainConfig, policy: Policy, batch_tasks, seed: int) -> list[Group]:
    r = cfg.rollout
    prompts = [render_prompt(policy.tokenizer, t.messages) for t in batch_tasks]
    params = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        n=r.samples_per_prompt,
        stop_token_ids=tuple(eos_ids(policy.tokenizer)),
        stop_strings=tuple(r.stop_strings),
        seed=seed,
    )
    outputs = policy.engine.generate(prompts, params)
    return [
        Group(task, [Trajectory(task, prompt, completion) for completion in completions])
        for task, prompt, completions in zip(batch_tasks, prompts, outputs)
    ]


def score(groups: list[Group], tasks) -> None:
    for group in groups:
        for traj in group.trajectories:
            traj.reward = tasks.reward(traj.completion.text, traj.task)
            traj.is_correct = traj.reward >= 1.0


def assign_advantages(groups: list[Group], cfg: TrainConfig) -> None:
    rewards_GN = torch.tensor(
        [[t.reward for t in g.trajectories] for g in groups], dtype=torch.float32
    )
    advantages_GN = grpo_advantages(rewards_GN, normalize_std=cfg.algorithm.normalize_std)
    for group, row in zip(groups, advantages_GN.tolist()):
        for traj, adv in zip(group.trajectories, row):
            traj.advantage = adv


def update_policy(
    cfg: TrainConfig, policy: Policy, reference, optimizer, scheduler, groups: list[Group]
) -> dict:
    a = cfg.algorithm
    settings = PPOClipSettings(
        a.clip_low, a.clip_high, a.kl_coef, a.kl_estimator, a.entropy_coef, a.loss_aggregation
    )
    trajs = [t for g in groups for t in g.trajectories]
    num_tokens = float(sum(t.num_completion_tokens for t in trajs))
    temperature = cfg.rollout.temperature or 1.0
    totals: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    for i in range(0, len(trajs), cfg.train.micro_batch_size):
        micro = trajs[i : i + cfg.train.micro_batch_size]
        batch = pad_batch(
            [t.prompt_ids for t in micro],
            [t.completion.token_ids for t in micro],
            policy.tokenizer.pad_token_id,
            policy.device,
        )
        sampler_BT = sampler_logprobs(micro, batch.mask_BT)
        logprobs_BT, entropy_BT = token_logprobs(
            policy.model, batch, temperature, with_entropy=True
        )
        ref_BT = None
        if reference is not None:
            with torch.no_grad():
                ref_BT, _ = token_logprobs(reference, batch, temperature)
        inputs = LossInputs(
            logprobs_BT=logprobs_BT,
            old_logprobs_BT=logprobs_BT.detach() if a.old_logprobs == "trainer" else sampler_BT,
            advantages_B=torch.tensor([t.advantage for t in micro], device=policy.device),
            mask_BT=batch.mask_BT,
            num_tokens_total=num_tokens,
            num_seqs_total=float(len(trajs)),
            ref_logprobs_BT=ref_BT,
            entropy_BT=entropy_BT,
        )
        loss, metrics = ppo_clip_loss(inputs, settings)
        loss.backward()
        with torch.no_grad():
            mismatch = kl_estimate(sampler_BT, logprobs_BT.detach(), "k3")
            metrics["kl_sampler"] = (mismatch * batch.mask_BT).sum() / num_tokens
        metrics["loss"] = loss.detach()
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    grad_norm = float(
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), cfg.optim.max_grad_norm)
    )
    if math.isfinite(grad_norm):
        optimizer.step()
        totals["nonfinite_skipped"] = 0.0
    else:
        totals["nonfinite_skipped"] = 1.0  # parameters untouched
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    totals["grad_norm"] = grad_norm
    return totals


def sampler_logprobs(micro: list[Trajectory], mask_BT: torch.Tensor) -> torch.Tensor:
    """The sampler's logprobs laid out like the trainer's [B, L-1] targets."""
    out = torch.zeros_like(mask_BT)
    for b, t in enumerate(micro):
        start = len(t.prompt_ids) - 1
        out[b, start : start + t.num_completion_tokens] = torch.tensor(
            t.completion.logprobs, dtype=out.dtype
        )
    return out


def rollout_metrics(groups: list[Group]) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    n = len(trajs)
    flat_groups = sum(1 for g in groups if len({t.reward for t in g.trajectories}) == 1)
    return {
        "reward_mean": sum(t.reward for t in trajs) / n,
        "accuracy": sum(t.is_correct for t in trajs) / n,
        "response_len": sum(t.num_completion_tokens for t in trajs) / n,
        "truncation_rate": sum(t.completion.finish_reason == "length" for t in trajs) / n,
        "zero_signal_groups": flat_groups / len(groups),
    }


def sample_rows(policy: Policy, groups: list[Group], count: int) -> list[dict]:
    rows = []
    for g in groups[:count]:
        t = g.trajectories[0]
        rows.append(
            {
                "prompt": policy.tokenizer.decode(t.prompt_ids),
                "completion": t.completion.text,
                "answer": t.task.answer,
                "reward": t.reward,
                "advantage": t.advantage,
            }
        )
    return rows


def log_eval(
    cfg, policy: Policy, tasks, logger, step: int, max_new_tokens: int, label: str
) -> float:
    result = run_eval(cfg, policy, tasks, max_new_tokens)
    logger.log(
        step,
        {
            "eval_accuracy": result.accuracy,
            "eval_reward": result.reward_mean,
            "eval_response_len": result.response_len,
            "eval_truncation_rate": result.truncation_rate,
        },
    )
    console.print(f"held-out accuracy {label}: {result.accuracy:.3f} ({result.num_tasks} tasks)")
    return result.accuracy


def load_reference(cfg: TrainConfig, ctx: RunContext, policy: Policy):
    """The frozen KL reference: the policy as RL started (after any SFT stage)."""
    if cfg.algorithm.kl_coef == 0.0:
        return None
    sft_final = ctx.run_dir / "checkpoints" / "sft_final"
    source = str(sft_final) if sft_final.exists() else policy.source
    if not sft_final.exists() and ctx.resume:
        from reinforge.train.common import model_source

        source = model_source(cfg.model.path, cfg.run.seed)
    ref = load_model(source, policy.device, next(policy.model.parameters()).dtype)
    ref.eval().requires_grad_(False)
    return ref
