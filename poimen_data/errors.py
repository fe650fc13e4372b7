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


#: the last line DuckDB quotes of a Python exception raised inside a scan it read
_QUOTED = re.compile(r"^poimen_data\.errors\.([A-Za-z]+): (.*)$")


def raised_in_scan(exc: BaseException) -> PoimenError | None:
    """The error of this package that a scan DuckDB was reading raised (a damaged segment's
    ``CorruptionError``, a ``StorageError``), which DuckDB hands on as its own
    ``InvalidInputException`` quoting the Python traceback; None for any other error. The
    jobs that fold through DuckDB (``materialize``, ``export_live``, ``grade``,
    ``check``) raise it as itself, and the CLI prints its first line."""
    for line in reversed(str(exc).splitlines()):
        found = _QUOTED.match(line.strip())
        if found is None:
            continue
        cls = globals().get(found.group(1))
        if isinstance(cls, type) and issubclass(cls, PoimenError) \
                and cls is not CommitUnknown:  # (needs its txn: never raised by a scan)
            return cls(found.group(2))
        return None
    return None


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
