"""`[task] name = "dataset"`: training and evaluation tasks from the user's own files.

The settings map one to one onto `reinforge.data.DatasetSpec` (`to_spec`), whose loader reads
JSONL, JSON, parquet, CSV/TSV, HF datasets and Python generators, and takes verl's parquet
schema, TRL's standard and conversational schemas and plain prompt/answer columns as they are.
What the command needs of each row (an answer for RL and evaluation, a reference solution for
SFT) is decided by the command, not set here: `reinforge.tasks.task_source_for`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from reinforge.config.base import Section
from reinforge.config.rewards import ScoredTask


class DatasetColumnsSection(Section):
    prompt: str | None = None
    """Column holding the prompt: text (one user message) or a list of chat messages. Default:
    the first of prompt, question, problem that the data has."""
    messages: str | None = None
    """Column holding a whole conversation: the prompt is everything before its last assistant
    message, which is the reference solution; SFT trains on every assistant turn. Default:
    messages, conversations (when there is no prompt column)."""
    answer: str | None = None
    """Column holding the ground truth the reward checks; a dotted name reaches into a record.
    Default: answer, reward_model.ground_truth (verl), ground_truth."""
    solution: str | None = None
    """Column holding the reference response SFT trains on (text, or assistant messages).
    Default: completion (TRL), solution, response."""
    data_source: str | None = None
    """Column naming each row's source, which picks its reward and groups accuracy. Default:
    data_source (verl); rows without one take task.data_source."""


class SplitValuesSection(Section):
    train: list[str] = ["train"]
    """Values of task.split_column that mark a training row."""
    eval: list[str] = ["test", "validation", "val", "valid", "dev", "eval"]
    """Values of task.split_column that mark a held-out row."""


class DatasetRowsSection(Section):
    """Where a task's rows come from, and how they are read and split: the settings of
    `name = "dataset"`, shared by the env tasks that play the user's rows (`name = "tools"`)."""

    path: str | list[str] = Field(min_length=1)
    """A .jsonl/.json/.parquet/.csv/.tsv file, a folder (a saved HF dataset, or data files), an
    HF hub name (when online), a generator "module:function" or "path/to/file.py:function", or
    a list of these trained on together. Relative paths are from the working directory."""
    format: Literal["auto", "jsonl", "json", "parquet", "csv", "hf", "procedural"] = "auto"
    """How to read `path`: auto decides from the suffix, the folder, or the colon of a
    generator; "json" is one JSON array, "jsonl" one record per line."""
    split: str = "train"
    """Split of an HF dataset to train on (files have one split)."""
    subset: str | None = None
    """Configuration of an HF dataset that has several, e.g. "main" for openai/gsm8k."""
    columns: DatasetColumnsSection = DatasetColumnsSection()
    """Which column holds what, when the usual names do not fit."""
    data_source: str | None = None
    """data_source of rows that carry none (it picks their reward and groups accuracy).
    Default: the file's name without its suffix."""
    eval_path: str | None = None
    """A file or folder of held-out evaluation tasks, read like `path`."""
    eval_split: str | None = None
    """A held-out split of the same HF dataset, e.g. "test"."""
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Hold out this fraction of the rows (drawn by task.seed) for evaluation; training rows whose
    prompt equals a held-out one are dropped too. With no eval_path, eval_split, eval_fraction
    or split_column there are no held-out tasks and evaluation during training is off."""
    split_column: str | None = None
    """A column naming each row's split, as verl keeps it: "extra_info.split" (a dotted name
    reaches into a record). Rows whose value is in split_values.train train, those in
    split_values.eval are held out, others are left out and counted."""
    split_values: SplitValuesSection = SplitValuesSection()
    """Which values of split_column mean training and held-out rows."""
    max_rows: int | None = Field(None, ge=1)
    """Read at most this many rows (required for an endless generator)."""
    seed: int = Field(0, ge=0)
    """Seed of the held-out draw, the training order and a generator's argument."""
    shuffle: bool = True
    """Visit the training rows in a fresh seeded order each epoch; false keeps the file's order."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """A bad row (missing or mistyped field, empty prompt, prompt over max_prompt_tokens) is
    skipped and reported with its row number, or, with "error", the run fails before loading the
    model, after listing every bad row."""
    require_answer: bool | None = None
    """Rows must have a ground-truth answer. Default: yes for `reinforge train` and
    `reinforge eval` (their rewards check it), no for `reinforge sft` (held-out accuracy is then
    scored only where the rows have answers and a known reward)."""
    reward: str = "auto"
    """Reward of every row: "math", "exact_match", "format", or your own `(completion, task) ->
    float` as "module:function" / "path/to/file.py:function". "auto" picks one per data_source:
    task.reward_by_source, then verl's source names (openai/gsm8k, MATH, aime*, ...), then the
    row's `ability` ("math")."""
    reward_by_source: dict[str, str] = {}
    """Reward per data_source when reward = "auto", e.g. {my_quiz = "exact_match"}."""

    @model_validator(mode="before")
    @classmethod
    def _has_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("path"):
            name = data.get("name", "dataset")
            raise ValueError(
                f'task.path is required with task.name = "{name}": the data to read, e.g. '
                'task.path = "train.jsonl" (or .parquet, .csv, a folder, or a list of these)'
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> DatasetTaskConfig:
        from reinforge.data.spec import check_spec

        check_spec(self.to_spec())  # a ConfigError naming the setting to change
        return self

    def to_spec(self, require_answer: bool = True, require_solution: bool = False):
        """The loader's `DatasetSpec`; `require_*` are what the command needs of each row
        (`require_answer` unset here defers to it)."""
        from reinforge.data.spec import ColumnMap, DatasetSpec

        return DatasetSpec(
            path=self.path if isinstance(self.path, str) else tuple(self.path),
            format=self.format,
            split=self.split,
            subset=self.subset,
            columns=ColumnMap(**self.columns.model_dump()),
            name=self.data_source,
            eval_path=self.eval_path,
            eval_split=self.eval_split,
            eval_fraction=self.eval_fraction,
            split_column=self.split_column,
            split_train=tuple(self.split_values.train),
            split_eval=tuple(self.split_values.eval),
            max_rows=self.max_rows,
            seed=self.seed,
            shuffle=self.shuffle,
            on_bad_row=self.on_bad_row,
            max_prompt_tokens=getattr(self, "max_prompt_tokens", None),
            require_answer=require_answer if self.require_answer is None else self.require_answer,
            require_solution=require_solution,
            reward=self.reward,
            reward_by_source=dict(self.reward_by_source),
        )


class DatasetTaskConfig(ScoredTask, DatasetRowsSection):
    name: Literal["dataset"] = "dataset"
    """Tasks from your data: JSONL, JSON, parquet, CSV/TSV, an HF dataset or a Python generator,
    in verl's, TRL's or plain prompt/answer columns."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Rows whose chat-rendered prompt has more tokens are bad rows (never truncated). Unset:
    every row is kept, and the preflight fails if the longest prompt it probes does not fit the
    context with the generation budget."""
