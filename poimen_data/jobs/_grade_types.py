"""The types of grading (docs/DESIGN.md, "Grading"): what a verifier gets and returns, and the
reports ``grade`` returns. Kept apart from the planner and the executors so both import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from poimen_data.errors import ValidationError
from poimen_data.log._blobs import BlobStore

if TYPE_CHECKING:
    from poimen_data.fold._query import EpisodeView

Verifier = Callable[["VerifierCtx"], "Verdict"]
DEFAULT_DEADLINE_S = 60.0
DEFAULT_BATCH = 1_000
DEFAULT_CHUNK = 5_000


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a verifier returns; ``detail`` is free text for people reading verdicts."""

    passed: bool
    score: float | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class VerifierCtx:
    """Everything a verifier may look at. ``episode`` is frozen at ``snapshot_lsn`` and
    holds refs only; ``blobs.get`` fetches a body on demand (None once reduced).
    ``deadline`` is a ``time.monotonic()`` value: past it, the verdict is an error.
    ``step``/``attempt`` name the attempt under review when a verifier grades one; they
    are None when it grades the whole run (all ``grade`` does today)."""

    run: str
    step: str | None
    attempt: int | None
    episode: EpisodeView
    snapshot_lsn: int
    blobs: BlobStore
    deadline: float


@dataclass(frozen=True, slots=True)
class VerifierCounts:
    verifier: str
    graded: int
    skipped: int
    passed: int
    failed: int
    errored: int


@dataclass(frozen=True, slots=True)
class GradeFailure:
    run_id: str
    verifier: str
    snapshot_lsn: int
    errored: bool
    detail: str | None


@dataclass(frozen=True, slots=True)
class GradeReport:
    """What one ``grade`` call did. Run counts: a run is *graded* when at least one
    verdict was recorded for it, *skipped* otherwise (all verdicts already there, or it
    never entered verifying); a graded run is *errored* if any of its new verdicts is an
    error, else *failed* if any failed, else *passed*."""

    head_lsn: int
    runs_graded: int
    runs_skipped: int
    runs_passed: int
    runs_failed: int
    runs_errored: int
    verdicts_recorded: int
    commits: int
    per_verifier: tuple[VerifierCounts, ...]
    failures: tuple[GradeFailure, ...]
    wall_s: float
    runs_per_s: float  # runs graded / wall_s
    snapshot_s: float  # building snapshots (summed over Dask workers)
    executor: Literal["threads", "dask"]


def identity(v: Verifier) -> str:
    """``name@version`` of a verifier: what ``verdicts.verifier`` records."""
    name = getattr(v, "name", None) or getattr(v, "__name__", None)
    if name is None:
        raise ValidationError(f"verifier {v!r} has neither a name nor a __name__")
    return f"{name}@{getattr(v, 'version', '0')}"


@dataclass(frozen=True, slots=True)
class GradeTask:
    """One run to grade: its snapshot LSN and the indices of the verifiers still owed."""

    run_id: str
    tenant: str
    snapshot_lsn: int
    todo: tuple[int, ...]


# A graded pair: (run_id, verifier index, branch_id, passed, score, detail, errored).
GradeResult = tuple[str, int, int, bool, float | None, str | None, bool]
