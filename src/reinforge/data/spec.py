"""What to load: `DatasetSpec` (a file, folder, hub name or generator; its columns; its eval split;
what to do with bad rows) and the check that refuses an inconsistent one before reading anything.

Settings are named as the config wires them, `task.<field>` under `task.name = "dataset"`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from reinforge.errors import ConfigError

SETTING = "task"
Format = Literal["auto", "jsonl", "json", "parquet", "csv", "hf", "procedural"]
FORMATS = ("auto", "jsonl", "json", "parquet", "csv", "hf", "procedural")
BadRowPolicy = Literal["skip", "error"]


@dataclass(frozen=True)
class ColumnMap:
    """Which column holds what. None means: take the first of the usual names that the data has
    (the names are in `reinforge.data.schema.AUTO_COLUMNS`). A dotted name reaches into a nested
    record: `reward_model.ground_truth` is verl's answer."""

    prompt: str | None = None
    """Text (one user message) or a list of chat messages; auto: prompt, question, problem."""
    messages: str | None = None
    """A whole conversation; the prompt is everything before its last assistant message, which
    becomes the reference solution. Auto: messages, conversations."""
    answer: str | None = None
    """The ground truth a reward checks; auto: answer, reward_model.ground_truth, ground_truth."""
    solution: str | None = None
    """Reference response text for SFT (text or assistant messages); auto: completion, solution,
    response."""
    data_source: str | None = None
    """Which dataset a row came from; picks its reward. Auto: data_source; else the dataset name."""


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset to train on, and where its held-out evaluation tasks come from."""

    path: str | tuple[str, ...]
    """A .jsonl/.json/.parquet/.csv/.tsv file, a folder (a saved HF dataset, parquet files, or
    data files `datasets.load_dataset` reads), a hub name when online, or a generator
    `"module:function"` / `"path/to/file.py:function"`; or several of these, whose rows are
    trained on together (each keeps its own default data_source)."""
    format: Format = "auto"
    """How to read `path`; auto decides from the suffix, the folder, or the colon of a generator.
    "json" is one JSON array of records; "jsonl" one record per line."""
    split: str = "train"
    """Split of an HF dataset (files have one split and ignore it)."""
    subset: str | None = None
    """Configuration name of an HF dataset that has several, e.g. "main" for openai/gsm8k."""
    columns: ColumnMap = field(default_factory=ColumnMap)
    name: str | None = None
    """Name of the task source and default data_source; default: the file or folder name."""
    eval_path: str | None = None
    """A separate file, folder or generator of evaluation tasks (read like `path`)."""
    eval_split: str | None = None
    """A separate split of the same HF dataset for evaluation, e.g. "test"."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the rows (drawn by `seed`) for evaluation."""
    split_column: str | None = None
    """A column (dotted names reach into records: verl's "extra_info.split") naming each row's
    split: rows valued in `split_train` train, those in `split_eval` are held out, the rest are
    left out (counted in `DatasetTasks.num_other_split`)."""
    split_train: tuple[str, ...] = ("train",)
    split_eval: tuple[str, ...] = ("test", "validation", "val", "valid", "dev", "eval")
    max_eval: int | None = None
    """At most this many evaluation tasks (the first ones)."""
    max_rows: int | None = None
    """Read at most this many rows (required for an endless generator)."""
    seed: int = 0
    """Seed of the held-out draw, the training order and a generator's argument."""
    shuffle: bool = True
    """Visit training rows in a fresh seeded order each epoch; False keeps file order."""
    on_bad_row: BadRowPolicy = "skip"
    """A bad row (missing or mistyped field, empty or over-long prompt) is skipped and reported,
    or, with "error", the load fails after reporting every bad row."""
    max_prompt_tokens: int | None = None
    """Rows whose chat-rendered prompt is longer are bad rows (checked when a tokenizer is given;
    prompts are never truncated)."""
    require_answer: bool = True
    """Rows need a ground-truth answer; False for data without one (SFT, or a custom reward that
    ignores task.answer). Without it, rewards are resolved only where the rows have answers and
    every data source has a known reward (else the tasks cannot be scored: `can_score`)."""
    require_solution: bool = False
    """Rows need a reference solution (for SFT): rows without one are bad rows."""
    reward: str = "auto"
    """Reward of every row: a name in `reinforge.data.rewards.DATA_REWARDS` or "module:function";
    "auto" picks one per data_source (verl's source names, `reward_by_source`, ability "math")."""
    reward_by_source: Mapping[str, str] = field(default_factory=dict)
    """Reward per data_source when `reward = "auto"`, e.g. {"my_quiz": "exact_match"}."""
    base_dir: str | None = None
    """Folder that relative paths and generator files are relative to (default: the working
    directory)."""

    def __post_init__(self):
        if isinstance(self.path, list):
            object.__setattr__(self, "path", tuple(self.path))
        if isinstance(self.columns, Mapping):
            unknown = set(self.columns) - {f.name for f in fields(ColumnMap)}
            if unknown:
                raise ConfigError(
                    f"{SETTING}.columns has unknown keys {sorted(unknown)}; the keys are "
                    f"{[f.name for f in fields(ColumnMap)]}"
                )
            object.__setattr__(self, "columns", ColumnMap(**self.columns))

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if isinstance(self.path, str) else self.path

    def resolve(self, path: str) -> str:
        """`path` made absolute against `base_dir` when it names something there."""
        if self.base_dir is None or Path(path).is_absolute():
            return path
        candidate = Path(self.base_dir) / path
        return str(candidate) if candidate.exists() else path


def check_spec(spec: DatasetSpec) -> None:
    """Refuse settings that contradict each other, naming the one to change."""
    s = SETTING
    if not spec.path or not all(spec.paths):
        raise ConfigError(f'{s}.path is empty; give a file, folder or hub name, e.g. "train.jsonl"')
    if spec.format not in FORMATS:
        raise ConfigError(f"{s}.format = {spec.format!r} is not one of {list(FORMATS)}")
    if spec.columns.prompt is not None and spec.columns.messages is not None:
        raise ConfigError(
            f"{s}.columns.prompt and {s}.columns.messages both name the prompt; set only one "
            "(messages: a whole conversation whose last assistant message is the solution)"
        )
    if spec.on_bad_row not in ("skip", "error"):
        raise ConfigError(f'{s}.on_bad_row = {spec.on_bad_row!r}; use "skip" or "error"')
    chosen = [
        name
        for name, is_set in (
            ("eval_path", spec.eval_path is not None),
            ("eval_split", spec.eval_split is not None),
            ("eval_fraction", spec.eval_fraction > 0),
            ("split_column", spec.split_column is not None),
        )
        if is_set
    ]
    if len(chosen) > 1:
        raise ConfigError(
            f"{s}.{chosen[0]} and {s}.{chosen[1]} both choose the evaluation tasks; set only one"
        )
    if not 0.0 <= spec.eval_fraction < 1.0:
        raise ConfigError(f"{s}.eval_fraction = {spec.eval_fraction} must be in [0, 1); e.g. 0.05")
    if spec.eval_split is not None and spec.eval_split == spec.split:
        raise ConfigError(
            f"{s}.eval_split = {spec.eval_split!r} is the training split; evaluating on training "
            f'data measures nothing; use another split (e.g. "test") or {s}.eval_fraction'
        )
    if spec.split_column is not None:
        _check_split_values(spec)
    for name in ("max_eval", "max_rows", "max_prompt_tokens"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise ConfigError(f"{s}.{name} = {value} must be at least 1 (or unset)")


def _check_split_values(spec: DatasetSpec) -> None:
    s = SETTING
    if not spec.split_column.strip():
        raise ConfigError(f'{s}.split_column is empty; name a column, e.g. "extra_info.split"')
    for role, values in (("train", spec.split_train), ("eval", spec.split_eval)):
        if not values:
            raise ConfigError(
                f"{s}.split_values.{role} is empty; list the values of {s}.split_column that "
                f'mark {role} rows, e.g. ["{"train" if role == "train" else "test"}"]'
            )
    both = sorted(set(spec.split_train) & set(spec.split_eval))
    if both:
        raise ConfigError(
            f"{s}.split_values.train and {s}.split_values.eval both hold {both}; a row is either "
            "trained on or held out: remove them from one list"
        )
