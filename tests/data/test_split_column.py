"""Train and held-out rows from one file by a column, as verl keeps them (`extra_info.split`)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.data import DatasetSpec, load_dataset_tasks
from reinforge.errors import ConfigError

from .conftest import verl_rows, write_jsonl


def rows_with_splits(splits: list[str | None]) -> list[dict]:
    rows = verl_rows(len(splits))
    for row, split in zip(rows, splits, strict=True):
        row["extra_info"] = {"index": row["extra_info"]["index"], "split": split}
    return rows


def test_a_dotted_split_column_takes_train_and_held_out_rows_from_one_parquet(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    splits = ["train", "test", "train", "validation", "train", "unused"]
    pq.write_table(pa.Table.from_pylist(rows_with_splits(splits)), path)
    tasks = load_dataset_tasks(DatasetSpec(path=str(path), split_column="extra_info.split"))
    assert [t.answer for t in tasks.train] == ["0", "4", "8"]
    assert [t.answer for t in tasks.eval] == ["2", "6"]
    assert tasks.num_other_split == {"unused": 1}
    assert all(t.info["split"] == "train" for t in tasks.train)


def test_split_values_map_the_files_own_names(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", rows_with_splits(["fit", "holdout", "fit"]))
    cfg = load_config(
        TrainConfig,
        None,
        [
            "task.name=dataset",
            f"task.path={path}",
            "task.split_column=extra_info.split",
            'task.split_values={train=["fit"], eval=["holdout"]}',
        ],
    )
    tasks = load_dataset_tasks(cfg.task.to_spec())
    assert (len(tasks.train), len(tasks.eval)) == (2, 1)


def test_no_matching_value_is_an_error_listing_the_values_found(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", rows_with_splits(["fit", "holdout", "fit"]))
    with pytest.raises(ConfigError) as e:
        load_dataset_tasks(DatasetSpec(path=str(path), split_column="extra_info.split"))
    message = str(e.value)
    assert "'fit': 2, 'holdout': 1" in message and "q.jsonl" in message
    assert "task.split_values.train" in message


def test_a_row_without_a_split_is_a_bad_row_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", rows_with_splits(["train", None, "test"]))
    spec = DatasetSpec(path=str(path), split_column="extra_info.split")
    tasks = load_dataset_tasks(spec)
    assert tasks.reports[0].bad_rows == {"missing split": [2]}
    with pytest.raises(ConfigError, match=r"missing split: 1 at lines 2"):
        load_dataset_tasks(
            DatasetSpec(path=str(path), split_column="extra_info.split", on_bad_row="error")
        )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["task.eval_fraction=0.1"], "both choose the evaluation tasks"),
        (['task.split_values={train=["a"], eval=["a"]}'], "both hold ['a']"),
        (['task.split_values={train=[], eval=["a"]}'], "split_values.train is empty"),
    ],
)
def test_contradicting_split_settings_are_refused(tmp_path, overrides, message):
    path = write_jsonl(tmp_path / "q.jsonl", rows_with_splits(["train"]))
    base = ["task.name=dataset", f"task.path={path}", "task.split_column=extra_info.split"]
    with pytest.raises(ConfigError, match=None) as e:
        load_config(TrainConfig, None, base + overrides)
    assert message in str(e.value)
