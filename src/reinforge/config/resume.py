"""Which settings a resumed run continues with.

`reinforge train --resume RUN_DIR` continues with the run's own settings, RUN_DIR/config.toml,
written when the run started. A config file or `section.key=value` overrides given with it are
compared with those settings: what differs is refused (a resumed run that silently trains with
other settings than it started with is not the run it says it is) unless `--allow-changes`,
which continues with the new settings and lists every change. Overrides alone apply on top of the
saved settings; a config file replaces them (its overrides on top of it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.config.load import load_config, read_saved_config
from reinforge.errors import ConfigError

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass

# Where the run lives, not how it trains: --resume RUN_DIR sets these.
# Where the run lives, and how to treat a damaged checkpoint when resuming: settings of this
# resume, not of the training (they change nothing the run computes).
IGNORED = {"run.output_dir", "run.name", "run.overwrite", "checkpoint.on_damaged"}


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    given: Any

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.saved)} -> {_show(self.given)}"


def resume_config(
    command: str,
    root,
    run_dir: Path,
    path: str | None,
    overrides: list[str],
    allow_changes: bool,
) -> tuple[Any, list[Change]]:
    """(the config the resumed run trains with, the changes from its saved one)."""
    saved_file = run_dir / "config.toml"
    if not saved_file.is_file():
        raise ConfigError(
            f"--resume {run_dir}: {saved_file} does not exist, so this is not a run directory; "
            "give the folder run.output_dir/run.name of an earlier run (e.g. runs/quickstart)"
        )
    saved_table = read_saved_config(saved_file)
    saved = load_config(root, None, base=saved_table)
    if path is None and not overrides:
        return _placed(saved, run_dir), []
    base = None if path is not None else saved_table
    given = load_config(root, path, overrides, base=base)
    changes = config_changes(saved.model_dump(mode="json"), given.model_dump(mode="json"))
    if changes and not allow_changes:
        listed = "\n  ".join(str(c) for c in changes)
        given_what = " ".join([*([path] if path else []), *overrides])
        raise ConfigError(
            f"--resume {run_dir} continues the run with its saved settings ({saved_file}), but "
            f"{given_what!r} changes {len(changes)} of them (saved -> given):\n  {listed}\n"
            f"resume with the saved settings: reinforge {command} --resume {run_dir}\n"
            "or continue with the changed ones, each listed in the log and the summary: add "
            "--allow-changes"
        )
    return _placed(given, run_dir), changes


def config_changes(saved: dict, given: dict, prefix: str = "") -> list[Change]:
    """The dotted keys whose values differ between two config dumps, in config order."""
    changes = []
    for key in dict.fromkeys([*saved, *given]):
        dotted = f"{prefix}{key}"
        a, b = saved.get(key), given.get(key)
        if dotted in IGNORED:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            changes.extend(config_changes(a, b, f"{dotted}."))
        elif a != b:
            changes.append(Change(dotted, a, b))
    return changes


def _placed(cfg, run_dir: Path):
    cfg.run.output_dir, cfg.run.name = str(run_dir.parent), run_dir.name
    return cfg


def _show(value: Any) -> str:
    return "(unset)" if value is None else repr(value)


def record_changes(run_dir: Path, changes) -> None:
    """A resume with --allow-changes: the changes on the console and, for the report, appended
    to RUN_DIR/config_changes.txt."""
    import time

    lines = [str(c) for c in changes]
    print("resume with changed settings (--allow-changes; saved -> now):")
    for line in lines:
        print(f"  {line}")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with (run_dir / "config_changes.txt").open("a") as f:
        f.write("".join(f"{stamp} {line}\n" for line in lines))


def change_notes(summary, changes) -> list[str]:
    """The summary's lines for settings changed on resume. An evaluation before the change may
    have scored other tasks (another eval.num_tasks, task.num_eval, ...): its figure is then not
    compared with the one after."""
    if not changes:
        return []
    notes = [f"settings changed on resume: {'; '.join(str(c) for c in changes)}"]
    scored = [c.key for c in changes if c.key.split(".")[0] in ("eval", "task", "model")]
    if scored and (summary.eval_before is not None or summary.sft_eval_before is not None):
        summary.eval_before = summary.sft_eval_before = None
        notes.append(
            f"held-out accuracy before not shown: {', '.join(scored)} changed since it was "
            "measured, so it scored other tasks or another model than the figure after"
        )
    return notes
