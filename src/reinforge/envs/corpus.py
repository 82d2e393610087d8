"""The user's documents behind the built-in `search` and `open` tools of `[task] name = "tools"`.

`load_corpus(path, on_bad_row)` reads a collection into `Document`s:
- a data file reinforge reads (.jsonl, .json, .parquet, .csv/.tsv) with one document a row:
  `text` (required), `title` and `id` (optional: the row number stands in for a missing id);
- a folder of .txt / .md files: one document each, its id the path inside the folder, its title
  the first line (a Markdown heading's `#` dropped).
Bad rows (unreadable, no text, an id seen before) are counted in a `LoadReport` with their row
numbers and skipped, or, with `on_bad_row = "error"`, refused all together, before any model
loads. `BM25Backend` (envs/search_env.py, bm25s) indexes what is kept.

`FunctionBackend` puts the user's own search function (`task.search_backend`, a web search say)
behind the same `SearchBackend` protocol: `fn(query: str, k: int)` returns hits, each a text or
a dict with `text` (or `snippet`) and optionally `id` (or `url`) and `title`. The texts of the
hits it returned are what `open` can show.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reinforge.data.formats import (
    ROW_UNITS,
    SUFFIX_FORMATS,
    BadRecord,
    detect_format,
    read_records,
)
from reinforge.data.report import LoadReport
from reinforge.envs.search_env import Document, Hit, snippet
from reinforge.errors import ConfigError

SETTING = "task.corpus"
TEXT_SUFFIXES = (".txt", ".md")


def load_corpus(path: str, on_bad_row: str = "skip") -> tuple[list[Document], LoadReport]:
    """The documents at `path` and the report of what was refused."""
    p = Path(path).expanduser()
    if p.is_dir():
        docs, report = _read_folder(p)
    elif p.is_file():
        if p.suffix.lower() not in SUFFIX_FORMATS:
            raise ConfigError(
                f"{SETTING} = {path!r}: a {p.suffix or 'suffix-less'} file is not a corpus; give "
                f"a .jsonl (one {{id, title, text}} per line), .json, .parquet or .csv file, or a "
                f"folder of {' / '.join(TEXT_SUFFIXES)} files"
            )
        docs, report = _read_rows(str(p), detect_format(str(p)))
    else:
        raise ConfigError(
            f"{SETTING} = {path!r}: no such file or folder (relative paths are from the working "
            f"directory, {Path.cwd()})"
        )
    report.num_loaded = len(docs)
    if report.num_skipped and on_bad_row == "error":
        raise ConfigError(
            f"bad documents in the corpus (task.on_bad_row = 'error'):\n{report.summary()}\n"
            "fix those rows, or set task.on_bad_row = 'skip' to search without them"
        )
    if not docs:
        raise ConfigError(f"{SETTING} = {path!r} holds no usable document:\n{report.summary()}")
    return docs, report


def _read_rows(path: str, fmt: str) -> tuple[list[Document], LoadReport]:
    report = LoadReport(
        path, "corpus", fmt, ROW_UNITS.get(fmt, "row"), "id/title/text", loaded_unit="documents"
    )
    docs: list[Document] = []
    seen: set[str] = set()
    for row, record in read_records(path, fmt, "train"):
        report.num_rows += 1
        problem = _problem(record, seen)
        if problem is not None:
            report.add_bad(problem[0], row, problem[1])
            continue
        doc_id = str(record.get("id", row))
        seen.add(doc_id)
        docs.append(Document(doc_id, str(record.get("title") or ""), record["text"]))
    return docs, report


def _problem(record: Any, seen: set[str]) -> tuple[str, str] | None:
    """(reason, detail) of a row that is no document, or None."""
    if isinstance(record, BadRecord):
        return record.reason, record.detail
    if not isinstance(record, dict):
        return "not a record", f"a {type(record).__name__}"
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        return "missing text", f"no text in column 'text' (its columns: {sorted(record)})"
    title = record.get("title")
    if title is not None and not isinstance(title, str):
        return "title has wrong type", f"a {type(title).__name__}, not text"
    doc_id = record.get("id")
    if doc_id is not None and (not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool)):
        return "id has wrong type", f"a {type(doc_id).__name__}, not text or a number"
    if doc_id is not None and str(doc_id) in seen:
        return "duplicate id", f"id {doc_id!r} is already taken; ids must be unique"
    return None


def _read_folder(folder: Path) -> tuple[list[Document], LoadReport]:
    files = sorted(f for f in folder.rglob("*") if f.suffix.lower() in TEXT_SUFFIXES)
    report = LoadReport(
        str(folder), "corpus", "text files", "file", "one file a document", loaded_unit="documents"
    )
    if not files:
        raise ConfigError(
            f"{SETTING} = {str(folder)!r} is a folder with no {' / '.join(TEXT_SUFFIXES)} files; "
            "put one document in each, or give a .jsonl file of {id, title, text} rows"
        )
    docs = []
    for number, file in enumerate(files):
        report.num_rows += 1
        name = file.relative_to(folder).as_posix()
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            report.add_bad("not UTF-8 text", number, f"{name}: {e.reason}")
            continue
        if not text.strip():
            report.add_bad("empty file", number, name)
            continue
        first = text.strip().splitlines()[0]
        docs.append(Document(name, first.lstrip("#").strip() or file.stem, text.strip()))
    return docs, report


class FunctionBackend:
    """A user's search function as a `SearchBackend`; `get` knows the hits it has returned."""

    def __init__(self, fn: Callable[..., Any], ref: str):
        self.fn, self.ref = fn, ref
        self._texts: dict[str, str] = {}

    def search(self, query: str, k: int) -> list[Hit]:
        results = self.fn(query, k)
        if not isinstance(results, (list, tuple)):
            raise TypeError(
                f"task.search_backend {self.ref!r} returned a {type(results).__name__}; it must "
                "return a list of hits (texts, or dicts with text, title, id)"
            )
        return [self._hit(result) for result in results[:k]]

    def _hit(self, result: Any) -> Hit:
        if isinstance(result, str):
            result = {"text": result}
        if not isinstance(result, dict):
            raise TypeError(
                f"task.search_backend {self.ref!r} returned a {type(result).__name__} hit; a hit "
                "is a text or a dict with text, title, id"
            )
        text = str(result.get("text") or result.get("snippet") or "")
        doc_id = str(result.get("id") or result.get("url") or f"result-{len(self._texts)}")
        self._texts[doc_id] = text
        return Hit(doc_id, str(result.get("title") or ""), snippet(text))

    def get(self, doc_id: str) -> str:
        return self._texts[doc_id]
