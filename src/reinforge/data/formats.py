"""Reading records from the formats users have: JSONL, JSON arrays, parquet, CSV/TSV, HF
`datasets` (a saved dataset, a folder of data files, or a hub name), and Python generators.

`read_records` yields `(row, record)` pairs. A record is a dict (one row as the file has it), a
`Task` (from a generator that builds them), or a `BadRecord` when the row cannot even be parsed
(a broken JSON line, a line or CSV row that is not UTF-8, a CSV row with the wrong number of
fields): those are counted, not raised, so one bad line does not hide the rest. Row numbers are 1-based line numbers for JSONL
(`ROW_UNITS`) and 0-based row indices (as pandas and `datasets` number them) otherwise.
"""

from __future__ import annotations

import csv
import inspect
import json
import re
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.data.spec import SETTING
from reinforge.errors import ConfigError
from reinforge.types import Task

SUFFIX_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",  # or JSON lines: decided by the first character
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
}
ROW_UNITS = {"jsonl": "line"}  # every other format: "row"
# "pkg.module:function" or "path/to/file.py:function"
_GENERATOR_REF = re.compile(r"^(?:[A-Za-z_][\w.]*|.+\.py):[A-Za-z_][\w.]*$")
_SURROGATE = re.compile("[\udc80-\udcff]")  # undecodable bytes under surrogateescape
_ANY_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class BadRecord:
    reason: str
    detail: str


Record = dict[str, Any] | Task | BadRecord


def detect_format(path: str) -> str:
    """The format `path` is in, judged from what it is; a clear error when it is nothing."""
    p = Path(path).expanduser()
    if p.is_file():
        fmt = SUFFIX_FORMATS.get(p.suffix.lower())
        if fmt == "json":
            with open(p, encoding="utf-8", errors="replace") as f:  # bad bytes: bad rows later
                return "json" if f.read(4096).lstrip().startswith("[") else "jsonl"
        if fmt is not None:
            return fmt
        raise ConfigError(
            f"{SETTING}.path = {path!r} has suffix {p.suffix!r}, which names no format; rename "
            f"it to one of {sorted(SUFFIX_FORMATS)} or set {SETTING}.format"
        )
    if p.is_dir():
        return "hf"
    if _GENERATOR_REF.match(path):
        return "procedural"
    if p.suffix.lower() in SUFFIX_FORMATS or path.startswith((".", "/", "~")):
        raise ConfigError(f"{SETTING}.path = {path!r}: no such file or folder")
    return "hf"  # a hub name, e.g. "openai/gsm8k"


def read_records(
    path: str,
    fmt: str,
    split: str,
    subset: str | None = None,
    seed: int = 0,
    max_rows: int | None = None,
    base_dir: str | None = None,
) -> Iterator[tuple[int, Record]]:
    readers = {
        "jsonl": lambda: _read_jsonl(Path(path)),
        "json": lambda: _read_json_array(Path(path)),
        "parquet": lambda: _read_parquet(Path(path)),
        "csv": lambda: _read_csv(Path(path)),
        "hf": lambda: _read_hf(path, split, subset),
        "procedural": lambda: _read_generator(path, seed, max_rows, base_dir),
    }
    assert fmt in readers, f"unresolved format {fmt!r}"
    for num_read, item in enumerate(readers[fmt]()):
        if max_rows is not None and num_read >= max_rows:
            return
        yield item


def _read_jsonl(path: Path) -> Iterator[tuple[int, Record]]:
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad row, not the file
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield line_no, _not_utf8(raw, e)
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield line_no, BadRecord("invalid JSON", str(e))
                continue
            except (ValueError, RecursionError) as e:  # a 5,000-digit number, deep nesting
                yield line_no, BadRecord("invalid JSON", f"{type(e).__name__}: {str(e)[:200]}")
                continue
            if _has_lone_surrogate(record):
                detail = "a \\u escape names a lone surrogate (half of a pair), which no text holds"
                yield line_no, BadRecord("invalid unicode", detail)
                continue
            yield line_no, record if isinstance(record, dict) else _not_a_record(record)


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value holds a surrogate code point: JSON decodes a valid pair to
    one character, so any left is lone, and tokenizers (UTF-8 encoders) refuse it."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _ANY_SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _not_utf8(raw: bytes, error: UnicodeDecodeError) -> BadRecord:
    bad = raw[error.start : error.end].hex(" ")
    return BadRecord("invalid UTF-8", f"byte(s) {bad} at byte {error.start + 1} of the line")


def _read_json_array(path: Path) -> Iterator[tuple[int, Record]]:
    with open(path, "rb") as f:
        try:
            records = json.loads(f.read().decode("utf-8"))
        except UnicodeDecodeError as e:  # one array: no row to blame, the file is the error
            raise ConfigError(
                f"{SETTING}.path = {str(path)!r} is not UTF-8 (byte {e.start}: "
                f"{e.object[e.start : e.end].hex(' ')}); save it as UTF-8, or as JSON lines, "
                "where each bad line is skipped and counted"
            ) from None
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise ConfigError(f"{SETTING}.path = {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(records, list):
        raise ConfigError(
            f"{SETTING}.path = {str(path)!r} holds a JSON {type(records).__name__}, not an array "
            "of records; write one record per array item, or one per line (JSONL)"
        )
    for row, record in enumerate(records):
        yield row, record if isinstance(record, dict) else _not_a_record(record)


def _not_a_record(value: Any) -> BadRecord:
    return BadRecord("not a record", f"a {type(value).__name__}, not an object with columns")


def _read_parquet(path: Path) -> Iterator[tuple[int, Record]]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{SETTING}.path = {str(path)!r} is a folder with no .parquet files")
    row = 0
    for file in files:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield row, record
                row += 1


def _read_csv(path: Path) -> Iterator[tuple[int, Record]]:
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    # surrogateescape: a byte that is not UTF-8 survives as a lone surrogate, found per row below
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, [])
        if any(_SURROGATE.search(name) for name in header):
            raise ConfigError(f"{SETTING}.path = {str(path)!r}: its header row is not UTF-8")
        rows = (fields for fields in reader if fields)  # blank lines are no rows, as in pandas
        for row, values in enumerate(rows):
            if any(_SURROGATE.search(value) for value in values):
                detail = "a field holds bytes that are not UTF-8"
                yield row, BadRecord("invalid UTF-8", detail)
            elif len(values) != len(header):
                detail = f"{len(values)} fields where the header has {len(header)}"
                yield row, BadRecord("malformed CSV row", detail)
            else:
                yield row, dict(zip(header, values))


def _read_hf(path: str, split: str, subset: str | None) -> Iterator[tuple[int, Record]]:
    import datasets  # type: ignore[import-untyped]

    p = Path(path).expanduser()
    is_saved = p.is_dir() and any((p / f).exists() for f in ("dataset_dict.json", "state.json"))
    if is_saved:
        ds = datasets.load_from_disk(str(p))
    else:  # a folder of data files, or a hub name (online)
        ds = datasets.load_dataset(path, subset, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(
                f"{SETTING}.split = {split!r} is not in {path}; its splits are {sorted(ds)}"
            )
        ds = ds[split]
    yield from enumerate(ds)


def _read_generator(
    ref: str, seed: int, max_rows: int | None, base_dir: str | None
) -> Iterator[tuple[int, Record]]:
    from reinforge.rewards.mix import load_callable

    fn = load_callable(ref, base_dir=base_dir, setting=f"{SETTING}.path")
    takes_seed = bool(inspect.signature(fn).parameters)
    items = fn(seed) if takes_seed else fn()
    if not isinstance(items, Sized) and max_rows is None:
        raise ConfigError(
            f"{SETTING}.path = {ref!r} returns a generator, which may never end; set "
            f"{SETTING}.max_rows to the number of rows to draw, e.g. {SETTING}.max_rows = 10000"
        )
    for row, item in enumerate(items):
        if isinstance(item, (dict, Task)):
            yield row, item
        else:
            yield row, BadRecord("not a record", f"a {type(item).__name__}, not a dict or Task")
