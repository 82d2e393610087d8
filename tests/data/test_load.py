"""Each format and schema read as-is from a real file: verl parquet, TRL JSONL, CSV, an HF
dataset saved to disk, and a generator; held-out splits and the training order."""

from __future__ import annotations

import sys

import pytest

from reinforge.data import ColumnMap, DatasetSpec, load_dataset_tasks
from reinforge.data.rewards import exact_match_reward
from reinforge.rewards import math_reward
from reinforge.types import Message

from .conftest import verl_rows, write_csv, write_jsonl


def test_verl_parquet_reads_prompt_messages_ground_truth_and_extra_info(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "gsm8k_train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(6)), path)

    tasks = load_dataset_tasks(DatasetSpec(path=str(path)))

    report = tasks.reports[0]
    assert (report.format, report.schema, report.num_rows, report.num_loaded) == (
        "parquet",
        "verl",
        6,
        6,
    )
    assert report.columns["answer"] == "reward_model.ground_truth"
    task = tasks.train[3]
    assert task.messages == (Message("user", "What is 3 + 3? Put it in \\boxed{}."),)
    assert task.answer == "6"
    assert task.info["data_source"] == "openai/gsm8k"
    assert task.info["ability"] == "math"
    assert task.info["style"] == "rule"
    assert task.info["extra_info"] == {"split": "train", "index": 3}
    assert tasks.rewards.by_source == {"openai/gsm8k": math_reward}


def test_trl_conversational_jsonl_splits_the_last_assistant_message_off_as_solution(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Say {w}."},
                {"role": "assistant", "content": w},
            ],
            "answer": w,
        }
        for w in ("yes", "no", "maybe")
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)

    tasks = load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match"))

    assert tasks.reports[0].schema == "trl-conversational"
    task = tasks.train[1]
    assert task.messages == (Message("system", "Be brief."), Message("user", "Say no."))
    assert task.solution == "no"
    assert task.id == "train-2"  # JSONL rows are numbered by line
    assert tasks.reward("  no ", task) == 1.0
    assert tasks.reward("yes", task) == 0.0


def test_trl_prompt_completion_as_message_lists_and_as_text(tmp_path):
    conversational = {
        "prompt": [{"role": "user", "content": "2+2="}],
        "completion": [{"role": "assistant", "content": "4"}],
        "answer": "4",
    }
    standard = {"prompt": "2+3=", "completion": "5", "answer": 5}
    conv = load_dataset_tasks(
        DatasetSpec(path=str(write_jsonl(tmp_path / "c.jsonl", [conversational])), reward="math")
    )
    std = load_dataset_tasks(
        DatasetSpec(path=str(write_jsonl(tmp_path / "s.jsonl", [standard])), reward="math")
    )
    assert conv.reports[0].schema == "trl-conversational"
    assert (conv.train[0].messages[0].content, conv.train[0].solution) == ("2+2=", "4")
    assert std.reports[0].schema == "trl-standard"
    assert std.train[0].messages == (Message("user", "2+3="),)
    assert (std.train[0].solution, std.train[0].answer, std.train[0].info["ground_truth"]) == (
        "5",
        "5",
        5,
    )


def test_csv_with_mapped_columns_and_a_default_data_source(tmp_path):
    path = write_csv(
        tmp_path / "quiz.csv",
        ["id", "q", "a"],
        [["1", "Capital of France?", "Paris"], ["2", "Capital of Peru?", "Lima"]],
    )
    spec = DatasetSpec(
        path=str(path),
        columns={"prompt": "q", "answer": "a"},
        reward_by_source={"quiz": "exact_match"},
    )

    tasks = load_dataset_tasks(spec)

    assert tasks.name == "quiz"
    assert [t.answer for t in tasks.train] == ["Paris", "Lima"]
    assert tasks.train[0].info == {"id": "1", "data_source": "quiz", "row": 0}
    assert tasks.rewards.names == {"quiz": "exact_match"}
    assert tasks.reward("Lima", tasks.train[1]) == 1.0


def test_hf_dataset_saved_to_disk_with_a_test_split_for_eval(tmp_path):
    import datasets

    def split(n: int, offset: int) -> datasets.Dataset:
        return datasets.Dataset.from_list(
            [{"question": f"{i}*2=", "answer": str(2 * i)} for i in range(offset, offset + n)]
        )

    datasets.DatasetDict({"train": split(8, 0), "test": split(3, 100)}).save_to_disk(
        tmp_path / "doubling"
    )
    spec = DatasetSpec(path=str(tmp_path / "doubling"), eval_split="test", reward="exact_match")

    tasks = load_dataset_tasks(spec)

    assert [r.format for r in tasks.reports] == ["hf", "hf"]
    assert len(tasks) == 8
    assert [t.answer for t in tasks.eval_tasks()] == ["200", "202", "204"]
    assert tasks.train[5].messages == (Message("user", "5*2="),)


def test_generator_by_file_and_by_module_reference(tmp_path, monkeypatch):
    (tmp_path / "my_gen.py").write_text(
        "from reinforge.types import Message, Task\n"
        "def rows(seed):\n"
        "    for i in range(10):\n"
        "        yield {'prompt': f'{seed}:{i}', 'answer': str(i)}\n"
        "def tasks():\n"
        "    return [Task(id=f't{i}', messages=(Message('user', str(i)),), answer=str(i))\n"
        "            for i in range(4)]\n"
    )
    by_file = load_dataset_tasks(
        DatasetSpec(
            path="my_gen.py:rows", base_dir=str(tmp_path), seed=7, max_rows=5, reward="math"
        )
    )
    assert by_file.reports[0].format == "procedural"
    assert [t.messages[0].content for t in by_file.train] == [f"7:{i}" for i in range(5)]

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_gen", raising=False)
    by_module = load_dataset_tasks(DatasetSpec(path="my_gen:tasks", reward="exact_match"))
    assert by_module.reports[0].schema == "tasks"
    assert [t.id for t in by_module.train] == ["t0", "t1", "t2", "t3"]
    assert by_module.train[2].info == {"data_source": "tasks", "row": 2}


def test_endless_generator_needs_max_rows(tmp_path):
    (tmp_path / "endless.py").write_text(
        "import itertools\n"
        "def rows():\n"
        "    return ({'prompt': str(i), 'answer': str(i)} for i in itertools.count())\n"
    )
    with pytest.raises(ValueError, match="max_rows"):
        load_dataset_tasks(DatasetSpec(path=str(tmp_path / "endless.py") + ":rows"))


def test_held_out_fraction_is_seeded_disjoint_and_drops_duplicate_prompts(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": "x"} for i in range(40)]
    rows += [{"prompt": "p0", "answer": "x"}] * 3  # duplicates of one prompt
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = DatasetSpec(path=str(path), eval_fraction=0.25, seed=3, reward="exact_match")

    a, b = load_dataset_tasks(spec), load_dataset_tasks(spec)

    assert [t.id for t in a.eval_tasks()] == [t.id for t in b.eval_tasks()]
    assert len(a.eval) == round(0.25 * 43)
    eval_prompts = {t.messages for t in a.eval}
    assert not eval_prompts & {t.messages for t in a.train}
    assert len(a.train) + len(a.eval) + a.num_train_dropped == 43
    other_seed = load_dataset_tasks(DatasetSpec(**{**spec.__dict__, "seed": 4}))
    assert {t.id for t in other_seed.eval} != {t.id for t in a.eval}


def test_train_task_is_a_pure_function_of_index_with_a_fresh_order_per_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": "x"} for i in range(6)])
    spec = DatasetSpec(path=str(path), reward="exact_match", seed=1)
    tasks, again = load_dataset_tasks(spec), load_dataset_tasks(spec)

    epoch0 = [tasks.train_task(i).id for i in range(6)]
    epoch1 = [tasks.train_task(i).id for i in range(6, 12)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(t.id for t in tasks.train)
    assert epoch0 != epoch1
    assert [again.train_task(i).id for i in (11, 0, 7)] == [epoch1[5], epoch0[0], epoch1[1]]
    in_order = load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match", shuffle=False))
    assert [in_order.train_task(i).id for i in range(7)] == [
        f"train-{i}" for i in [*range(1, 7), 1]
    ]


def test_explicit_messages_column_and_sharegpt_roles(tmp_path):
    rows = [
        {
            "conv": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
            "gold": "hello",
        }
    ]
    path = write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    spec = DatasetSpec(
        path=str(path), columns=ColumnMap(messages="conv", answer="gold"), reward="exact_match"
    )
    task = load_dataset_tasks(spec).train[0]
    assert (task.messages, task.solution, task.answer) == (
        (Message("user", "hi"),),
        "hello",
        "hello",
    )
    assert exact_match_reward("hello", task) == 1.0


def test_json_array_file_numbers_rows_from_0(tmp_path):
    path = tmp_path / "alpaca.json"
    path.write_text('[{"instruction": "x"}, {"question": "2+2=", "answer": "4"}, 7]')
    spec = DatasetSpec(path=str(path), columns={"prompt": "question"}, reward="exact_match")
    with pytest.raises(ValueError, match=r"columns.prompt = 'question'.*\['instruction'\]"):
        load_dataset_tasks(spec)  # columns are resolved on the first row
    path.write_text('[{"question": "2+2=", "answer": "4"}, {"question": "3+3="}, 7]')
    tasks = load_dataset_tasks(spec)
    assert tasks.reports[0].format == "json"
    assert tasks.reports[0].bad_rows == {"missing answer": [1], "not a record": [2]}


def test_folder_of_data_files_goes_through_load_dataset(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    folder = tmp_path / "my_data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)])
    write_jsonl(folder / "test.jsonl", [{"prompt": "q", "answer": "0"}])

    tasks = load_dataset_tasks(DatasetSpec(path=str(folder), eval_split="test", reward="math"))

    assert (tasks.name, len(tasks), len(tasks.eval)) == ("my_data", 5, 1)
    assert tasks.train[4].answer == "4"
