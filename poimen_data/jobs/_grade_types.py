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

    An attempt-scoped verifier (``scope = "attempt"``) is called once per attempt it
    grades: ``branch``/``step``/``attempt`` name that attempt (``branch`` is the branch
    that recorded it, which for an inherited attempt is an ancestor of the live one;
    ``verifiers.judged_attempt(ctx)`` finds its ``AttemptView``). All three are None when
    a verifier grades the whole run."""

    run: str
    step: str | None
    attempt: int | None
    episode: EpisodeView
    snapshot_lsn: int
    blobs: BlobStore
    deadline: float
    branch: int | None = None


Scope = Literal["run", "attempt"]
#: Which attempts an attempt-scoped verifier grades: every terminal attempt of the
#: snapshot, on every branch (the default: failed retries and abandoned branches are the
#: learning signal, and each needs its own label), or the last attempt of each step on
#: the live trajectory (what the run's outcome rests on).
Which = Literal["all", "last_per_step"]
SCOPES: tuple[Scope, ...] = ("run", "attempt")
WHICH: tuple[Which, ...] = ("all", "last_per_step")


@dataclass(frozen=True, slots=True)
class VerifierScope:
    """What one verifier grades, read from its attributes by ``scope_of``."""

    scope: Scope
    steps: frozenset[str] | None  # None: every step
    attempts: Which


def scope_of(v: Verifier) -> VerifierScope:
    """A verifier's scope from its attributes: ``scope`` ("run" by default, or
    "attempt"), ``steps`` (step ids; implies attempt scope) and ``attempts`` ("all" by
    default, or "last_per_step"). A bad value is a ``ValidationError`` naming it."""
    name = identity(v)
    steps = getattr(v, "steps", None)
    scope = getattr(v, "scope", "attempt" if steps is not None else "run")
    if scope not in SCOPES:
        raise ValidationError(f"verifier {name}: scope must be one of {SCOPES}, got {scope!r}")
    if steps is not None:
        if isinstance(steps, str) or not all(isinstance(s, str) for s in steps) or not steps:
            raise ValidationError(f"verifier {name}: steps must be a non-empty tuple of step "
                                  f"ids, got {steps!r}")
        if scope != "attempt":
            raise ValidationError(f"verifier {name}: steps= needs scope 'attempt'")
        steps = frozenset(steps)
    which = getattr(v, "attempts", "all")
    if which not in WHICH:
        raise ValidationError(f"verifier {name}: attempts must be one of {WHICH}, "
                              f"got {which!r}")
    return VerifierScope(scope, steps, which)


@dataclass(frozen=True, slots=True)
class VerifierCounts:
    """One verifier's share of a ``grade`` call. ``graded`` counts the verdicts it
    recorded (one per run, or one per attempt for an attempt-scoped verifier);
    ``skipped`` the runs considered that got none from it."""

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
    step: str | None = None  # the attempt judged, for an attempt-scoped verifier
    attempt: int | None = None
    branch: int | None = None


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
    """One run to grade: its snapshot LSN and the indices of the verifiers still owed.
    An attempt-scoped verifier is owed whatever ``done`` does not list: the
    (verifier index, branch, step, attempt) already graded at this snapshot (which
    attempts there are is known only once the snapshot is built)."""

    run_id: str
    tenant: str
    snapshot_lsn: int
    todo: tuple[int, ...]
    done: frozenset[tuple[int, int, str, int]] = frozenset()
    #: at or below the run's first event (the state's run index): its snapshot's fold
    #: need not scan the log below it
    first_lsn: int = 1


# A verdict made: (run_id, verifier index, branch_id, passed, score, detail, errored,
# step_id, attempt_no); the last two None for a run verdict.
GradeResult = tuple[str, int, int, bool, float | None, str | None, bool, str | None,
                    int | None]
