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
    ("tool_call_rate", "tools", "{:.2f}"),
    ("win_rate", "win", "{:.2f}"),
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


def episode_fields(tokenizer, trajectory) -> dict[str, Any]:
    """What samples.jsonl keeps of an episode besides its prompt and completion (for the HTML
    report's sample browser): its data source, and for a multi-turn
    episode its turns in order, the model's (`assistant`, tool calls included as it wrote them)
    and the environment's (`env`: tool results, game boards), cut where the loss mask changes."""
    task, completion = trajectory.task, trajectory.completion
    out: dict[str, Any] = {}
    if "data_source" in task.info:  # datasets' rows name theirs; built-in tasks have one source
        out["data_source"] = str(task.info["data_source"])
    mask = completion.loss_mask
    if mask is not None and 0 in mask:
        turns, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                role = "assistant" if mask[start] else "env"
                turns.append(
                    {"role": role, "text": tokenizer.decode(completion.token_ids[start:i])}
                )
                start = i
        out["turns"] = turns
    return out


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
    """curves.png from metrics.jsonl: one panel each for the RL reward, the rates scored 0..1
    (train and held-out accuracy, tool-call and win rates) and the SFT loss, so no line hides
    another (a 0/1 reward's mean equals the accuracy)."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    rl = [r for r in rows if r.get("phase") == "rl" and "reward_mean" in r]
    sft = [r for r in rows if r.get("phase") == "sft" and ("loss" in r or "eval_loss" in r)]
    panels = [(draw, data) for draw, data in PANELS if data(rl, rows, sft)]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), dpi=100)
    for ax, (draw, data) in zip(list(getattr(axes, "flat", [axes])), panels):
        for label, steps, values, style in data(rl, rows, sft):
            ax.plot(steps, values, style, label=label, alpha=0.85, markersize=4)
        draw(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    out = run_dir / "curves.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _series(rows: list[dict], key: str, label: str, style: str = "-") -> list[tuple]:
    have = [r for r in rows if key in r]
    return [(label, [r["step"] for r in have], [r[key] for r in have], style)] if have else []


def _reward(rl, rows, sft) -> list[tuple]:
    return _series(rl, "reward_mean", "train reward (mean)")


def _rates(rl, rows, sft) -> list[tuple]:
    held_out = [r for r in rows if r.get("phase", "rl") == "rl"]
    return [
        *_series(rl, "accuracy", "train accuracy"),
        *_series(held_out, "eval_accuracy", "held-out accuracy", "o-"),
        *_series(rl, "tool_call_rate", "tool-call rate"),
        *_series(rl, "win_rate", "win rate"),
    ]


def _sft_loss(rl, rows, sft) -> list[tuple]:
    return [*_series(sft, "loss", "SFT loss"), *_series(sft, "eval_loss", "validation loss", "o-")]


def _axes(title: str, xlabel: str, unit_range: bool):
    def draw(ax) -> None:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        if unit_range:
            ax.set_ylim(-0.02, 1.02)

    return draw


PANELS = [
    (_axes("reward", "RL step", False), _reward),
    (_axes("rates", "RL step", True), _rates),
    (_axes("SFT loss", "SFT step", False), _sft_loss),
]
