"""The one error root of poimen_data and its few leaves (DESIGN section 4)."""

from __future__ import annotations


class PoimenError(Exception):
    """Root of every error this package raises on purpose."""


class ValidationError(PoimenError, ValueError):
    """A bad event, id or argument; nothing was written."""


class CorruptionError(PoimenError):
    """A file the log trusts does not match what its manifest says."""


class CommitConflict(PoimenError):
    """A commit could not be published after its retries were exhausted."""


class TenantMismatch(PoimenError, PermissionError):
    """A ref was used under a tenant that does not own it."""


class NotFound(PoimenError, FileNotFoundError):
    """No committed object exists under that name (run, body, state, log)."""


class StateChanged(PoimenError):
    """A materialized-state file named by the pointer a reader holds is gone because newer
    generations replaced it meanwhile: read the pointer again and retry (never damage)."""


class LeaseHeld(PoimenError):
    """Another process holds the maintenance lease (vacuum, reduce, compact)."""


__all__ = [
    "CommitConflict",
    "CorruptionError",
    "LeaseHeld",
    "NotFound",
    "PoimenError",
    "StateChanged",
    "TenantMismatch",
    "ValidationError",
]
