"""The configuration: pydantic sections and one root per command (here, the import point), the
`[algorithm]` union (`algorithm`), task sections (`tasks`, `data`, `envs`, `rewards`), loading
with strict keys and overrides (`load`), a saved run's config for resume (`resume`) and the
reference generator (`docs`). It may import `errors`, `types` and the pure parts' tables
(`algorithms`, `data`), never torch, so `--help` and config errors are instant.

Typed configuration: one root model per command, loaded from TOML plus `section.key=value`
overrides, validated once.

Every field carries a docstring (it becomes the field's description and the generated config
reference), bounds, and a default that works. Unknown or misplaced keys are refused with the
closest valid key and, when the key belongs to another section, the section to move it to.

This module defines the roots and the sections of run, model, stages and logging, and is the
place to import any of it from: the task sections and their union (config/tasks.py, with
config/data.py and config/envs.py), `[algorithm]` and its presets (config/algorithm.py), the RL
step's `[rollout]`, `[optim]` and `[train]` (config/training.py), and
loading, key checking and `to_toml` (config/load.py) are imported here.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from reinforge.config.algorithm import AlgorithmBase, AlgorithmSection, GRPOAlgorithm, preset_values
from reinforge.config.base import MAX_SEED, Section
from reinforge.config.distributed import DistributedSection
from reinforge.config.envs import is_env_task
from reinforge.config.load import (
    apply_override,
    check_keys,
    format_validation_error,
    load_config,
    to_toml,
)
from reinforge.config.resilience import FaultsSection, WatchdogSection
from reinforge.config.tasks import (
    ArithmeticTaskConfig,
    CountdownTaskConfig,
    RandomTokensTaskConfig,
    TaskConfig,
)
from reinforge.config.training import OptimSection, RolloutSection, TrainSection

__all__ = [
    "ROOTS",
    "AlgorithmBase",
    "AlgorithmSection",
    "ArithmeticTaskConfig",
    "CheckpointSection",
    "CountdownTaskConfig",
    "DistributedSection",
    "EvalConfig",
    "EvalRunSection",
    "EvalSamplingSection",
    "EvalSection",
    "LogSection",
    "LoraSection",
    "ModelSection",
    "OptimSection",
    "RandomTokensTaskConfig",
    "RolloutSection",
    "RunSection",
    "SFTConfig",
    "SFTOnlySection",
    "SFTSection",
    "TaskConfig",
    "TrainConfig",
    "TrainSection",
    "apply_override",
    "check_keys",
    "format_validation_error",
    "load_config",
    "preset_values",
    "to_toml",
]


# ----------------------------------------------------------------------------- run / model


class RunSection(Section):
    name: str = "run"
    """Name of the run; the run directory is `output_dir/name`."""
    output_dir: str = "runs"
    """Folder that holds run directories."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed for model init, data order, sampling and dropout, from 0 to 2**32 - 1 (numpy's and
    torch's seeds, and the per-step seeds derived from it, must fit 64 bits). Same seed, same
    run (per device)."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weight dtype for training and generation. `auto`: bfloat16 on a GPU that supports it, float32 on CPU."""
    max_steps: int = Field(60, ge=1, le=10_000_000)
    """Number of RL (or SFT) optimizer steps to run."""
    num_threads: int = Field(0, ge=0, le=1024)
    """CPU threads for torch; 0 keeps torch's default."""
    overwrite: bool = False
    """Allow starting a new run in a run directory that already holds one (it is cleared)."""


class LoraSection(Section):
    rank: int = Field(0, ge=0, le=4096)
    """LoRA rank: train low-rank adapters (PEFT) instead of every weight; 0 = off (full
    fine-tuning). The KL reference is then the base model with the adapter disabled: no copy."""
    alpha: float | None = Field(None, gt=0.0)
    """LoRA scale numerator: the update is alpha / rank * B A. Default: 2 * rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get adapters: "all-linear" (every linear layer but the LM head), a list of
    module-name suffixes such as ["q_proj", "v_proj"], or a regular expression. Binding to no
    layer is refused."""


class ModelSection(Section):
    path: str = "builtin:tiny"
    """A local HF checkpoint folder, a hub name (when online), or `builtin:tiny` (a few-million-parameter
    Qwen2 model and byte-level tokenizer built offline, random init)."""
    tokenizer: str | None = None
    """Tokenizer folder or name when it differs from `path`."""
    max_context: int | None = Field(None, ge=8)
    """Override of the context length the preflight checks against (default: the model config's
    `max_position_embeddings`)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in the backward pass to save memory: true, false, or "auto" (the
    memory planner turns it on only when the job does not fit without it)."""
    lora: LoraSection = LoraSection()
    """LoRA adapters; rank 0 (the default) trains every weight."""


# ----------------------------------------------------------------------------- stages


class SFTSection(Section):
    steps: int = Field(0, ge=0, le=10_000_000)
    """SFT optimizer steps on the task's reference solutions. In `reinforge train` these run before RL
    (0 = no SFT stage); `reinforge sft` uses `run.max_steps` instead when this is 0."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Examples per SFT step (over all processes under torchrun, each taking an equal share)."""
    lr: float = Field(3e-3, gt=0, le=1.0)
    """Peak learning rate of the SFT stage (warmup then cosine to 10%)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup steps of the SFT stage."""


class EvalSamplingSection(Section):
    """How held-out tasks are scored: `[eval]` of `reinforge eval`, and the part of training's
    `[eval]` that the same code reads."""

    num_tasks: int | None = Field(None, ge=1)
    """Held-out tasks to score, the first ones (default: all of them)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation budget per sample. Default: `rollout.max_new_tokens` in `reinforge train` and
    in `reinforge eval` of a run; 32 in `reinforge sft`; 512 otherwise."""
    samples_per_task: int = Field(1, ge=1, le=1024)
    """Samples per task (n): pass@k is reported for k = 1, 2, 4, ... up to n, and mean@n."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 decodes greedily (one sample per task is then enough)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""

    @model_validator(mode="after")
    def _samples_differ(self) -> EvalSamplingSection:
        if self.samples_per_task > 1 and self.temperature == 0.0:
            raise ValueError(
                f"eval.samples_per_task = {self.samples_per_task} with eval.temperature = 0 "
                "gives identical greedy samples; set eval.temperature = 0.6 (or 1.0) for "
                "pass@k, or eval.samples_per_task = 1"
            )
        return self


class EvalSection(EvalSamplingSection):
    before_train: bool = True
    """Validate before training starts (validate_before_train): held-out accuracy, and in SFT the
    validation loss. In `reinforge train` this is before RL, after any SFT stage."""
    every: int = Field(0, ge=0)
    """Also validate every N steps (validate_every; 0 = only before and after)."""
    headroom_tasks: int = Field(32, ge=0)
    """`reinforge train`: at each evaluation, also sample rollout.samples_per_prompt (k) answers
    of the first this many held-out tasks at the rollout's temperature and log
    `eval_sampled_pass@1`, `eval_sampled_pass@k` and `eval_headroom` (sampled pass@k minus the
    evaluation's pass@1 on those tasks): what RL can still sharpen. 32 tasks x 8 samples took 0.6 s beside
    2.1 s for the greedy 200 (builtin:tiny, the quickstart's task, a CPU thread: a group's prompt
    is prefilled once) and measure headroom to about +-8 points; 0 turns it off."""


class CheckpointSection(Section):
    every: int = Field(20, ge=0)
    """Save every N steps (0 = only at the end and on a signal)."""
    keep_last: int = Field(2, ge=1)
    """Step checkpoints kept on disk (older ones are deleted)."""
    async_save: bool = False
    """Write periodic checkpoints in a background thread: training waits only while the weights,
    optimizer and state are copied to host memory (which needs that much free RAM), never for the
    disk, and cannot change the copy being written. Saves on a stop signal and at the end are
    synchronous, so they are durable before the process exits. Under torchrun with several
    processes every save is synchronous (a sharded save is collective)."""
    on_damaged: Literal["previous", "error"] = "previous"
    """What a resume does when the latest checkpoint's files differ from the hashes saved with
    them (a flipped bit, a truncated or missing file): "previous" reports the damage, keeps the
    damaged folder as `damaged-NAME` and resumes from the newest intact earlier checkpoint;
    "error" stops (exit code 1), naming the damage and the checkpoint "previous" would take."""


class LogSection(Section):
    tensorboard: bool = True
    """Write TensorBoard event files under the run directory."""
    wandb: bool = False
    """Log to Weights & Biases when installed (offline unless WANDB_API_KEY is set)."""
    wandb_project: str = "reinforge"
    """W&B project name."""
    samples_per_step: int = Field(4, ge=0)
    """Rollouts written to samples.jsonl each step."""
    plot: bool = True
    """Write a PNG of reward and accuracy curves at each checkpoint and at the end."""


# ----------------------------------------------------------------------------- roots


class TrainConfig(Section):
    """`reinforge train`: an optional SFT stage, then RL."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskConfig = ArithmeticTaskConfig()
    sft: SFTSection = SFTSection()
    rollout: RolloutSection = RolloutSection()
    algorithm: AlgorithmSection = GRPOAlgorithm()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    watchdog: WatchdogSection = WatchdogSection()
    faults: FaultsSection = FaultsSection()
    distributed: DistributedSection = DistributedSection()

    @model_validator(mode="after")
    def _algorithm_fits_rollout(self) -> TrainConfig:
        a, budget = self.algorithm, self.rollout.max_new_tokens
        if a.overlong_buffer > budget:
            origin = a.origins()["overlong_buffer"]
            raise ValueError(
                f"algorithm.overlong_buffer = {a.overlong_buffer} ({origin}) is longer than "
                f"rollout.max_new_tokens = {budget}: the penalty ramps over the last "
                f"overlong_buffer tokens of the budget; set algorithm.overlong_buffer = "
                f"{max(budget // 5, 1)} (a fifth of the budget, the paper's proportion) or 0 "
                "to turn it off"
            )
        if a.overlong_buffer and is_env_task(self.task):
            raise ValueError(
                f"algorithm.overlong_buffer = {a.overlong_buffer} ({a.origins()['overlong_buffer']}) "
                "shapes single completions by their length, but task.name = "
                f"{self.task.name!r} runs multi-turn episodes (rollout.max_new_tokens is each "
                "turn's budget, task.max_context the episode's); set algorithm.overlong_buffer = 0"
            )
        return self


class SFTOnlySection(SFTSection):
    steps: int = Field(200, ge=1, le=10_000_000)
    """SFT optimizer steps."""


class SFTConfig(Section):
    """`reinforge sft`: supervised fine-tuning on a task's reference solutions."""

    needs_task_answers: ClassVar[bool] = False  # SFT trains on solutions; answers only score

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskConfig = ArithmeticTaskConfig()
    sft: SFTOnlySection = SFTOnlySection()
    optim: OptimSection = OptimSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    watchdog: WatchdogSection = WatchdogSection()
    faults: FaultsSection = FaultsSection()


class EvalRunSection(Section):
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of sampling (when eval.temperature > 0) and of a dataset's held-out draw, from 0 to
    2**32 - 1."""
    device: str = "auto"
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weight dtype. `auto`: bfloat16 on a GPU that supports it, float32 on CPU."""
    num_threads: int = Field(0, ge=0, le=1024)
    """CPU threads for torch; 0 keeps torch's default."""


class EvalConfig(Section):
    """`reinforge eval MODEL`: score a model, checkpoint or run on held-out tasks or data files:
    pass@k (unbiased), mean@n, accuracy by data_source, response lengths, truncation rate; a
    table and a JSON file. Evaluating a run starts from the run's own `[task]` and `[eval]`."""

    run: EvalRunSection = EvalRunSection()
    task: TaskConfig = ArithmeticTaskConfig()
    eval: EvalSamplingSection = EvalSamplingSection()


ROOTS: dict[str, type[Section]] = {"train": TrainConfig, "sft": SFTConfig, "eval": EvalConfig}
