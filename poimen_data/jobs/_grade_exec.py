"""How grading runs: snapshots built in bulk, verifiers under deadlines, Dask workers.

Split from ``_grade`` (which plans, records and reports) so each reads on its own. Both
executors share ``_snapshots`` and ``_run_local``: a Dask task is the in-process path run
on a worker against its own read-only handle on the log.
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from poimen_data.errors import NotFound
from poimen_data.jobs._grade_types import (
    GradeResult,
    GradeTask,
    Verdict,
    Verifier,
    VerifierCtx,
    VerifierScope,
)
from poimen_data.log._blobs import BlobStore
from poimen_data.model._limits import number_problem, stored_double, text_problem, utf8_ok

if TYPE_CHECKING:
    from poimen_data.fold._build import Budget
    from poimen_data.fold._query import EpisodeView
    from poimen_data.log._log import EventLog


# --- snapshots -------------------------------------------------------------------------


def _snapshots(log: EventLog, tasks: Sequence[GradeTask]) -> dict[str, EpisodeView]:
    """Every task's episode, all branches, each at its own snapshot LSN, from one fold
    (what a Dask worker builds for its chunk).

    Every fold rule looks at one run's events only, so folding the events of all these
    runs, each cut at its own snapshot LSN, gives for each run exactly what a cold fold
    of the log at that LSN gives (the barrier tests compare the bytes). One fold for the
    batch instead of one per run is what makes grading fast. The segments stream past
    and only these runs' events are kept: memory holds the chunk, never the log.
    """
    if not tasks:
        return {}
    import pyarrow as pa
    import pyarrow.compute as pc

    from poimen_data.fold._fold import fold_tables, run_events
    from poimen_data.fold._query import EPISODE_TABLES

    cut = {t.run_id: t.snapshot_lsn for t in tasks}
    events = run_events(log, list(cut), at_lsn=max(cut.values()),
                        min_lsn=min(t.first_lsn for t in tasks))
    # The mask is computed on two combined columns and applied with one take: a log of
    # many small commits has one chunk per commit, and per-chunk compute costs add up.
    slot = pc.index_in(events.column("run_id").combine_chunks(),
                       value_set=pa.array(list(cut), pa.string()))
    limit = pc.take(pa.array(list(cut.values()), pa.int64()), slot)
    keep = pc.fill_null(pc.less_equal(events.column("lsn").combine_chunks(), limit), False)
    return _views(fold_tables(events.take(pc.indices_nonzero(keep)), EPISODE_TABLES), cut)


def _views(tables: dict[str, Any], cut: dict[str, int]) -> dict[str, EpisodeView]:
    from poimen_data.fold._query import episodes_from_tables

    out = {v.run_id: v for v in episodes_from_tables(tables, at_lsn=0, lsn_of=cut)}
    missing = set(cut) - set(out)
    if missing:
        raise NotFound(f"grade: no events for run {sorted(missing)[0]!r} at its snapshot")
    return out


def _bucketed_snapshots(log: EventLog, tasks: Sequence[GradeTask], chunk: int,
                        budget: Budget) -> Iterator[tuple[list[GradeTask],
                                                          dict[str, EpisodeView], float]]:
    """(tasks, their snapshots, seconds spent) ``chunk`` runs at a time, under ``budget``.

    The events of the runs to grade, each cut at its snapshot LSN, are spilled by run
    bucket in one scan of the segments (``fold._build.spill_groups``); each group of
    buckets is then loaded into DuckDB (which spills past ``memory_limit``), and folded
    ``chunk`` runs at a time. Memory holds one chunk's fold and views, whatever the size
    of the log. One group needs no spill.
    """
    import pyarrow as pa

    from poimen_data.fold import _build as B
    from poimen_data.fold._fold import TABLE_KEYS, create_fold_tables
    from poimen_data.fold._query import EPISODE_TABLES
    from poimen_data.fold._state import plan_groups

    lsn = max(t.snapshot_lsn for t in tasks)
    low = min(t.first_lsn for t in tasks)  # no task's run has an event below it
    groups = plan_groups(log, lsn, budget, None, low)
    by_group: list[list[GradeTask]] = [[] for _ in groups]
    group_of = {b: i for i, g in enumerate(groups) for b in g}
    for t in tasks:
        by_group[group_of[B.bucket_of(t.run_id)]].append(t)
    keep = ("WHERE EXISTS (SELECT 1 FROM _grade_cut c WHERE c.run_id = _scan.run_id "
            "AND _scan.lsn <= c.snapshot_lsn)")
    with B.connection(budget) as con:
        tmp = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
        con.register("_grade_cut", pa.table({
            "run_id": pa.array([t.run_id for t in tasks], pa.string()),
            "snapshot_lsn": pa.array([t.snapshot_lsn for t in tasks], pa.int64())}))
        if len(groups) == 1:
            con.register("_scan", log.scan_events(lsn, low, batch_rows=B.BATCH_ROWS))
            con.execute(f"CREATE TEMP TABLE _grade_group AS SELECT * FROM _scan {keep}")
            con.unregister("_scan")
            parts = None
        else:
            parts = B.spill_groups(con, log, lsn, groups, f"{tmp}/parts", where=keep,
                                   min_lsn=low)
        for i, todo in enumerate(by_group):
            if not todo:
                continue
            if parts is not None:
                B.load_group(con, parts[i], "_grade_group")
            for lo in range(0, len(todo), chunk):
                t0 = time.perf_counter()
                part = todo[lo:lo + chunk]
                cut = {t.run_id: t.snapshot_lsn for t in part}
                con.register("_grade_chunk", pa.table({"run_id": pa.array(list(cut),
                                                                            pa.string())}))
                # the fold of one chunk of runs: its memory does not grow with the group
                con.execute("CREATE TEMP TABLE events AS SELECT * FROM _grade_group "
                            "WHERE run_id IN (SELECT run_id FROM _grade_chunk)")
                con.unregister("_grade_chunk")
                create_fold_tables(con, EPISODE_TABLES, ordered=False, temp=True)
                tables = {name: con.sql(f"SELECT * FROM {name} ORDER BY "
                                        f"{', '.join(TABLE_KEYS[name])}").to_arrow_table()
                          for name in EPISODE_TABLES}
                for name in ("events", "runs", "attempts", "branches"):
                    con.execute(f"DROP TABLE IF EXISTS {name}")
                snaps = _views(tables, cut)
                del tables
                yield part, snaps, time.perf_counter() - t0
            con.execute("DROP TABLE _grade_group")


# --- which attempts an attempt-scoped verifier grades ----------------------------------

#: The attempt an attempt-scoped verifier grades: (branch_id, step_id, attempt_no).
AttemptKey = tuple[int, str, int]


def attempts_to_grade(snap: EpisodeView, spec: VerifierScope) -> list[AttemptKey]:
    """The terminal attempts of a frozen snapshot that ``spec`` applies to, in a fixed
    order: every branch's own attempts (by branch, then as the branch lists them), or
    the last attempt of each step on the live trajectory. A still-``dispatched``
    attempt has no outcome to judge and is left out."""
    from poimen_data.jobs.verifiers import last_attempts_branches

    if spec.attempts == "all":
        pairs = [(b.branch_id, a) for b in snap.branches for a in b.attempts]
    else:
        pairs = list(last_attempts_branches(snap))
    return [(b, a.step, a.attempt) for b, a in pairs
            if a.state != "dispatched" and (spec.steps is None or a.step in spec.steps)]


def _items(tasks: Sequence[GradeTask], snaps: dict[str, EpisodeView],
           scopes: Sequence[VerifierScope]) -> list[tuple[GradeTask, int, AttemptKey | None]]:
    """Every call to make: one per (run, run-scoped verifier), one per (run,
    attempt-scoped verifier, attempt it applies to) not yet graded at this snapshot."""
    items: list[tuple[GradeTask, int, AttemptKey | None]] = []
    for t in tasks:
        for i in t.todo:
            if scopes[i].scope == "run":
                items.append((t, i, None))
                continue
            items.extend((t, i, key) for key in attempts_to_grade(snaps[t.run_id], scopes[i])
                         if (i, *key) not in t.done)
    return items


# --- running verifiers under deadlines -------------------------------------------------


Outcome = tuple[bool, float | None, str | None, bool]  # passed, score, detail, errored
#: A verdict's ``detail`` longer than this (in characters) is an error verdict.
DETAIL_MAX = 65_536


def _call(v: Verifier, ctx: VerifierCtx) -> Outcome:
    """Run one verifier; anything but a clean, in-time ``Verdict`` is an error verdict."""
    try:
        out = v(ctx)
    except Exception as exc:  # a verifier's bug is a verdict, not the batch's end
        return _error(f"{type(exc).__name__}: {_text(exc)}")
    late = time.monotonic() - ctx.deadline
    if late > 0:
        return _error(f"deadline passed ({late:.3f}s late)")
    return safe_verdict(out)


def safe_verdict(out: Any) -> Outcome:
    """A verifier's return value as a verdict the log can hold, or an error verdict saying
    why not: never an exception (the same value rules as ``validate_event``)."""
    try:
        if not isinstance(out, Verdict) or type(out.passed) is not bool:
            return _error(f"returned {_text(out, repr)[:200]}, not a Verdict(passed: bool)")
        score = out.score
        if score is not None:
            problem = number_problem(score)
            if problem:
                return _error(f"score {problem}")
            score = stored_double(score)
        detail = out.detail
        if detail is not None:
            if not isinstance(detail, str):
                detail = str(detail)
            problem = text_problem(detail)
            if problem:
                return _error(f"detail {problem}")
            if len(detail) > DETAIL_MAX:
                return _error(f"detail of {len(detail):,} chars is over {DETAIL_MAX:,}")
        return out.passed, score, detail, False
    except Exception as exc:  # a __str__ or __repr__ that raises
        return _error(f"bad verdict: {type(exc).__name__}: {_text(exc)}")


def _error(why: str) -> Outcome:
    return False, None, "error: " + why, True


def _text(x: Any, how: Callable[[Any], str] = str) -> str:
    """Text about a value, storable whatever it holds (lone surrogates escaped, bounded)."""
    try:
        s = how(x)
    except Exception as exc:
        s = f"<unprintable {type(x).__name__}: {type(exc).__name__}>"
    s = s[:2000]
    return s if utf8_ok(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")


def _run_local(tasks: Sequence[GradeTask], snaps: dict[str, EpisodeView],
               verifiers: Sequence[Verifier], scopes: Sequence[VerifierScope],
               blobs: BlobStore, limits: Sequence[float], threads: int,
               planned: list[int] | None = None) -> Iterator[GradeResult]:
    """Yield a result per item (see ``_items``) as it completes, on a pool of daemon
    threads; ``planned`` is told how many items there are before the first result.

    A verifier past its deadline is answered with an error verdict at once and left
    behind (a thread cannot be killed); a fresh thread takes its place so the pool keeps
    its size. Daemon threads, so a verifier that never returns cannot block exit.
    """
    todo: queue.SimpleQueue[Any] = queue.SimpleQueue()
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    items = _items(tasks, snaps, scopes)
    if planned is not None:
        planned.append(len(items))

    def work() -> None:
        while True:
            got = todo.get()
            if got is None:
                return
            k, (t, i, key) = got
            snap = snaps[t.run_id]
            deadline = time.monotonic() + limits[i]
            out.put((0, k, deadline))
            if key is None:
                ctx = VerifierCtx(t.run_id, None, None, snap, t.snapshot_lsn, blobs, deadline)
            else:
                ctx = VerifierCtx(t.run_id, key[1], key[2], snap, t.snapshot_lsn, blobs,
                                  deadline, key[0])
            try:
                got = _call(verifiers[i], ctx)
            except BaseException as exc:  # never lose the thread's answer (a verifier
                got = _error(f"{type(exc).__name__}: {_text(exc)}")  # raising SystemExit)
            out.put((1, k, got))

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
                        t, i, key = items[k]
                        yield _result(t, i, key, snaps, (False, None, "error: deadline of "
                                                         f"{limits[i]}s passed; abandoned",
                                                         True))
                continue
            if what == 0:
                heapq.heappush(running, (payload, k))
            elif k not in resolved:
                resolved.add(k)
                t, i, key = items[k]
                yield _result(t, i, key, snaps, payload)
    finally:
        while True:  # closed early: drop what no thread has taken yet
            try:
                todo.get_nowait()
            except queue.Empty:
                break
        for _ in range(started):
            todo.put(None)


def _result(t: GradeTask, i: int, key: AttemptKey | None, snaps: dict[str, EpisodeView],
            r: tuple[bool, float | None, str | None, bool]) -> GradeResult:
    """A run verdict goes on the snapshot's live branch; an attempt verdict on the
    attempt it judged (its own branch, step and number)."""
    if key is None:
        return (t.run_id, i, int(snaps[t.run_id].live_branch), *r, None, None)
    return (t.run_id, i, key[0], *r, key[1], key[2])


# --- Dask ------------------------------------------------------------------------------


def is_dask_client(executor: Any) -> bool:
    return any(c.__module__.startswith("distributed") and c.__name__ == "Client"
               for c in type(executor).__mro__)


def _grade_chunk(root: str, storage_options: dict[str, Any], tasks: Sequence[GradeTask],
                 verifiers: Sequence[Verifier], scopes: Sequence[VerifierScope],
                 limits: Sequence[float], threads: int) -> tuple[list[GradeResult], float]:
    """Dask task: open the log read-only, build the chunk's snapshots here at their
    snapshot LSNs (so no episode crosses the network), grade, return the results."""
    from poimen_data.log._log import open_log

    log = open_log(root, storage_options or None, create=False, read_only=True)
    t0 = time.perf_counter()
    snaps = _snapshots(log, tasks)
    snap_s = time.perf_counter() - t0
    return list(_run_local(tasks, snaps, verifiers, scopes, log.blobs, limits,
                           threads)), snap_s


def run_dask(client: Any, log: EventLog, tasks: Sequence[GradeTask],
              verifiers: Sequence[Verifier], scopes: Sequence[VerifierScope],
              limits: Sequence[float], threads: int, chunk: int, snap_s: list[float],
              planned: list[int]) -> Iterator[GradeResult]:
    """Yield results chunk by chunk as workers finish; the driver alone commits.
    ``planned`` learns each chunk's number of results as it arrives."""
    from distributed import as_completed

    n_workers = max(1, len(client.scheduler_info().get("workers", {})))
    size = max(1, min(chunk, -(-len(tasks) // (2 * n_workers))))
    futures = [client.submit(_grade_chunk, log.root, log.storage.storage_options,
                             list(tasks[i:i + size]), list(verifiers), list(scopes),
                             list(limits), threads, pure=False)
               for i in range(0, len(tasks), size)]
    try:
        for fut in as_completed(futures):
            results, s = fut.result()
            snap_s.append(s)
            planned.append(len(results))
            yield from results
    finally:
        client.cancel(futures)


def run_here(log: EventLog, tasks: Sequence[GradeTask], verifiers: Sequence[Verifier],
              scopes: Sequence[VerifierScope], blobs: BlobStore, limits: Sequence[float],
              threads: int, chunk: int, snap_s: list[float], planned: list[int],
              budget: Budget) -> Iterator[GradeResult]:
    """In-process: snapshots come ``chunk`` runs at a time from a fold split by run
    bucket (``_bucketed_snapshots``), so memory holds one chunk of snapshots and one
    bucket group's fold under ``budget``."""
    if not tasks:
        return
    for part, snaps, spent in _bucketed_snapshots(log, tasks, chunk, budget):
        snap_s.append(spent)
        yield from _run_local(part, snaps, verifiers, scopes, blobs, limits, threads,
                              planned)
