"""Errors that reach the user as one clear message (never a stack trace)."""
from __future__ import annotations


class UspError(Exception):
    """A problem the user can fix: says which key, which value, why, and how to fix it."""

    def __init__(self, message: str, *, key: str | None = None, value: object = None, fix: str | None = None):
        self.why, self.key, self.value, self.fix = message, key, value, fix
        parts = []
        if key is not None:
            parts.append(f"{key}={value!r}: " if value is not None else f"{key}: ")
        parts.append(message)
        if fix:
            parts.append(f"\n  fix: {fix}")
        super().__init__("".join(parts))


class ConfigError(UspError):
    """The config could not be composed (unknown key, wrong type, unknown option)."""


class PlanError(UspError):
    """The config composes but describes a run that cannot work."""


class LaunchError(UspError):
    """The run could not be started (run directory, launcher, missing tools)."""


def one_line(exc: Exception) -> str:
    """A UspError's message and fix on one line (for tables and sweep.json)."""
    text = str(exc).strip()
    head, _, fix = text.partition("\n  fix: ")
    head = " ".join(head.split())
    return f"{head} (fix: {' '.join(fix.split())})" if fix else head
