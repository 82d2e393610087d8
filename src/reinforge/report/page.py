"""`reinforge report RUN_DIR --html`: the run as one self-contained HTML page.

One file, readable offline and shareable as it is: no server, no CDN, no external file. The
page (report/page.html, inline CSS and JavaScript drawing SVG) gets the run's data as one JSON
block: every logged metric (each a curve: reward and its components, SFT loss, evaluation, ...),
the status and headline figures of `reinforge report`, the failure counters, settings changed on
resume, the config, and samples.jsonl for the sample browser (filters by step, reward, data
source and text; a multi-turn episode shows turn by turn, tool calls highlighted, tool results
as the environment's turns).
"""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from reinforge.metrics import read_metrics
from reinforge.report import build_report, headline_rows

MAX_SAMPLES = 5000  # the newest ones; a long run's file can be larger than a browser likes


def write_html_report(run_dir: Path, out: Path | None = None) -> Path:
    run_dir = Path(run_dir)
    data = report_data(run_dir)
    out = Path(out) if out is not None else run_dir / "report.html"
    out.write_text(render(data), encoding="utf-8")
    return out


def report_data(run_dir: Path) -> dict[str, Any]:
    report = build_report(run_dir)
    samples = read_metrics(run_dir / "samples.jsonl")
    changes = run_dir / "config_changes.txt"
    return {
        "name": run_dir.name,
        "run_dir": str(run_dir),
        "status": report.status,
        "facts": _facts(report, run_dir),
        "counters": report.counters,
        "changes": changes.read_text().splitlines() if changes.exists() else [],
        "config": (run_dir / "config.toml").read_text(),
        "metrics": [_finite(row) for row in read_metrics(run_dir / "metrics.jsonl")],
        "samples": [_finite(row) for row in samples[-MAX_SAMPLES:]],
        "samples_total": len(samples),
    }


def _facts(report, run_dir: Path) -> list[tuple[str, str]]:
    facts = []
    if report.command == "train":
        of = f" of {report.max_steps}" if report.max_steps else ""
        facts.append(("RL steps logged", f"{report.steps_done}{of}"))
    if report.sft_steps_done:
        facts.append(("SFT steps logged", str(report.sft_steps_done)))
    for key, (value, step) in sorted(report.best.items()):
        facts.append((f"best {key}", f"{value:.4f} (step {step})"))
    facts.extend(headline_rows(run_dir))
    if report.last_error:
        facts.append(("last error", report.last_error))
    facts.extend(report.rank_errors)
    if report.resume_command:
        facts.append(("resume with", report.resume_command))
    return facts


def _finite(row: dict) -> dict:
    """JSON has no NaN or infinity: such values become null (a gap in the curve)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def render(data: dict[str, Any]) -> str:
    page = resources.files("reinforge").joinpath("report/page.html").read_text(encoding="utf-8")
    # inside <script>, "</script" or "<!--" in a completion would change how the page parses:
    # every "<" (only ever inside JSON strings) is written as its escape
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    return page.replace("__TITLE__", html.escape(data["name"])).replace("__DATA__", blob)
