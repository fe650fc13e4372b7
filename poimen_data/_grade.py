"""Batch grading (DESIGN section 6): verifiers over frozen snapshots, verdicts back to the log.

A run is graded at its latest ``verifying_entered`` LSN. The snapshot is an owned
``EpisodeView`` of every branch at that LSN, so a rewind, a cancel or a recovery that
commits while a verifier runs cannot reach it. Snapshots are built in bulk (one fold for
a whole batch of runs, see ``_snapshot``), because one fold per run is what would make
grading slow. Verifiers run on a thread pool, or on Dask workers that open the log
themselves; only the driver writes, committing verdicts in batches.
"""

from __future__ import annotations

import heapq
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import events as ev
from ._blobs import BlobStore
from .errors import NotFound, ValidationError

if TYPE_CHECKING:
    from ._log import EventLog
    from ._query import EpisodeView

Verifier = Callable[["VerifierCtx"], "Verdict"]
DEFAULT_DEADLINE_S = 60.0
DEFAULT_BATCH = 1_000


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
    ``deadline`` is a ``time.monotonic()`` value: past it, the verdict is an error."""

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
    executor: str  # "threads" | "dask"


def identity(v: Verifier) -> str:
    """``name@version`` of a verifier: what ``verdicts.verifier`` records."""
    name = getattr(v, "name", None) or getattr(v, "__name__", None)
    if name is None:
        raise ValidationError(f"verifier {v!r} has neither a name nor a __name__")
    return f"{name}@{getattr(v, 'version', '0')}"


@dataclass(frozen=True, slots=True)
class _Task:
    """One run to grade: its snapshot LSN and the indices of the verifiers still owed."""

    run_id: str
    tenant: str
    snapshot_lsn: int
    todo: tuple[int, ...]


# A graded pair: (run_id, verifier index, branch_id, passed, score, detail, errored).
_Result = tuple[str, int, int, bool, float | None, str | None, bool]


# --- planning: which runs, which verifiers -----------------------------------------


def _plan(log: EventLog, head: int, ids: Sequence[str], runs: Iterable[str] | None,
          force: bool) -> tuple[list[_Task], int]:
    """Runs to grade with their verifiers still owed, and how many runs were considered.

    One query over the ``runs`` view finds them all (never one per run); one more over
    ``verdicts`` finds what is already graded at the same snapshot LSN.
    """
    import pyarrow as pa

    from ._fold import connect

    con = connect(log, at_lsn=head)
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
        if rows and not force:
            con.register("_grade_runs", pa.table({
                "run_id": pa.array([r[0] for r in rows], pa.string()),
                "snapshot_lsn": pa.array([r[2] for r in rows], pa.int64())}))
            con.register("_grade_ids", pa.table({"verifier": pa.array(ids, pa.string())}))
            done = set(con.execute(
                "select v.run_id, v.verifier, v.snapshot_lsn from verdicts v "
                "join _grade_runs r on v.run_id = r.run_id and v.snapshot_lsn = r.snapshot_lsn "
                "join _grade_ids i on v.verifier = i.verifier"
            ).fetchall())
    finally:
        con.close()
    tasks = []
    for run_id, tenant, lsn in rows:
        todo = tuple(i for i, name in enumerate(ids) if (run_id, name, lsn) not in done)
        if todo:
            tasks.append(_Task(run_id, tenant, int(lsn), todo))
    return tasks, (asked if runs is not None else len(rows))


# --- snapshots -------------------------------------------------------------------------


def _snapshots(log: EventLog, tasks: Sequence[_Task]) -> dict[str, EpisodeView]:
    """Every task's episode, all branches, each at its own snapshot LSN, from one fold.

    Every fold rule looks at one run's events only, so folding the events of all these
    runs, each cut at its own snapshot LSN, gives for each run exactly what a cold fold
    of the log at that LSN gives (the barrier tests compare the bytes). One fold for the
    batch instead of one per run is what makes grading fast.
    """
    if not tasks:
        return {}
    import pyarrow as pa
    import pyarrow.compute as pc

    from ._fold import fold_tables
    from ._query import EPISODE_TABLES, EpisodeView, episodes_from_tables

    cut = {t.run_id: t.snapshot_lsn for t in tasks}
    events = log.read_events(at_lsn=max(cut.values()))
    runs = pa.array(list(cut), pa.string())
    slot = pc.index_in(events.column("run_id"), value_set=runs)
    limit = pc.take(pa.array(list(cut.values()), pa.int64()), slot)
    keep = pc.fill_null(pc.less_equal(events.column("lsn"), limit), False)
    tables = fold_tables(events.filter(keep), EPISODE_TABLES)
    out = {}
    for v in episodes_from_tables(tables, at_lsn=0, all_branches=True):
        out[v.run_id] = EpisodeView(v.run_id, v.tenant, v.workflow_version, v.state,
                                    v.live_branch, cut[v.run_id], v.branches)
    missing = set(cut) - set(out)
    if missing:
        raise NotFound(f"grade: no events for run {sorted(missing)[0]!r} at its snapshot")
    return out


# --- running verifiers under deadlines -------------------------------------------------


def _call(v: Verifier, ctx: VerifierCtx) -> tuple[bool, float | None, str | None, bool]:
    """Run one verifier; anything but a clean, in-time ``Verdict`` is an error verdict."""
    try:
        out = v(ctx)
    except Exception as exc:  # a verifier's bug is a verdict, not the batch's end
        return False, None, f"error: {type(exc).__name__}: {exc}", True
    late = time.monotonic() - ctx.deadline
    if late > 0:
        return False, None, f"error: deadline passed ({late:.3f}s late)", True
    if not isinstance(out, Verdict) or type(out.passed) is not bool:
        return False, None, f"error: returned {out!r}, not a Verdict(passed: bool)", True
    score = out.score
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, int | float):
            return False, None, f"error: score {score!r} is not a number", True
        score = float(score)
    detail = out.detail if out.detail is None else str(out.detail)
    return out.passed, score, detail, False


def _run_local(tasks: Sequence[_Task], snaps: dict[str, EpisodeView],
               verifiers: Sequence[Verifier], blobs: BlobStore, deadline_s: float,
               threads: int) -> Iterator[_Result]:
    """Yield a result per (run, verifier) as it completes, on a pool of daemon threads.

    A verifier past its deadline is answered with an error verdict at once and left
    behind (a thread cannot be killed); a fresh thread takes its place so the pool keeps
    its size. Daemon threads, so a verifier that never returns cannot block exit.
    """
    todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    items = [(t, i) for t in tasks for i in t.todo]

    def work() -> None:
        while True:
            got = todo.get()
            if got is None:
                return
            k, (t, i) = got
            snap = snaps[t.run_id]
            deadline = time.monotonic() + deadline_s
            out.put((0, k, deadline))
            ctx = VerifierCtx(t.run_id, None, None, snap, t.snapshot_lsn, blobs, deadline)
            out.put((1, k, _call(verifiers[i], ctx)))

    started = 0

    def spawn() -> None:
        nonlocal started
        started += 1
        threading.Thread(target=work, name="poimen-grade", daemon=True).start()

    for _ in range(max(1, min(threads, len(items)))):
        spawn()  # before the work is queued: a busy pool would slow each start
    for k, item in enumerate(items):
        todo.put((k, item))
    running: list[tuple[float, int]] = []
    resolved: set[int] = set()
    try:
        while len(resolved) < len(items):
            timeout = max(0.0, running[0][0] - time.monotonic()) if running else None
            try:
                what, k, payload = out.get(timeout=timeout)
            except queue.Empty:
                now = time.monotonic()
                while running and running[0][0] <= now:
                    _dl, k = heapq.heappop(running)
                    if k not in resolved:
                        resolved.add(k)
                        spawn()
                        t, i = items[k]
                        yield _result(t, i, snaps, (False, None, "error: deadline of "
                                                    f"{deadline_s}s passed; abandoned", True))
                continue
            if what == 0:
                heapq.heappush(running, (payload, k))
            elif k not in resolved:
                resolved.add(k)
                t, i = items[k]
                yield _result(t, i, snaps, payload)
    finally:
        while True:  # closed early: drop what no thread has taken yet
            try:
                todo.get_nowait()
            except queue.Empty:
                break
        for _ in range(started):
            todo.put(None)


def _result(t: _Task, i: int, snaps: dict[str, EpisodeView],
            r: tuple[bool, float | None, str | None, bool]) -> _Result:
    return (t.run_id, i, int(snaps[t.run_id].live_branch), *r)


# --- Dask ------------------------------------------------------------------------------


def _is_dask_client(executor: Any) -> bool:
    return any(c.__module__.startswith("distributed") and c.__name__ == "Client"
               for c in type(executor).__mro__)


def _grade_chunk(root: str, storage_options: dict[str, Any], tasks: Sequence[_Task],
                 verifiers: Sequence[Verifier], deadline_s: float,
                 threads: int) -> tuple[list[_Result], float]:
    """Dask task: open the log read-only, build the chunk's snapshots here at their
    snapshot LSNs (so no episode crosses the network), grade, return the results."""
    from ._log import open_log

    log = open_log(root, storage_options or None, create=False)
    t0 = time.perf_counter()
    snaps = _snapshots(log, tasks)
    snap_s = time.perf_counter() - t0
    return list(_run_local(tasks, snaps, verifiers, log.blobs, deadline_s, threads)), snap_s


def _run_dask(client: Any, log: EventLog, tasks: Sequence[_Task],
              verifiers: Sequence[Verifier], deadline_s: float, threads: int,
              snap_s: list[float]) -> Iterator[_Result]:
    """Yield results chunk by chunk as workers finish; the driver alone commits."""
    from distributed import as_completed

    n_workers = max(1, len(client.scheduler_info().get("workers", {})))
    size = max(1, min(5_000, -(-len(tasks) // (2 * n_workers))))
    futures = [client.submit(_grade_chunk, log.root, log.storage.storage_options,
                             list(tasks[i:i + size]), list(verifiers), deadline_s, threads,
                             pure=False)
               for i in range(0, len(tasks), size)]
    try:
        for fut in as_completed(futures):
            results, s = fut.result()
            snap_s.append(s)
            yield from results
    finally:
        client.cancel(futures)


# --- recording verdicts ----------------------------------------------------------------


class _Recorder:
    """Commits verdicts ``batch`` at a time (one transaction per batch) and keeps the
    counts for the report."""

    def __init__(self, log: EventLog, ids: Sequence[str], tasks: Sequence[_Task],
                 batch: int) -> None:
        self.log, self.ids, self.batch = log, ids, batch
        self.tasks = {t.run_id: t for t in tasks}
        self.rows: list[_Result] = []
        self.commits = 0
        self.recorded = 0
        self.counts = {i: [0, 0, 0, 0] for i in range(len(ids))}  # graded/pass/fail/error
        self.run_status: dict[str, int] = {}  # 0 passed, 1 failed, 2 errored
        self.failures: list[GradeFailure] = []

    def add(self, r: _Result) -> None:
        run_id, i, _branch, passed, _score, detail, errored = r
        c = self.counts[i]
        c[0] += 1
        status = 2 if errored else 0 if passed else 1
        c[1 + status] += 1
        self.run_status[run_id] = max(self.run_status.get(run_id, 0), status)
        if status:
            self.failures.append(GradeFailure(run_id, self.ids[i],
                                              self.tasks[run_id].snapshot_lsn, errored,
                                              detail))
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
        })
        with self.log.transaction() as tx:
            tx.extend(table)
        self.commits += 1
        self.recorded += n


# --- the front door --------------------------------------------------------------------


def grade(
    log: EventLog,
    verifiers: Verifier | Sequence[Verifier],
    runs: Iterable[str] | None = None,
    executor: Any = None,
    blobs: BlobStore | None = None,
    force: bool = False,
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    progress: Callable[[int, int], None] | None = None,
    batch_size: int = DEFAULT_BATCH,
    threads: int | None = None,
) -> GradeReport:
    """Grade the runs in ``verifying`` at the head (or ``runs``) and record one verdict
    per (run, verifier) not yet graded at that snapshot LSN (all of them with ``force``).

    ``executor``: None for a thread pool in this process (``threads`` wide), or a
    ``distributed.Client``; Dask workers read bodies through their own read-only log, so
    ``blobs`` (default ``log.blobs``) is for the in-process executor only. ``deadline_s``
    bounds each verifier call; a verifier may set its own ``deadline_s`` attribute.
    ``progress(done, total)`` counts (run, verifier) pairs. Verdicts are committed
    ``batch_size`` per transaction as they arrive, so an interrupted job keeps its work.
    """
    t0 = time.perf_counter()
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
    limits = {getattr(v, "deadline_s", deadline_s) for v in vs}
    if len(limits) > 1:
        raise ValidationError("grade: verifiers with different deadline_s need separate calls")
    limit = float(limits.pop())
    if batch_size < 1:
        raise ValidationError("grade: batch_size must be >= 1")
    n_threads = threads or min(8, (os.cpu_count() or 1) + 4)
    dask = executor is not None and _is_dask_client(executor)
    if executor is not None and not dask:
        raise ValidationError(f"grade: executor must be None or a distributed.Client, got "
                              f"{type(executor).__name__}")
    if dask and blobs is not None:
        raise ValidationError("grade: blobs= is not available on Dask (workers read bodies "
                              "through their own log)")

    head = log.head
    tasks, considered = _plan(log, head, ids, runs, force)
    rec = _Recorder(log, ids, tasks, batch_size)
    snap_s: list[float] = []
    if dask:
        results = _run_dask(executor, log, tasks, vs, limit, n_threads, snap_s)
    else:
        t1 = time.perf_counter()
        snaps = _snapshots(log, tasks)
        snap_s.append(time.perf_counter() - t1)
        results = _run_local(tasks, snaps, vs, blobs if blobs is not None else log.blobs,
                             limit, n_threads)
    total = sum(len(t.todo) for t in tasks)
    done = 0
    try:
        for r in results:
            rec.add(r)
            done += 1
            if progress is not None:
                progress(done, total)
    finally:
        rec.flush()
    wall = time.perf_counter() - t0
    status = list(rec.run_status.values())
    per = tuple(VerifierCounts(ids[i], c[0], considered - c[0], c[1], c[2], c[3])
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
