"""The `dataset` task: a `DatasetTasks` loaded from `[task] name = "dataset"`, once per process.

A command builds its task source more than once (the preflight, the memory planner's probe,
the trainer); the files are read, checked and reported the first time only, and the same
source is handed out after that, keyed by the settings and what the command needs of a row.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from reinforge.config.data import DatasetTaskConfig
from reinforge.data.source import DatasetTasks, load_dataset_tasks
from reinforge.metrics import console

_LOADED: dict[tuple, DatasetTasks] = {}


def load_dataset_source(
    cfg: DatasetTaskConfig,
    tokenizer=None,
    needs_answers: bool = True,
    needs_solutions: bool = False,
    scored_by: str | None = None,
) -> DatasetTasks:
    """The tasks `cfg` names; rows lacking what the command needs (an answer to score, a
    solution to train on) are bad rows. The load report goes to the console; `scored_by` names
    what scores the tasks when it is not the rows' reward (an env)."""
    spec = cfg.to_spec(require_answer=needs_answers, require_solution=needs_solutions)
    # the tokenizer matters only for the prompt budget; the same one is loaded more than once
    tokenizer_key = getattr(tokenizer, "name_or_path", None) if spec.max_prompt_tokens else None
    key = (cfg.model_dump_json(), needs_answers, needs_solutions, tokenizer_key)
    if key not in _LOADED:
        with _quiet("reinforge.data.source"):  # its bad-row warning is in the report below
            source = load_dataset_tasks(spec, tokenizer)
        print_load_report(source, scored_by)
        _LOADED[key] = source
    return _LOADED[key]


def print_load_report(source: DatasetTasks, scored_by: str | None = None) -> None:
    for report in source.reports:
        console.print(f"data: {report.summary()}", markup=False)
    split = f"{len(source.train)} training tasks, {len(source.eval)} held-out"
    if source.num_train_dropped:
        split += (
            f" ({source.num_train_dropped} training rows dropped: same prompt as a held-out one)"
        )
    if source.num_other_split:
        others = ", ".join(f"{v!r}: {n}" for v, n in sorted(source.num_other_split.items()))
        split += f"; left out by task.split_column (neither train nor eval): {others}"
    rewards = (
        f"scored by {scored_by}"
        if scored_by is not None
        else ", ".join(f"{s}: {r}" for s, r in sorted(source.rewards.names.items()))
        if source.rewards is not None
        else "none (rows without answers or a known reward: completions are not scored)"
    )
    label = "rewards" if scored_by is not None else "rewards by data_source"
    console.print(f"data: {split}; {label}: {rewards}", markup=False)


@contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
