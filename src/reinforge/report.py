"""`reinforge report RUN_DIR`: what a run did and why it stopped, from its run directory alone."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from reinforge.metrics import plot_curves, read_metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

COUNTERS = (
    "nonfinite_skipped",
    "reward_errors",
    "reward_nonfinite",
    "tool_errors",
    "tool_timeouts",
    "malformed_calls",
    "dropped_groups",
)


@dataclass
class RunReport:
    run_dir: Path
    status: str
    steps_done: int
    max_steps: int | None
    final: dict[str, float] = field(default_factory=dict)
    best: dict[str, tuple[float, int]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    last_error: str | None = None
    resume_command: str | None = None
    plot: Path | None = None


def build_report(run_dir: Path) -> RunReport:
    run_dir = Path(run_dir)
    assert run_dir.is_dir(), f"{run_dir} is not a run directory"
    cfg = (
        tomllib.loads((run_dir / "config.toml").read_text())
        if (run_dir / "config.toml").exists()
        else {}
    )
    max_steps = cfg.get("run", {}).get("max_steps")
    rows = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    steps_done = max((r["step"] for r in rl), default=0)
    saved = _saved_step(run_dir)
    error = (
        (run_dir / "error.txt").read_text().strip().splitlines()[-1]
        if (run_dir / "error.txt").exists()
        else None
    )
    hang = (
        (run_dir / "hang.txt").read_text().strip().splitlines()[0]
        if (run_dir / "hang.txt").exists()
        else None
    )
    if hang:
        status = f"hung: {hang}"
    elif error:
        status = "failed"
    elif max_steps is not None and saved is not None and saved >= max_steps:
        status = "finished"
    elif saved is not None:
        status = f"stopped at step {saved} (checkpoint saved; not finished)"
    else:
        status = "no checkpoint (stopped or failed before the first save)"
    report = RunReport(run_dir, status, steps_done, max_steps, last_error=error or hang)
    if rl:
        report.final = {
            k: v for k, v in rl[-1].items() if isinstance(v, (int, float)) and k != "step"
        }
    for row in rows:
        for key in ("reward_mean", "accuracy", "eval_accuracy"):
            if key in row and (key not in report.best or row[key] > report.best[key][0]):
                report.best[key] = (row[key], row["step"])
        for key in COUNTERS:
            if key in row:
                report.counters[key] = report.counters.get(key, 0.0) + row[key]
    if saved is not None and status != "finished":
        report.resume_command = f"reinforge train {run_dir / 'config.toml'} --resume {run_dir}"
    report.plot = plot_curves(run_dir)
    return report


def _saved_step(run_dir: Path) -> int | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    state = run_dir / "checkpoints" / pointer.read_text().strip() / "trainer_state.json"
    if not state.exists():
        return None
    data = json.loads(state.read_text())
    return data["step"] if data.get("phase") == "rl" else 0


def print_run_report(report: RunReport) -> None:
    from rich.table import Table

    from reinforge.metrics import console

    table = Table(title=f"run report: {report.run_dir.name}", show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    table.add_row("status", report.status)
    table.add_row(
        "RL steps logged",
        f"{report.steps_done}" + (f" of {report.max_steps}" if report.max_steps else ""),
    )
    for key, (value, step) in sorted(report.best.items()):
        table.add_row(f"best {key}", f"{value:.4f} (step {step})")
    for key in ("reward_mean", "accuracy", "response_len", "entropy", "kl_sampler"):
        if key in report.final:
            table.add_row(f"final {key}", f"{report.final[key]:.4g}")
    for key, value in sorted(report.counters.items()):
        table.add_row(f"total {key}", f"{value:g}")
    if report.last_error:
        table.add_row("last error", report.last_error)
    if report.plot:
        table.add_row("plot", str(report.plot))
    console.print(table)
    if report.resume_command:
        print(f"resume with: {report.resume_command}")
