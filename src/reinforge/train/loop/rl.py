"""The RL loop: rollout, score, advantages, policy update, log, save; one step at a time.

`train` and `rl_step` read like their table of contents; each phase is a named helper, here or in
the module that owns it (`advantage_step`: rows, reward shaping, advantages; `learner`: the
models, reference logprobs and old values; `update`: the optimizer step). Generation goes through
the `Engine` interface over the trainer's own model, so a step's new weights are what the next
rollout samples from, with nothing to sync.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch

from reinforge import faults, watchdog
from reinforge.checkpoint import TrainerState, rng_state, wait_for_saves
from reinforge.checkpoint.files import Saved, latest_checkpoint
from reinforge.config import TrainConfig
from reinforge.distributed import any_rank, is_distributed, is_generator, is_main, reduce_metrics
from reinforge.envs.env_tasks import EnvTasks, single_turn_tasks
from reinforge.eval import logged_metrics
from reinforge.eval.answers import answer_spread
from reinforge.metrics import console, episode_fields, format_line, plot_curves
from reinforge.rollout.sources import LocalRollouts, RemoteRollouts, rollout_source
from reinforge.rollout.trajectories import SUMMED as EPISODE_SUMS
from reinforge.rollout.trajectories import episode_metrics, tool_use_notes
from reinforge.run import RunContext, Stopped, Summary
from reinforge.sharding import full_weights
from reinforge.train.loop.advantage_step import assign_advantages, build_step_batch
from reinforge.train.loop.collector import Collector
from reinforge.train.loop.diagnostics import headroom_eval, headroom_text, question_repeats
from reinforge.train.loop.disaggregated import generate_for_trainers
from reinforge.train.loop.engine_records import begin_rollout
from reinforge.train.loop.graphs import held_bytes, peak_allocated, pool_metrics
from reinforge.train.loop.learner import Learner, build_learner, score_with_models
from reinforge.train.loop.nonfinite import enforce_non_finite_policy
from reinforge.train.loop.run_notes import learning_notes
from reinforge.train.loop.session import (
    Policy,
    first_eval_from_log,
    load_policy,
    open_logger,
    progress_bar,
    run_eval,
    run_tasks,
    save,
    sft_phase,
)
from reinforge.train.loop.update import update_policy
from reinforge.types import Group

__all__ = ["rl_step", "train"]

LOCAL = LocalRollouts()


def train(cfg: TrainConfig, ctx: RunContext) -> Summary:
    if is_generator():  # rank 0 of a disaggregated run: it only samples, for the trainers
        return generate_for_trainers(cfg, ctx)
    policy, state, ckpt = load_policy(cfg, ctx)
    sft_tasks = run_tasks(cfg, policy)
    tasks = single_turn_tasks(sft_tasks, cfg.task.rewards)  # every task an env (rollout/)
    logger = open_logger(cfg, ctx, state)
    summary = Summary("train", ctx.run_dir, final_step=state.step)
    eval_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
    rollouts = rollout_source(cfg, state)
    collector = Collector()
    try:
        if cfg.sft.steps > 0 and not state.sft_done:
            if state.phase != "sft":
                summary.sft_eval_before = log_eval(
                    cfg, policy, tasks, None, 0, eval_tokens, "before SFT"
                )
            state = sft_phase(cfg, ctx, policy, sft_tasks, state, ckpt, logger, cfg.sft.steps)
            ckpt = None  # RL starts fresh from the SFT result
        learner = build_learner(cfg, ctx, policy, ckpt, state)
        # a run resumed from `sft_final` may have logged it already (every rank follows rank 0,
        # which alone has the log: the evaluation is collective under FSDP)
        logged = any_rank(is_main() and first_eval_from_log(ctx.run_dir) is not None)
        if state.step == 0 and cfg.eval.before_train and not logged:
            log_eval(cfg, policy, tasks, logger, 0, eval_tokens, "before RL")
        summary.eval_before = first_eval_from_log(ctx.run_dir)
        start_step = state.step
        collector.take()  # SFT's and the set-up's collections are not RL steps'
        logged_at = None  # when the last step was logged (`iteration_s`)
        with progress_bar(cfg.run.max_steps, state.step, "RL") as advance:
            for step in range(state.step + 1, cfg.run.max_steps + 1):
                with collector.held():  # collected once, while the device runs the update
                    metrics = rl_step(
                        cfg,
                        learner,
                        tasks,
                        state,
                        step,
                        logger,
                        rollouts,
                        collector.collect,
                        collector.defer,
                    )
                metrics["gc_s"] = collector.take()
                if step == start_step + 1:  # compiled, captured, allocated: the rest is per step
                    collector.settle()
                state.step = summary.final_step = step
                summary.steps_trained = step - start_step
                now = time.perf_counter()
                if logged_at is not None:  # from the last step's log to this one's: the work
                    metrics["iteration_s"] = now - logged_at  # between steps too
                logged_at = now
                logger.log(step, metrics)
                console.print(format_line(step, metrics))
                advance()
                enforce_non_finite_policy(cfg.train, state, metrics, "RL")
                between_steps(cfg, ctx, learner, tasks, logger, state, eval_tokens)
        if summary.steps_trained > 0:
            summary.eval_after = log_eval(
                cfg, policy, tasks, logger, state.step, eval_tokens, "after RL"
            )
            save_rl(ctx, cfg, learner, state)
        if cfg.log.plot and is_main():
            plot_curves(ctx.run_dir)
    finally:
        collector.close()
        rollouts.close()
        logger.close()
    summary.notes += tool_use_notes(ctx.run_dir)
    summary.notes += task_notes(tasks)
    summary.notes += learning_notes(ctx.run_dir) if is_main() else []
    return summary


def task_notes(tasks) -> list[str]:
    """What the task source skipped or worked around (`notes()`, where it has one)."""
    notes = getattr(getattr(tasks, "source", tasks), "notes", None)
    return notes() if callable(notes) else []


def rl_step(
    cfg: TrainConfig,
    learner: Learner,
    tasks: EnvTasks,
    state: TrainerState,
    step: int,
    logger,
    rollouts: LocalRollouts | RemoteRollouts = LOCAL,
    while_busy: Callable[[], None] | None = None,
    defer: Callable[..., None] | None = None,
) -> dict[str, float]:
    """One RL step: the rollout, the step's batch and the update. `while_busy`: host work to do
    while the device runs the update (`update_policy`); `defer`: takes the step's rollout to
    keep until then in the next step (`Collector.defer`)."""
    start = time.perf_counter()
    totals = engine_totals(learner.policy)
    begin_rollout(learner)  # the engine's records of this rollout, for its update
    sampled, groups, sampling_metrics = rollouts.sample(cfg, learner.policy, tasks, state, step)
    # this step's share of the engine's fixed costs (restoring its pool, capturing graphs)
    engine_costs = {k: v - totals[k] for k, v in engine_totals(learner.policy).items()}
    if learner.policy.device.type == "cuda":
        # the KV pool and decode graphs are not needed until the next rollout: the update gets
        # their memory (a fresh pool costs a zero fill and a graph capture per batch size used)
        learner.policy.engine.release_memory()
    # read after the release, so the update's peak starts from what it keeps
    generate_peak = device_memory_metrics(learner, "generate")
    gen_s = time.perf_counter() - start
    train_start = time.perf_counter()
    with faults.site("training") as poison:
        batch = build_step_batch(groups, cfg.algorithm, learner.policy.device)
        score_with_models(cfg, learner, batch)
        shaping_metrics = assign_advantages(batch, learner.algorithm, cfg.rollout.max_new_tokens)
        if poison:  # a drill: a NaN that reaches the gradient
            batch.advantages.fill_(math.nan)
        metrics = update_policy(cfg, learner, batch, while_busy)
    logger.log_samples(step, sample_rows(learner.policy, groups, cfg.log.samples_per_step))
    num_generated = sum(t.num_completion_tokens for g in sampled for t in g.trajectories)
    metrics = {
        **rollout_metrics(sampled),
        **episode_metrics(sampled),
        **sampling_metrics,
        **engine_costs,
        **question_repeats(groups, learner.questions_seen),
        **shaping_metrics,
        **metrics,
        "generate_s": gen_s,
        "train_s": time.perf_counter() - train_start,
        "step_s": time.perf_counter() - start,
        "tokens_per_s": num_generated / max(gen_s, 1e-9),
        "lr": learner.scheduler.get_last_lr()[0],
        "data_position": float(state.data_position),
        **train_memory_metrics(learner, generate_peak, metrics.get("graph_capture", 0) > 0),
        **faults.step_metrics(),
    }
    if defer is not None:  # (host objects only: the batch's device tensors go now)
        defer(sampled, groups)
    return reduce_metrics(metrics, SUMMED_OVER_RANKS | set(EPISODE_SUMS.values()), MAXED_OVER_RANKS)


def engine_totals(policy) -> dict[str, float]:
    """The local engine's running totals of its fixed costs (`PagedEngine.totals`), if it keeps
    them (a remote or simple engine: none)."""
    totals = getattr(getattr(policy, "engine", None), "totals", None)
    return dict(totals) if isinstance(totals, dict) else {}


# How a step's per-rank metrics combine in a distributed run (the rest: mean over ranks; the
# loss terms arrive already reduced, `update.update_policy`).
SUMMED_OVER_RANKS = {
    "tokens_per_s",
    "reward_errors",
    "reward_nonfinite",
    "faults_injected",
    "gen_texts_ahead_ids",
}
MAXED_OVER_RANKS = {
    "generate_s",
    "train_s",
    "step_s",
    "gpu_peak_gib",
    "gpu_peak_generate_gib",
    "gpu_peak_train_gib",
    "gen_engine_s",
    "gen_restore_s",
    "gen_graph_capture_s",
}


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
                "rewards": t.rewards,
                "advantage": t.advantage,
                **episode_fields(policy.tokenizer, t),  # data source, turns
            }
        )
    return rows


def between_steps(cfg, ctx, learner: Learner, tasks, logger, state, eval_tokens: int) -> None:
    """Periodic evaluation and checkpoints; on a stop signal, save and raise `Stopped`."""
    mark_consistent(ctx, cfg, learner, state)
    step, is_last = state.step, state.step >= cfg.run.max_steps
    if cfg.eval.every and step % cfg.eval.every == 0 and not is_last:
        log_eval(cfg, learner.policy, tasks, logger, step, eval_tokens, f"step {step}")
    if any_rank(ctx.should_stop) and not is_last:  # the ranks stop at the same step
        raise Stopped(ctx.stop_signal or "signal", save_rl(ctx, cfg, learner, state))
    if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and not is_last:
        save_rl(ctx, cfg, learner, state, asynchronous=cfg.checkpoint.async_save)
        if cfg.log.plot and is_main():
            plot_curves(ctx.run_dir)


def save_rl(
    ctx: RunContext,
    cfg: TrainConfig,
    learner: Learner,
    state: TrainerState,
    rng: dict | None = None,
    asynchronous: bool = False,
):
    policy = learner.policy
    saved = Saved(
        policy.model,
        policy.tokenizer,
        state,
        learner.optimizer,
        learner.scheduler,
        learner.checkpoint_state(),
        rng,
    )
    name, keep_last = f"step_{state.step:06d}", cfg.checkpoint.keep_last
    return save(ctx, name, saved, keep_last, asynchronous and not is_distributed())


def mark_consistent(ctx: RunContext, cfg: TrainConfig, learner: Learner, state: TrainerState):
    """At a step boundary: should a later generation, reward, tool, logging or eval phase hang,
    the watchdog saves this step. The weights, optimizer and algorithm state change only in
    training; the loop's position and the RNG are snapshot here. Not in a distributed run: a
    sharded save is collective, and a hang leaves the other ranks elsewhere."""
    if is_distributed():
        return
    snapshot, rng, name = dataclasses.replace(state), rng_state(), f"step_{state.step:06d}"

    def save_this_step():
        wait_for_saves()
        latest = latest_checkpoint(ctx.run_dir)
        if latest is not None and latest.name == name:
            return latest
        return save_rl(ctx, cfg, learner, snapshot, rng=rng)

    watchdog.set_consistent_save(save_this_step)


def log_eval(
    cfg,
    policy: Policy,
    tasks,
    logger,
    step: int,
    max_new_tokens: int,
    label: str,
    phase: str = "rl",
) -> float | None:
    """Held-out accuracy (None: nothing to score), printed and, with a logger, logged with the
    other evaluation metrics (`eval_pass@k`, per-source accuracy, ...)."""
    with watchdog.phase("eval"), full_weights(policy.model):
        result = run_eval(cfg, policy, tasks, max_new_tokens)  # every rank: the same tasks
        is_logged = result is not None and logger is not None
        headroom = headroom_eval(cfg, policy, tasks, max_new_tokens, result) if is_logged else {}
    if result is None:
        return None
    if logger is not None:
        logger.log(
            step, logged_metrics(result) | answer_spread(result.samples) | headroom, phase=phase
        )
    console.print(
        f"held-out accuracy {label}: {result.accuracy:.3f} ({result.num_tasks} tasks)"
        + headroom_text(headroom)
    )
    return result.accuracy


def train_memory_metrics(learner: Learner, generate_peak: dict, captured: bool) -> dict:
    """The update's peak, the step's peaks and the graph pools' sizes, from one allocator
    snapshot (`captured`: the update captured its graph)."""
    if learner.policy.device.type != "cuda":
        return {}
    segments = torch.cuda.memory_snapshot()
    train_peak = device_memory_metrics(learner, "train", captured, segments)
    return peak_memory(generate_peak, train_peak) | pool_metrics(learner, segments)


def device_memory_metrics(
    learner: Learner, phase: str, captured: bool = False, segments: list | None = None
) -> dict[str, float]:
    """Peak accelerator memory since the last call (GiB) as `gpu_peak_<phase>_gib`, then reset:
    one figure per phase of a step (the generation phase counts from the previous update's end,
    the update from the rollout's). It adds what CUDA graphs' pools hold beyond what the
    allocator counts as allocated (`graphs.held_bytes`: a replay allocates nothing), so a
    replayed update's activations are in its peak."""
    device = learner.policy.device
    if device.type != "cuda":
        return {}
    held = held_bytes(learner, phase, captured, segments)
    peak = (peak_allocated(learner, device) + held) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {f"gpu_peak_{phase}_gib": peak}


def peak_memory(*phases: dict[str, float]) -> dict[str, float]:
    """The phases' peaks and the step's (`gpu_peak_gib`, their largest): which phase sets a
    step's peak is what the memory planner's table says to compare with."""
    merged = {k: v for phase in phases for k, v in phase.items()}
    return merged | ({"gpu_peak_gib": max(merged.values())} if merged else {})
