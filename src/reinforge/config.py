"""Typed configuration: one root model per command, loaded from TOML plus `section.key=value`
overrides, validated once.

Every field carries a docstring (it becomes the field's description and the generated config
reference), bounds, and a default that works. Unknown or misplaced keys are refused with the
closest valid key and, when the key belongs to another section, the section to move it to.
"""

from __future__ import annotations

import copy
import difflib
import sys
import types
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, Field, ValidationError, model_validator

from reinforge.algorithms.table import (
    PRESETS,
    AdvantageName,
    Aggregation,
    AlgorithmName,
    KLEstimator,
    KLPlacement,
    LossName,
)
from reinforge.config_base import Section
from reinforge.config_data import DatasetTaskConfig
from reinforge.config_envs import (
    GameTaskConfig,
    HtmlTaskConfig,
    SearchTaskConfig,
    ToolArithmeticTaskConfig,
    is_env_task,
)
from reinforge.config_resilience import FaultsSection, WatchdogSection
from reinforge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ----------------------------------------------------------------------------- run / model


class RunSection(Section):
    name: str = "run"
    """Name of the run; the run directory is `output_dir/name`."""
    output_dir: str = "runs"
    """Folder that holds run directories."""
    seed: int = Field(0, ge=0)
    """Seed for model init, data order, sampling and dropout. Same seed, same run (per device)."""
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


# ----------------------------------------------------------------------------- tasks


class ArithmeticTaskConfig(Section):
    name: Literal["arithmetic"] = "arithmetic"
    """Multi-digit arithmetic: `a op b` with a numeric answer."""
    min_digits: int = Field(1, ge=1, le=12)
    """Fewest digits of an operand."""
    max_digits: int = Field(2, ge=1, le=12)
    """Most digits of an operand."""
    operations: list[Literal["+", "-", "*"]] = ["+", "-"]
    """Operations to draw from."""
    sentence_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of SFT reference solutions written as a sentence ("The answer is 133.") instead of
    the bare number the checker accepts: a format habit SFT teaches and RL has to unlearn, as with
    real SFT data whose style differs from what the verifier wants."""
    partial_credit: float = Field(0.0, ge=0.0, lt=1.0)
    """Reward for a wrong answer, scaled by the fraction of its digits (aligned from the right) that
    match; 0 gives a plain 0/1 reward. Credit for the digits a wrong answer got right tells RL which
    tokens to blame. Accuracy always counts exact answers only."""
    num_eval: int = Field(200, ge=1, le=100_000)
    """Held-out tasks scored before and after training (never used for training)."""
    seed: int = Field(1234, ge=0)
    """Seed of the task generator (independent of `run.seed`)."""

    @model_validator(mode="after")
    def _digits_ordered(self) -> ArithmeticTaskConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(
                f"min_digits={self.min_digits} is above max_digits={self.max_digits}; "
                f"set max_digits >= {self.min_digits}"
            )
        return self


class CountdownTaskConfig(Section):
    name: Literal["countdown"] = "countdown"
    """Countdown: combine the given numbers with + - * / to reach the target."""
    num_numbers: int = Field(3, ge=2, le=6)
    """How many numbers each task gives."""
    max_number: int = Field(20, ge=2, le=1000)
    """Largest given number."""
    num_eval: int = Field(200, ge=1, le=100_000)
    """Held-out tasks scored before and after training (never used for training)."""
    seed: int = Field(1234, ge=0)
    """Seed of the task generator (independent of `run.seed`)."""


class RandomTokensTaskConfig(Section):
    name: Literal["random_tokens"] = "random_tokens"
    """Benchmark workload: prompts of random words `t0 t1 ...` (one token each with the word-level
    tokenizer of `model.path = "shape:..."`), reward (len(completion text) mod 7) / 6, as the
    TRL peer of bench/grpo_bench.py scores it. Measures speed, not learning."""
    prompt_tokens: int = Field(128, ge=1, le=1_000_000)
    """Words per prompt."""
    vocab_words: int = Field(32_000, ge=2)
    """Prompts draw words t0 .. t{vocab_words - 1}; keep it at most the model's vocabulary size
    less 3 (the shape tokenizer's UNK, PAD and EOS)."""
    num_eval: int = Field(8, ge=1, le=100_000)
    """Held-out prompts scored before and after training."""
    seed: int = Field(1234, ge=0)
    """Seed of the prompt generator (independent of `run.seed`)."""


TaskConfig = Annotated[
    ArithmeticTaskConfig
    | CountdownTaskConfig
    | RandomTokensTaskConfig
    | DatasetTaskConfig
    | ToolArithmeticTaskConfig
    | HtmlTaskConfig
    | SearchTaskConfig
    | GameTaskConfig,
    Field(discriminator="name"),
]


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


class RolloutSection(Section):
    prompts_per_step: int = Field(32, ge=1, le=65536)
    """Distinct prompts sampled per RL step: the global batch, over all processes under torchrun
    (each generates for an equal share; the preflight checks the number divides)."""
    samples_per_prompt: int = Field(8, ge=1, le=1024)
    """Completions per prompt (the group size of group-relative methods)."""
    max_new_tokens: int = Field(16, ge=1, le=1_000_000)
    """Most tokens generated per completion."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature (0 = greedy). Trainer logprobs use the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0 = off)."""
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    """Drop tokens whose probability is below min_p times the top token's (0 = off)."""
    stop_strings: list[str] = []
    """Extra strings that end a completion (the tokenizer's EOS always does)."""
    ignore_eos: bool = False
    """Generate max_new_tokens for every completion, past EOS and stop strings (benchmarks: every
    step does the same work)."""
    engine: Literal["auto", "paged", "simple"] = "auto"
    """Generation engine for rollouts and validation: "paged" (continuous batching over a paged KV
    cache, one prefill per group's prompt, CUDA graphs on a GPU; Qwen2/2.5, Qwen3 and Llama models,
    LoRA included), "simple" (the model's own forward; any causal LM), or "auto" (paged where the
    architecture is supported, else simple with a warning). Both read the trainer's weights in
    place."""
    kv_cache_bytes: int | None = Field(None, ge=1)
    """Size of the paged engine's KV page pool in bytes. Unset: the memory planner chooses it
    (room for the whole step's rollout when it fits beside training; `--dry-run` shows it). Set:
    the planner plans around it, and refuses a value that does not fit."""


# Preset fields whose "off" value is 0 in the config (TOML has no null): the preset's None maps to it.
_OFF_IS_ZERO = ("dual_clip_c", "overlong_buffer")
# Value-model settings for presets without one, so `advantage = "gae"` works on any preset.
_VALUE_FIELDS = ("gamma", "lam", "value_clip")


def preset_values(name: str) -> dict[str, Any]:
    """The `[algorithm]` field values preset `name` implies (config names, no None)."""
    preset = dict(PRESETS[name])
    values: dict[str, Any] = {
        k: v for k, v in preset.items() if k not in ("aggregation", "value_model")
    }
    values["loss_aggregation"] = preset["aggregation"]
    for key in _OFF_IS_ZERO:
        values[key] = values[key] or 0
    for key in _VALUE_FIELDS:
        if values[key] is None:
            values[key] = PRESETS["ppo"][key]
    values["value_clip"] = values["value_clip"] or 0.0
    values["kl_placement"] = preset["kl_placement"] or "loss"  # inert while kl_coef is 0
    return values


class AlgorithmSection(Section):
    """Every setting left unset takes the value of the preset `name`; set one to override it alone.
    After loading, every field holds a concrete value (`--dry-run` shows each one's origin)."""

    name: AlgorithmName = "grpo"
    """Algorithm preset: grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp or ppo (see
    docs/algorithms.md for each one's paper and values)."""
    advantage: AdvantageName | None = None
    """Advantage estimator: grpo (group mean, optional std), rloo (leave-one-out),
    reinforce_pp (batch-normalised), reinforce_pp_baseline (group mean, batch std), gae (token
    level; trains a value head), ema_baseline (running mean of rewards). Default: the preset's."""
    normalize_std: bool | None = None
    """Divide advantages by a standard deviation: the group's (grpo, rloo), the batch's
    (reinforce_pp*, ema_baseline) or whiten token advantages (gae). Default: the preset's."""
    loss: LossName | None = None
    """Policy loss: ppo_clip (token ratio, clipped), gspo (sequence ratio), cispo (clipped,
    detached IS weight). Default: the preset's."""
    clip_low: float | None = Field(None, ge=0.0, le=1.0)
    """Ratios below 1 - clip_low are clipped (CISPO: 1.0 = no lower bound). Default: the preset's."""
    clip_high: float | None = Field(None, ge=0.0, le=10.0)
    """Ratios above 1 + clip_high are clipped (DAPO's clip-higher: 0.28). Default: the preset's."""
    dual_clip_c: float | None = Field(None, ge=0.0)
    """PPO dual clip: cap a negative-advantage token's loss at -c * A (c > 1; 0 = off). Default:
    the preset's."""
    loss_aggregation: Aggregation | None = None
    """How token losses become one number: token_mean (over all tokens of the step),
    seq_mean_token_mean (per sequence, then over sequences), seq_mean_token_sum_norm (token sums
    over rollout.max_new_tokens, then over sequences), seq_mean_token_sum (token sums, then over
    sequences). Default: the preset's."""
    kl_coef: float | None = Field(None, ge=0.0)
    """Weight of the KL to the reference policy (the policy as RL started; 0 = no reference is
    kept). Default: the preset's."""
    kl_estimator: KLEstimator | None = None
    """KL estimator: k1 (log ratio), k2 (half its square), k3 (Schulman's low-variance,
    non-negative). Default: the preset's."""
    kl_placement: KLPlacement | None = None
    """Where the KL acts: loss (a differentiated loss term), reward_token (a per-token reward
    penalty; needs advantage = gae) or reward_sequence (summed over the completion and taken off
    its reward). Ignored while kl_coef is 0. Default: the preset's."""
    entropy_coef: float | None = Field(None, ge=0.0)
    """Weight of an entropy bonus (entropy is always reported). Default: the preset's."""
    dynamic_sampling: bool | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal) and sample
    more prompts until the step has rollout.prompts_per_step informative groups. Default: the
    preset's."""
    max_sampling_rounds: int = Field(4, ge=1, le=1000)
    """Most rollout rounds per step under dynamic sampling; if the batch is still short after
    them, it is filled with the dropped groups (they carry no advantage) and the metric
    `filled_groups` says how many."""
    overlong_buffer: int | None = Field(None, ge=0)
    """DAPO's soft overlong punishment: the reward falls linearly from 0 to -1 over the last this
    many tokens before rollout.max_new_tokens (0 = off). Default: the preset's."""
    mask_truncated: bool | None = None
    """Leave completions cut off by rollout.max_new_tokens out of the loss (overlong filtering).
    Default: the preset's."""
    tis_cap: float = Field(0.0, ge=0.0)
    """Truncated importance sampling: weight each token's policy-gradient term by
    min(pi_trainer / pi_sampler, tis_cap), correcting for sampler/trainer mismatch (0 = off; the
    mismatch KL `kl_sampler` is reported either way)."""
    gamma: float | None = Field(None, ge=0.0, le=1.0)
    """GAE discount (advantage = gae only). Default: the preset's, else PPO's."""
    lam: float | None = Field(None, ge=0.0, le=1.0)
    """GAE lambda (advantage = gae only). Default: the preset's, else PPO's."""
    value_clip: float | None = Field(None, ge=0.0)
    """Clip of the value loss: V may move at most this far from its old value (advantage = gae
    only; 0 = unclipped). Default: the preset's, else PPO's."""
    value_lr: float | None = Field(None, gt=0.0, le=1.0)
    """Learning rate of the value head (advantage = gae only; it has its own AdamW parameter group
    and the policy's schedule). Default: optim.lr."""
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0)
    """Decay of the running reward baseline (advantage = ema_baseline only)."""
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Old-policy logprobs for the ratio: the trainer's own forward (detached; ratio exactly 1 on
    policy) or the sampler's. Their KL is reported either way."""

    @model_validator(mode="before")
    @classmethod
    def _take_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("name", "grpo") not in PRESETS:
            return data  # field validation reports an unknown name
        given = {k: v for k, v in data.items() if v is not None}
        return {**preset_values(given.get("name", "grpo")), **given}

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmSection:
        if 0.0 < self.dual_clip_c <= 1.0:
            raise ValueError(
                f"dual_clip_c = {self.dual_clip_c} must be above 1 (it caps the loss at c times "
                "the advantage); use e.g. dual_clip_c = 3.0, or 0 to turn it off"
            )
        if self.kl_coef > 0 and self.kl_placement == "reward_token" and not self.uses_value_model:
            raise ValueError(
                f"kl_placement = 'reward_token' needs token-level advantages, but advantage = "
                f"{self.advantage!r} gives one per sequence; use kl_placement = 'reward_sequence' "
                "(or 'loss'), or advantage = 'gae'"
            )
        return self

    @property
    def uses_value_model(self) -> bool:
        return self.advantage == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def origins(self) -> dict[str, str]:
        """Where each preset-backed field's value came from: the preset, or a setting."""
        origins = {}
        for key, value in preset_values(self.name).items():
            if getattr(self, key) != value:
                origins[key] = f"set (preset {self.name}: {value!r})"
            elif key in _VALUE_FIELDS and PRESETS[self.name][key] is None:
                origins[key] = f"preset ppo ({self.name} has no value model)"
            else:
                origins[key] = f"preset {self.name}"
        return origins


class OptimSection(Section):
    lr: float = Field(1e-4, gt=0.0, le=1.0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warmup."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final learning rate as a fraction of `lr` for cosine and linear schedules."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of AdamW's two moment estimates. float32 (8 bytes per parameter) also with bfloat16
    weights, which are updated from the float32 step; bfloat16 halves that memory at the cost of
    precision. LoRA adapters are float32 and keep float32 states either way."""


class TrainSection(Section):
    micro_batch_tokens: int | None = Field(None, ge=8, le=10_000_000)
    """Token budget of one packed micro-batch (prompt + completion tokens of the sequences it
    holds, no padding); gradients accumulate over a step's micro-batches. Default: the memory
    planner's choice (`--dry-run` prints it)."""
    micro_batch_size: int | None = Field(None, ge=1, le=65536)
    """Deprecated: micro-batches are packed by tokens. When set (and micro_batch_tokens is not),
    the planner's budget is capped at micro_batch_size x (longest prompt + max_new_tokens), the
    memory bound it gave before; preflight says so. Set micro_batch_tokens instead, or neither."""
    share_prompts: bool = True
    """Sequences of a micro-batch with the same prompt (a GRPO group's samples) run the prompt
    once: each completion attends to that one copy. Same values and gradients as running every
    sequence whole (tested), fewer tokens: 8 samples of a 30-token prompt with 5-token answers
    are 70 tokens instead of 280. false runs every sequence whole (to compare)."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer (dynamic shapes) for the trainer's forward and backward:
    true, false, or "auto" (on CUDA for full fine-tuning; not with LoRA, whose PEFT layers took
    80 s to compile for a 10% faster update on the 0.5B shape; not on a CPU, where compiling
    costs a short run more than it saves). The first step pays the compile time. Measured on
    G1 (0.5B shape, full fine-tune, H100): the training phase 2.98 -> 2.15 s per step."""
    non_finite: Literal["skip", "crash"] = "skip"
    """What a step whose gradient holds NaN or infinity does: "skip" (count it in the metric
    `nonfinite_skipped`, leave parameters and optimizer state untouched, go on; the run fails
    after train.max_consecutive_non_finite such steps in a row) or "crash" (fail at once, exit
    code 1). Either way a non-finite state is never checkpointed."""
    max_consecutive_non_finite: int = Field(3, ge=1, le=10_000)
    """Skipped non-finite steps in a row after which the run fails (train.non_finite = "skip")."""


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


class DistributedSection(Section):
    mode: Literal["colocated", "disaggregated"] = "colocated"
    """How the processes of a torchrun launch share the work (ignored in a single process):
    "colocated": every process generates for its share of a step's prompts and trains (FSDP2,
    the global batch's loss); "disaggregated": the last rank only generates, with its own copy
    of the weights, while the other processes train; the trainers broadcast the weights to it after each
    optimizer step and it generates the next step's rollout meanwhile, so a step trains on
    samples from weights one step old (`rollout_staleness`). The sampler/trainer mismatch is
    reported as `kl_sampler`; algorithm.tis_cap corrects for it (set it, e.g. 2.0)."""
    strategy: Literal["auto", "fsdp", "replicate"] = "auto"
    """How the training processes hold the model (ignored in a single process): "replicate":
    every process holds the whole model, its gradients and optimizer states, as one process
    would, and the gradients are averaged over the processes once per optimizer step (float32
    all-reduce, in buckets): no per-layer gathers, hooks or sharded optimizer, so the fastest
    where it fits; "fsdp": FSDP2 shards the weights, gradients and optimizer states over the
    processes (a model that fits no single GPU). "auto": replicate when the memory planner finds
    it fits without checkpointing, KV-pool or micro-batch sacrifices that FSDP would avoid, else
    FSDP (`--dry-run` shows its choice)."""
    accumulate_unsharded: Literal["auto"] | bool = "auto"
    """Under FSDP, within an optimizer step: keep every layer's weights gathered from the first
    micro-batch to the last and add the micro-batches' gradients up unsharded (float32),
    reduce-scattering them across processes once per step (true), or gather each layer and
    reduce its gradients at every micro-batch (false: least memory). true costs, per process,
    the rest of the weights (gathered) and 4 bytes per parameter (the float32 gradient sum), and
    saves a gather, a reduction and their host work per layer and micro-batch. "auto": the
    memory planner turns it on when it fits beside the rest of the training peak (`--dry-run`
    shows its choice). Ignored in a single process."""


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
    algorithm: AlgorithmSection = AlgorithmSection()
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
    seed: int = Field(0, ge=0)
    """Seed of sampling (when eval.temperature > 0) and of a dataset's held-out draw."""
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


# ----------------------------------------------------------------------------- loading


def load_config(
    root: type[Section],
    path: str | Path | None,
    overrides: list[str] = (),
    base: dict[str, Any] | None = None,
) -> Any:
    """Read TOML, apply `section.key=value` overrides, check keys, validate. `base` holds section
    tables used where the file has none (`reinforge eval RUN_DIR` starts from the run's config);
    a section the file has replaces the base's whole."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist (e.g. configs/quickstart.toml)"
            )
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    raw = {**copy.deepcopy(base or {}), **raw}
    for item in overrides:
        apply_override(raw, item)
    check_keys(raw, root)
    try:
        return root.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, root)) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} must look like section.key=value (e.g. rollout.temperature=0.7)"
        )
    dotted, text = item.split("=", 1)
    keys = [k.strip() for k in dotted.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"override {item!r}: empty key in {dotted!r} (e.g. optim.lr=1e-5)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: model.path=/data/ckpt
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {key!r} is a value, not a section")
    node[keys[-1]] = value


def _variants(annotation: Any) -> list[type[BaseModel]]:
    """The section models an annotation can hold (several for a union on `name`)."""
    from typing import get_args, get_origin

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    origin = get_origin(annotation)
    if origin is Annotated or origin is Union or origin is types.UnionType:
        for arg in get_args(annotation):
            out.extend(_variants(arg))
    return out


def _pick_variant(
    variants: list[type[BaseModel]], raw: dict[str, Any], where: str
) -> type[BaseModel]:
    if len(variants) == 1:
        return variants[0]
    names = {v.model_fields["name"].default: v for v in variants}
    chosen = raw.get("name", next(iter(names)))
    if chosen not in names:
        close = difflib.get_close_matches(str(chosen), list(names), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"[{where}] name = {chosen!r} is not known; {hint}choose one of {sorted(names)}"
        )
    return names[chosen]


def _all_locations(root: type[BaseModel]) -> dict[str, list[str]]:
    """key -> sections it is valid in, across every variant."""
    where: dict[str, list[str]] = {}
    for sec_name, field in root.model_fields.items():
        for variant in _variants(field.annotation):
            label = sec_name
            if len(_variants(field.annotation)) > 1:
                label = f"{sec_name}] with name = {variant.model_fields['name'].default!r} ["
            for key in variant.model_fields:
                where.setdefault(key, [])
                if label not in where[key]:
                    where[key].append(label)
    return where


def check_keys(raw: dict[str, Any], root: type[BaseModel]) -> None:
    """Refuse unknown or misplaced keys, naming the closest valid key or the right section."""
    locations = _all_locations(root)
    for sec_name, sec_raw in raw.items():
        if sec_name not in root.model_fields:
            if not isinstance(sec_raw, dict) and sec_name in locations:
                places = " or ".join(f"[{s}]".replace(" []", "") for s in locations[sec_name])
                raise ConfigError(
                    f"{sec_name!r} is at the top level of the config, but it belongs in {places}: move it there"
                )
            close = difflib.get_close_matches(sec_name, list(root.model_fields), n=1)
            hint = f"did you mean [{close[0]}]? " if close else ""
            raise ConfigError(
                f"unknown section [{sec_name}]; {hint}sections are {list(root.model_fields)}"
            )
        if not isinstance(sec_raw, dict):
            raise ConfigError(f"[{sec_name}] must be a table of settings, got {sec_raw!r}")
        variants = _variants(root.model_fields[sec_name].annotation)
        model = _pick_variant(variants, sec_raw, sec_name)
        if len(variants) > 1:
            sec_raw.setdefault("name", model.model_fields["name"].default)
        for key in sec_raw:
            if key in model.model_fields:
                _check_nested(sec_raw[key], model.model_fields[key].annotation, f"{sec_name}.{key}")
                continue
            elsewhere = [s for s in locations.get(key, []) if s != sec_name]
            if elsewhere:
                places = " or ".join(f"[{s}]".replace(" []", "") for s in elsewhere)
                raise ConfigError(
                    f"[{sec_name}] has no setting {key!r}: {key!r} belongs in {places}; move it there"
                )
            close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"[{sec_name}] has no setting {key!r}; {hint}valid settings: {', '.join(model.model_fields)}"
            )


def _check_nested(raw: Any, annotation: Any, where: str) -> None:
    """Keys of a table inside a section (e.g. `[model.lora]`): unknown ones name the closest."""
    if not isinstance(raw, dict) or not (
        isinstance(annotation, type) and issubclass(annotation, BaseModel)
    ):
        return
    for key, value in raw.items():
        if key not in annotation.model_fields:
            close = difflib.get_close_matches(key, list(annotation.model_fields), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"[{where}] has no setting {key!r}; {hint}valid settings: "
                f"{', '.join(annotation.model_fields)}"
            )
        _check_nested(value, annotation.model_fields[key].annotation, f"{where}.{key}")


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> str:
    tags = {
        v.model_fields["name"].default
        for f in root.model_fields.values()
        for v in _variants(f.annotation)
        if len(_variants(f.annotation)) > 1
    }
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if str(p) not in tags)
        default = _default_at(root, [str(p) for p in e["loc"]])
        example = f"; e.g. {loc} = {default!r}" if default is not None else ""
        got = f" (got {e['input']!r})" if not isinstance(e.get("input"), dict) else ""
        message = e["msg"].removeprefix("Value error, ") + got + example
        lines.append(f"{loc}: {message}" if loc else message)
    return "invalid config:\n  " + "\n  ".join(lines)


def _default_at(root: type[BaseModel], loc: list[str]) -> Any:
    model: Any = root
    value: Any = None
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields:
            field = model.model_fields[part]
            variants = _variants(field.annotation)
            value = field.default
            model = variants[0] if variants else None
        elif isinstance(model, type) and issubclass(model, BaseModel):
            continue  # union tag in the location
        else:
            return None
    return None if isinstance(value, BaseModel) else value


def to_toml(cfg: BaseModel) -> str:
    import tomli_w

    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))
