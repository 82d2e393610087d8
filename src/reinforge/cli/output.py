"""What the train and sft commands print around a run: the dry run's annotated config and
preflight table, and the summary a run ends with."""

from __future__ import annotations


def annotated_toml(cfg) -> str:
    """The resolved config as TOML; each preset-backed `[algorithm]` value says where it came
    from (the preset, or a setting and the preset's value it replaced)."""
    from reinforge.config import to_toml

    text = to_toml(cfg)
    algorithm = getattr(cfg, "algorithm", None)
    if algorithm is None:
        return text
    origins = algorithm.origins()
    lines, section = [], None
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        key = line.split(" = ", 1)[0]
        if section == "algorithm" and key in origins:
            line = f"{line}  # {origins[key]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def print_preflight(pf, cfg) -> None:
    from rich.table import Table

    from reinforge.metrics import console

    table = Table(title="preflight", show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    for k, v in pf.rows:
        table.add_row(k, v)
    for w in pf.warnings:
        table.add_row("[yellow]warning[/]", w)
    for e in pf.errors:
        table.add_row("[red]error[/]", e)
    console.print(table)


def print_summary(s) -> None:
    from rich.table import Table

    from reinforge.metrics import console

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    table = Table(title=f"reinforge {s.command}: summary", show_header=False)
    table.add_column(overflow="fold")
    table.add_column(overflow="fold")
    table.add_row("steps trained", f"{s.steps_trained} (now at step {s.final_step})")
    if s.sft_eval_before is not None:
        table.add_row("held-out accuracy before SFT", pct(s.sft_eval_before))
    stage = "RL" if s.command == "train" else "SFT"
    table.add_row(f"held-out accuracy before {stage}", pct(s.eval_before))
    table.add_row(f"held-out accuracy after {stage}", pct(s.eval_after))
    for label, value in s.extra.get("headlines", []):
        table.add_row(label, value)
    table.add_row("wall time", f"{s.wall_s:.0f} s")
    failures = ", ".join(f"{k} {v:g}" for k, v in sorted(s.counters.items()) if v)
    table.add_row("failures counted", failures or "none")
    for note in s.notes:
        table.add_row("note", note)
    console.print(table)
    print(f"run directory: {s.run_dir}")
