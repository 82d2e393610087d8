"""Datasets in the formats users already have, as task sources.

`load_dataset_tasks(DatasetSpec(path=...), tokenizer)` reads JSONL, parquet, CSV, HF `datasets`
(saved to disk, a folder of data files, or a hub name) or a Python generator; takes verl's
parquet schema, TRL's standard and conversational schemas and plain prompt/answer columns as
they are; refuses bad rows with a `LoadReport` (counts per reason, row numbers); and returns a
`DatasetTasks` (a `TaskSource`) whose rewards are picked per data source. `chat_example` cuts a
conversation's assistant turns out of the chat template, for the SFT loss mask.

Importing this package is cheap: pyarrow and `datasets` load only when a file of theirs is read.
"""

from reinforge.data.chat import ChatExample, chat_example
from reinforge.data.formats import detect_format, read_records
from reinforge.data.report import LoadReport
from reinforge.data.rewards import DATA_REWARDS, RewardRouter, exact_match_reward, resolve_rewards
from reinforge.data.schema import AUTO_COLUMNS, BadRow, record_to_task, resolve_columns
from reinforge.data.source import DatasetTasks, hold_out, load_dataset_tasks, load_tasks
from reinforge.data.spec import ColumnMap, DatasetSpec, check_spec

__all__ = [
    "AUTO_COLUMNS",
    "DATA_REWARDS",
    "BadRow",
    "ChatExample",
    "ColumnMap",
    "DatasetSpec",
    "DatasetTasks",
    "LoadReport",
    "RewardRouter",
    "chat_example",
    "check_spec",
    "detect_format",
    "exact_match_reward",
    "hold_out",
    "load_dataset_tasks",
    "load_tasks",
    "read_records",
    "record_to_task",
    "resolve_columns",
    "resolve_rewards",
]
