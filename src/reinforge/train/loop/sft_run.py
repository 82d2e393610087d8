"""`reinforge sft`: supervised fine-tuning on a task's reference solutions (or a dataset's
conversations), validated before, every eval.every steps and after (validation loss on the
held-out solutions; held-out accuracy where the tasks can be scored), with the same run
directory, checkpoints and resume as RL."""

from __future__ import annotations

import json

from reinforge.config import SFTConfig
from reinforge.distributed import is_main
from reinforge.metrics import console, plot_curves
from reinforge.run import RunContext, Summary
from reinforge.train.loop.rl import log_eval
from reinforge.train.loop.session import (
    Policy,
    first_eval_from_log,
    held_out,
    load_policy,
    open_logger,
    run_tasks,
    sft_phase,
)
from reinforge.train.sft import validation_loss


def run_sft(cfg: SFTConfig, ctx: RunContext) -> Summary:
    policy, state, ckpt = load_policy(cfg, ctx)
    tasks = run_tasks(cfg, policy)
    if ckpt is None:
        state.phase = "sft"
    logger = open_logger(cfg, ctx, state)
    summary = Summary(
        "sft", ctx.run_dir, final_step=state.step if state.phase == "sft" else cfg.sft.steps
    )
    eval_tokens = cfg.eval.max_new_tokens or 32

    def validate(step: int, label: str) -> float | None:
        return validate_sft(cfg, policy, tasks, logger, step, eval_tokens, label)

    def periodic(step: int) -> None:
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.sft.steps:
            validate(step, f"step {step}")

    try:
        if state.sft_done:
            return summary
        if state.step == 0 and cfg.eval.before_train:
            validate(0, "before SFT")
        summary.eval_before = first_eval_from_log(ctx.run_dir, phase="sft")
        start = state.step
        sft_phase(cfg, ctx, policy, tasks, state, ckpt, logger, cfg.sft.steps, periodic)
        summary.steps_trained, summary.final_step = cfg.sft.steps - start, cfg.sft.steps
        summary.eval_after = validate(cfg.sft.steps, "after SFT")
        summary.notes += loss_note(ctx.run_dir, cfg.sft.steps)
        if cfg.log.plot and is_main():
            plot_curves(ctx.run_dir)
    finally:
        logger.close()
    return summary


def validate_sft(
    cfg, policy: Policy, tasks, logger, step: int, max_new_tokens: int, label: str
) -> float | None:
    """Validation loss on the held-out solutions (`eval_loss`), then held-out accuracy where the
    tasks can be scored (the evaluation `reinforge eval` runs); returns the accuracy."""
    tokens = policy.setup.memory.micro_batch_tokens
    loss = validation_loss(policy.model, policy.tokenizer, held_out(cfg, tasks), tokens)
    if loss is not None:
        logger.log(step, {"eval_loss": loss}, phase="sft")
        console.print(f"validation loss {label}: {loss:.4f}")
    return log_eval(cfg, policy, tasks, logger, step, max_new_tokens, label, phase="sft")


def loss_note(run_dir, last_step: int) -> list[str]:
    """The summary's line on validation loss, from the log (a resumed run's first value too)."""
    before = first_eval_from_log(run_dir, key="eval_loss", phase="sft")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r["phase"] == "sft" and r["step"] == last_step]
    after = next((r["eval_loss"] for r in logged if "eval_loss" in r), None)
    if after is None:
        return []
    start = f"{before:.4f} before, " if before is not None else ""
    return [f"validation loss: {start}{after:.4f} after"]
