"""`[watchdog]` and `[faults]`: the hang watchdog's limits, and fault injection for drills.

Both roots (`train`, `sft`) take them; `reinforge.run.guarded` applies them for a run's duration.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reinforge.config.base import Section


class WatchdogSection(Section):
    timeout_s: float = Field(900.0, ge=0.0, le=604_800.0)
    """Seconds without progress after which the run counts as hung: every thread's stack goes to
    stderr and hang.txt in the run directory, the last completed step is saved when the state
    allows (watchdog.save_on_hang), and the process exits with code 4 naming the phase
    (generation, reward, tool, training, checkpoint, logging, eval). Every forward pass of the
    model and every phase change is progress. 0 = off."""
    startup_timeout_s: float = Field(1800.0, ge=0.0, le=604_800.0)
    """The limit while the run starts (loading model, tokenizer and data, downloads included):
    the larger of this and watchdog.timeout_s."""
    save_on_hang: bool = True
    """On a hang in a phase that leaves the state as the last step left it (generation, reward,
    tool, logging, eval), checkpoint that step before exiting. Hangs in training or checkpoint
    phases never save: their state is half-changed; nor does a run of several processes (a
    sharded save needs every process)."""


class FaultsSection(Section):
    """Fault injection for tests and drills: every instrumented call at a site faults with that
    site's probability. All rates 0 (the default) is off."""

    reward: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a reward call faults. Recoverable: the sample's reward is 0 and the metric
    `reward_errors` (exception) or `reward_nonfinite` (nan) counts it."""
    tool: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a tool call faults. Recoverable: the model reads the tool's error text and
    `tool_errors` counts it."""
    generation: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a generation call (a rollout round, an evaluation) faults. Fatal: the run
    fails with exit code 1."""
    training: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a training step (an RL update, an SFT step) faults. A nan makes the step's
    gradient non-finite, so train.non_finite acts; an exception is fatal."""
    logging: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that a metrics write faults. Fatal."""
    checkpoint: float = Field(0.0, ge=0.0, le=1.0)
    """Probability of a fault at each of a save's three points (after the weights, before the
    folder's rename, before the `latest` pointer moves). Fatal; a resume loads the previous
    complete checkpoint."""
    kinds: list[Literal["exception", "hang", "nan"]] = Field(["exception"], min_length=1)
    """What a fault is: "exception" (raised at the call), "hang" (the call sleeps faults.hang_s,
    for the watchdog to catch), "nan" (the call's value becomes NaN; only reward and training
    compute a value, the other sites draw among the other kinds)."""
    hang_s: float = Field(3600.0, gt=0.0, le=604_800.0)
    """How long an injected hang sleeps."""
    seed: int = Field(0, ge=0)
    """Seed of the fault draws (independent of run.seed: a drill does not change training's draws)."""

    @model_validator(mode="after")
    def _kinds_fit_sites(self) -> FaultsSection:
        numeric = ("reward", "training")
        for site, rate in self.rates().items():
            if rate > 0 and self.kinds == ["nan"] and site not in numeric:
                raise ValueError(
                    f"faults.{site} = {rate} with faults.kinds = ['nan']: a {site} call computes "
                    "no number to make NaN; add a kind, e.g. kinds = ['exception', 'nan'], or set "
                    f"faults.{site} = 0"
                )
        return self

    def rates(self) -> dict[str, float]:
        sites = ("reward", "tool", "generation", "training", "logging", "checkpoint")
        return {site: getattr(self, site) for site in sites}
