"""The fold: committed events -> episode tables, as SQL text kept as data
(docs/DESIGN.md, "SQL views").

``VIEW_SQL`` maps each view to the exact SQL DuckDB runs (print it, read it, diff it).
``connect()`` serves the views from the materialized state plus a fold of the runs
touched since (``_sql.py``), or runs these texts over the log's events; the
materializer (``_state.py``) runs the very same texts into tables, so a view and the
stored state can never fold differently. The fold is total and deterministic: every
event is kept, forbidden ones are folded by the same rules and listed in ``anomalies``.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import uuid
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, Literal, get_args

import duckdb
import duckdb.func
import pyarrow as pa

from poimen_data.errors import ValidationError
from poimen_data.log._log import EventLog
from poimen_data.model import _events as ev
from poimen_data.model._limits import short_repr

#: Run-level kinds and the run state each one leaves behind (docs/DESIGN.md, "Domain").
RUN_LEVEL_KINDS = ("run_started", "verifying_entered", "branch_forked", "run_finished",
                   "run_cancelled")
ATTEMPT_KINDS = ("attempt_dispatched", "attempt_finished", "attempt_recovered")

#: The total order of every view and of every materialized table. Total, so that the
#: same events always give the same rows in the same order (and the same parquet bytes).
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "attempts": ("run_id", "branch_id", "step_index NULLS LAST", "attempt_no", "step_id"),
    "branches": ("run_id", "branch_id"),
    "runs": ("run_id",),
    "trajectories": ("run_id", "trajectory_branch_id", "branch_id", "step_index NULLS LAST",
                     "attempt_no", "step_id"),
    "verdicts": ("run_id", "lsn"),
    "reductions": ("lsn",),
    "anomalies": ("run_id", "lsn", "reason"),
}

_ATTEMPTS = """
-- One row per (run, branch, step, attempt), whatever its outcome. Its state is that of
-- its last event by LSN; every other field keeps its last non-null value (arg_max skips
-- NULL arguments). workflow_version: the dispatch's when given, else the run's (from the
-- run_started that started it: the first).
WITH folded AS (
    SELECT run_id, branch_id, step_id, attempt_no,
           arg_max(tenant, lsn)                                   AS tenant,
           arg_max(step_index, lsn)                               AS step_index,
           arg_max(CASE kind WHEN 'attempt_dispatched' THEN 'dispatched'
                   ELSE state END, lsn)                           AS state,
           arg_max(workflow_version, lsn)                         AS dispatch_version,
           arg_max(context, lsn)                                  AS context,
           arg_max(prompt, lsn)                                   AS prompt,
           arg_max(output, lsn)                                   AS output,
           arg_max(tools, lsn)                                    AS tools,
           arg_max(usage, lsn)                                    AS usage,
           arg_max(error, lsn)                                    AS error,
           arg_max(kind, lsn) = 'attempt_recovered'               AS recovered,
           min(lsn)                                               AS first_lsn,
           max(lsn)                                               AS last_lsn
    FROM events
    WHERE kind IN ('attempt_dispatched', 'attempt_finished', 'attempt_recovered')
    GROUP BY run_id, branch_id, step_id, attempt_no
), run_version AS (
    SELECT run_id, arg_min(workflow_version, lsn) AS workflow_version
    FROM events WHERE kind = 'run_started' GROUP BY run_id
)
SELECT a.run_id, a.tenant, a.branch_id, a.step_id, a.step_index, a.attempt_no, a.state,
       coalesce(a.dispatch_version, r.workflow_version) AS workflow_version,
       a.context, a.prompt, a.output, a.tools, a.usage, a.error, a.recovered,
       a.first_lsn, a.last_lsn
FROM folded a LEFT JOIN run_version r USING (run_id)
"""

_BRANCHES = """
-- Branch 0 of every run that any event names, plus one row per forked branch (a repeated
-- fork of the same branch id: last by LSN wins). The live branch is the one of the highest
-- branch_id: the newest in a log whose forks take max + 1 (one that does not is an anomaly).
WITH run_ids AS (
    SELECT DISTINCT run_id FROM events WHERE run_id IS NOT NULL
), forks AS (
    SELECT run_id, branch_id,
           arg_max(parent_branch_id, lsn) AS parent_branch_id,
           arg_max(fork_step_index, lsn)  AS fork_step_index,
           max(lsn)                       AS fork_lsn
    FROM events WHERE kind = 'branch_forked' AND branch_id <> 0
    GROUP BY run_id, branch_id
), every_branch AS (
    SELECT run_id, 0::BIGINT AS branch_id, NULL::BIGINT AS parent_branch_id,
           NULL::BIGINT AS fork_step_index, NULL::BIGINT AS fork_lsn
    FROM run_ids
    UNION ALL
    SELECT run_id, branch_id, parent_branch_id, fork_step_index, fork_lsn FROM forks
)
SELECT run_id, branch_id, parent_branch_id, fork_step_index, fork_lsn,
       branch_id = max(branch_id) OVER (PARTITION BY run_id) AS is_live
FROM every_branch
"""

_RUNS = """
-- One row per run that any event names. Its state is the effect of its last run-level
-- event by LSN; tenant, workflow_version and started_at come from the run_started that
-- started it (the first: a later one, another tenant's above all, is an anomaly and
-- never takes the run over).
WITH run_level AS (
    SELECT run_id,
           arg_max(CASE kind WHEN 'run_started' THEN 'running'
                             WHEN 'verifying_entered' THEN 'verifying'
                             WHEN 'branch_forked' THEN 'running'
                             WHEN 'run_finished' THEN outcome
                             WHEN 'run_cancelled' THEN 'cancelled' END, lsn) AS state,
           arg_max(ts, lsn)                                                  AS last_ts,
           arg_min(tenant, lsn) FILTER (WHERE kind = 'run_started')          AS tenant,
           arg_min(workflow_version, lsn) FILTER (WHERE kind = 'run_started')
                                                                             AS workflow_version,
           arg_min(ts, lsn) FILTER (WHERE kind = 'run_started')              AS started_at,
           max(lsn) FILTER (WHERE kind = 'verifying_entered')                AS verifying_lsn
    FROM events
    WHERE kind IN ('run_started', 'verifying_entered', 'branch_forked', 'run_finished',
                   'run_cancelled')
    GROUP BY run_id
), seen AS (
    SELECT run_id, arg_min(tenant, lsn) AS first_tenant, max(lsn) AS last_lsn
    FROM events WHERE run_id IS NOT NULL GROUP BY run_id
), per_branch AS (
    SELECT run_id, count(*) AS n_branches, max(branch_id) AS live_branch
    FROM branches GROUP BY run_id
), per_attempt AS (
    SELECT run_id, count(*) AS n_attempts,
           count(*) FILTER (WHERE state IN ('failed', 'timed_out')) AS n_failed_attempts,
           sum(usage.cost_usd) AS cost_usd
    FROM attempts GROUP BY run_id
)
SELECT s.run_id,
       coalesce(l.tenant, s.first_tenant)                   AS tenant,
       l.workflow_version,
       l.state,
       b.live_branch,
       b.n_branches,
       coalesce(a.n_attempts, 0)                            AS n_attempts,
       coalesce(a.n_failed_attempts, 0)                     AS n_failed_attempts,
       a.cost_usd::DECIMAL(38, 9)                           AS cost_usd,
       l.started_at,
       CASE WHEN l.state IN ('succeeded', 'failed', 'cancelled') THEN l.last_ts END
                                                            AS ended_at,
       l.verifying_lsn,
       s.last_lsn
FROM seen s
LEFT JOIN run_level l USING (run_id)
LEFT JOIN per_branch b USING (run_id)
LEFT JOIN per_attempt a USING (run_id)
"""

_TRAJECTORIES = """
-- trajectory(0) = branch 0's attempts; trajectory(b) = trajectory(parent(b)) restricted
-- to step_index < fork_step_index(b), then b's own attempts. Walking up from b, an
-- ancestor's attempts are kept below the smallest fork point met on the way. A parent's
-- branch_id is always lower than its child's, so ordering by the recording branch_id
-- puts inherited attempts first, then by step_index (never by LSN).
WITH RECURSIVE chain(run_id, trajectory_branch_id, branch_id, step_limit) AS (
    SELECT run_id, branch_id, branch_id, NULL::BIGINT FROM branches
    UNION ALL
    SELECT c.run_id, c.trajectory_branch_id, b.parent_branch_id,
           least(coalesce(c.step_limit, b.fork_step_index), b.fork_step_index)
    FROM chain c
    JOIN branches b ON b.run_id = c.run_id AND b.branch_id = c.branch_id
    JOIN branches p ON p.run_id = b.run_id AND p.branch_id = b.parent_branch_id
)
SELECT a.run_id, a.tenant, a.branch_id, a.step_id, a.step_index, a.attempt_no, a.state,
       a.workflow_version, a.context, a.prompt, a.output, a.tools, a.usage, a.error,
       a.recovered, a.first_lsn, a.last_lsn,
       c.trajectory_branch_id,
       t.is_live
FROM chain c
JOIN attempts a ON a.run_id = c.run_id AND a.branch_id = c.branch_id
JOIN branches t ON t.run_id = c.run_id AND t.branch_id = c.trajectory_branch_id
WHERE c.step_limit IS NULL OR a.step_index < c.step_limit
"""

_VERDICTS = """
-- A run verdict has step_id and attempt_no NULL and branch_id the snapshot's live branch;
-- an attempt verdict names the attempt it judged: (branch_id, step_id, attempt_no) join
-- the attempts view. Logs written before attempt verdicts existed have only run verdicts.
SELECT run_id, tenant, branch_id, verifier, snapshot_lsn, passed, score, detail, lsn,
       step_id, attempt_no
FROM events WHERE kind = 'verdict_recorded'
"""

_REDUCTIONS = """
SELECT tenant, original, summary, lsn FROM events WHERE kind = 'blob_reduced'
"""

_ANOMALIES = """
-- Events the state machine forbids. They are folded like any other event; this view
-- says which and why. Every rule looks at one run's events only.
WITH e AS (
    SELECT lsn, kind, tenant, run_id, branch_id, step_id, attempt_no, parent_branch_id
    FROM events WHERE run_id IS NOT NULL
), started AS (
    SELECT run_id, min(lsn) AS lsn, arg_min(tenant, lsn) AS tenant
    FROM e WHERE kind = 'run_started' GROUP BY run_id
), cancelled AS (
    SELECT run_id, min(lsn) AS lsn FROM e WHERE kind = 'run_cancelled' GROUP BY run_id
), forked AS (
    SELECT run_id, branch_id, min(lsn) AS lsn FROM e WHERE kind = 'branch_forked'
    GROUP BY run_id, branch_id
), dispatched AS (
    SELECT run_id, branch_id, step_id, attempt_no, min(lsn) AS lsn
    FROM e WHERE kind = 'attempt_dispatched' GROUP BY run_id, branch_id, step_id, attempt_no
), forks AS (
    SELECT lsn, kind, run_id, branch_id,
           coalesce(max(branch_id) OVER (PARTITION BY run_id ORDER BY lsn
                    ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS prior_max
    FROM e WHERE kind = 'branch_forked'
), run_steps AS (  -- each run-level event with the run's state just before it, the
    SELECT lsn, kind, run_id,  -- LSN of its first finish, and of its first cancel (or
    -- the event's own when there is none: lsn <= cancelled_lsn reads "not after a cancel")
           lag(CASE kind WHEN 'run_started' THEN 'running'
                         WHEN 'verifying_entered' THEN 'verifying'
                         WHEN 'branch_forked' THEN 'running'
                         WHEN 'run_finished' THEN 'finished'
                         WHEN 'run_cancelled' THEN 'cancelled' END)
               OVER (PARTITION BY run_id ORDER BY lsn) AS before,
           min(CASE kind WHEN 'run_finished' THEN lsn END)
               OVER (PARTITION BY run_id) AS finished_lsn,
           coalesce(min(CASE kind WHEN 'run_cancelled' THEN lsn END)
               OVER (PARTITION BY run_id), lsn) AS cancelled_lsn
    FROM e WHERE kind IN ('run_started', 'verifying_entered', 'branch_forked',
                          'run_finished', 'run_cancelled')
), attempt_steps AS (  -- each attempt-level event with the attempt's event just before it
    SELECT lsn, kind, run_id, branch_id, step_id, attempt_no,
           lag(kind) OVER (PARTITION BY run_id, branch_id, step_id, attempt_no
                           ORDER BY lsn) AS before
    FROM e WHERE kind IN ('attempt_dispatched', 'attempt_finished', 'attempt_recovered')
)
SELECT e.lsn, e.kind, e.run_id, 'event of an unknown run' AS reason
FROM e LEFT JOIN started s USING (run_id)
WHERE e.kind <> 'run_started' AND (s.lsn IS NULL OR s.lsn > e.lsn)
UNION ALL
SELECT e.lsn, e.kind, e.run_id, 'run started twice'
FROM e JOIN started s USING (run_id)
WHERE e.kind = 'run_started' AND e.lsn > s.lsn
UNION ALL
SELECT e.lsn, e.kind, e.run_id, 'event of another tenant than the run''s'
FROM e JOIN started s USING (run_id)
WHERE e.lsn > s.lsn AND e.tenant <> s.tenant
UNION ALL
SELECT e.lsn, e.kind, e.run_id, 'run event after cancel'
FROM e JOIN cancelled c USING (run_id)
WHERE e.kind IN ('run_started', 'verifying_entered', 'branch_forked', 'run_finished',
                 'run_cancelled') AND e.lsn > c.lsn
UNION ALL
SELECT e.lsn, e.kind, e.run_id,
       CASE e.kind WHEN 'attempt_finished' THEN 'finished without a dispatch'
                   ELSE 'recovered without a dispatch' END
FROM e LEFT JOIN dispatched d USING (run_id, branch_id, step_id, attempt_no)
WHERE e.kind IN ('attempt_finished', 'attempt_recovered') AND (d.lsn IS NULL OR d.lsn > e.lsn)
UNION ALL
SELECT e.lsn, e.kind, e.run_id, 'attempt number dispatched twice'
FROM e JOIN dispatched d USING (run_id, branch_id, step_id, attempt_no)
WHERE e.kind = 'attempt_dispatched' AND e.lsn > d.lsn
UNION ALL
SELECT e.lsn, e.kind, e.run_id, 'attempt on an unknown branch'
FROM e LEFT JOIN forked f USING (run_id, branch_id)
WHERE e.kind IN ('attempt_dispatched', 'attempt_finished', 'attempt_recovered')
  AND e.branch_id <> 0 AND (f.lsn IS NULL OR f.lsn > e.lsn)
UNION ALL
SELECT e.lsn, e.kind, e.run_id, 'fork of an unknown branch'
FROM e LEFT JOIN forked f ON f.run_id = e.run_id AND f.branch_id = e.parent_branch_id
WHERE e.kind = 'branch_forked' AND e.parent_branch_id <> 0 AND (f.lsn IS NULL OR f.lsn > e.lsn)
UNION ALL
SELECT lsn, kind, run_id, 'fork does not take the run''s max branch + 1'
FROM forks WHERE branch_id <> prior_max + 1
-- the rules below give one reason per event: after a cancel (above) goes first, then
-- after the run finished; a run not ended yet is judged by its state just before
UNION ALL
SELECT lsn, kind, run_id, 'run event after the run finished'
FROM run_steps WHERE lsn > finished_lsn AND lsn <= cancelled_lsn
UNION ALL
SELECT lsn, kind, run_id, 'run finished without verifying'
FROM run_steps WHERE kind = 'run_finished' AND before = 'running'
  AND lsn <= cancelled_lsn AND lsn = finished_lsn
UNION ALL
SELECT lsn, kind, run_id, 'verifying entered while verifying'
FROM run_steps WHERE kind = 'verifying_entered' AND before = 'verifying'
  AND lsn <= cancelled_lsn AND (finished_lsn IS NULL OR lsn < finished_lsn)
UNION ALL
SELECT s.lsn, s.kind, s.run_id, 'attempt event after the attempt ended'
FROM attempt_steps s JOIN dispatched d USING (run_id, branch_id, step_id, attempt_no)
WHERE s.kind IN ('attempt_finished', 'attempt_recovered') AND d.lsn < s.lsn
  AND s.before IN ('attempt_finished', 'attempt_recovered')
"""


_BODIES: dict[str, str] = {
    "attempts": _ATTEMPTS,
    "branches": _BRANCHES,
    "runs": _RUNS,
    "trajectories": _TRAJECTORIES,
    "verdicts": _VERDICTS,
    "reductions": _REDUCTIONS,
    "anomalies": _ANOMALIES,
}
#: name -> the SQL of the view, in an order where each text only names earlier ones.
VIEW_SQL: dict[str, str] = {
    name: f"{body.strip()}\nORDER BY {', '.join(TABLE_KEYS[name])}\n"
    for name, body in _BODIES.items()
}
VIEWS = ("runs", "branches", "attempts", "trajectories", "verdicts", "reductions", "anomalies")
#: Tables whose every row belongs to one run (re-folded per run by the materializer).
PER_RUN_TABLES = ("runs", "branches", "attempts", "trajectories", "verdicts", "anomalies")

#: Names the fold as a whole; a state made under another fold version is never served.
#: It covers the view texts and the event schema they read, so a change of either (a
#: new column, a new meaning of one) rebuilds every state made before it.
FOLD_VERSION = "1-" + hashlib.sha256(
    "\n".join([*(f"-- {k}\n{v}" for k, v in VIEW_SQL.items()),
               f"-- events\n{ev.LOG_SCHEMA}"]).encode()
).hexdigest()[:16]

REF_SQL_TYPE = "STRUCT(tenant VARCHAR, sha256 VARCHAR, size BIGINT)"


#: Environment variable that sets DuckDB's memory limit for every fold and query.
MEMORY_ENV = "POIMEN_MEMORY_LIMIT"


def default_memory_limit() -> str:
    """A quarter of the machine's physical memory (2 GiB where it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return "2GiB"
    return f"{max(64, total // 4 >> 20)}MiB"


#: the smallest and largest memory limit taken (bytes): DuckDB's own buffers need more
#: than a few MiB, and DuckDB's setting holds no more than the second
MIN_MEMORY_LIMIT = 16 << 20
MAX_MEMORY_LIMIT = 1 << 62

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 1 << 10,  # as DuckDB
          "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "B": 1,  # reads them ('4G' is
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}  # 4 GB there too)


def memory_bytes(value: Any, where: str = "memory_limit") -> int:
    """A memory limit in bytes: an int or a str of digits (an environment variable or a CLI
    option), or a size such as ``"2GB"``, ``"4G"`` or ``"512 MiB"`` (the units DuckDB
    reads; no percentages), from ``MIN_MEMORY_LIMIT`` to ``MAX_MEMORY_LIMIT``; anything
    else is a ``ValidationError`` naming ``where``. One rule for queries and jobs alike."""
    size: int | None = None
    if isinstance(value, str):
        s = value.strip().upper().replace(" ", "")
        if re.fullmatch(r"[0-9]{1,30}", s):
            s += "B"
        for u, mult in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
            number = s[:-len(u)]
            # ASCII digits only ('²'.isdigit() is true); Decimal: no float overflow
            if s.endswith(u) and re.fullmatch(r"[0-9]{1,30}(\.[0-9]{1,30})?", number):
                size = int(Decimal(number) * mult)
                break
    elif not isinstance(value, bool) and isinstance(value, int):
        size = value
    if size is not None and MIN_MEMORY_LIMIT <= size <= MAX_MEMORY_LIMIT:
        return size
    raise ValidationError(f"{where}: expected a size such as '2GB' or a number of bytes, "
                          f"from 16 MiB (DuckDB runs out of memory below) to 2**62, got "
                          f"{short_repr(value)}")


def memory_limit(value: int | str | None = None) -> str:
    """DuckDB's memory limit: ``value`` (``memory_bytes``), else ``$POIMEN_MEMORY_LIMIT``,
    else a quarter of the machine's memory."""
    where = "memory_limit"
    if value is None:
        value, where = os.environ.get(MEMORY_ENV) or None, MEMORY_ENV
        if value is None:
            return default_memory_limit()
    return f"{memory_bytes(value, where) >> 10}KiB"


def new_connection(events: pa.Table | None = None, *, progress: bool = False,
                   memory: int | str | None = None) -> duckdb.DuckDBPyConnection:
    """A private DuckDB connection, ``events`` registered when given, the session pinned
    to UTC (timestamps come back as UTC, whatever the machine's zone), memory capped by
    ``memory_limit(memory)`` and spilling to a temp directory of its own that DuckDB
    makes on first use and removes at close (never ``.tmp`` in the working directory).
    Internal folds print no progress bar (it would land in the middle of a CLI's output)."""
    limit = memory_limit(memory)
    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    try:
        con.execute(f"SET memory_limit = '{limit.replace(chr(39), '')}'")
    except duckdb.Error as exc:
        con.close()
        where = MEMORY_ENV if memory is None and os.environ.get(MEMORY_ENV) else "memory_limit"
        raise ValidationError(f"{where}: not a memory size: {limit!r} ({exc})") from None
    spill = os.path.join(tempfile.gettempdir(),
                         f"poimen-duckdb-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    con.execute(f"SET temp_directory = '{spill.replace(chr(39), chr(39) * 2)}'")
    if not progress:
        try:
            con.execute("SET enable_progress_bar = false")
        except duckdb.InvalidInputException:
            pass  # in Jupyter without ipywidgets DuckDB refuses to touch the setting at all
    if events is not None:
        con.register("events", events)
    return con


def create_fold_tables(con: duckdb.DuckDBPyConnection, names: tuple[str, ...] = VIEWS, *,
                       ordered: bool = True, temp: bool = False) -> None:
    """Run the fold texts into tables registered in ``con`` (whose ``events`` is set).

    Each text runs once and later texts read its table, so ``attempts`` is folded once
    even though ``runs`` and ``trajectories`` build on it. ``ordered=False`` skips the
    views' ORDER BY, for callers that sort the rows their own way anyway.
    ``temp=True`` keeps each table in DuckDB (a TEMP TABLE, which DuckDB spills under its
    ``memory_limit``) instead of a Python-held Arrow table.
    """
    needed = set(names)
    if needed & {"runs", "trajectories"}:
        needed |= {"attempts", "branches"}
    texts = VIEW_SQL if ordered else _BODIES
    for name, sql in texts.items():
        if name in needed and temp:
            con.execute(f"CREATE TEMP TABLE {name} AS {sql}")
        elif name in needed:  # an Arrow result registered back is cheaper than a TEMP TABLE
            con.register(name, con.sql(sql).to_arrow_table())


def fold_tables(events: pa.Table, names: tuple[str, ...] = VIEWS) -> dict[str, pa.Table]:
    """Run the fold over an events table (``events.LOG_SCHEMA``) and return each table."""
    con = new_connection(events)
    try:
        create_fold_tables(con, names)
        return {name: con.sql(f"SELECT * FROM {name}").to_arrow_table() for name in names}
    finally:
        con.close()


def run_events(log: EventLog, run_ids: Sequence[str] | pa.Array, *, at_lsn: int,
               min_lsn: int = 1) -> pa.Table:
    """The events of some runs up to ``at_lsn`` (``min_lsn`` bounds what is read), kept
    as the segments stream past: memory holds those runs' events, never the log."""
    return pa.Table.from_batches(list(log.scan(at_lsn, min_lsn, run_ids=run_ids)),
                                 ev.LOG_SCHEMA)


Source = Literal["auto", "state", "log"]
#: Where a read is served from (``Source``): the state plus the tail, the state alone, the log.
SOURCES: tuple[str, ...] = get_args(Source)


def register_blob_text(con: duckdb.DuckDBPyConnection, log: EventLog) -> None:
    """``blob_text(ref)``: the body of a ref as text (None once reduced), read at call
    time through ``log.blobs`` (so a counting wrapper installed later sees the calls)."""

    def blob_text(ref: dict[str, Any] | None) -> str | None:
        if ref is None:
            return None
        body = log.blobs.get(ev.BlobRef(ref["tenant"], ref["sha256"], ref["size"]))
        return None if body is None else body.decode("utf-8", errors="replace")

    con.create_function("blob_text", blob_text, [REF_SQL_TYPE], "VARCHAR",
                        null_handling=duckdb.func.SPECIAL, side_effects=True)


def view_sql(name: str) -> str:
    """The SQL text of one view, as ``connect()`` registers it (for ``--explain``)."""
    if name not in VIEW_SQL:
        raise KeyError(f"no view {name!r}; views: {', '.join(VIEWS)}")
    return VIEW_SQL[name]


__all__ = ["FOLD_VERSION", "MEMORY_ENV", "TABLE_KEYS", "VIEWS", "VIEW_SQL",
           "create_fold_tables", "fold_tables", "memory_limit", "new_connection", "run_events",
           "view_sql"]
