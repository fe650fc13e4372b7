"""The rows an export writes (docs/DESIGN.md, "Export"): refs and metadata of the live
trajectories in ``(run_id, pos)`` order, from SQL over the fold, under a memory budget.

A log larger than its budget is exported one group of run buckets at a time (the
buckets of ``fold._build``): each group's rows are sorted in DuckDB and spilled to a temp
file, then the groups are merged back into the one global order (a run lives in one
bucket), so the bytes are those of a single query. From a state, each group reads the
views through ``connect``; from the log, one scan spills the events by group and each
group folds alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import NotFound, ValidationError
from poimen_data.fold import _build as B
from poimen_data.fold import _fold, _state
from poimen_data.fold._connect import connect
from poimen_data.jobs._export_formats import VERDICT_TYPE
from poimen_data.log._log import EventLog

#: Rows per batch of a group's spilled rows (the merge holds one batch per group).
SPILL_ROWS = 2048

_LIVE_SQL = """
WITH vd AS (
    SELECT v.run_id,
           list({{'verifier': v.verifier, 'passed': v.passed, 'score': v.score::DOUBLE,
                  'snapshot_lsn': v.snapshot_lsn::BIGINT}}
                ORDER BY v.snapshot_lsn, v.verifier, v.lsn) AS verdicts
    FROM verdicts v JOIN runs r ON r.run_id = v.run_id AND v.branch_id = r.live_branch
    WHERE v.step_id IS NULL {vwhere}
    GROUP BY v.run_id
), va AS (
    SELECT v.run_id, v.branch_id, v.step_id, v.attempt_no,
           list({{'verifier': v.verifier, 'passed': v.passed, 'score': v.score::DOUBLE,
                  'snapshot_lsn': v.snapshot_lsn::BIGINT}}
                ORDER BY v.snapshot_lsn, v.verifier, v.lsn) AS verdicts
    FROM verdicts v WHERE v.step_id IS NOT NULL {vwhere}
    GROUP BY v.run_id, v.branch_id, v.step_id, v.attempt_no
)
SELECT t.run_id, t.tenant, t.branch_id, t.step_id, t.step_index, t.attempt_no, t.state,
       t.workflow_version, t.usage, t.tools, t.error, t.trajectory_branch_id AS live_branch,
       coalesce(rp.summary, t.prompt) AS prompt_ref, rp.summary IS NOT NULL AS prompt_reduced,
       coalesce(ro.summary, t.output) AS output_ref, ro.summary IS NOT NULL AS output_reduced,
       list_concat(coalesce(vd.verdicts, []::{verdict_type}[]),
                   coalesce(va.verdicts, []::{verdict_type}[])) AS verdicts,
       len(coalesce(vd.verdicts, []::{verdict_type}[])) AS run_verdicts,
       row_number() OVER (PARTITION BY t.run_id ORDER BY {trajectory_order}) AS pos
FROM trajectories t
LEFT JOIN _export_red rp ON rp.tenant = t.prompt.tenant AND rp.sha256 = t.prompt.sha256
LEFT JOIN _export_red ro ON ro.tenant = t.output.tenant AND ro.sha256 = t.output.sha256
LEFT JOIN vd ON vd.run_id = t.run_id
LEFT JOIN va ON va.run_id = t.run_id AND va.branch_id = t.branch_id
            AND va.step_id = t.step_id AND va.attempt_no = t.attempt_no
WHERE t.is_live {where}
"""

#: The latest summary of each reduced body (reductions belong to no run: made once).
_RED_SQL = """CREATE OR REPLACE TEMP TABLE _export_red AS
    SELECT tenant, original.sha256 AS sha256, arg_max(summary, lsn) AS summary
    FROM reductions GROUP BY tenant, original.sha256"""

_PAIRS_SQL = """
SELECT * FROM (
    SELECT r.run_id, r.tenant, r.step_id, r.step_index,
           c.branch_id AS chosen_branch_id, c.attempt_no AS chosen_attempt_no,
           c.workflow_version AS chosen_workflow_version,
           r.branch_id AS rejected_branch_id, r.attempt_no AS rejected_attempt_no,
           r.state AS rejected_state, r.workflow_version AS rejected_workflow_version,
           r.prompt_ref, r.prompt_reduced, c.output_ref AS chosen_ref,
           c.output_reduced AS chosen_reduced, r.output_ref AS rejected_ref,
           r.output_reduced AS rejected_reduced, r.verdicts, r.pos
    FROM export_live r JOIN export_live c
      ON c.run_id = r.run_id AND c.step_id = r.step_id
     AND c.step_index IS NOT DISTINCT FROM r.step_index AND c.pos > r.pos
     AND c.state = 'succeeded'
    WHERE r.state IN ('failed', 'timed_out')
    QUALIFY row_number() OVER (PARTITION BY r.run_id, r.pos ORDER BY c.pos) = 1
)
WHERE prompt_ref IS NOT NULL AND chosen_ref IS NOT NULL AND rejected_ref IS NOT NULL
ORDER BY run_id, pos
"""


@dataclass(frozen=True)
class Options:
    """What decides which rows an export writes."""

    format: str
    runs: tuple[str, ...] | None
    only_succeeded: bool
    keep_unanswered: bool


@dataclass
class Rows:
    """The rows to write, in order, and what the report needs before the first one."""

    batches: Iterable[pa.RecordBatch]
    source: str  # "state", "state+log" or "log"
    total_runs: int
    skipped: tuple[int, int]  # (no output, no prompt): see ``ExportReport``


@contextlib.contextmanager
def export_rows(log: EventLog, source: str, lsn: int, opts: Options, budget: B.Budget,
                tmp: str) -> Iterator[Rows]:
    """The rows of an export at ``lsn`` (valid while the block runs); ``tmp`` is a
    folder for the groups' spilled rows. One query when the log fits the budget."""
    groups = _state.plan_groups(log, lsn, budget, None)
    with contextlib.ExitStack() as stack:
        con, used = _connect(log, source, lsn, budget)
        stack.callback(con.close)
        query = _query(opts)
        if len(groups) == 1 and used == "log":
            # the fold once, into tables: each of the views' many reads of ``events``
            # scanned the whole log again (23 scans of it for one export)
            con.close()
            con = stack.enter_context(B.connection(budget))
            _fold_once(con, log, lsn)
        if len(groups) == 1 or used != "log":
            if opts.runs is not None:
                _check_runs(opts.runs, _found(con, opts.runs, None))
            con.execute(_RED_SQL)
        if len(groups) == 1:
            _select(con, opts, None)
            total = int(con.sql(f"SELECT count(DISTINCT run_id) FROM ({query})"
                                ).fetchall()[0][0])
            skipped = _skipped(con, opts)
            yield Rows(con.sql(query).to_arrow_reader(_MAX_ROWS), used, total, skipped)
            return
        if used == "log":  # fold each group's events alone, not the views over the log
            con.close()
            con = stack.enter_context(B.connection(budget))  # every query orders its rows
            parts = _fold_groups(con, log, lsn, groups, opts, tmp, budget)
        else:
            parts = iter(groups)  # the views hold every run: a query keeps the group's
        files, total, no_out, no_prompt = [], 0, 0, 0
        found: set[str] = set()
        for i, in_group in enumerate(parts):
            if opts.runs is not None and used == "log":
                found |= _found(con, opts.runs, in_group)
            _select(con, opts, in_group)
            total += int(con.sql(f"SELECT count(DISTINCT run_id) FROM ({query})"
                                 ).fetchall()[0][0])
            a, b = _skipped(con, opts)
            no_out, no_prompt = no_out + a, no_prompt + b
            path = os.path.join(tmp, f"rows-{i:04d}.arrow")
            if _spill(con.sql(query).to_arrow_reader(SPILL_ROWS), path):
                files.append(path)
            con.execute("DROP TABLE export_live")
        if opts.runs is not None and used == "log":
            _check_runs(opts.runs, found)
        yield Rows(_merged(files), used, total, (no_out, no_prompt))


#: At most this many rows per batch from DuckDB (re-cut by the pipeline anyway).
_MAX_ROWS = 8192


def _fold_once(con: Any, log: EventLog, lsn: int) -> None:
    """The tables the export reads, folded from one scan of the log up to ``lsn`` (which
    fits the budget: one bucket group), as ``_fold_groups`` folds each group."""
    con.register("_scan", log.scan_events(lsn, batch_rows=B.BATCH_ROWS))
    con.execute("CREATE TEMP TABLE events AS SELECT * FROM _scan")
    con.unregister("_scan")
    _fold.create_fold_tables(con, ("reductions", "runs", "trajectories", "verdicts"),
                             ordered=False, temp=True)
    con.execute("DROP TABLE events")


def _fold_groups(con: Any, log: EventLog, lsn: int, groups: list[tuple[int, ...]],
                 opts: Options, tmp: str, budget: B.Budget) -> Iterator[tuple[int, ...] | None]:
    """Spill the events by group in one scan, then fold each group's runs into the tables
    the export reads, in as many slices of the group (by more digits of the same md5) as
    the budget needs: a fold never grows with the log. ``reductions`` is folded once (its
    events belong to no run and land in group 0). Yields None per slice: its tables hold
    its runs only."""
    where = ""
    if opts.runs is not None:
        con.register("_export_wanted", pa.table({"run_id": pa.array(opts.runs, pa.string())}))
        where = "WHERE run_id IS NULL OR run_id IN (SELECT run_id FROM _export_wanted)"
    size = sum(s.size for s in log.segments(lsn))
    wanted = -(-size * _state.PASS_FACTOR // max(1, budget.memory_limit))
    slices = max(1, -(-wanted // len(groups)))
    parts = B.spill_groups(con, log, lsn, groups, os.path.join(tmp, "events"), where=where)
    tables = ("runs", "trajectories", "verdicts")
    for i, part in enumerate(parts):
        B.load_group(con, part, "_export_group")
        if i == 0:
            con.execute("CREATE TEMP TABLE events AS SELECT * FROM _export_group "
                        "WHERE run_id IS NULL")
            _fold.create_fold_tables(con, ("reductions",), ordered=False, temp=True)
            con.execute("DROP TABLE events")
            con.execute(_RED_SQL)
        for j in range(slices):
            keep = "" if slices == 1 else \
                f"WHERE ((('0x' || substr(md5(run_id), 9, 8))::UBIGINT) % {slices}) = {j}"
            con.execute(f"CREATE TEMP TABLE events AS SELECT * FROM _export_group {keep}")
            _fold.create_fold_tables(con, tables, ordered=False, temp=True)
            con.execute("DROP TABLE events")
            yield None
            for t in (*tables, "attempts", "branches"):
                con.execute(f"DROP TABLE IF EXISTS {t}")
        con.execute("DROP TABLE _export_group")


def _spill(reader: pa.RecordBatchReader, path: str) -> bool:
    """Write a group's sorted rows to an Arrow IPC file; False (and no file) when none."""
    wrote = False
    opts = pa.ipc.IpcWriteOptions(compression="lz4")
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, reader.schema, options=opts) as w:
        for b in reader:
            if b.num_rows:
                w.write_batch(b)
                wrote = True
    if not wrote:
        os.remove(path)
    return wrote


def _file_batches(path: str) -> Iterator[pa.RecordBatch]:
    with pa.OSFile(path, "rb") as f:
        r = pa.ipc.open_file(f)
        for i in range(r.num_record_batches):
            yield r.get_batch(i)


def _merged(paths: list[str]) -> Iterator[pa.RecordBatch]:
    """The rows of several files, each sorted by ``(run_id, pos)`` and holding disjoint
    runs, in that order overall. Each round takes, from every file, its rows up to the
    smallest last ``run_id`` of the batches in hand (so one batch is used up per round)
    and sorts them by ``run_id`` stably (a run's rows stay in their order)."""
    heads: list[tuple[pa.RecordBatch, Iterator[pa.RecordBatch]]] = []
    for p in paths:
        it = _file_batches(p)
        b = next(it, None)
        if b is not None:
            heads.append((b, it))
    while heads:
        frontier = min(b.column("run_id")[b.num_rows - 1].as_py() for b, _ in heads)
        pieces, nxt = [], []
        for b, it in heads:
            k = pc.sum(pc.less_equal(b.column("run_id"), frontier)).as_py() or 0
            if k:
                pieces.append(b.slice(0, k))
            rest: pa.RecordBatch | None = b.slice(k) if k < b.num_rows else next(it, None)
            if rest is not None:
                nxt.append((rest, it))
        heads = nxt
        t = pa.Table.from_batches(pieces)
        if len(pieces) > 1:
            t = t.take(pc.sort_indices(t, sort_keys=[("run_id", "ascending")]))
        yield from t.to_batches()


# --- the SQL -----------------------------------------------------------------------------


def _connect(log: EventLog, source: str, lsn: int, budget: B.Budget) -> tuple[Any, str]:
    """A connection with the fold's views at ``lsn`` (``fold.connect``: the state's files
    and the segments are scanned, never loaded whole), and the source used: ``"state"``
    (a state at exactly ``lsn``), ``"state+log"`` (an older state, the runs later commits
    touched folded again), or ``"log"`` (a cold fold). The rows are the same whichever
    it is, so the bytes are too."""
    try:
        con = connect(log, lsn, source=source,  # type: ignore[arg-type]
                      memory_limit=budget.memory_limit)
    except NotFound as exc:
        raise NotFound(str(exc).replace("connect:", "export:", 1)) from None
    used = con.execute("SELECT getvariable('poimen_source')").fetchall()[0][0]
    return con, str(used)


def wanted_runs(runs: Iterable[str] | None) -> tuple[str, ...] | None:
    """``runs`` as sorted distinct ids (a ``ValidationError`` for anything but str)."""
    if runs is None:
        return None
    wanted = sorted(set(runs if not isinstance(runs, str) else [runs]))
    if not all(isinstance(r, str) for r in wanted):
        raise ValidationError("export: runs must be run ids (str)")
    return tuple(wanted)


def _in(buckets: tuple[int, ...] | None, col: str) -> str:
    """`` AND`` the condition that ``col`` is a run of ``buckets`` (nothing for None)."""
    if buckets is None:
        return ""
    return f" AND {B.bucket_sql(col)} IN ({', '.join(map(str, buckets))})"


def _found(con: Any, runs: tuple[str, ...], in_group: tuple[int, ...] | None) -> set[str]:
    and_group = _in(in_group, "run_id")
    return {r for (r,) in con.execute(
        f"SELECT run_id FROM runs WHERE list_contains($runs, run_id){and_group}",
        {"runs": list(runs)}).fetchall()}


def _check_runs(runs: tuple[str, ...], found: set[str]) -> None:
    missing = [r for r in runs if r not in found]
    if missing:
        raise NotFound(f"export: no run {', '.join(missing[:5])} in the log at this LSN")


def _select(con: Any, opts: Options, in_group: tuple[int, ...] | None) -> None:
    """Create the temp table ``export_live``: the rows to export (of the runs of the
    buckets ``in_group``, when given), refs and metadata only."""
    where, vwhere = [_in(in_group, "t.run_id")], [_in(in_group, "v.run_id")]
    params: dict[str, Any] = {}
    if opts.runs is not None:
        where.append("AND list_contains($runs, t.run_id)")
        params["runs"] = list(opts.runs)
    if opts.only_succeeded:
        where.append("AND t.state = 'succeeded'")
    sql = _LIVE_SQL.format(where=" ".join(where), vwhere=" ".join(vwhere),
                           verdict_type=_duck_type(VERDICT_TYPE),
                           trajectory_order=_trajectory_order())
    con.execute(f"CREATE OR REPLACE TEMP TABLE export_live AS {sql}", params)


def _query(opts: Options) -> str:
    if opts.format == "pairs":
        return _PAIRS_SQL
    return f"SELECT * FROM export_live {_chat_filter(opts)} ORDER BY run_id, pos"


def _chat_filter(opts: Options) -> str:
    """The chat format needs a user turn, and an assistant turn unless ``keep_unanswered``:
    a null message would train a model to stop at once."""
    if opts.format != "jsonl":
        return ""
    return "WHERE prompt_ref IS NOT NULL" + ("" if opts.keep_unanswered
                                             else " AND output_ref IS NOT NULL")


def _skipped(con: Any, opts: Options) -> tuple[int, int]:
    """(no output, no prompt) attempts the chat filter leaves out."""
    if opts.format != "jsonl":
        return 0, 0
    no_out, no_prompt = con.execute(
        "SELECT count(*) FILTER (prompt_ref IS NOT NULL AND output_ref IS NULL), "
        "count(*) FILTER (prompt_ref IS NULL) FROM export_live").fetchall()[0]
    return (0 if opts.keep_unanswered else int(no_out)), int(no_prompt)


def _trajectory_order() -> str:
    """The fold's order of the attempts within one trajectory (its table keys after run
    and trajectory), so the export and the ``trajectories`` view never disagree."""
    keys = [k for k in _fold.TABLE_KEYS["trajectories"]
            if k.split()[0] not in ("run_id", "trajectory_branch_id")]
    return ", ".join(f"t.{k}" for k in keys)


def _duck_type(t: pa.StructType) -> str:
    names = {pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN", pa.float64(): "DOUBLE",
             pa.int64(): "BIGINT"}
    return "STRUCT(" + ", ".join(f"{f.name} {names[f.type]}" for f in t) + ")"
