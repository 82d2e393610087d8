"""What both trainers share around their loops: loading the policy (fresh or from a checkpoint),
held-out evaluation, checkpoint saving, the SFT phase, the progress bar."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from reinforge import faults, watchdog
from reinforge.checkpoint import (
    TrainerState,
    check_disk_room,
    checkpoint_bytes,
    load_optimizer,
    load_trainer_state,
    save_checkpoint,
)
from reinforge.checkpoint.files import Saved, checkpoints_dir, latest_checkpoint
from reinforge.distributed import any_rank, is_generator, is_main, share
from reinforge.engine.base import Engine
from reinforge.engine.factory import build_engine
from reinforge.envs.env_tasks import EnvTasks
from reinforge.eval import EvalResult, evaluate
from reinforge.metrics import MetricsLogger, NullLogger, console
from reinforge.models.loading import load_tokenizer, model_source, resolve_device, resolve_dtype
from reinforge.run import RunContext, Stopped
from reinforge.sharding import shard_model
from reinforge.tasks import task_source_for
from reinforge.train.loop.collector import Collector
from reinforge.train.loop.nonfinite import enforce_non_finite_policy
from reinforge.train.packing.forward import packed_logprobs
from reinforge.train.planner.lengths import probe_lengths
from reinforge.train.planner.memory import MemoryChoice, plan_run
from reinforge.train.policy.model import SFT_FINAL, attach_adapter, build_model, merge_adapter
from reinforge.train.policy.moe import check_routing_replay
from reinforge.train.policy.optim import STATE_DTYPES, build_optimizer
from reinforge.train.sft import sft_examples, sft_step

PHASE_RANK = {"sft": 0, "rl": 1}


@dataclass(frozen=True)
class RunSetup:
    """What a run resolves once at its start, from its config and the machine, and passes down
    (on its `Policy`); never written back into the config, which keeps what the user gave."""

    source: str  # `model.path` as a loadable folder (a built-in model is built on first use)
    device: torch.device
    dtype: torch.dtype
    memory: MemoryChoice  # micro-batch tokens, checkpointing, sharding, the engine's KV pool
    episode_context: int | None = None  # env tasks: an episode's tokens (task.max_context resolved)


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object
    engine: Engine  # reads `model`'s parameters in place: nothing to sync after a step
    source: str  # where the weights were loaded from
    setup: RunSetup

    @property
    def device(self) -> torch.device:
        return self.setup.device


def run_tasks(cfg, policy: Policy):
    """The run's task source; an env task's episodes get the context the setup resolved."""
    tasks = task_source_for(cfg, policy.tokenizer)
    if isinstance(tasks, EnvTasks) and policy.setup.episode_context is not None:
        tasks = dataclasses.replace(tasks, max_context=policy.setup.episode_context)
    return tasks


def load_policy(cfg, ctx: RunContext) -> tuple[Policy, TrainerState, Path | None]:
    """The policy (fresh, or from the run's latest checkpoint) and the run's setup on it: the
    memory plan is made here, before the weights load."""
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    torch.manual_seed(cfg.run.seed)
    device = resolve_device(cfg.run.device)
    dtype = resolve_dtype(cfg.run.dtype, device)
    ckpt = latest_checkpoint(ctx.run_dir) if ctx.resume else None
    state = load_trainer_state(ckpt) if ckpt is not None else TrainerState("rl", 0, 0)
    base = model_source(cfg.model.path, cfg.run.seed)
    tokenizer = load_tokenizer(str(ckpt) if ckpt else (cfg.model.tokenizer or base))
    lengths = probe_lengths(cfg, tokenizer)
    choice, _ = plan_run(cfg, tokenizer, lengths, state.micro_batch_tokens)
    setup = RunSetup(base, device, dtype, choice, lengths.episode_context)
    state.micro_batch_tokens = choice.micro_batch_tokens
    sharded = ""
    if choice.replicated and choice.num_shards > 1:
        sharded = f", replicated on {choice.num_shards} processes, gradients averaged once a step"
    elif choice.num_shards > 1:
        how = "unsharded" if choice.accumulate_unsharded else "reduced every micro-batch"
        sharded = f", FSDP over {choice.num_shards} processes, gradients {how}"
    console.print(
        f"memory: micro-batches of <= {choice.micro_batch_tokens} tokens, gradient "
        f"checkpointing {'on' if choice.gradient_checkpointing else 'off'}{sharded} "
        f"({choice.budget_note})"
    )
    if choice.lora_generation_note:
        console.print(f"LoRA generation: {choice.lora_generation} ({choice.lora_generation_note})")
    model, source = build_model(cfg, ctx.run_dir, ckpt, state, setup)
    # under torchrun FSDP2 or a replica per process (`distributed.strategy`); one process: as it is
    model = shard_model(model, replicate=choice.replicated, packed_forward=packed_logprobs)
    watchdog.beat_on_forward(model)  # every forward is progress for the hang watchdog
    if not is_generator():  # the processes that save
        state_bytes = 2 * STATE_DTYPES[cfg.optim.state_dtype].itemsize  # AdamW's two moments
        need = checkpoint_bytes(model, state_bytes)
        warning = check_disk_room(ctx.run_dir, need, cfg.checkpoint.keep_last)
        if warning:
            console.print(f"[yellow]{warning}[/yellow]")
    engine = policy_engine(cfg, model, tokenizer, choice.kv_cache_bytes, choice.lora_generation)
    policy = Policy(model, tokenizer, engine, source, setup)
    return policy, state, ckpt


def policy_engine(
    cfg, model, tokenizer, kv_cache_bytes: int | None, lora_generation: str = "auto"
) -> Engine:
    """The engine `rollout.engine` names ("auto" for SFT runs, which have no rollout section),
    its KV pool and LoRA generation the memory plan's: the trainer shares the device, so never
    all free memory."""
    rollout = getattr(cfg, "rollout", None)
    choice = rollout.engine if rollout is not None else "auto"
    replay = getattr(getattr(cfg, "algorithm", None), "routing_replay", False)
    return build_engine(
        model,
        tokenizer,
        choice,
        kv_cache_bytes=kv_cache_bytes,
        setting="rollout.engine",
        lora_generation=lora_generation,
        record_routes=check_routing_replay(model, replay, choice),
    )


def open_logger(cfg, ctx: RunContext, state: TrainerState) -> MetricsLogger | NullLogger:
    if not is_main():
        return NullLogger()
    resume_key = (PHASE_RANK[state.phase], state.step) if ctx.resume else None
    return MetricsLogger(
        ctx.run_dir,
        cfg.log.tensorboard,
        cfg.log.wandb,
        cfg.log.wandb_project,
        cfg.model_dump(mode="json"),
        resume_key=resume_key,
    )


def held_out(cfg, tasks) -> list:
    all_eval = tasks.eval_tasks()
    return all_eval[: cfg.eval.num_tasks] if cfg.eval.num_tasks else all_eval


def run_eval(cfg, policy: Policy, tasks, max_new_tokens: int) -> EvalResult | None:
    """Held-out evaluation as `[eval]` says (the code `reinforge eval` runs); None when there is
    nothing to score: no held-out tasks, or tasks without a reward (`can_score`)."""
    chosen = held_out(cfg, tasks)
    if not chosen or not getattr(tasks, "can_score", True):
        return None
    e = cfg.eval
    return evaluate(
        policy.engine,
        policy.tokenizer,
        tasks,
        chosen,
        max_new_tokens,
        seed=cfg.run.seed,
        samples_per_task=e.samples_per_task,
        temperature=e.temperature,
        top_p=e.top_p,
    )


def save(
    ctx: RunContext,
    name: str,
    saved: Saved,
    keep_last: int | None = None,
    asynchronous: bool = False,
) -> Path:
    with watchdog.phase("checkpoint"):
        return save_checkpoint(ctx.run_dir, name, saved, keep_last, asynchronous)


def sft_phase(
    cfg,
    ctx: RunContext,
    policy: Policy,
    tasks,
    state: TrainerState,
    ckpt: Path | None,
    logger: MetricsLogger,
    total_steps: int,
    validate: Callable[[int], object] | None = None,
) -> TrainerState:
    """Run (or finish) the SFT phase; returns the state RL starts from, saved as `sft_final`.
    `validate(step)` runs after each step (`reinforge sft` validates every eval.every steps);
    every checkpoint.every steps the phase is saved as `sft_step_N`, to resume from."""
    s, o = cfg.sft, cfg.optim
    optimizer, scheduler = build_optimizer(
        policy.model,
        s.lr,
        o.betas,
        o.eps,
        o.weight_decay,
        s.warmup_steps,
        total_steps,
        "cosine",
        0.1,
        state_dtype=STATE_DTYPES[o.state_dtype],
    )
    if state.phase == "sft" and state.step > 0:
        assert ckpt is not None
        load_optimizer(ckpt, Saved(policy.model, policy.tokenizer, state, optimizer, scheduler))
    else:
        state = TrainerState("sft", 0, state.data_position, False, state.micro_batch_tokens)
    every = max(total_steps // 10, 1)
    mine = share(s.batch_size)  # this rank's examples of each batch
    eta = StepTimer(total_steps, state.step)
    collector, first = Collector(), state.step + 1  # the collector's pauses (`collector`)
    try:
        with progress_bar(total_steps, state.step, "SFT") as advance:
            for step in range(state.step + 1, total_steps + 1):
                prompts, responses, masks = sft_examples(
                    policy.tokenizer, tasks, state.data_position + mine.start, len(mine)
                )
                state.data_position += s.batch_size
                with faults.site("training") as poison:
                    metrics = sft_step(
                        policy.model,
                        policy.tokenizer,
                        optimizer,
                        scheduler,
                        prompts,
                        responses,
                        o.max_grad_norm,
                        micro_batch_tokens=policy.setup.memory.micro_batch_tokens,
                        poison=poison,
                        share_prompts=cfg.train.share_prompts,
                        masks=masks,
                        accumulate_unsharded=policy.setup.memory.accumulate_unsharded,
                    )
                metrics["gc_s"] = collector.take()
                if step == first:  # compiled and allocated: the rest is per step
                    collector.settle()
                state.step = step
                logger.log(step, {**metrics, **faults.step_metrics()}, phase="sft")
                advance()
                enforce_non_finite_policy(cfg.train, state, metrics, "sft")
                if step % every == 0 or step == total_steps:
                    console.print(
                        f"sft {step:>5}/{total_steps} | loss {metrics['loss']:.4f} | "
                        f"lr {metrics['lr']:.2e} | {eta.left(step)}"
                    )
                if validate is not None:
                    validate(step)
                if any_rank(ctx.should_stop) and step < total_steps:
                    saved = Saved(policy.model, policy.tokenizer, state, optimizer, scheduler)
                    path = save(ctx, f"sft_step_{step:06d}", saved)
                    raise Stopped(ctx.stop_signal or "signal", path)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < total_steps:
                    keep = cfg.checkpoint.keep_last
                    saved = Saved(policy.model, policy.tokenizer, state, optimizer, scheduler)
                    save(ctx, f"sft_step_{step:06d}", saved, keep)
    finally:
        collector.close()
    state = TrainerState("rl", 0, state.data_position, True, state.micro_batch_tokens)
    save_sft_final(cfg, ctx, policy, state)
    for stale in checkpoints_dir(ctx.run_dir).glob("sft_step_*"):
        import shutil

        shutil.rmtree(stale, ignore_errors=True)
    return state


def save_sft_final(cfg, ctx: RunContext, policy: Policy, state: TrainerState) -> None:
    """Save the SFT result, where RL starts (and its KL reference). With LoRA the SFT adapter is
    merged into the weights first, and RL gets a fresh adapter on top of them."""
    if not cfg.model.lora.rank:
        save(ctx, SFT_FINAL, Saved(policy.model, policy.tokenizer, state))
        return
    policy.model = merge_adapter(policy.model)
    path = save(ctx, SFT_FINAL, Saved(policy.model, policy.tokenizer, state))
    policy.model = attach_adapter(cfg, policy.model)
    del policy.engine  # its KV pool is freed before the new engine allocates one
    memory = policy.setup.memory
    policy.engine = policy_engine(
        cfg, policy.model, policy.tokenizer, memory.kv_cache_bytes, memory.lora_generation
    )
    policy.source = str(path)


def first_eval_from_log(
    run_dir: Path, key: str = "eval_accuracy", phase: str = "rl"
) -> float | None:
    """The held-out score logged at step 0 (before training) by an earlier process of this run."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("phase") == phase and row.get("step") == 0 and key in row:
            return row[key]
    return None


class StepTimer:
    """Time left in a phase, from the mean time of the steps this process ran (for the log
    lines, which a log file keeps where the progress bar is drawn only on a terminal)."""

    def __init__(self, total: int, done: int):
        self.total, self.first, self.started = total, done, time.perf_counter()

    def left(self, step: int) -> str:
        ran = step - self.first
        if ran <= 0 or step >= self.total:
            return f"{_duration(time.perf_counter() - self.started)} in this process"
        per_step = (time.perf_counter() - self.started) / ran
        return f"about {_duration(per_step * (self.total - step))} left"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@contextmanager
def progress_bar(total: int, completed: int, description: str):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task_id = bar.add_task(description, total=total, completed=completed)
        yield lambda: bar.advance(task_id)
