"""Typed configuration: one root model per command, loaded from TOML plus `section.key=value`
overrides, validated once.

Every field carries a docstring (it becomes the field's description and the generated config
reference), bounds, and a default that works. Unknown or misplaced keys are refused with the
closest valid key and, when the key belongs to another section, the section to move it to.
"""

from __future__ import annotations

import difflib
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from reinforge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


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


class ModelSection(Section):
    path: str = "builtin:tiny"
    """A local HF checkpoint folder, a hub name (when online), or `builtin:tiny` (a few-million-parameter
    Qwen2 model and byte-level tokenizer built offline, random init)."""
    tokenizer: str | None = None
    """Tokenizer folder or name when it differs from `path`."""
    max_context: int | None = Field(None, ge=8)
    """Override of the context length the preflight checks against (default: the model config's
    `max_position_embeddings`)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""


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


TaskConfig = Annotated[ArithmeticTaskConfig | CountdownTaskConfig, Field(discriminator="name")]


# ----------------------------------------------------------------------------- stages


class SFTSection(Section):
    steps: int = Field(0, ge=0, le=10_000_000)
    """SFT optimizer steps on the task's reference solutions. In `reinforge train` these run before RL
    (0 = no SFT stage); `reinforge sft` uses `run.max_steps` instead when this is 0."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Examples per SFT step."""
    lr: float = Field(3e-3, gt=0, le=1.0)
    """Peak learning rate of the SFT stage (warmup then cosine to 10%)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup steps of the SFT stage."""


class RolloutSection(Section):
    prompts_per_step: int = Field(32, ge=1, le=65536)
    """Distinct prompts sampled per RL step."""
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


class AlgorithmSection(Section):
    name: Literal["grpo"] = "grpo"
    """Algorithm preset."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (off = Dr. GRPO)."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip: ratios below 1 - clip_low stop contributing gradient."""
    clip_high: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip: ratios above 1 + clip_high stop contributing gradient."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL-to-reference loss term (0 = no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k3: Schulman's low-variance, always non-negative)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of an entropy bonus (entropy is always reported)."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """How token losses become one number: mean over all tokens of the batch, or mean per sequence then
    over sequences."""
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Old-policy logprobs for the ratio: the trainer's own forward (detached; ratio exactly 1 on policy)
    or the sampler's. Their KL is reported either way."""


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


class TrainSection(Section):
    micro_batch_size: int = Field(64, ge=1, le=65536)
    """Sequences per forward/backward; gradients accumulate over the step's micro-batches."""


class EvalSection(Section):
    before_train: bool = True
    """Score the held-out tasks before RL (after any SFT stage)."""
    every: int = Field(0, ge=0)
    """Also score every N steps (0 = only before and after)."""
    num_tasks: int | None = Field(None, ge=1)
    """Held-out tasks to score (default: all of the task's `num_eval`)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation budget for evaluation (default: `rollout.max_new_tokens`). Decoding is greedy."""


class CheckpointSection(Section):
    every: int = Field(20, ge=0)
    """Save every N steps (0 = only at the end and on a signal)."""
    keep_last: int = Field(2, ge=1)
    """Step checkpoints kept on disk (older ones are deleted)."""


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


class SFTOnlySection(SFTSection):
    steps: int = Field(200, ge=1, le=10_000_000)
    """SFT optimizer steps."""


class SFTConfig(Section):
    """`reinforge sft`: supervised fine-tuning on a task's reference solutions."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskConfig = ArithmeticTaskConfig()
    sft: SFTOnlySection = SFTOnlySection()
    optim: OptimSection = OptimSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()


ROOTS: dict[str, type[Section]] = {"train": TrainConfig, "sft": SFTConfig}


# ----------------------------------------------------------------------------- loading


def load_config(root: type[Section], path: str | Path | None, overrides: list[str] = ()) -> Any:
    """Read TOML, apply `section.key=value` overrides, check keys, validate."""
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
        lines.append(f"{loc}: {e['msg']}{got}{example}")
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
