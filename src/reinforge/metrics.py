"""Metric sinks: console lines, metrics.jsonl, TensorBoard, Weights & Biases; and the curve plot.

Every step's metrics are one flat dict of floats; each sink writes it as it likes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console

from reinforge.faults import site

console = Console(highlight=False, soft_wrap=True)

# What the per-step console line shows, in order: (key, label, format).
CONSOLE_FIELDS = [
    ("reward_mean", "reward", "{:.3f}"),
    ("accuracy", "acc", "{:.3f}"),
    ("response_len", "len", "{:.1f}"),
    ("kl_ref", "kl_ref", "{:.4f}"),
    ("kl_sampler", "kl_smp", "{:.1e}"),
    ("policy_kl", "dKL", "{:.1e}"),  # how far the step's update moved the policy
    ("entropy", "ent", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("step_s", "step_s", "{:.2f}"),
]


def format_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step:>5}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        wandb: bool,
        wandb_project: str,
        config: dict[str, Any],
        resume_key: tuple[int, int] | None = None,
    ):
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        resume_step = None
        if resume_key is not None:
            for path in (self.path, self.samples_path):
                truncate_after(path, resume_key)
            resume_step = resume_key[1] if resume_key[0] == 1 else 0
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=(resume_step or 0) + 1
            )
        if wandb:
            self._wandb = _start_wandb(run_dir, wandb_project, config)

    def log(self, step: int, metrics: dict[str, float], phase: str = "rl") -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        with site("logging"):  # a watchdog phase (a stuck tracker hangs here) and a fault site
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, "phase": phase, **clean}) + "\n")
            if self._tb is not None:
                for k, v in clean.items():
                    if math.isfinite(v):
                        self._tb.add_scalar(f"{phase}/{k}", v, step)
            if self._wandb is not None:
                self._wandb.log({f"{phase}/{k}": v for k, v in clean.items()}, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, "phase": "rl", **row}) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class NullLogger:
    """The logger of ranks other than 0 in a distributed run: rank 0 writes the run's files."""

    def log(self, step: int, metrics: dict[str, float], phase: str = "rl") -> None:
        pass

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def truncate_after(path: Path, key: tuple[int, int]) -> None:
    """On resume, drop lines a stopped run wrote after its last checkpoint (`key` = (phase rank,
    step)): the resumed run writes those steps again, so the file reads as if it never stopped."""
    if not path.exists():
        return
    rank = {"sft": 0, "rl": 1}
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill; its step is written again
            continue
        if (rank.get(row.get("phase", "rl"), 1), row.get("step", 0)) <= key:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")  # replaced whole, so a kill here loses nothing
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)


def _start_wandb(run_dir: Path, project: str, config: dict[str, Any]):
    try:
        import wandb
    except ImportError:
        console.print(
            "[yellow]log.wandb = true but wandb is not installed (pip install 'reinforge[wandb]'); "
            "logging to metrics.jsonl and TensorBoard only[/]"
        )
        return None
    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(
        project=project, dir=str(run_dir), config=config, mode=mode, name=run_dir.name
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a kill -9, or blank
            continue
    return rows


def plot_curves(run_dir: Path) -> Path | None:
    """reward and accuracy against step, from metrics.jsonl, as curves.png."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl")]
    rl = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    ev = [r for r in rows if "eval_accuracy" in r]
    if not rl and not ev:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if rl:
        ax.plot(
            [r["step"] for r in rl],
            [r["reward_mean"] for r in rl],
            label="train reward (mean)",
            alpha=0.8,
        )
        if "accuracy" in rl[0]:
            ax.plot(
                [r["step"] for r in rl],
                [r["accuracy"] for r in rl],
                label="train accuracy",
                alpha=0.8,
            )
    if ev:
        ax.plot(
            [r["step"] for r in ev],
            [r["eval_accuracy"] for r in ev],
            "o-",
            label="held-out accuracy",
        )
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    out = run_dir / "curves.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
