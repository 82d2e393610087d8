"""Errors a user can act on, and the process exit codes every command uses.

A `ConfigError` is a user mistake: its message names the setting, the bad value and a value
that would work. Internal invariants are plain asserts, never these classes.
"""

from __future__ import annotations

import os
from enum import IntEnum
from pathlib import Path

# Set by `reinforge launch` for its workers: the folder where each writes the code it exits with,
# so the launcher can return it (torchrun itself turns every failure into 1).
EXIT_DIR_ENV = "REINFORGE_EXIT_DIR"


class ExitCode(IntEnum):
    """Distinct exit codes, so scripts and schedulers can tell outcomes apart."""

    OK = 0
    RUNTIME_FAILURE = 1
    CONFIG_ERROR = 2
    STOPPED_AFTER_SAVE = 3
    HANG = 4
    NOTHING_TRAINED = 5
    PEER_LOST = 6  # another process of a torchrun job died or froze; checkpoints are intact


def record_exit(code: int) -> None:
    """Tell `reinforge launch` (when it started this process) the code this process exits
    with: the file `rank{RANK}` in $REINFORGE_EXIT_DIR. A no-op otherwise."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if folder:
        path = Path(folder) / f"rank{os.environ.get('RANK', '0')}"
        path.write_text(f"{int(code)}\n")


class ConfigError(ValueError):
    """A configuration or input the user must change; the message says to what."""


class RunFailure(RuntimeError):
    """A run that cannot go on; the message is the summary the user sees."""
