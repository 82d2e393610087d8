"""A dataset as a `TaskSource`: `load_dataset_tasks(spec, tokenizer)` reads, validates and splits
it once; `DatasetTasks` then serves training tasks by index and the held-out evaluation tasks.

`train_task(i)` is a pure function of (seed, i): epoch `i // n` visits the n training rows in
its own seeded order, so a run's data position is one integer. Held-out tasks come from a
separate file or split, or from a seeded fraction of the rows; with a fraction, training rows
whose prompt equals a held-out prompt are dropped too (counted in `num_train_dropped`), so
duplicates in the data do not leak the evaluation set.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from reinforge.data.formats import ROW_UNITS, BadRecord, detect_format, read_records
from reinforge.data.report import LoadReport
from reinforge.data.rewards import RewardRouter, known_rewards, resolve_rewards
from reinforge.data.schema import (
    MISSING,
    BadRow,
    Columns,
    check_prompt,
    lookup,
    record_to_task,
    resolve_columns,
)
from reinforge.data.spec import SETTING, DatasetSpec, check_spec
from reinforge.errors import ConfigError
from reinforge.types import Task

log = logging.getLogger(__name__)
_TOKENIZE_CHUNK = 512
SPLIT_KEY = "split"  # task.info key of a row's split_column value


@dataclass
class DatasetTasks:
    name: str
    train: list[Task]
    eval: list[Task]
    rewards: RewardRouter | None  # None: rows with no answer or reward to score them (SFT data)
    seed: int = 0
    shuffle: bool = True
    reports: list[LoadReport] = field(default_factory=list)  # train first, then a separate eval
    num_train_dropped: int = 0  # training rows equal to a held-out prompt
    num_other_split: dict[str, int] = field(default_factory=dict)  # split_column value -> rows

    def __post_init__(self):
        assert self.train, "a task source needs training tasks"
        self._epoch, self._order = -1, list(range(len(self.train)))

    def __len__(self) -> int:
        return len(self.train)

    def train_task(self, index: int) -> Task:
        epoch, position = divmod(index, len(self.train))
        if self.shuffle and epoch != self._epoch:
            self._order = list(range(len(self.train)))
            random.Random(f"{self.seed}/epoch/{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self.train[self._order[position]]

    def eval_tasks(self) -> list[Task]:
        return list(self.eval)

    @property
    def can_score(self) -> bool:
        """Whether completions can be scored (held-out accuracy, RL rewards)."""
        return self.rewards is not None

    def reward(self, completion: str, task: Task) -> float:
        assert self.rewards is not None, f"dataset {self.name} has no reward; check can_score"
        return self.rewards(completion, task)


def load_dataset_tasks(spec: DatasetSpec, tokenizer=None) -> DatasetTasks:
    """Read, validate and split the dataset `spec` names. With a tokenizer and
    `spec.max_prompt_tokens`, prompts over the budget are bad rows."""
    check_spec(spec)
    if spec.max_prompt_tokens is not None and tokenizer is None:
        raise ConfigError(
            f"{SETTING}.max_prompt_tokens needs a tokenizer to count with; pass the model's"
        )
    train, reports = _load_each(spec, spec.paths, spec.split, "train", tokenizer)
    dropped, others = 0, {}
    if spec.split_column is not None:
        train, held_out, others = split_by_column(train, spec, reports)
    elif spec.eval_path is not None:
        # one training dataset: its held-out file's rows share its name (and so its reward)
        name = default_name(spec.paths[0]) if len(spec.paths) == 1 else None
        held_out, eval_reports = _load_each(
            spec, (spec.eval_path,), spec.split, "eval", tokenizer, name
        )
        reports += eval_reports
    elif spec.eval_split is not None:
        held_out, eval_reports = _load_each(spec, spec.paths, spec.eval_split, "eval", tokenizer)
        reports += eval_reports
    elif spec.eval_fraction > 0:
        train, held_out, dropped = hold_out(train, spec.eval_fraction, spec.seed)
    else:
        held_out = []
    if spec.max_eval is not None:
        held_out = held_out[: spec.max_eval]
    if not train:
        raise ConfigError(
            f"{SETTING}.eval_fraction = {spec.eval_fraction} leaves no training rows of "
            f"{reports[0].num_loaded}; lower it"
        )
    rewards = (resolve_rewards if spec.require_answer else known_rewards)(train + held_out, spec)
    return DatasetTasks(
        name=spec.name or "+".join(default_name(p) for p in spec.paths),
        train=train,
        eval=held_out,
        rewards=rewards,
        seed=spec.seed,
        shuffle=spec.shuffle,
        reports=reports,
        num_train_dropped=dropped,
        num_other_split=others,
    )


def split_by_column(
    tasks: list[Task], spec: DatasetSpec, reports: Sequence[LoadReport]
) -> tuple[list[Task], list[Task], dict[str, int]]:
    """(training tasks, held-out tasks, row counts of the other values) by `spec.split_column`;
    an error listing the values found when either side would be empty."""
    found = Counter(t.info[SPLIT_KEY] for t in tasks)
    train = [t for t in tasks if t.info[SPLIT_KEY] in spec.split_train]
    held_out = [t for t in tasks if t.info[SPLIT_KEY] in spec.split_eval]
    for role, side, values in (
        ("train", train, spec.split_train),
        ("eval", held_out, spec.split_eval),
    ):
        if not side:
            counts = ", ".join(f"{v!r}: {n}" for v, n in found.most_common(20))
            example = next((v for v in found if v not in spec.split_train + spec.split_eval), "")
            raise ConfigError(
                f"no {role} rows in {', '.join(r.source for r in reports)}: "
                f"{SETTING}.split_column = {spec.split_column!r} holds {counts}, none of "
                f"{SETTING}.split_values.{role} = {list(values)}; set {SETTING}.split_values."
                f'{role} = ["{example or "..."}"] (the values that mark {role} rows)'
            )
    known = set(spec.split_train) | set(spec.split_eval)
    return train, held_out, {v: n for v, n in found.items() if v not in known}


def _load_each(
    spec: DatasetSpec,
    paths: Sequence[str],
    split: str,
    role: str,
    tokenizer,
    default: str | None = None,
) -> tuple[list[Task], list[LoadReport]]:
    """The tasks of every path in turn (ids carry the dataset's name when there are several, so
    they stay unique) and each path's report. Rows without a data_source take `spec.name`, else
    `default`, else their file's name."""
    tasks, reports = [], []
    for path in paths:
        name = spec.name or default or default_name(path)
        prefix = f"{name}/{role}" if len(paths) > 1 else role
        loaded, report = load_tasks(spec, path, split, prefix, name, tokenizer)
        tasks += loaded
        reports.append(report)
    return tasks, reports


def load_tasks(
    spec: DatasetSpec, path: str, split: str, role: str, name: str, tokenizer=None
) -> tuple[list[Task], LoadReport]:
    """The valid tasks of one file or split and the report of what was refused; fails when the
    policy is "error" and any row was bad, or when no row is usable."""
    path = spec.resolve(path)
    fmt = spec.format if spec.format != "auto" else detect_format(path)
    report = LoadReport(source=path, split=split, format=fmt, row_unit=ROW_UNITS.get(fmt, "row"))
    records = read_records(path, fmt, split, spec.subset, spec.seed, spec.max_rows, spec.base_dir)
    cols: Columns | None = None
    tasks = []
    for row, record in records:
        report.num_rows += 1
        try:
            if isinstance(record, BadRecord):
                raise BadRow(record.reason, record.detail)
            if isinstance(record, Task):
                check_prompt(record.messages)
                report.schema = "tasks"
                info = {"data_source": name, **record.info, "row": row}
                if spec.split_column is not None:
                    info[SPLIT_KEY] = split_value(record.info, spec.split_column)
                tasks.append(dataclasses.replace(record, info=info))
                continue
            if cols is None:
                cols = resolve_columns(
                    record, spec.columns, spec.require_answer, path, spec.require_solution
                )
                report.schema, report.columns = cols.schema, cols.as_dict()
            split = split_value(record, spec.split_column) if spec.split_column else None
            tasks.append(record_to_task(record, cols, f"{role}-{row}", row, name))
            if split is not None:
                tasks[-1].info[SPLIT_KEY] = split
            if spec.require_solution and tasks[-1].solution is None:
                tasks.pop()
                raise BadRow("missing solution", "no reference response to train on")
        except BadRow as bad:
            report.add_bad(bad.reason, row, bad.detail)
    if tokenizer is not None and spec.max_prompt_tokens is not None:
        tasks = drop_over_budget(tasks, tokenizer, spec.max_prompt_tokens, report)
    report.num_loaded = len(tasks)
    _settle(report, spec)
    return tasks, report


def split_value(record: dict, column: str) -> str:
    """The row's value in the split column, as text; a bad row when it has none."""
    value = lookup(record, column)
    if value is MISSING or value is None or value == "":
        raise BadRow("missing split", f"no value in {SETTING}.split_column {column!r}")
    return str(value)


def _settle(report: LoadReport, spec: DatasetSpec) -> None:
    if report.num_skipped and spec.on_bad_row == "error":
        raise ConfigError(
            f"bad rows in the data ({SETTING}.on_bad_row = 'error'):\n{report.summary()}\n"
            f"fix those rows, or set {SETTING}.on_bad_row = 'skip' to train without them"
        )
    if not report.num_loaded:
        raise ConfigError(f"no usable rows:\n{report.summary()}")
    if report.num_skipped:
        log.warning("skipped bad rows:\n%s", report.summary())


def drop_over_budget(
    tasks: list[Task], tokenizer, max_prompt_tokens: int, report: LoadReport
) -> list[Task]:
    """Tasks whose chat-rendered prompt fits in `max_prompt_tokens`; the rest are bad rows."""
    kept = []
    for start in range(0, len(tasks), _TOKENIZE_CHUNK):
        chunk = tasks[start : start + _TOKENIZE_CHUNK]
        ids = tokenizer.apply_chat_template(
            [[m.to_dict() for m in t.messages] for t in chunk],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for task, prompt_ids in zip(chunk, ids, strict=True):
            if len(prompt_ids) > max_prompt_tokens:
                detail = (
                    f"{len(prompt_ids)} tokens > {SETTING}.max_prompt_tokens = {max_prompt_tokens}"
                )
                report.add_bad("prompt over token budget", task.info.get("row", -1), detail)
            else:
                kept.append(task)
    return kept


def hold_out(
    tasks: Sequence[Task], fraction: float, seed: int
) -> tuple[list[Task], list[Task], int]:
    """(train, held out, number of training rows dropped as duplicates of a held-out prompt)."""
    order = list(range(len(tasks)))
    random.Random(f"{seed}/holdout").shuffle(order)
    num_eval = max(1, round(fraction * len(tasks)))
    held = sorted(order[:num_eval])
    held_keys = {prompt_key(tasks[i]) for i in held}
    rest = [tasks[i] for i in sorted(order[num_eval:])]
    train = [t for t in rest if prompt_key(t) not in held_keys]
    return train, [tasks[i] for i in held], len(rest) - len(train)


def prompt_key(task: Task) -> tuple[tuple[str, str], ...]:
    return tuple((m.role, m.content) for m in task.messages)


def default_name(path: str) -> str:
    """The dataset's name: the file's stem, a folder's or hub dataset's last part, or the
    generator's function."""
    if ":" in path and not Path(path).exists():
        return path.rsplit(":", 1)[1]
    p = Path(path.rstrip("/\\"))
    return p.stem if p.suffix else p.name
