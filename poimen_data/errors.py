"""The one error root of poimen_data and its few leaves (docs/DESIGN.md, "Python API")."""

from __future__ import annotations

import re


class PoimenError(Exception):
    """Root of every error this package raises on purpose."""


class ValidationError(PoimenError, ValueError):
    """A bad event, id or argument; nothing was written."""


class CorruptionError(PoimenError):
    """A file the log trusts does not match what its manifest says."""


class CommitConflict(PoimenError):
    """A commit could not be published after its retries were exhausted."""


class CommitUnknown(CommitConflict):
    """A commit's publish failed without telling whether it landed (the object store
    kept failing past its retry deadline after a write it may have stored). ``txn`` names
    the transaction: ``log.settle(txn)`` decides it once storage answers again (a
    recorder settles its windows itself). Nothing is lost either way, and it is never
    published twice."""

    def __init__(self, message: str, txn: str) -> None:
        super().__init__(message)
        self.txn = txn

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # pickles with its txn
        return type(self), (str(self), self.txn)


class TenantMismatch(ValidationError, PermissionError):
    """A ref was used under a tenant that does not own it (a ``ValidationError``: the
    transaction is rejected whole, on the event path and the bulk path alike)."""


class NotFound(PoimenError, FileNotFoundError):
    """No committed object exists under that name (run, body, state, log)."""


class StateChanged(PoimenError):
    """A materialized-state file named by the pointer a reader holds is gone because newer
    generations replaced it meanwhile: read the pointer again and retry (never damage)."""


class LeaseHeld(PoimenError):
    """Another process holds the maintenance lease (vacuum, reduce, compact)."""


class StorageError(PoimenError, OSError):
    """Storage kept failing until the retry deadline passed (the operation may or may
    not have taken effect; the commit protocol resolves which)."""


class WritersActive(PoimenError):
    """``vacuum`` with a grace shorter than a live writer's pause was refused: other
    writers left files moments ago (pass ``force=True`` if they are known dead)."""


def one_line(exc: BaseException) -> str:
    """The first line of an error's message (its class name when it has none): what the
    CLI prints and the viewer's error page shows, never a traceback."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


#: how DuckDB quotes a Python exception raised inside a scan it read, and the traceback's
#: last line: the exception of this package it ends with
_QUOTING = "Python exception: Traceback (most recent call last):"
_QUOTED = re.compile(r"poimen_data\.errors\.([A-Za-z]+): (.+)")


def raised_in_scan(exc: BaseException) -> PoimenError | None:
    """The error of this package that a scan DuckDB was reading raised (a damaged segment's
    ``CorruptionError``, a ``StorageError``), which DuckDB hands on as its own
    ``InvalidInputException`` quoting the Python traceback; None for any other error: one
    that quotes no traceback, or whose traceback ends in another exception, or in one of
    ours whose message spans lines (left as DuckDB raised it rather than read wrong). The
    jobs that fold through DuckDB (``materialize``, ``export_live``, ``grade``, ``check``),
    the CLI and the viewer raise or show it as itself."""
    text = str(exc)
    if _QUOTING not in text or type(exc).__name__ != "InvalidInputException":
        return None
    last = text.rstrip().rsplit("\n", 1)[-1]
    found = _QUOTED.fullmatch(last)
    if found is None:
        return None
    cls = globals().get(found.group(1))
    if not (isinstance(cls, type) and issubclass(cls, PoimenError)) \
            or cls is CommitUnknown:  # (needs its txn: never raised by a scan)
        return None
    return cls(found.group(2))


__all__ = [
    "CommitConflict",
    "CommitUnknown",
    "CorruptionError",
    "LeaseHeld",
    "NotFound",
    "PoimenError",
    "StorageError",
    "StateChanged",
    "TenantMismatch",
    "ValidationError",
    "WritersActive",
]
