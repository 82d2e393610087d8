"""What a load read, kept and refused: counts per reason and the first row numbers of each, so a
bad row is never dropped without a trace."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadReport:
    source: str  # path, folder, hub name or generator reference
    split: str
    format: str
    row_unit: str = "row"  # "line" (1-based, JSONL) or "row" (0-based index)
    schema: str = ""  # "verl", "trl-conversational", "trl-standard", "prompt-answer", "tasks"
    columns: dict[str, str] = field(default_factory=dict)  # role -> column read
    num_rows: int = 0  # rows read, good and bad
    num_loaded: int = 0  # tasks made
    num_bad: dict[str, int] = field(default_factory=dict)  # reason -> count
    bad_rows: dict[str, list[int]] = field(default_factory=dict)  # reason -> first row numbers
    first_detail: dict[str, str] = field(default_factory=dict)  # reason -> its first row's detail
    max_listed: int = 10  # row numbers kept per reason
    loaded_unit: str = "tasks"  # what a kept row became ("documents" for a search corpus)

    def add_bad(self, reason: str, row: int, detail: str = "") -> None:
        self.num_bad[reason] = self.num_bad.get(reason, 0) + 1
        rows = self.bad_rows.setdefault(reason, [])
        if len(rows) < self.max_listed:
            rows.append(row)
        if detail:
            self.first_detail.setdefault(reason, detail)

    @property
    def num_skipped(self) -> int:
        return sum(self.num_bad.values())

    def summary(self) -> str:
        head = (
            f"{self.source} ({self.format}, split {self.split!r}, schema {self.schema or '?'}): "
            f"{self.num_rows} rows read, {self.num_loaded} {self.loaded_unit}, "
            f"{self.num_skipped} bad rows"
        )
        lines = [head]
        for reason, count in sorted(self.num_bad.items(), key=lambda kv: -kv[1]):
            rows = ", ".join(map(str, self.bad_rows[reason]))
            more = ", ..." if count > len(self.bad_rows[reason]) else ""
            detail = f" (first: {self.first_detail[reason]})" if reason in self.first_detail else ""
            lines.append(f"  {reason}: {count} at {self.row_unit}s {rows}{more}{detail}")
        return "\n".join(lines)
