"""The non-finite policy: what the run does after a step whose gradient holds NaN or infinity.

The optimizer step itself is skipped wherever the gradient is not finite (`optimizer_step.optimizer_step`,
`sft.sft_step`): parameters and optimizer moments stay the previous step's, the schedule and the
data position advance (the step counts), and the metric `nonfinite_skipped` is 1. This module
decides whether the run goes on: `train.non_finite = "crash"` fails at the first such step,
"skip" after `train.max_consecutive_non_finite` in a row. The streak is part of `TrainerState`,
so it survives a resume; a state with a non-finite parameter is refused by the checkpoint writer.
"""

from __future__ import annotations

from reinforge.checkpoint import TrainerState
from reinforge.config import TrainSection
from reinforge.errors import RunFailure
from reinforge.metrics import console


def enforce_non_finite_policy(
    settings: TrainSection, state: TrainerState, metrics: dict[str, float], phase: str
) -> None:
    """Update the streak after step `state.step`; raise `RunFailure` when the policy says stop."""
    if not metrics.get("nonfinite_skipped"):
        state.non_finite_streak = 0
        return
    state.non_finite_streak += 1
    streak, where = state.non_finite_streak, f"{phase} step {state.step}"
    grad_norm = metrics.get("grad_norm", float("nan"))
    if settings.non_finite == "crash":
        raise RunFailure(
            f"{where}: the gradient is not finite (grad_norm {grad_norm}); the optimizer step was "
            "skipped and train.non_finite = 'crash' stops the run here. Set train.non_finite = "
            "'skip' to skip such steps, or lower optim.lr"
        )
    if streak >= settings.max_consecutive_non_finite:
        raise RunFailure(
            f"{streak} steps in a row had a non-finite gradient (up to {where}); the parameters "
            f"are still those of {phase} step {state.step - streak}. Lower optim.lr or "
            "optim.max_grad_norm and check the data, or raise train.max_consecutive_non_finite "
            f"(now {settings.max_consecutive_non_finite})"
        )
    console.print(
        f"[yellow]{where}: non-finite gradient (grad_norm {grad_norm}); step skipped, parameters "
        f"unchanged ({streak} in a row; the run stops at {settings.max_consecutive_non_finite})[/]"
    )
