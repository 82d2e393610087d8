"""Bad rows are counted per reason with their row numbers, skipped or fatal as configured, and
never truncated; settings that cannot work fail before any row is read."""

from __future__ import annotations

import pytest

from reinforge.data import DatasetSpec, load_dataset_tasks
from reinforge.errors import ConfigError
from reinforge.models.tiny import builtin_path

from .conftest import write_csv, write_jsonl

GOOD = {"prompt": "1+1=", "answer": "2"}


def mixed_jsonl(tmp_path):
    """Lines 1, 4, 9 are good; every other line is bad in its own way (line 7 is blank)."""
    lines = [
        '{"prompt": "1+1=", "answer": "2"}',  # 1
        '{"prompt": "1+2=", "answer": ',  # 2 invalid JSON
        '{"answer": "3"}',  # 3 missing prompt
        '{"prompt": "2+2=", "answer": "4"}',  # 4
        '{"prompt": 12, "answer": "5"}',  # 5 prompt has wrong type
        '{"prompt": "   ", "answer": "6"}',  # 6 empty prompt
        "",  # 7 blank: not a row
        '{"prompt": "3+3="}',  # 8 missing answer
        '{"prompt": "4+4=", "answer": "8"}',  # 9
        '{"prompt": [{"role": "user"}], "answer": "9"}',  # 10 bad message
        "[1, 2]",  # 11 not a record
        '{"prompt": "x", "answer": true}',  # 12 answer has wrong type
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_skip_mode_counts_each_reason_with_line_numbers(tmp_path, caplog):
    spec = DatasetSpec(path=str(mixed_jsonl(tmp_path)), reward="exact_match")

    with caplog.at_level("WARNING"):
        tasks = load_dataset_tasks(spec)

    report = tasks.reports[0]
    assert [t.answer for t in tasks.train] == ["2", "4", "8"]
    assert (report.num_rows, report.num_loaded, report.num_skipped) == (11, 3, 8)
    assert report.row_unit == "line"
    assert report.bad_rows == {
        "invalid JSON": [2],
        "missing prompt": [3],
        "prompt has wrong type": [5],
        "empty prompt": [6],
        "missing answer": [8],
        "bad message": [10],
        "not a record": [11],
        "answer has wrong type": [12],
    }
    assert "missing prompt: 1 at lines 3" in caplog.text


def test_error_mode_fails_after_listing_every_bad_row(tmp_path):
    spec = DatasetSpec(path=str(mixed_jsonl(tmp_path)), on_bad_row="error", reward="exact_match")
    with pytest.raises(ConfigError) as e:
        load_dataset_tasks(spec)
    message = str(e.value)
    assert "8 bad rows" in message
    assert "invalid JSON: 1 at lines 2" in message
    assert "empty prompt: 1 at lines 6" in message
    assert "on_bad_row = 'skip'" in message


def test_row_numbers_are_capped_per_reason_but_counts_are_not(tmp_path):
    rows = [GOOD] + [{"prompt": ""}] * 25
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    report = load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match")).reports[0]
    assert report.num_bad == {"empty prompt": 25}
    assert report.bad_rows["empty prompt"] == list(range(2, 12))
    assert "empty prompt: 25 at lines 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ..." in report.summary()


def test_malformed_csv_rows_are_bad_rows_with_0_based_numbers(tmp_path):
    path = write_csv(
        tmp_path / "d.csv",
        ["prompt", "answer"],
        [["1+1=", "2"], ["2+2=", "4", "extra"], ["3+3="], ["4+4=", ""]],
    )
    tasks = load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match"))
    report = tasks.reports[0]
    assert [t.answer for t in tasks.train] == ["2"]
    assert report.bad_rows == {"malformed CSV row": [1, 2], "empty answer": [3]}
    assert report.first_detail["malformed CSV row"] == "3 fields where the header has 2"


def test_bytes_that_are_not_utf8_make_one_bad_row_each(tmp_path):
    good = b'{"prompt": "1+1=", "answer": "2"}\n'
    bad_byte = b'{"prompt": "caf\xe9=", "answer": "3"}\n'  # Latin-1, not UTF-8
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    huge = b'{"prompt": "x", "answer": ' + b"9" * 5000 + b"}\n"
    lone = b'{"prompt": "a\\ud800b", "answer": "1"}\n'  # valid UTF-8; decodes to no text
    pair = b'{"prompt": "smile \\ud83d\\ude00", "answer": "1"}\n'  # a valid pair: an emoji
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(good + bad_byte + good + deep + huge + good + lone + pair)
    tasks = load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match"))
    report = tasks.reports[0]
    assert len(tasks.train) == 4 and report.num_rows == 8
    assert tasks.train[-1].messages[-1].content == "smile \U0001f600"
    assert report.bad_rows == {
        "invalid UTF-8": [2],
        "invalid JSON": [4, 5],
        "invalid unicode": [7],
    }
    assert report.first_detail["invalid UTF-8"] == "byte(s) e9 at byte 16 of the line"
    assert "invalid UTF-8: 1 at lines 2" in report.summary()

    csv_path = tmp_path / "mixed.csv"
    csv_path.write_bytes(b"prompt,answer\n1+1=,2\ncaf\xe9=,3\n2+2=,4\n")
    csv_tasks = load_dataset_tasks(DatasetSpec(path=str(csv_path), reward="exact_match"))
    assert [t.answer for t in csv_tasks.train] == ["2", "4"]
    assert csv_tasks.reports[0].bad_rows == {"invalid UTF-8": [1]}


def test_prompts_over_the_token_budget_are_counted_not_truncated(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(builtin_path("micro", 0))
    empty = [{"role": "user", "content": ""}]
    overhead = len(
        tokenizer.apply_chat_template(empty, add_generation_prompt=True, return_dict=False)
    )
    # one token per byte: "x" * n renders to overhead + n tokens
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (5, 40, 10, 41, 60)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = DatasetSpec(path=str(path), max_prompt_tokens=overhead + 40, reward="exact_match")

    tasks = load_dataset_tasks(spec, tokenizer=tokenizer)

    assert [len(t.messages[0].content) for t in tasks.train] == [5, 40, 10]
    report = tasks.reports[0]
    assert report.bad_rows == {"prompt over token budget": [4, 5]}
    assert f"{overhead + 41} tokens >" in report.first_detail["prompt over token budget"]
    with pytest.raises(ConfigError, match="budget"):
        load_dataset_tasks(
            DatasetSpec(**{**spec.__dict__, "on_bad_row": "error"}), tokenizer=tokenizer
        )
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_dataset_tasks(spec)


def test_a_file_with_no_usable_row_fails(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "", "answer": "1"}])
    with pytest.raises(ConfigError, match="no usable rows"):
        load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match"))


@pytest.mark.parametrize(
    ("spec_kwargs", "match"),
    [
        (
            {"columns": {"prompt": "query"}},
            r"columns.prompt = 'query'.*columns are \['answer', 'prompt'\]",
        ),
        ({"columns": {"question": "q"}}, "unknown keys"),
        ({"columns": {"prompt": "prompt", "messages": "m"}}, "set only one"),
        ({"eval_fraction": 0.1, "eval_split": "test"}, "set only one"),
        ({"eval_fraction": 1.0}, r"\[0, 1\)"),
        ({"max_rows": 0}, "at least 1"),
        ({"format": "xlsx"}, "not one of"),
    ],
)
def test_inconsistent_settings_name_the_fix(tmp_path, spec_kwargs, match):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    with pytest.raises(ConfigError, match=match):
        load_dataset_tasks(DatasetSpec(path=str(path), reward="exact_match", **spec_kwargs))


def test_data_without_a_prompt_or_answer_column_says_which_to_set(tmp_path):
    no_prompt = write_jsonl(tmp_path / "a.jsonl", [{"text": "hi", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"no prompt column.*columns.prompt"):
        load_dataset_tasks(DatasetSpec(path=str(no_prompt)))
    no_answer = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "hi", "completion": "hello"}])
    with pytest.raises(ConfigError, match=r"columns.answer.*require_answer = false"):
        load_dataset_tasks(DatasetSpec(path=str(no_answer)))
    sft = load_dataset_tasks(
        DatasetSpec(path=str(no_answer), require_answer=False, reward="format")
    )
    assert (sft.train[0].answer, sft.train[0].solution) == ("", "hello")


def test_missing_files_and_unknown_suffixes_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_dataset_tasks(DatasetSpec(path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "d.xlsx").write_text("")
    with pytest.raises(ConfigError, match="names no format"):
        load_dataset_tasks(DatasetSpec(path=str(tmp_path / "d.xlsx")))
