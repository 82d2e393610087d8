"""Evaluation metrics over n samples per task: pass@k, mean@n, accuracy per data source,
response lengths and truncation.

- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
  Models Trained on Code"), 1 - C(n-c, k) / C(n, k): the chance that at least one of k samples
  drawn without replacement from the n is correct. Computed as a product of n-c+1..n terms, never
  as binomials, so it stays exact in floating point for any n.
- `mean@n`: the mean reward over all samples of a task, averaged over tasks (n is the fewest
  samples a task has, usually every task's).
- A sample is correct when its reward is at least `correct_threshold` (1.0: partial credit is
  not a pass).

`summarize_eval(groups)` takes one list of `Sample`s (or plain `(reward, length, finish_reason,
data_source)` tuples) per task and returns an `EvalSummary`: a flat dict of floats for the
metric sinks (`pass@1`, `mean@8`, `truncation_rate`, `response_len/p90`, `pass@1/<source>`, ...)
and the same numbers as a rich table.
"""

from __future__ import annotations

import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Sample(NamedTuple):
    reward: float
    length: int  # completion tokens
    finish_reason: str  # "stop" or "length" (truncated at max_new_tokens)
    data_source: str = "all"


@dataclass(frozen=True)
class EvalSummary:
    metrics: dict[str, float]
    table: str


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples, got n={n}; sample more or lower k")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def summarize_eval(
    groups: Sequence[Sequence[Sample | tuple]],
    ks: Sequence[int] | None = None,
    correct_threshold: float = 1.0,
) -> EvalSummary:
    """Metrics of per-task sample lists; pass@k for each k up to the fewest samples of a task
    (default: `default_ks`)."""
    tasks = [[Sample(*s) for s in group] for group in groups]
    if not tasks or any(not g for g in tasks):
        raise ValueError("summarize_eval needs at least one task, each with at least one sample")
    for group in tasks:
        sources = {s.data_source for s in group}
        assert len(sources) == 1, f"one task's samples carry several data sources {sources}"
    min_n = min(len(g) for g in tasks)
    ks = sorted(set(ks)) if ks is not None else default_ks(min_n)
    if not ks or ks[-1] > min_n or ks[0] < 1:
        raise ValueError(
            f"pass@k for k in {ks} needs 1 <= k <= {min_n}, the fewest samples of a task"
        )
    by_source: dict[str, list[list[Sample]]] = {}
    for group in tasks:
        by_source.setdefault(group[0].data_source, []).append(group)
    overall = _block(tasks, ks, min_n, correct_threshold)
    blocks = {
        source: _block(g, ks, min_n, correct_threshold) for source, g in sorted(by_source.items())
    }
    samples = [s for g in tasks for s in g]
    lengths = [s.length for s in samples]
    metrics = {**overall, **_length_stats(lengths)}
    if len(blocks) > 1:
        for source, block in blocks.items():
            metrics.update({f"{key}/{source}": value for key, value in block.items()})
    return EvalSummary(metrics, _table(overall, blocks, ks, min_n))


def _block(
    groups: list[list[Sample]], ks: Sequence[int], n: int, threshold: float
) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    metrics = {"num_tasks": float(len(groups)), "num_samples": float(len(samples))}
    for k in ks:
        per_task = [pass_at_k(len(g), sum(s.reward >= threshold for s in g), k) for g in groups]
        metrics[f"pass@{k}"] = statistics.fmean(per_task)
    metrics[f"mean@{n}"] = statistics.fmean(statistics.fmean(s.reward for s in g) for g in groups)
    metrics["truncation_rate"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
    metrics["response_len/mean"] = statistics.fmean(s.length for s in samples)
    return metrics


def _length_stats(lengths: list[int]) -> dict[str, float]:
    ordered = sorted(lengths)

    def quantile(q: float) -> float:  # nearest rank
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {
        "response_len/mean": statistics.fmean(ordered),
        "response_len/std": statistics.pstdev(ordered),
        "response_len/min": float(ordered[0]),
        "response_len/p50": quantile(0.5),
        "response_len/p90": quantile(0.9),
        "response_len/max": float(ordered[-1]),
    }


def _table(
    overall: dict[str, float], blocks: dict[str, dict[str, float]], ks: Sequence[int], n: int
) -> str:
    from rich.console import Console
    from rich.table import Table

    columns = [f"pass@{k}" for k in ks] + [f"mean@{n}", "truncation_rate"]
    table = Table(title="evaluation")
    table.add_column("data source")
    table.add_column("tasks", justify="right")
    for name in columns:
        table.add_column(name.replace("_rate", ""), justify="right")
    table.add_column("mean len", justify="right")

    def add(label: str, block: dict[str, float]) -> None:
        values = [f"{block[c]:.3f}" for c in columns]
        length = f"{block['response_len/mean']:.1f}"
        table.add_row(label, f"{block['num_tasks']:.0f}", *values, length)

    if len(blocks) > 1:
        for source, block in blocks.items():
            add(source, block)
        table.add_section()
    add("all", overall)
    out = io.StringIO()
    Console(file=out, width=120, color_system=None, highlight=False).print(table)
    return out.getvalue()
