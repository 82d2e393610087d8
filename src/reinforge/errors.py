"""Errors a user can act on, and the process exit codes every command uses.

A `ConfigError` is a user mistake: its message names the setting, the bad value and a value
that would work. Internal invariants are plain asserts, never these classes.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Distinct exit codes, so scripts and schedulers can tell outcomes apart."""

    OK = 0
    RUNTIME_FAILURE = 1
    CONFIG_ERROR = 2
    STOPPED_AFTER_SAVE = 3
    HANG = 4
    NOTHING_TRAINED = 5


class ConfigError(ValueError):
    """A configuration or input the user must change; the message says to what."""


class RunFailure(RuntimeError):
    """A run that cannot go on; the message is the summary the user sees."""
