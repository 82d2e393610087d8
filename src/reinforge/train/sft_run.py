"""`reinforge sft`: supervised fine-tuning on a task's reference solutions, with held-out
accuracy before and after, the same run directory, checkpoints and resume as RL."""

from __future__ import annotations

from reinforge.config import SFTConfig
from reinforge.metrics import plot_curves
from reinforge.run import RunContext, Summary
from reinforge.tasks import build_task_source
from reinforge.train.rl import log_eval
from reinforge.train.session import first_eval_from_log, load_policy, open_logger, sft_phase


def run_sft(cfg: SFTConfig, ctx: RunContext) -> Summary:
    tasks = build_task_source(cfg.task)
    policy, state, ckpt = load_policy(cfg, ctx)
    if ckpt is None:
        state.phase = "sft"
    logger = open_logger(cfg, ctx, state)
    summary = Summary(
        "sft", ctx.run_dir, final_step=state.step if state.phase == "sft" else cfg.sft.steps
    )
    eval_tokens = cfg.eval.max_new_tokens or 32
    try:
        if state.sft_done:
            return summary
        if state.step == 0 and cfg.eval.before_train:
            log_eval(cfg, policy, tasks, logger, 0, eval_tokens, "before SFT")
        summary.eval_before = first_eval_from_log(ctx.run_dir)
        start = state.step
        sft_phase(cfg, ctx, policy, tasks, state, ckpt, logger, cfg.sft.steps)
        summary.steps_trained, summary.final_step = cfg.sft.steps - start, cfg.sft.steps
        summary.eval_after = log_eval(
            cfg, policy, tasks, logger, cfg.sft.steps, eval_tokens, "after SFT"
        )
        if cfg.log.plot:
            plot_curves(ctx.run_dir)
    finally:
        logger.close()
    return summary
