"""The scaling part of `grpo_bench.py` (no torch here): which runs a `--nproc` list asks for, the
per-GPU figures of a run, and its scaling efficiency against the baseline.

A layout is one `reinforge train` run on N GPUs of the machine:

- strong: the workload's own global batch on N GPUs (colocated: each GPU generates and trains
  its share);
- weak: N / N0 times the prompts per step, the same batch per GPU as the baseline's N0 GPUs;
- disaggregated: G generators + N - G trainers (`distributed.generators`), G = 1 and G = N/2,
  at the workload's global batch (rounded up to a multiple of the trainers when it does not
  divide among them).

The baseline is the strong run on the workload's smallest GPU count that ran (N0: 1, or the
smallest N in the list at which the workload fits, `min_gpus`). Efficiency is per-GPU
throughput against the baseline's, generated tokens per second of the steady step:

    efficiency = (tokens_N / t_N / N) / (tokens_0 / t_0 / N0)

which is t_0 N0 / (N t_N) at the same batch (strong; t1 / (N tN) from one GPU) and t_0 / t_N at
N / N0 times the batch (weak). Train MFU is per training GPU: the step's model FLOPs over the
update's time and the trainers' peak (N colocated, N - G disaggregated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PEAK_FLOPS = 796e12  # measured bf16 matmul rate of one H200 (shared/BENCHMARKS.md)


@dataclass
class Layout:
    label: str
    nproc: int
    scaling: str  # "strong" or "weak" (disaggregated runs are strong)
    prompts: int
    generators: int = 0  # 0: colocated
    overrides: list[str] = field(default_factory=list)

    @property
    def trainers(self) -> int:
        return self.nproc - self.generators


def round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def plan_layouts(
    name: str,
    w: dict,
    nprocs: list[int],
    num_gpus: int,
    weak: bool = False,
    disagg: bool = False,
    skip_strong: bool = False,
    staleness: list[str] = (),
) -> tuple[list[Layout], list[str]]:
    """The runs, baseline first, and a line for each one skipped (and why)."""
    base_n = w.get("min_gpus", 1)
    layouts, skipped = [], []
    runnable = []
    for n in sorted(set(nprocs)):
        if n > num_gpus:
            skipped.append(f"{name} on {n} GPUs: skipped, the machine has {num_gpus}")
        elif n < base_n:
            skipped.append(f"{name} on {n} GPU(s): skipped, {w['why_min_gpus']}")
        else:
            runnable.append(n)
    if runnable and runnable[0] > 1:
        skipped.append(
            f"{name}: the efficiency baseline is {runnable[0]} GPUs (the smallest N that runs)"
        )
    for n in runnable:
        if n == runnable[0] or not skip_strong:
            layouts.append(colocated(n, w["prompts"], "strong"))
        if weak and n > runnable[0]:
            layouts.append(colocated(n, w["prompts"] * n // runnable[0], "weak"))
        for g in sorted({1, n // 2}) if disagg and n > 1 else []:
            if n - g < base_n:
                skipped.append(
                    f"{name} disaggregated {g}+{n - g} on {n} GPUs: skipped, {w['why_min_gpus']}"
                )
                continue
            for k in staleness or [""]:
                layouts.append(disaggregated(n, g, w["prompts"], k))
    return layouts, skipped


def colocated(n: int, prompts: int, scaling: str) -> Layout:
    label = f"{n} GPU" + ("s" if n > 1 else "")
    if scaling == "weak":
        label += f", weak ({prompts} prompts)"
    overrides = [] if scaling == "strong" else [f"rollout.prompts_per_step={prompts}"]
    return Layout(label, n, scaling, prompts, 0, overrides)


def disaggregated(n: int, generators: int, prompts: int, k: str = "") -> Layout:
    trainers = n - generators
    fitted = round_up(prompts, trainers)
    label = f"{n} GPUs, disaggregated {generators}+{trainers}"
    overrides = [
        "distributed.mode=disaggregated",
        "algorithm.tis_cap=2.0",
        f"distributed.generators={generators}",
    ]
    if k:
        label += f" k={k}"
        overrides.append(f"distributed.rollout_staleness={k}")
    if fitted != prompts:
        label += f" ({fitted} prompts)"
        overrides.append(f"rollout.prompts_per_step={fitted}")
    return Layout(label, n, "strong", fitted, generators, overrides)


def per_gpu(summary: dict, layout: Layout, flops_per_step: float) -> dict:
    """The run's totals split per GPU (every GPU of the run) and its train MFU per training
    GPU; `summary` holds the steady step's seconds and the step's token totals."""
    n, trainers = layout.nproc, layout.trainers
    tok_s = summary["generated_tok_per_s_total"]
    return {
        "nproc": n,
        "generators": layout.generators,
        "trainers": trainers,
        "prompts": layout.prompts,
        "scaling": layout.scaling,
        "generated_tok_per_s_per_gpu": round(tok_s / n),
        "train_tok_per_s_per_training_gpu": round(summary["train_tok_per_s_total"] / trainers),
        "train_mfu_per_training_gpu": round(
            flops_per_step / summary["train_s"] / (trainers * PEAK_FLOPS), 3
        ),
        # over every GPU of the run, the generators' too (the same as above when colocated)
        "train_mfu_per_gpu": round(flops_per_step / summary["train_s"] / (n * PEAK_FLOPS), 3),
    }


def efficiency(run: dict, base: dict) -> float:
    """Per-GPU generated tokens/s of `run` over the baseline's (see the module docstring)."""
    ours = run["generated_tok_per_s_total"] / run["nproc"]
    theirs = base["generated_tok_per_s_total"] / base["nproc"]
    return round(ours / theirs, 3)


HEADER = (
    "| workload | run | GPUs (gen+train) | prompts | steady step s | generate s | train s "
    "| gen tok/s total | gen tok/s per GPU | train tok/s per training GPU "
    "| train MFU per training GPU | peak GiB per GPU | scaling | efficiency |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(name: str, label: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | {label} | | | {r['error']} | | | | | | | | | |"
    split = f"{r['generators']}+{r['trainers']}" if r["generators"] else str(r["nproc"])
    eff = f"**{r['efficiency']:.2f}** vs {r['efficiency_vs']}" if "efficiency" in r else ""
    return (
        f"| {name} | {label} | {split} | {r['prompts']} | {r['steady_step_s']} | "
        f"{r['generate_s']} | {r['train_s']} | {r['generated_tok_per_s_total']:,} | "
        f"{r['generated_tok_per_s_per_gpu']:,} | {r['train_tok_per_s_per_training_gpu']:,} | "
        f"{r['train_mfu_per_training_gpu']:.1%} | {r['peak_gib']} | {r['scaling']} | {eff} |"
    )
