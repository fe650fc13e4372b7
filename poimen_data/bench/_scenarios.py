"""The scenarios of ``poimen bench`` (issue 8), one function each, in the table's order.

Each builds its data from the demo generator, times ours and its reference with
``interleave`` and returns a ``Result``. Logs that several scenarios need (10,000 small
commits, a materialized state of 100,000 runs) are built once per run and kept in
``ctx.cache``. What each reference is, and why it is the fair one, is in the docstrings.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from poimen_data.bench import _recorder as _rec
from poimen_data.bench import _scale_fold, _scale_sql, _view
from poimen_data.bench._core import (
    Ctx,
    Goal,
    Result,
    Scenario,
    fmt_bytes_rate,
    fmt_rate,
    fmt_ratio,
    fmt_time,
    interleave,
    median,
    percentile,
)
from poimen_data.bench._core import open_log as _open

ROWS_PER_COMMIT = 100_000  # rows per commit when a scenario bulk-loads a log
SMALL_POOL = 50_000  # small commits take their 100 events from this many generated rows


def _load(root: Path, table: pa.Table, rows_per_commit: int = ROWS_PER_COMMIT) -> Any:
    """A new log at ``root`` holding ``table``, committed ``rows_per_commit`` at a time
    through the bulk path (what a compacted log looks like)."""
    log = _open(root)
    for lo in range(0, table.num_rows, rows_per_commit):
        with log.transaction() as tx:
            tx.extend(table.slice(lo, rows_per_commit))
    return log


def _fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ok(ctx: Ctx, name: str, title: str, goal: Goal, **kw: Any) -> Result:
    r = Result(name, title, "ok", goal.text, **kw)
    r.details.setdefault("quick", ctx.quick)
    return r


def _rate_result(ctx: Ctx, name: str, title: str, goal: Goal, *, work: float,
                 t_ours: list[float], t_ref: list[float], unit: str, ref_unit: str = "",
                 note: str = "", ref_work: float | None = None, **details: Any) -> Result:
    """A result whose figures are rates (work / median seconds); ratio = ours / ref."""
    ours = work / median(t_ours)
    ref = (work if ref_work is None else ref_work) / median(t_ref)
    ref_unit = ref_unit or unit
    return _ok(ctx, name, title, goal, ours=ours, reference=ref, ratio=ours / ref,
               unit=unit, ref_unit=ref_unit, ours_text=fmt_rate(ours, unit),
               reference_text=fmt_rate(ref, ref_unit), ratio_text=fmt_ratio(ours / ref),
               note=note, details={"t_ours_s": t_ours, "t_ref_s": t_ref, **details})


def _time_result(ctx: Ctx, name: str, title: str, goal: Goal, *, t_ours: list[float],
                 t_ref: list[float], ref_label: str = "", note: str = "",
                 **details: Any) -> Result:
    """A result whose figures are median times; ratio = ours / ref (lower is better)."""
    ours, ref = median(t_ours), median(t_ref)
    return _ok(ctx, name, title, goal, ours=ours, reference=ref, ratio=ours / ref,
               unit="s", ref_unit="s", ours_text=fmt_time(ours),
               reference_text=(f"{ref_label} " if ref_label else "") + fmt_time(ref),
               ratio_text=fmt_ratio(ours / ref), note=note,
               details={"t_ours_s": t_ours, "t_ref_s": t_ref, **details})


# --- bulk ingest ------------------------------------------------------------------------


def bulk_ingest(ctx: Ctx) -> Result:
    """``tx.extend(table)`` into a fresh log against writing the same table with plain
    ``pyarrow.ipc.new_file`` plus fsync, to the same disk. Ours also validates the
    table, hashes the segment and publishes a manifest: that is the overhead measured."""
    n = ctx.sizes.bulk_events
    table = ctx.events(n).combine_chunks()
    d = ctx.dir("bulk")
    state: dict[str, Any] = {"i": 0}

    def fresh() -> None:
        for p in d.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        state["i"] += 1
        state["log"] = _open(d / f"log{state['i']}")

    def ours() -> None:
        with state["log"].transaction() as tx:
            tx.extend(table)

    def ref() -> None:
        path = d / f"plain{state['i']}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
        _fsync_path(path)

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps,
                   setup={"ours": fresh, "ref": fresh})
    return _rate_result(ctx, "bulk_ingest", "bulk ingest", GOALS["bulk_ingest"],
                        work=n, t_ours=t["ours"], t_ref=t["ref"], unit="events/s",
                        note=f"{n:,} events ({table.nbytes / 2**20:.0f} MiB in Arrow); "
                             "reference: pyarrow.ipc.new_file + fsync",
                        events=n, arrow_bytes=table.nbytes)


# --- event objects ------------------------------------------------------------------------


def event_objects(ctx: Ctx) -> Result:
    """``tx.append(event)`` with validation, committed, in events/s. The goal is absolute;
    the reference is converting the same events (as dicts) to Arrow with
    ``pa.Table.from_pylist`` and no validation: the least a Python writer must pay."""
    from poimen_data.model import _events as ev

    n = ctx.sizes.object_events
    rows = ctx.events(n).to_pylist()
    objs = [ev.event_from_row(r) for r in rows]
    d = ctx.dir("objects")
    state: dict[str, Any] = {"i": 0}

    def fresh() -> None:
        state["i"] += 1
        state["log"] = _open(d / f"log{state['i']}")

    def ours() -> None:
        with state["log"].transaction() as tx:
            for e in objs:
                tx.append(e)

    def ref() -> None:
        pa.Table.from_pylist(rows, schema=ev.EVENT_SCHEMA)

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps, setup={"ours": fresh})
    return _rate_result(ctx, "event_objects", "event objects", GOALS["event_objects"],
                        work=n, t_ours=t["ours"], t_ref=t["ref"], unit="events/s",
                        note=f"{n:,} events appended one by one and committed; reference: "
                             "pa.Table.from_pylist of the same events, unvalidated",
                        events=n)


# --- small commits ------------------------------------------------------------------------


@dataclass
class _SmallCommit:
    """The pieces of one small commit: 100 events and two 4 KB bodies, plus the segment
    bytes the bare reference writes for them."""

    table: pa.Table
    blobs: tuple[bytes, bytes]
    segment: bytes


def _small_commit(ctx: Ctx, i: int) -> _SmallCommit:
    n = ctx.sizes.commit_events
    t = ctx.events(n, offset=(i * n) % (SMALL_POOL - n)).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    return _SmallCommit(t, (os.urandom(4096), os.urandom(4096)), sink.getvalue().to_pybytes())


def _commit_small(log: Any, c: _SmallCommit, blobs: bool = True) -> None:
    tenant = c.table.column("tenant")[0].as_py()
    with log.transaction() as tx:
        if blobs:
            for b in c.blobs:
                tx.put_blob(tenant, b)
        tx.extend(c.table)


def small_commit(ctx: Ctx) -> Result:
    """Latency of a durable commit of 100 events + 2 bodies of 4 KB (median and p99)
    against the bare file operations it needs: create + write + fsync of the two bodies
    and the segment, and temp file + fsync + ``os.link`` of a manifest of the real size
    + fsync of its directory (a durable publish needs all five fsyncs: without the last,
    a power loss may forget the link, i.e. the commit).
    The events come as an Arrow table (the cost of event objects is its own scenario)."""
    n = ctx.sizes.small_commits
    d = ctx.dir("small")
    log = _open(d / "log")
    bare = d / "bare"
    bare.mkdir()
    _commit_small(log, _small_commit(ctx, 0))  # warm-up, and a real manifest to size by
    manifest = log.storage.read("_log/" + f"{1:020d}.json")
    cur: dict[str, Any] = {"i": 0}

    def next_commit() -> None:
        cur["i"] += 1
        cur["c"] = _small_commit(ctx, cur["i"])

    def ours() -> None:
        _commit_small(log, cur["c"])

    def ref() -> None:
        c, i = cur["c"], cur["i"]
        for name, data in ((f"a{i}", c.blobs[0]), (f"b{i}", c.blobs[1]), (f"s{i}", c.segment)):
            with open(bare / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        tmp = bare / f".tmp-{i}"
        with open(tmp, "wb") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, bare / f"m{i}.json")
        os.unlink(tmp)
        _fsync_path(bare)  # the link is durable only once its directory is synced

    t = interleave({"ours": ours, "ref": ref}, n, each=next_commit)
    med_o, med_r = median(t["ours"]), median(t["ref"])
    p99_o, p99_r = percentile(t["ours"], 0.99), percentile(t["ref"], 0.99)
    return _ok(ctx, "small_commit", "small commit", GOALS["small_commit"], ours=med_o,
               reference=med_r, ratio=med_o / med_r, unit="s", ref_unit="s",
               ours_text=f"median {fmt_time(med_o)}, p99 {fmt_time(p99_o)}",
               reference_text=f"median {fmt_time(med_r)}, p99 {fmt_time(p99_r)}",
               ratio_text=f"{fmt_ratio(med_o / med_r)} (p99 {fmt_ratio(p99_o / p99_r)})",
               note=f"{n} commits of {ctx.sizes.commit_events} events + 2 x 4 KB, fsync on; "
                    "reference: write+fsync x3, temp+fsync+link of the manifest, "
                    "fsync of its directory",
               details={"t_ours_s": t["ours"], "t_ref_s": t["ref"], "p99_ours_s": p99_o,
                        "p99_ref_s": p99_r, "manifest_bytes": len(manifest)})


def small_commit_vs_peer(ctx: Ctx) -> Result:
    """Commits/s of the same 100 rows through ``tx.extend`` and through
    ``deltalake.write_deltalake(mode="append")``, each into its own table on the same
    disk. No bodies on either side (Delta has no blob store)."""
    import deltalake

    n = ctx.sizes.peer_commits
    d = ctx.dir("peer")
    log = _open(d / "log")
    delta = str(d / "delta")
    first = _small_commit(ctx, 0)
    _commit_small(log, first, blobs=False)  # both sides: the first commit creates the table
    deltalake.write_deltalake(delta, first.table, mode="append")
    cur: dict[str, Any] = {"i": 0}

    def next_rows() -> None:
        cur["i"] += 1
        cur["c"] = _small_commit(ctx, cur["i"])

    def ours() -> None:
        _commit_small(log, cur["c"], blobs=False)

    def ref() -> None:
        deltalake.write_deltalake(delta, cur["c"].table, mode="append")

    t = interleave({"ours": ours, "ref": ref}, n, each=next_rows)
    return _rate_result(ctx, "small_commit_vs_peer", "small commit vs peer",
                        GOALS["small_commit_vs_peer"], work=1, t_ours=t["ours"],
                        t_ref=t["ref"], unit="commits/s",
                        note=f"{n} appends of {ctx.sizes.commit_events} rows each; reference: "
                             f"deltalake {deltalake.__version__} write_deltalake(mode='append')")


# --- open and small files -------------------------------------------------------------------


def _many_commits(ctx: Ctx) -> tuple[Path, Path, pa.Table]:
    """A log of ``many_commits`` small commits (100 events each) and one of
    ``few_commits``, built once per run. Returns (many root, few root, all events)."""
    if "many" not in ctx.cache:
        s = ctx.sizes
        d = ctx.dir("many")
        table = ctx.events(s.many_commits * s.commit_events).combine_chunks()
        log = _open(d / "many")
        for i in range(s.many_commits):
            with log.transaction() as tx:
                tx.extend(table.slice(i * s.commit_events, s.commit_events))
        few = _open(d / "few")
        for i in range(s.few_commits):
            with few.transaction() as tx:
                tx.extend(table.slice(i * s.commit_events, s.commit_events))
        ctx.cache["many"] = (d / "many", d / "few", table)
    return ctx.cache["many"]


def open_log_scenario(ctx: Ctx) -> Result:
    """``open_log`` of a log of 10,000 commits against one of 10 commits: with
    checkpoints, opening reads the newest checkpoint and the manifests after it, so the
    time should barely grow with the number of commits."""
    many, few, _ = _many_commits(ctx)
    heads: dict[str, int] = {}

    def ours() -> None:
        heads["many"] = _open(many, create=False).head

    def ref() -> None:
        heads["few"] = _open(few, create=False).head

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.open_reps)
    s = ctx.sizes
    return _time_result(ctx, "open", "open", GOALS["open"], t_ours=t["ours"], t_ref=t["ref"],
                        note=f"open_log of {s.many_commits:,} commits vs {s.few_commits} "
                             f"commits ({s.commit_events} events each); checkpoint every "
                             "100 commits",
                        commits=s.many_commits, heads=heads)


def _scan(root: Path) -> list[tuple[Any, ...]]:
    """What a data scientist's first query costs: open the log, connect, and aggregate
    every event (reads, verifies and scans each segment)."""
    from poimen_data.fold._connect import connect

    con = connect(_open(root, create=False))
    try:
        return con.execute("SELECT kind, count(*), count(DISTINCT run_id), sum(step_index) "
                           "FROM events GROUP BY kind ORDER BY kind").fetchall()
    finally:
        con.close()


def small_files(ctx: Ctx) -> Result:
    """A full scan of the 10,000-commit log after ``compact`` against the same events
    written in one commit; the uncompacted log is scanned in the same rounds (the
    "before" ratio in the details and the note)."""
    from poimen_data.jobs._maint import compact

    many, _few, table = _many_commits(ctx)
    d = ctx.dir("small_files")
    compacted = d / "compacted"
    shutil.copytree(many, compacted)
    t0 = time.perf_counter()
    rep = compact(_open(compacted))
    t_compact = time.perf_counter() - t0
    one = d / "one"
    _load(one, table, rows_per_commit=table.num_rows)
    got: dict[str, Any] = {}

    def scan(name: str, root: Path) -> Any:
        return lambda: got.__setitem__(name, _scan(root))

    t = interleave({"after": scan("after", compacted), "one": scan("one", one),
                    "before": scan("before", many)}, ctx.sizes.reps)
    if not (got["after"] == got["one"] == got["before"]):
        raise AssertionError("scans of the compacted, uncompacted and one-commit logs differ")
    before = median(t["before"]) / median(t["one"])
    r = _time_result(ctx, "small_files", "small files", GOALS["small_files"],
                     t_ours=t["after"], t_ref=t["one"], ref_label="one commit",
                     note=f"scan of {table.num_rows:,} events from "
                          f"{ctx.sizes.many_commits:,} commits after compact "
                          f"({rep.segments_after} segments, compact took "
                          f"{fmt_time(t_compact)}) vs one commit; before compaction "
                          f"{fmt_ratio(before)} ({fmt_time(median(t['before']))})",
                     t_before_s=t["before"], ratio_before=before,
                     segments_before=rep.segments_before, segments_after=rep.segments_after,
                     compact_s=t_compact)
    r.ratio_text += f" (before compact {fmt_ratio(before)})"
    return r


# --- the fold ---------------------------------------------------------------------------------


def _fold_log(ctx: Ctx) -> tuple[Path, pa.Table]:
    """A log of ``fold_events`` events in commits of 100,000 and the same events as one
    in-memory table, read back from it (``LOG_SCHEMA``, with lsn and seq)."""
    if "fold" not in ctx.cache:
        root = ctx.dir("fold") / "log"
        log = _load(root, ctx.events(ctx.sizes.fold_events))
        ctx.cache["fold"] = (root, log.read_events().combine_chunks())
    return ctx.cache["fold"]


def cold_refold(ctx: Ctx) -> Result:
    """Fold every event into all tables from a freshly opened log (reading and verifying
    the segments) against the very same fold (``_fold.fold_tables``, which registers the
    table as ``events`` the way ``connect`` does) over the events already in memory as
    one Arrow table. The difference is what reading costs."""
    from poimen_data.fold._fold import VIEWS, fold_tables

    root, mem = _fold_log(ctx)

    def ours() -> None:
        fold_tables(_open(root, create=False).read_events(), VIEWS)

    def ref() -> None:
        fold_tables(mem, VIEWS)

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps)
    return _time_result(ctx, "cold_refold", "cold re-fold", GOALS["cold_refold"],
                        t_ours=t["ours"], t_ref=t["ref"], ref_label="in memory",
                        note=f"{mem.num_rows:,} events into {len(VIEWS)} tables; reference: "
                             "the same SQL over one in-memory Arrow table",
                        events=mem.num_rows)


ATTEMPT_KINDS = ("attempt_dispatched", "attempt_finished", "attempt_recovered")
_POLARS_COLS = ("lsn", "kind", "tenant", "run_id", "branch_id", "step_id", "step_index",
                "attempt_no", "state", "workflow_version", "context", "prompt", "output",
                "tools", "usage", "error")


def polars_attempts(events: pa.Table) -> pa.Table:
    """The ``attempts`` fold written in polars: one row per (run, branch, step, attempt),
    its state from its last event by LSN, every other field its last non-null value,
    the workflow version falling back to the run's, sorted like the view. Events arrive
    in LSN order and polars keeps the row order inside a group, so "last" is by LSN."""
    import polars as pl

    def last(c: str) -> pl.Expr:
        return pl.col(c).drop_nulls().last().alias(c)

    frame = pl.from_arrow(events.select(list(_POLARS_COLS)))
    assert isinstance(frame, pl.DataFrame)  # a table gives a frame, never a series
    df = frame.lazy()
    folded = (
        df.filter(pl.col("kind").is_in(ATTEMPT_KINDS))
        .group_by("run_id", "branch_id", "step_id", "attempt_no")
        .agg(last("tenant"), last("step_index"),
             pl.when(pl.col("kind") == "attempt_dispatched").then(pl.lit("dispatched"))
             .otherwise(pl.col("state")).drop_nulls().last().alias("state"),
             last("workflow_version").alias("dispatch_version"),
             last("context"), last("prompt"), last("output"), last("tools"), last("usage"),
             last("error"),
             (pl.col("kind").last() == "attempt_recovered").alias("recovered"),
             pl.col("lsn").min().alias("first_lsn"), pl.col("lsn").max().alias("last_lsn"))
    )
    versions = (df.filter(pl.col("kind") == "run_started").group_by("run_id")
                .agg(last("workflow_version").alias("run_version")))
    out = (
        folded.join(versions, on="run_id", how="left")
        .with_columns(pl.coalesce("dispatch_version", "run_version").alias("workflow_version"))
        .select("run_id", "tenant", "branch_id", "step_id", "step_index", "attempt_no",
                "state", "workflow_version", "context", "prompt", "output", "tools", "usage",
                "error", "recovered", "first_lsn", "last_lsn")
        .sort("run_id", "branch_id", "step_index", "attempt_no", "step_id", nulls_last=True)
    )
    return out.collect().to_arrow()


def fold_engine(ctx: Ctx) -> Result:
    """Our latest-state-per-attempt fold (the ``attempts`` SQL in DuckDB) against the same
    fold written in polars, both over the same in-memory events. Reported, not judged;
    the two results are checked to agree (rows, states, LSN ranges)."""
    from poimen_data.fold._fold import fold_tables

    _root, mem = _fold_log(ctx)
    got: dict[str, pa.Table] = {}

    def ours() -> None:
        got["ours"] = fold_tables(mem, ("attempts",))["attempts"]

    def ref() -> None:
        got["ref"] = polars_attempts(mem)

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps)
    a, b = got["ours"], got["ref"]
    for col in ("run_id", "branch_id", "step_id", "attempt_no", "state", "first_lsn",
                "last_lsn"):
        if a.column(col).to_pylist() != b.column(col).cast(a.schema.field(col).type
                                                            ).to_pylist():
            raise AssertionError(f"polars and DuckDB attempts differ in column {col!r}")
    return _time_result(ctx, "fold_engine", "fold engine", GOALS["fold_engine"],
                        t_ours=t["ours"], t_ref=t["ref"], ref_label="polars",
                        note=f"attempts fold of {mem.num_rows:,} events ({a.num_rows:,} "
                             "attempts); ratio < 1: DuckDB faster",
                        events=mem.num_rows, attempts=a.num_rows)


# --- materialized state -----------------------------------------------------------------------


@dataclass
class _StateLog:
    root: Path
    base_events: int
    runs: int
    snapshot: Path  # a copy of state/ as the first full materialize left it
    full_first_s: float
    appended: int = 0


def _state_log(ctx: Ctx) -> _StateLog:
    """A log of about ``state_runs`` runs (whole 500-run tiles plus half a tile, so a few
    runs are still in flight at its end), materialized once; its state/ is copied aside
    so incremental rounds can start again from it."""
    if "state" not in ctx.cache:
        from poimen_data.fold._state import materialize

        b = ctx.block_rows()
        n = (ctx.sizes.state_runs // 500) * b + b // 2
        d = ctx.dir("state")
        root = d / "log"
        table = ctx.events(n)
        log = _load(root, table)
        t0 = time.perf_counter()
        materialize(log, full=True)
        full_s = time.perf_counter() - t0
        snap = d / "state0"
        shutil.copytree(root / "state", snap)
        runs = len(set(table.column("run_id").to_pylist()) - {None})
        ctx.cache["state"] = _StateLog(root, n, runs, snap, full_s)
    return ctx.cache["state"]


def _restore(st: _StateLog) -> None:
    shutil.rmtree(st.root / "state")
    shutil.copytree(st.snapshot, st.root / "state")


def incremental(ctx: Ctx) -> Result:
    """``materialize`` after 1% more events (10 commits: new runs, and the ends of runs
    that were in flight) against a full materialize of the same log. Each round starts
    from the state of the base log, restored untimed."""
    from poimen_data.fold._state import materialize

    st = _state_log(ctx)
    if not st.appended:
        extra = ctx.events(st.base_events // 100, offset=st.base_events)
        log = _open(st.root)
        step = max(1, extra.num_rows // 10)
        for lo in range(0, extra.num_rows, step):
            with log.transaction() as tx:
                tx.extend(extra.slice(lo, step))
        st.appended = extra.num_rows
    head = _open(st.root, create=False).head

    def ours() -> None:
        assert materialize(_open(st.root, create=False)).lsn == head

    def ref() -> None:
        assert materialize(_open(st.root, create=False), full=True).lsn == head

    restore = lambda: _restore(st)  # noqa: E731
    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps,
                   setup={"ours": restore, "ref": restore})
    return _time_result(ctx, "incremental", "incremental", GOALS["incremental"],
                        t_ours=t["ours"], t_ref=t["ref"], ref_label="full",
                        note=f"+{st.appended:,} events on {st.base_events:,} "
                             f"({st.runs:,} runs); reference: materialize(full=True)",
                        base_events=st.base_events, added=st.appended, runs=st.runs)


def point_query(ctx: Ctx) -> Result:
    """``episode(log, run, source="state")`` for random runs of a log of about 100,000
    runs. The goal is absolute (median <= 20 ms); the reference reads the same run's rows
    with ``pyarrow.parquet.read_table(filters=...)`` from the four state files an answer
    needs (run index, runs, branches, attempts), the bare minimum of I/O."""
    from poimen_data.fold._query import episode
    from poimen_data.fold._state import materialize, read_pointer

    st = _state_log(ctx)
    log = _open(st.root, create=False)
    materialize(log)  # a state at the head (a no-op unless incremental left none)
    ptr = read_pointer(log)
    assert ptr is not None
    full = log.storage.full
    index = pa.concat_tables([pq.read_table(full(f.path)) for f in ptr.tables["run_index"]])
    rng = random.Random(8)
    ids = index.column("run_id").to_pylist()
    picks = [ids[rng.randrange(len(ids))] for _ in range(ctx.sizes.lookups)]
    chunk_of = dict(zip(ids, zip(index.column("bucket").to_pylist(),
                                 index.column("chunk").to_pylist(), strict=True), strict=True))
    files = {t: {f.key: full(f.path) for f in ptr.tables[t]}
             for t in ("runs", "branches", "attempts")}
    index_files = [full(f.path) for f in ptr.tables["run_index"]]
    cur: dict[str, Any] = {"i": -1}

    def next_run() -> None:
        cur["i"] += 1
        cur["run"] = picks[cur["i"]]

    def ours() -> None:
        episode(log, cur["run"], source="state")

    def ref() -> None:
        run = cur["run"]
        filt = [("run_id", "=", run)]
        for p in index_files:
            pq.read_table(p, filters=filt)
        c = chunk_of[run]
        for t in ("runs", "branches", "attempts"):
            pq.read_table(files[t][c], filters=filt)

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.lookups, each=next_run)
    ours_m, ref_m = median(t["ours"]), median(t["ref"])
    return _ok(ctx, "point_query", "point query", GOALS["point_query"], ours=ours_m * 1e3,
               reference=ref_m * 1e3, ratio=ours_m / ref_m, unit="ms", ref_unit="ms",
               ours_text=f"median {fmt_time(ours_m)}, p95 {fmt_time(percentile(t['ours'], .95))}",
               reference_text=f"pyarrow read {fmt_time(ref_m)}",
               ratio_text=fmt_ratio(ours_m / ref_m),
               note=f"{len(picks)} episode() lookups from state over {len(ids):,} runs; "
                    "reference: filtered pyarrow reads of the 4 state files",
               details={"t_ours_s": t["ours"], "t_ref_s": t["ref"], "runs": len(ids)})


# --- grading and export -----------------------------------------------------------------------


def grading(ctx: Ctx) -> Result:
    """``grade`` with the exit-code verifier over 10,000 runs in ``verifying`` (in
    process, verdicts committed), in runs/s; the goal is absolute. The reference folds
    the whole log in one query, builds every run's view from it and calls the same
    verifier: what grading costs without per-run snapshots at their own LSN and without
    recording verdicts."""
    import math

    from poimen_data.fold._connect import connect
    from poimen_data.fold._fold import fold_tables
    from poimen_data.fold._query import episodes_from_tables
    from poimen_data.jobs._grade import VerifierCtx, grade
    from poimen_data.jobs.verifiers import exit_code

    want = ctx.sizes.grade_runs
    b = ctx.block_rows()
    # A tile of 500 runs leaves some 250 in verifying: take enough tiles for ``want``.
    n = (want // 200 + 2) * b
    root = ctx.dir("grading") / "log"
    log = _load(root, ctx.events(n))
    con = connect(log)
    try:
        ids = [r[0] for r in con.execute(
            "SELECT run_id FROM runs WHERE state = 'verifying' ORDER BY run_id LIMIT ?",
            [want]).fetchall()]
    finally:
        con.close()
    wanted = set(ids)
    graded: dict[str, int] = {}

    def ours() -> None:
        rep = grade(log, [exit_code], runs=ids, force=True)
        graded["ours"] = rep.runs_graded

    def ref() -> None:
        head = log.head
        tables = fold_tables(log.read_events(head), ("runs", "branches", "attempts"))
        k = 0
        for view in episodes_from_tables(tables, at_lsn=head, all_branches=True):
            if view.run_id in wanted:
                exit_code(VerifierCtx(view.run_id, None, None, view, head, log.blobs,
                                      math.inf))
                k += 1
        graded["ref"] = k

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps)
    if graded["ours"] != len(ids) or graded["ref"] != len(ids):
        raise AssertionError(f"graded {graded} runs, expected {len(ids)}")
    return _rate_result(ctx, "grading", "grading", GOALS["grading"], work=len(ids),
                        t_ours=t["ours"], t_ref=t["ref"], unit="runs/s",
                        note=f"{len(ids):,} runs of {n:,} events, exit_code verifier; "
                             "reference: one bulk fold + views + the verifier, no commit",
                        runs=len(ids), events=n)


def export(ctx: Ctx) -> Result:
    """Bytes/s of ``export_live(format="jsonl")`` from a local log against reading the
    same bodies (every prompt and output of every exported record, as the export writes
    them) from disk with a thread pool of the same width (8)."""
    from poimen_data.fold._connect import connect
    from poimen_data.jobs._export import export_live
    from poimen_data.log._manifest import blob_path
    from poimen_data.workload.synth import generate

    d = ctx.dir("export")
    log = _open(d / "log")
    summary = generate(log, runs=ctx.sizes.export_runs, seed=ctx.seed, batch=20)
    con = connect(log)
    try:
        refs = con.execute("SELECT prompt, output FROM trajectories WHERE is_live"
                           ).fetchall()
    finally:
        con.close()
    paths = [log.storage.full(blob_path(r["tenant"], r["sha256"]))
             for row in refs for r in row if r is not None]
    body_bytes = sum(os.path.getsize(p) for p in paths)
    out: dict[str, Any] = {"i": 0}

    def ours() -> None:
        out["i"] += 1
        dest = d / f"out{out['i']}.jsonl"
        out["bytes"] = export_live(log, str(dest), format="jsonl").bytes
        dest.unlink()

    def read(p: str) -> int:
        with open(p, "rb") as f:
            return len(f.read())

    def ref() -> None:
        with ThreadPoolExecutor(8) as pool:
            out["read"] = sum(pool.map(read, paths))

    t = interleave({"ours": ours, "ref": ref}, ctx.sizes.reps)
    assert out["read"] == body_bytes
    return _ok_bytes(ctx, out["bytes"], body_bytes, t, summary.runs, len(paths))


def _ok_bytes(ctx: Ctx, out_bytes: int, body_bytes: int, t: dict[str, list[float]],
              runs: int, bodies: int) -> Result:
    ours = out_bytes / median(t["ours"])
    ref = body_bytes / median(t["ref"])
    return _ok(ctx, "export", "export", GOALS["export"], ours=ours, reference=ref,
               ratio=ours / ref, unit="B/s", ref_unit="B/s", ours_text=fmt_bytes_rate(ours),
               reference_text=fmt_bytes_rate(ref), ratio_text=fmt_ratio(ours / ref),
               note=f"jsonl of {runs} demo runs ({out_bytes / 2**20:.1f} MiB written, "
                    f"{bodies:,} bodies of {body_bytes / 2**20:.1f} MiB read by the "
                    "reference with 8 threads)",
               details={"t_ours_s": t["ours"], "t_ref_s": t["ref"], "out_bytes": out_bytes,
                        "body_bytes": body_bytes})


# --- S3 -----------------------------------------------------------------------------------------


def s3_commit(ctx: Ctx) -> Result:
    """A small commit (100 events + 2 bodies of 4 KB) on a log in S3, served by moto's
    ``ThreadedMotoServer`` on 127.0.0.1 (started here), against the PUTs such a commit
    needs, timed bare through the same s3fs client: the two bodies, the segment, and a
    conditional PUT (``If-None-Match: *``) of a manifest of the real size."""
    with _rec.moto_s3() as (base, opts):
        log = _open(f"{base}/log", storage_options=opts)
        _commit_small(log, _small_commit(ctx, 0))
        manifest = log.storage.read("_log/" + f"{1:020d}.json")
        fs = log.storage.fs
        bare = base.removeprefix("s3://") + "/bare"
        cur: dict[str, Any] = {"i": 0}

        def next_commit() -> None:
            cur["i"] += 1
            cur["c"] = _small_commit(ctx, cur["i"])

        def ours() -> None:
            _commit_small(log, cur["c"])

        def ref() -> None:
            c, i = cur["c"], cur["i"]
            fs.pipe_file(f"{bare}/a{i}", c.blobs[0])
            fs.pipe_file(f"{bare}/b{i}", c.blobs[1])
            fs.pipe_file(f"{bare}/s{i}", c.segment)
            with fs.open(f"{bare}/m{i}.json", "xb") as f:
                f.write(manifest)

        t = interleave({"ours": ours, "ref": ref}, ctx.sizes.s3_commits,
                       each=next_commit)
        # its promotions finished while moto still answers: left to retry against a
        # stopped server, they held the process's promotion thread for their deadline
        # (16 s), and the next scenario's promotions (group_commit's drain) behind them
        log.flush()
    return _time_result(ctx, "s3_commit", "S3 commit", GOALS["s3_commit"], t_ours=t["ours"],
                        t_ref=t["ref"], ref_label="4 PUTs",
                        note=f"{ctx.sizes.s3_commits} commits on moto (loopback); reference: "
                             "3 PUTs + 1 conditional PUT via the same s3fs client")


GOALS: dict[str, Goal] = {
    "bulk_ingest": Goal("ratio >= 0.5", "ratio", ">=", 0.5),
    "event_objects": Goal(">= 200,000 events/s", "ours", ">=", 200_000),
    "small_commit": Goal("median ratio <= 2x", "ratio", "<=", 2.0),
    "small_commit_vs_peer": Goal(">= 5x faster", "ratio", ">=", 5.0),
    "open": Goal("ratio <= 2x", "ratio", "<=", 2.0),
    "small_files": Goal("ratio <= 1.5x", "ratio", "<=", 1.5),
    "cold_refold": Goal("ratio <= 1.5x", "ratio", "<=", 1.5),
    "fold_engine": Goal("report"),
    "incremental": Goal("ratio <= 0.1", "ratio", "<=", 0.1),
    "point_query": Goal("median <= 20 ms", "ours", "<=", 20.0),
    "grading": Goal(">= 2,000 runs/s", "ours", ">=", 2_000),
    "export": Goal("ratio >= 0.5", "ratio", ">=", 0.5),
    "s3_commit": Goal("ratio <= 2x", "ratio", "<=", 2.0),
}

SCENARIOS: list[Scenario] = [
    Scenario("bulk_ingest", "bulk ingest", GOALS["bulk_ingest"], bulk_ingest),
    Scenario("event_objects", "event objects", GOALS["event_objects"], event_objects),
    Scenario("small_commit", "small commit", GOALS["small_commit"], small_commit),
    Scenario("small_commit_vs_peer", "small commit vs peer", GOALS["small_commit_vs_peer"],
             small_commit_vs_peer),
    Scenario("open", "open", GOALS["open"], open_log_scenario),
    Scenario("small_files", "small files", GOALS["small_files"], small_files),
    Scenario("cold_refold", "cold re-fold", GOALS["cold_refold"], cold_refold),
    Scenario("fold_engine", "fold engine", GOALS["fold_engine"], fold_engine),
    Scenario("incremental", "incremental", GOALS["incremental"], incremental),
    Scenario("point_query", "point query", GOALS["point_query"], point_query),
    Scenario("grading", "grading", GOALS["grading"], grading),
    Scenario("export", "export", GOALS["export"], export),
    Scenario("s3_commit", "S3 commit", GOALS["s3_commit"], s3_commit),
    Scenario("scale_fold", "scale: materialize", _scale_fold.GOAL, _scale_fold.scale_fold),
    _scale_sql.SCENARIO,
    Scenario("group_commit", "group commit", _rec.GOALS["group_commit"], _rec.group_commit),
    Scenario("group_commit_p99", "group commit p99", _rec.GOALS["group_commit_p99"],
             _rec.group_commit_p99),
    Scenario("group_commit_s3", "group commit S3", _rec.GOALS["group_commit_s3"],
             _rec.group_commit_s3),
    Scenario("s3_writers", "S3 writers", _rec.GOALS["s3_writers"], _rec.s3_writers),
    Scenario("recorder_memory", "recorder memory", _rec.GOALS["recorder_memory"],
             _rec.recorder_memory),
    Scenario("view", "viewer pages", _view.GOAL, _view.view),
]
