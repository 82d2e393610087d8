"""The run report from a run directory alone: the summary (here) and one self-contained HTML
page (`html`, `page.html`). It may import `metrics` and `errors`.

`reinforge report RUN_DIR`: what a run did and why it stopped, from its run directory alone.

Reads config.toml, metrics.jsonl, the latest checkpoint's trainer_state.json, and the files a run
leaves when it ends badly: error.txt (a failure's traceback or message) and hang.txt (the
watchdog's stack dump), and under torchrun error.rank{r}.txt and hang.rank{r}.txt of the other
ranks, each shown. An error or hang older than the latest checkpoint belongs to an earlier
process that a resume got past: it is shown as the last error, not as the status. Every text
from these files is shown as plain text (never read as console markup: an error message may
hold brackets).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from reinforge.errors import ConfigError
from reinforge.metrics import plot_curves, read_metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Per-step failure counts the trainer logs; the report and the summary add them up over the run.
COUNTERS = (
    "nonfinite_skipped",
    "reward_errors",
    "reward_nonfinite",
    "tool_errors",
    "tool_timeouts",
    "malformed_calls",
    "unknown_tool_calls",
    "context_overflows",
    "faults_injected",
)


@dataclass
class RunReport:
    run_dir: Path
    command: str  # "train" or "sft"
    status: str
    steps_done: int
    max_steps: int | None
    sft_steps_done: int = 0
    final: dict[str, float] = field(default_factory=dict)
    best: dict[str, tuple[float, int]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    last_error: str | None = None
    rank_errors: list[tuple[str, str]] = field(default_factory=list)  # (file, its line)
    resume_command: str | None = None
    plot: Path | None = None


def build_report(run_dir: Path) -> RunReport:
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ConfigError(
            f"{run_dir} is not a run directory (it has no config.toml); give the folder "
            "run.output_dir/run.name of a run, e.g. runs/run"
        )
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    command = "train" if "rollout" in cfg else "sft"
    rows = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    sft = [r for r in rows if r.get("phase") == "sft" and "loss" in r]
    status, last_error = _status(run_dir, cfg, command)
    report = RunReport(
        run_dir,
        command,
        status,
        steps_done=max((r["step"] for r in rl), default=0),
        max_steps=cfg.get("run", {}).get("max_steps"),
        sft_steps_done=max((r["step"] for r in sft), default=0),
        last_error=last_error,
    )
    last = rl[-1] if rl else sft[-1] if sft else {}
    report.final = {k: v for k, v in last.items() if isinstance(v, (int, float)) and k != "step"}
    report.best = best_metrics(rows)
    report.counters = counters_of(rows)
    report.rank_errors = rank_errors(run_dir)
    if _latest_state(run_dir) is not None and not status.startswith("finished"):
        report.resume_command = f"reinforge {command} --resume {run_dir}"
    report.plot = plot_curves(run_dir)
    return report


def rank_errors(run_dir: Path) -> list[tuple[str, str]]:
    """(file name, its line) for every rank's error and hang file but rank 0's: an error file's
    last line (the message), a hang file's first (the phase)."""
    out = []
    for path in sorted(run_dir.glob("error.rank*.txt")) + sorted(run_dir.glob("hang.rank*.txt")):
        lines = path.read_text(errors="replace").strip().splitlines() or ["(empty)"]
        out.append((path.name, lines[0] if path.name.startswith("hang") else lines[-1]))
    return out


def run_counters(run_dir: Path) -> dict[str, float]:
    """Failure counters summed over every step the run logged (all its processes)."""
    return counters_of(read_metrics(Path(run_dir) / "metrics.jsonl"))


# A task's own headline besides accuracy: (metric key, label), shown before -> after.
HEADLINES = (("tool_call_rate", "tool-call rate"), ("win_rate", "win rate"))


def headline_rows(run_dir: Path) -> list[tuple[str, str]]:
    """(label, "first -> last") for each headline rate the run logged: over the RL steps, and
    held-out (before RL -> last evaluation) where the evaluation scored it."""
    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("phase") == "rl"]
    out = []
    for key, label in HEADLINES:
        for scope, k in (("RL steps", key), ("held-out", f"eval_{key}")):
            have = [r for r in rows if k in r]
            if have:
                first, last = have[0], have[-1]
                out.append(
                    (
                        f"{label}, {scope}",
                        f"{first[k]:.2f} (step {first['step']}) -> {last[k]:.2f} (step {last['step']})",
                    )
                )
    return out


def counters_of(rows: list[dict]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for row in rows:
        for key in COUNTERS:
            if key in row:
                totals[key] = totals.get(key, 0.0) + row[key]
    return totals


def best_metrics(rows: list[dict]) -> dict[str, tuple[float, int]]:
    best: dict[str, tuple[float, int]] = {}
    for row in rows:
        for key in ("reward_mean", "accuracy", "eval_accuracy"):
            if key in row and (key not in best or row[key] > best[key][0]):
                best[key] = (row[key], row["step"])
    return best


def _status(run_dir: Path, cfg: dict, command: str) -> tuple[str, str | None]:
    """(why the run stopped, the last error or hang seen, if any)."""
    state = _latest_state(run_dir)
    pointer = run_dir / "checkpoints" / "latest"
    saved_at = pointer.stat().st_mtime if pointer.exists() else 0.0
    hang, error = run_dir / "hang.txt", run_dir / "error.txt"
    if not error.exists():  # rank 0 wrote none: the first other rank's error stands for it
        error = next(iter(sorted(run_dir.glob("error.rank*.txt"))), error)
    hang_line = _line(hang, first=True) if hang.exists() else None
    error_line = _line(error, first=False) if error.exists() else None
    last_error = hang_line or error_line
    if hang.exists() and error.exists():
        last_error = hang_line if hang.stat().st_mtime >= error.stat().st_mtime else error_line
    if state is not None and _is_finished(state, cfg, command):
        return "finished", last_error
    if hang.exists() and hang.stat().st_mtime >= saved_at:
        return f"hung: {hang_line}", last_error
    if error.exists() and error.stat().st_mtime >= saved_at:
        return f"failed: {error_line}", last_error
    if state is not None:
        where = f"RL step {state['step']}" if state["phase"] == "rl" else "SFT"
        where = f"SFT step {state['step']}" if state["phase"] == "sft" else where
        return f"stopped at {where} (checkpoint saved; not finished)", last_error
    return "no checkpoint (stopped or failed before the first save)", last_error


def _line(path: Path, first: bool) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() or ["(empty file)"]
    prefix = "" if path.name in ("error.txt", "hang.txt") else f"{path.name}: "
    return prefix + (lines[0] if first else lines[-1])


def _is_finished(state: dict, cfg: dict, command: str) -> bool:
    if command == "sft":
        return bool(state.get("sft_done"))
    max_steps = cfg.get("run", {}).get("max_steps")
    return state["phase"] == "rl" and max_steps is not None and state["step"] >= max_steps


def _latest_state(run_dir: Path) -> dict | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip() / "trainer_state.json"
    return json.loads(path.read_text()) if path.exists() else None


def print_run_report(report: RunReport) -> None:
    from rich.table import Table
    from rich.text import Text

    from reinforge.metrics import console

    table = Table(title=Text(f"run report: {report.run_dir.name}"), show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    table.add_row("status", Text(report.status))
    if report.sft_steps_done:
        table.add_row("SFT steps logged", str(report.sft_steps_done))
    if report.command == "train":
        of = f" of {report.max_steps}" if report.max_steps else ""
        table.add_row("RL steps logged", f"{report.steps_done}{of}")
    for key, (value, step) in sorted(report.best.items()):
        table.add_row(f"best {key}", f"{value:.4f} (step {step})")
    for key in ("reward_mean", "accuracy", "loss", "response_len", "entropy", "kl_sampler"):
        if key in report.final:
            table.add_row(f"final {key}", f"{report.final[key]:.4g}")
    failures = ", ".join(f"{k} {v:g}" for k, v in sorted(report.counters.items()) if v)
    table.add_row("failures counted", failures or "none")
    if report.last_error:
        table.add_row("last error", Text(report.last_error))
    for name, line in report.rank_errors:
        table.add_row(name, Text(line))
    if report.plot:
        table.add_row("plot", str(report.plot))
    console.print(table)
    if report.resume_command:
        print(f"resume with: {report.resume_command}")
