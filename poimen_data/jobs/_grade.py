"""Batch grading (docs/DESIGN.md, "Grading"): verifiers over frozen snapshots, verdicts back
to the log.

A run is graded at its latest ``verifying_entered`` LSN. The snapshot is an owned
``EpisodeView`` of every branch at that LSN, so a rewind, a cancel or a recovery that
commits while a verifier runs cannot reach it. Snapshots are built in bulk (one fold for
a whole chunk of runs, see ``_grade_exec``), because one fold per run is what would make
grading slow. Verifiers run on a thread pool, or on Dask workers that open the log
themselves; only the driver writes, committing verdicts in batches.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from poimen_data.errors import NotFound, ValidationError
from poimen_data.fold._build import budget_of, scan_errors
from poimen_data.jobs._grade_exec import is_dask_client, run_dask, run_here
from poimen_data.jobs._grade_types import (
    DEFAULT_BATCH,
    DEFAULT_CHUNK,
    DEFAULT_DEADLINE_S,
    GradeFailure,
    GradeReport,
    GradeResult,
    GradeTask,
    Verdict,
    Verifier,
    VerifierCounts,
    VerifierCtx,
    VerifierScope,
    identity,
    scope_of,
)
from poimen_data.log._blobs import BlobStore
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.model import _events as ev
from poimen_data.model._limits import is_count, short_repr

# --- planning: which runs, which verifiers -----------------------------------------


def _plan(log: EventLog, head: int, ids: Sequence[str], scopes: Sequence[VerifierScope],
          runs: Iterable[str] | None, force: bool,
          memory_limit: int) -> tuple[list[GradeTask], int]:
    """Runs to grade with their verifiers still owed, and how many runs were considered.

    One query over the ``runs`` view finds them all (never one per run); one more over
    ``verdicts`` finds what is already graded at the same snapshot LSN: a run verdict
    per (run, verifier, snapshot), an attempt verdict per (run, verifier, snapshot,
    branch, step, attempt). An attempt-scoped verifier is owed by a run until every
    attempt that was terminal at the snapshot (of its steps) has its verdict; the
    executor skips the attempts already graded once the snapshot shows them.
    """
    import pyarrow as pa

    from poimen_data.fold._connect import connect
    from poimen_data.fold._query import first_lsns

    con = connect(log, at_lsn=head, memory_limit=memory_limit)
    try:
        if runs is None:
            rows = con.execute(
                "select run_id, tenant, verifying_lsn from runs "
                "where state = 'verifying' and verifying_lsn is not null order by run_id"
            ).fetchall()
            asked = 0
        else:
            wanted = sorted({ev.check_run_id(r, "grade") for r in runs})
            asked = len(wanted)
            con.register("_grade_wanted", pa.table({"run_id": pa.array(wanted, pa.string())}))
            found = con.execute(
                "select r.run_id, r.tenant, r.verifying_lsn from runs r "
                "join _grade_wanted w using (run_id) order by r.run_id"
            ).fetchall()
            missing = set(wanted) - {r[0] for r in found}
            if missing:
                raise NotFound(f"grade: no run {sorted(missing)[0]!r} in {log.root} "
                               f"({len(missing)} unknown)")
            rows = [r for r in found if r[2] is not None]
        done: set[tuple[str, str, int]] = set()
        done_attempts: dict[str, set[tuple[int, int, str, int]]] = {}
        if rows and not force:
            con.register("_grade_runs", pa.table({
                "run_id": pa.array([r[0] for r in rows], pa.string()),
                "snapshot_lsn": pa.array([r[2] for r in rows], pa.int64())}))
            con.register("_grade_ids", pa.table({"verifier": pa.array(ids, pa.string())}))
            index = {name: i for i, name in enumerate(ids)}
            for run_id, name, lsn, branch, step, attempt in con.execute(
                "select v.run_id, v.verifier, v.snapshot_lsn, v.branch_id, v.step_id, "
                "v.attempt_no from verdicts v "
                "join _grade_runs r on v.run_id = r.run_id and v.snapshot_lsn = r.snapshot_lsn "
                "join _grade_ids i on v.verifier = i.verifier"
            ).fetchall():
                if step is None:
                    done.add((run_id, name, lsn))
                else:
                    done_attempts.setdefault(run_id, set()).add(
                        (index[name], branch, step, attempt))
        # where each run starts (the state's run index, read once): the snapshots' folds
        # and the look at graded attempts scan from there
        first = first_lsns(log, [r[0] for r in rows])
        terminal = _terminal_attempts(log, con, done_attempts, rows, first) \
            if done_attempts else {}
    finally:
        con.close()

    def owed(i: int, run_id: str, name: str, lsn: int) -> bool:
        if scopes[i].scope == "run":
            return (run_id, name, lsn) not in done
        if run_id not in done_attempts:
            return True
        got, steps = done_attempts[run_id], scopes[i].steps
        return any((i, *key) not in got for key in terminal[run_id]
                   if steps is None or key[1] in steps)

    tasks = []
    for run_id, tenant, lsn in rows:
        todo = tuple(i for i, name in enumerate(ids) if owed(i, run_id, name, lsn))
        if todo:
            tasks.append(GradeTask(run_id, tenant, int(lsn), todo,
                                   frozenset(done_attempts.get(run_id, ())), first[run_id]))
    return tasks, (asked if runs is not None else len(rows))


def _terminal_attempts(log: EventLog, con: Any, runs: dict[str, Any],
                       rows: Sequence[tuple[Any, ...]], first: dict[str, int]
                       ) -> dict[str, list[tuple[int, str, int]]]:
    """(branch, step, attempt) of every attempt terminal at its run's snapshot LSN, for
    the runs in ``runs``: what an attempt-scoped verifier may grade there at most (its
    selection is a subset), so a run whose every such attempt is graded is not owed.
    Those runs' events are scanned from the first of them (``first``: the state's run
    index), six columns kept: not the ``events`` view, a scan of the whole log."""
    import pyarrow as pa

    graded = [r for r in rows if r[0] in runs]
    con.register("_grade_graded", pa.table({
        "run_id": pa.array([r[0] for r in graded], pa.string()),
        "snapshot_lsn": pa.array([r[2] for r in graded], pa.int64())}))
    ids = [r[0] for r in graded]
    cols = ("run_id", "branch_id", "step_id", "attempt_no", "kind", "lsn")
    scanned = log.scan(max(int(r[2]) for r in graded), min(first[r] for r in ids),
                       columns=cols, run_ids=ids)
    # a reader: DuckDB streams it through its group-by (which may spill), read once
    con.register("_grade_events", pa.RecordBatchReader.from_batches(
        pa.schema([ev.LOG_SCHEMA.field(c) for c in cols]), scanned))
    out: dict[str, list[tuple[int, str, int]]] = {run: [] for run in runs}
    for run_id, branch, step, attempt in con.execute(
        "select e.run_id, e.branch_id, e.step_id, e.attempt_no from _grade_events e "
        "join _grade_graded g on e.run_id = g.run_id and e.lsn <= g.snapshot_lsn "
        "where e.kind in ('attempt_dispatched', 'attempt_finished', 'attempt_recovered') "
        "group by all having arg_max(e.kind, e.lsn) <> 'attempt_dispatched'"
    ).fetchall():
        out[run_id].append((branch, step, attempt))
    return out


# --- recording verdicts ----------------------------------------------------------------


class _Recorder:
    """Commits verdicts ``batch`` at a time (one transaction per batch) and keeps the
    counts for the report."""

    def __init__(self, log: EventLog, ids: Sequence[str], tasks: Sequence[GradeTask],
                 batch: int) -> None:
        self.log, self.ids, self.batch = log, ids, batch
        self.tasks = {t.run_id: t for t in tasks}
        self.rows: list[GradeResult] = []
        self.commits = 0
        self.recorded = 0
        self.counts = {i: [0, 0, 0, 0] for i in range(len(ids))}  # graded/pass/fail/error
        self.runs_of: dict[int, set[str]] = {i: set() for i in range(len(ids))}
        self.run_status: dict[str, int] = {}  # 0 passed, 1 failed, 2 errored
        self.failures: list[GradeFailure] = []

    def add(self, r: GradeResult) -> None:
        run_id, i, branch, passed, _score, detail, errored, step, attempt = r
        c = self.counts[i]
        c[0] += 1
        self.runs_of[i].add(run_id)
        status = 2 if errored else 0 if passed else 1
        c[1 + status] += 1
        self.run_status[run_id] = max(self.run_status.get(run_id, 0), status)
        if status:
            self.failures.append(GradeFailure(run_id, self.ids[i],
                                              self.tasks[run_id].snapshot_lsn, errored,
                                              detail, step, attempt,
                                              None if step is None else branch))
        self.rows.append(r)
        if len(self.rows) >= self.batch:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        import pyarrow as pa

        rows, self.rows = self.rows, []
        n = len(rows)
        table = pa.table({
            "kind": pa.array(["verdict_recorded"] * n, pa.string()),
            "tenant": pa.array([self.tasks[r[0]].tenant for r in rows], pa.string()),
            "run_id": pa.array([r[0] for r in rows], pa.string()),
            "branch_id": pa.array([r[2] for r in rows], pa.int64()),
            "verifier": pa.array([self.ids[r[1]] for r in rows], pa.string()),
            "snapshot_lsn": pa.array([self.tasks[r[0]].snapshot_lsn for r in rows],
                                     pa.int64()),
            "passed": pa.array([r[3] for r in rows], pa.bool_()),
            "score": pa.array([r[4] for r in rows], pa.float64()),
            "detail": pa.array([r[5] for r in rows], pa.string()),
            "step_id": pa.array([r[7] for r in rows], pa.string()),
            "attempt_no": pa.array([r[8] for r in rows], pa.int64()),
        })
        with self.log.transaction() as tx:
            tx.extend(table)
        self.commits += 1
        self.recorded += n


# --- the front door --------------------------------------------------------------------


def _deadline(v: Any, verifier: str) -> float:
    """A verifier call's deadline in seconds: a number > 0; infinity (or one past what a
    timer takes, about 31 years) means none, NaN is refused (no comparison with it holds,
    so it switched the deadline off)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not float(v) > 0:
        raise ValidationError(f"grade: deadline_s of {verifier} must be a number of seconds "
                              f"> 0, got {short_repr(v)}")
    return min(float(v), MAX_DEADLINE_S)


#: the longest deadline a verifier call gets (threading's timers overflow past about
#: 2**33 s): infinity is this
MAX_DEADLINE_S = 1e9


@scan_errors()
def grade(
    log: LogLike,
    verifiers: Verifier | Sequence[Verifier],
    *,
    storage_options: dict[str, Any] | None = None,
    runs: Iterable[str] | None = None,
    executor: Any = None,
    blobs: BlobStore | None = None,
    force: bool = False,
    deadline_s: float = DEFAULT_DEADLINE_S,
    progress: Callable[[int, int], None] | None = None,
    batch_size: int = DEFAULT_BATCH,
    threads: int | None = None,
    chunk_runs: int = DEFAULT_CHUNK,
    memory_limit: int | str | None = None,
) -> GradeReport:
    """Grade the runs in ``verifying`` at the head (or ``runs``) and record one verdict
    per (run, verifier) not yet graded at that snapshot LSN (all of them with ``force``).
    ``log`` is an ``EventLog`` or the root URL of an existing log (with
    ``storage_options``).

    A verifier with ``scope = "attempt"`` (or a ``steps`` tuple) is called once per
    terminal attempt of the snapshot instead (``attempts = "all"``, the default) or
    per last attempt of each step on the live trajectory (``"last_per_step"``), and
    records one verdict per (run, verifier, snapshot, attempt) not yet recorded.

    ``executor``: None for a thread pool in this process (``threads`` wide), or a
    ``distributed.Client``; Dask workers read bodies through their own read-only log, so
    ``blobs`` (default ``log.blobs``) is for the in-process executor only. ``deadline_s``
    bounds each verifier call (a verifier's own ``deadline_s`` attribute wins).
    ``progress(done, total)`` counts verdicts (``total`` grows as the snapshots show
    how many attempts the attempt-scoped verifiers grade). Snapshots are built
    ``chunk_runs`` runs per fold. Verdicts are committed ``batch_size`` per transaction
    as they arrive, so an interrupted job keeps the verdicts it made.

    Memory is bounded whatever the size of the log: the runs to grade are planned in
    DuckDB, and their snapshots are folded one group of run buckets at a time (one scan
    of the segments spills their events by bucket) under ``memory_limit`` (bytes or e.g.
    ``"2GB"``; default ``$POIMEN_MEMORY_LIMIT``, else a quarter of the machine, at most
    1.5 GiB), spilling past it to a temp directory.
    """

    t0 = time.perf_counter()
    log = as_log(log, storage_options=storage_options)
    vs = [verifiers] if callable(verifiers) else list(verifiers)
    if not vs:
        raise ValidationError("grade: no verifiers given")
    ids = [identity(v) for v in vs]
    for name in ids:
        if not ev.VERIFIER_RE.fullmatch(name):
            raise ValidationError(f"grade: verifier identity {name!r} is not 'name@version' "
                                  "(no spaces, exactly one @)")
    if len(set(ids)) != len(ids):
        raise ValidationError(f"grade: two verifiers share an identity in {ids}")
    scopes = [scope_of(v) for v in vs]
    limits = [_deadline(getattr(v, "deadline_s", deadline_s), name)
              for v, name in zip(vs, ids, strict=True)]
    for name, v in (("batch_size", batch_size), ("chunk_runs", chunk_runs),
                    ("threads", 1 if threads is None else threads)):
        if not is_count(v) or v < 1:
            raise ValidationError(f"grade: {name} must be an int >= 1, got {short_repr(v)}")
    if isinstance(runs, str):
        raise ValidationError(f"grade: runs must be a list of run ids, not one str "
                              f"({short_repr(runs)})")
    n_threads = threads or min(8, (os.cpu_count() or 1) + 4)
    dask = executor is not None and is_dask_client(executor)
    if executor is not None and not dask:
        raise ValidationError(f"grade: executor must be None or a distributed.Client, got "
                              f"{type(executor).__name__}")
    if dask and log.storage.kind == "memory":
        raise ValidationError("grade: a memory:// log lives in this process; Dask workers "
                              "cannot open it")
    if dask and blobs is not None:
        raise ValidationError("grade: blobs= is not available on Dask (workers read bodies "
                              "through their own log)")

    budget = budget_of(memory_limit)
    head = log.head
    tasks, considered = _plan(log, head, ids, scopes, runs, force, budget.memory_limit)
    rec = _Recorder(log, ids, tasks, batch_size)
    snap_s: list[float] = []
    planned: list[int] = []  # results per chunk, known once its snapshots are built
    if dask:
        results = run_dask(executor, log, tasks, vs, scopes, limits, n_threads, chunk_runs,
                           snap_s, planned)
    else:
        results = run_here(log, tasks, vs, scopes,
                           blobs if blobs is not None else log.blobs, limits, n_threads,
                           chunk_runs, snap_s, planned, budget)
    per_run = sum(1 for t in tasks for i in t.todo if scopes[i].scope == "run")
    done = 0
    try:
        for r in results:
            rec.add(r)
            done += 1
            if progress is not None:
                progress(done, max(done, per_run, sum(planned)))
    finally:
        rec.flush()
    wall = time.perf_counter() - t0
    status = list(rec.run_status.values())
    per = tuple(VerifierCounts(ids[i], c[0], considered - len(rec.runs_of[i]), c[1], c[2],
                               c[3])
                for i, c in rec.counts.items())
    return GradeReport(
        head_lsn=head, runs_graded=len(status), runs_skipped=considered - len(status),
        runs_passed=status.count(0), runs_failed=status.count(1),
        runs_errored=status.count(2), verdicts_recorded=rec.recorded, commits=rec.commits,
        per_verifier=per, failures=tuple(rec.failures),
        wall_s=wall, runs_per_s=len(status) / wall if wall > 0 else 0.0,
        snapshot_s=sum(snap_s),
        executor="dask" if dask else "threads")


__all__ = ["GradeFailure", "GradeReport", "Verdict", "VerifierCounts", "VerifierCtx", "grade",
           "identity"]
