"""SQL over the materialized state plus the tail: the sources ``connect()`` serves.

A view reads the parquet files the state pointer names (never a glob: other generations
may sit beside them); the rows of the runs that later commits touched are replaced by a
fold of those runs' events, as ``episode(source="auto")`` and the incremental materialize
do (every fold rule looks at one run). ``events`` streams the segments on each scan.
"""

from __future__ import annotations

import sys
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import CorruptionError, NotFound, ValidationError
from poimen_data.fold._build import scan_errors
from poimen_data.fold._fold import (
    PER_RUN_TABLES,
    SOURCES,
    VIEW_SQL,
    Source,
    new_connection,
    register_blob_text,
    run_events,
)
from poimen_data.fold._query import resolve_lsn
from poimen_data.fold._state import INDEX, Pointer, locate, usable_pointer
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.model import _events as ev

#: Prefix of the names a state connection adds for itself (the stream, the tail schema).
_PREFIX = "_poimen"
#: The schema holding the tail's events and the fold's views over them.
TAIL = f"{_PREFIX}_tail"
#: A tail of events up to this size (Arrow bytes) is scanned in place, not copied.
ARROW_TAIL_BYTES = 64 << 20


class EventStream:
    """The log's events up to an LSN as an Arrow stream (the PyCapsule protocol) that
    DuckDB opens afresh on each scan: segments are read one at a time as DuckDB pulls
    batches, and nothing stays in memory between queries."""

    def __init__(self, log: EventLog, lsn: int) -> None:
        self._log = log
        self._lsn = lsn

    def __arrow_c_schema__(self) -> Any:
        return ev.LOG_SCHEMA.__arrow_c_schema__()

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        reader = pa.RecordBatchReader.from_batches(ev.LOG_SCHEMA, self._log.scan(self._lsn))
        return reader.__arrow_c_stream__(requested_schema)


def _files_sql(con: duckdb.DuckDBPyConnection, log: EventLog, ptr: Pointer,
               table: str, native: list[str]) -> str | None:
    """A scan over exactly the files the pointer lists (None when there are none). Local
    files are read by DuckDB's own parquet reader, in the pointer's order (which is the
    table's key order: no sort is needed), and their paths are added to ``native`` (the
    connection's variable ``poimen_files``, which ``lock_down`` allows and nothing
    else). Other storage is registered from Python as an Arrow dataset, so DuckDB opens
    no file of its own. A file a newer generation moved aside is read from where it
    went; the scan keeps these paths, so the connection survives one concurrent publish."""
    files = [locate(log, f, ptr) for f in ptr.tables.get(table, ())]
    if not files:
        return None
    paths = [log.storage.native_path(f) for f in files]
    if all(p is not None for p in paths):
        listed = [p for p in paths if p is not None]
        native.extend(listed)
        # the list as a variable: binding a view whose text spells out hundreds of
        # paths costs more than the query (DuckDB reads the variable when it binds)
        var = f"{_PREFIX}_files_{table}"
        con.execute(f"SET VARIABLE {var} = ?::VARCHAR[]", [listed])
        return f"read_parquet(getvariable('{var}'))"
    name = f"{_PREFIX}_state_{table}"
    con.register(name, log.storage.arrow_dataset(files))
    return name


def _load(con: duckdb.DuckDBPyConnection, sql: str, table: pa.Table) -> None:
    """Run ``sql`` with ``table`` as ``_poimen_arrow`` (copied into DuckDB, which may spill
    it; nothing stays registered)."""
    con.register(f"{_PREFIX}_arrow", table)
    try:
        con.execute(sql.format(arrow=f"{_PREFIX}_arrow"))
    finally:
        con.unregister(f"{_PREFIX}_arrow")


def tail_views(con: duckdb.DuckDBPyConnection, log: EventLog, ptr: Pointer, lsn: int,
               native: list[str]) -> None:
    """Schema ``_poimen_tail``: the events of the runs that commits in ``(ptr.lsn, lsn]``
    touched, from each run's first event (found through the state's run index), plus
    those commits' reductions; the fold's views over them (DuckDB binds a view's names in
    its own schema first); and ``touched``, the runs whose state rows they replace. The
    views fold when a query reads them, like the log's. A tail under
    ``ARROW_TAIL_BYTES`` stays an Arrow table DuckDB scans in place (copying it costs
    more than folding it). A tail whose segments pass ``ARROW_TAIL_BYTES`` (a state left
    behind a busy log) is never held here: its run ids are read first (one column), then
    its events stream into a DuckDB table, which may spill, under ``memory_limit``."""
    big = sum(s.size for s in log.segments(lsn, ptr.lsn + 1)) > ARROW_TAIL_BYTES
    new: pa.Table | None = None
    if big:
        seen: set[str] = set()
        for b in log.scan(lsn, ptr.lsn + 1, columns=("run_id",)):
            seen.update(pc.unique(b.column("run_id").drop_null()).to_pylist())
        touched = pa.array(sorted(seen), pa.string())
    else:
        new = pa.Table.from_batches(list(log.scan(lsn, ptr.lsn + 1)), ev.LOG_SCHEMA)
        touched = pc.unique(new.column("run_id").drop_null())
    con.register(f"{TAIL}_touched", pa.table({"run_id": touched}))
    lo = ptr.lsn + 1
    index = _files_sql(con, log, ptr, INDEX, native)
    if len(touched) and index is None and ptr.tables.get("runs"):
        lo = 1  # no run index: the touched runs' first events may be anywhere
    elif len(touched) and index is not None:
        first = con.execute(f"SELECT min(first_lsn) FROM {index} WHERE run_id IN "
                            f"(SELECT run_id FROM {TAIL}_touched)").fetchall()[0][0]
        lo = lo if first is None else min(lo, int(first))
    con.execute(f"CREATE SCHEMA {TAIL}")
    if new is None:  # the touched runs' events from their first, and all the tail's
        con.register(f"{_PREFIX}_arrow", log.scan_events(lsn, lo))
        try:
            with scan_errors():  # a damaged segment, raised inside DuckDB's read
                con.execute(f"CREATE TABLE {TAIL}.events AS SELECT * FROM {_PREFIX}_arrow "
                            f"WHERE lsn > {int(ptr.lsn)} OR run_id IN "
                            f"(SELECT run_id FROM {TAIL}_touched)")
        finally:
            con.unregister(f"{_PREFIX}_arrow")
    else:
        if lo <= ptr.lsn:
            new = pa.concat_tables([run_events(log, touched, at_lsn=ptr.lsn, min_lsn=lo),
                                    new])
        if new.nbytes <= ARROW_TAIL_BYTES:
            # registered under another name: a temp ``events`` would shadow its own
            con.register(f"{TAIL}_events", new)
            con.execute(f"CREATE VIEW {TAIL}.events AS SELECT * FROM {TAIL}_events")
        else:
            _load(con, f"CREATE TABLE {TAIL}.events AS SELECT * FROM {{arrow}}", new)
    for name, sql in VIEW_SQL.items():
        con.execute(f"CREATE VIEW {TAIL}.{name} AS {sql}")
    # the runs touched, as computed here: not a DISTINCT over the events at every query
    con.execute(f"CREATE VIEW {TAIL}.touched AS SELECT run_id FROM {TAIL}_touched")


def _state_views(con: duckdb.DuckDBPyConnection, log: EventLog, ptr: Pointer,
                 lsn: int) -> None:
    """Create the views over the state's files, topped up with the tail's fold. A view
    promises its rows, not their order (the files are in key order within each bucket
    only): sorting 10 M-event states for every query cost 3x the query itself."""
    tail = ptr.lsn < lsn
    native: list[str] = []
    if tail:
        tail_views(con, log, ptr, lsn, native)
    for t, sql in VIEW_SQL.items():  # in dependency order, for the empty ones
        # A table with no file is the fold's text over no rows (DuckDB never scans for it).
        src = _files_sql(con, log, ptr, t, native)
        body = f"SELECT * FROM {src or f'({sql}) WHERE false'}"
        if tail:
            if t in PER_RUN_TABLES:
                body = (f"SELECT s.* FROM {src or f'({sql}) WHERE false'} AS s ANTI JOIN "
                        f"{TAIL}.touched AS t ON s.run_id = t.run_id")
            body += f" UNION ALL BY NAME SELECT * FROM {TAIL}.{t}"
        con.execute(f"CREATE OR REPLACE VIEW {t} AS {body}")
    if native:
        con.execute("SET VARIABLE poimen_files = ?::VARCHAR[]", [native])


def _log_views(con: duckdb.DuckDBPyConnection) -> None:
    for name, sql in VIEW_SQL.items():  # DuckDB binds a view at creation: dependencies first
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")


def _connection(memory: int | str | None) -> duckdb.DuckDBPyConnection:
    # a progress bar only on a terminal: in Jupyter DuckDB's bar needs ipywidgets
    return new_connection(progress=sys.stderr.isatty(), memory=memory)


def _try_state(log: EventLog, ptr: Pointer, lsn: int,
               memory: int | str | None) -> duckdb.DuckDBPyConnection:
    con = _connection(memory)
    try:
        # ``events`` is a plain view here, never the registered stream itself: a temp
        # object would shadow the tail schema's own ``events`` in its views
        con.register(f"{_PREFIX}_events", EventStream(log, lsn))
        con.execute(f"CREATE VIEW events AS SELECT * FROM {_PREFIX}_events")
        _state_views(con, log, ptr, lsn)
    except BaseException:
        con.close()
        raise
    return con


#: Statements that reach past the connection (files, databases, extensions); PREPARE may
#: wrap any of them. A locked-down connection refuses them before DuckDB sees them.
OUTSIDE_STATEMENTS = frozenset({
    "COPY", "COPY_DATABASE", "EXPORT", "ATTACH", "DETACH", "LOAD", "EXTENSION",
    "UPDATE_EXTENSIONS", "PREPARE", "MULTI",
})


def lock_down(con: duckdb.DuckDBPyConnection) -> None:
    """Close a ``connect()`` connection to the outside: no file, URL, ATTACH, COPY or
    extension, and no SQL can undo it. DuckDB may still open exactly the state files its
    views read (``poimen_files``); since DuckDB lets SQL write what it may read, callers
    that run a user's SQL also check it with ``outside_statement`` first."""
    files = con.execute("SELECT getvariable('poimen_files')").fetchall()[0][0] or []
    if files:
        con.execute("SET allowed_paths = ?", [files])
    for setting in ("SET python_enable_replacements = false",
                    "SET enable_external_access = false",
                    "SET lock_configuration = true"):
        con.execute(setting)


def outside_statement(query: str) -> str | None:
    """The type of the first statement in ``query`` that reaches outside a locked-down
    connection (``OUTSIDE_STATEMENTS``), or None. A query DuckDB cannot parse is left
    to DuckDB, which reports it."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error:
        return None
    for st in statements:
        kind = st.type.name
        if kind == "EXPLAIN":  # EXPLAIN ANALYZE runs what it explains: judged by that
            inner = explained_statements(st.query)
            if inner is None:
                return kind  # not found: refused rather than run
            kind = next((t for t in inner if t in OUTSIDE_STATEMENTS), "")
        if kind in OUTSIDE_STATEMENTS:
            return kind
    return None


def explained_statements(statement: str) -> list[str] | None:
    """The types of the statements an ``EXPLAIN [ANALYZE] [(options)]`` statement explains
    (``EXPLAIN ANALYZE`` runs them: ``EXPLAIN ANALYZE COPY ... TO`` writes), found past
    its keywords, options and comments with DuckDB's own tokenizer; None when they cannot
    be found or parsed. A parenthesis after the keywords may open options or the statement
    itself (``EXPLAIN (SELECT 1)``): both readings that parse are returned, so a caller
    refusing any outside type refuses either."""
    raw = statement.encode()  # the tokenizer's positions count UTF-8 bytes, not characters
    try:
        tokens = duckdb.tokenize(statement)
    except (duckdb.Error, RuntimeError, ValueError):
        return None
    ends = [pos for pos, _kind in tokens[1:]] + [len(raw)]
    words = [(pos, raw[pos:end].decode(errors="replace").strip().upper())
             for (pos, kind), end in zip(tokens, ends, strict=True)
             if kind != duckdb.token_type.comment]
    if not words or words[0][1] != "EXPLAIN":
        return None
    i = 1
    if i < len(words) and words[i][1] in ("ANALYZE", "ANALYSE"):
        i += 1
    starts = [i]
    if i < len(words) and words[i][1] == "(":  # options: past the matching parenthesis
        depth = 0
        while i < len(words):
            depth += {"(": 1, ")": -1}.get(words[i][1], 0)
            i += 1
            if depth == 0:
                break
        starts.append(i)
    found: list[str] = []
    for at in starts:
        if at >= len(words):
            continue
        try:
            found += [st.type.name for st in
                      duckdb.extract_statements(raw[words[at][0]:].decode())]
        except duckdb.Error:
            continue
    return found or None


def open_views(log: EventLog, at_lsn: int | None, *, source: str = "auto",
               memory: int | str | None = None) -> duckdb.DuckDBPyConnection:
    """The connection ``fold.connect`` returns (see there)."""
    if source not in SOURCES:
        raise ValidationError(f"connect: source must be one of {SOURCES}, got {source!r}")
    lsn = resolve_lsn(log, at_lsn)
    con, used = None, "log"
    for _attempt in range(2):  # a concurrent materialize may remove what we just read
        ptr = None if source == "log" else usable_pointer(log)
        if source == "state" and (ptr is None or ptr.lsn != lsn):
            have = "no usable materialized state" if ptr is None else \
                f"the materialized state covers lsn {ptr.lsn}"
            raise NotFound(f"connect: {have}, not lsn {lsn} (run materialize, or use "
                           "source='auto' or 'log')")
        if ptr is None or ptr.lsn > lsn:
            break
        try:
            con = _try_state(log, ptr, lsn, memory)
        except (duckdb.IOException, CorruptionError) as exc:
            if source == "state":
                raise CorruptionError(f"connect: the state at lsn {ptr.lsn} is "
                                      f"unreadable: {exc}") from None
            continue  # read the pointer again; then serve the log
        used = "state" if ptr.lsn == lsn else "state+log"
        break
    if con is None:
        con = _connection(memory)
    try:
        if used == "log":
            con.register("events", EventStream(log, lsn))
            _log_views(con)
        con.execute("SET VARIABLE poimen_source = ?", [used])
        con.execute("SET VARIABLE poimen_lsn = ?", [lsn])
        register_blob_text(con, log)
    except BaseException:
        con.close()
        raise
    return con




def connect(
    root_or_log: LogLike,
    at_lsn: int | None = None,
    *,
    source: Source = "auto",
    memory_limit: int | str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views of the log as it stood at ``at_lsn`` (default:
    the head). The connection is the caller's to close.

    ``source="auto"`` serves each view from the materialized state (the parquet files its
    pointer names) plus a fold of the runs that commits after it touched, so opening costs
    the tail, not the log; with no usable state, or one newer than ``at_lsn``, the views
    fold the log. ``"state"`` requires a state made at exactly ``at_lsn`` (else
    ``NotFound``); ``"log"`` always folds the log. Either way the rows are those of a cold
    fold. ``events`` streams the segments on each scan (never held in memory);
    ``getvariable('poimen_source')`` says what served the views. ``memory_limit`` caps
    DuckDB (default ``$POIMEN_MEMORY_LIMIT``, else a quarter of the machine), which
    spills to a temp directory beyond it. ``blob_text(ref)`` reads a body only when a
    query calls it, through ``log.blobs`` as it is at call time.
    """
    return open_views(as_log(root_or_log, storage_options=storage_options,
                             read_only=True), at_lsn,
                      source=source, memory=memory_limit)


__all__ = [
    "OUTSIDE_STATEMENTS", "SOURCES", "TAIL", "EventStream", "connect", "lock_down",
    "explained_statements", "open_views", "outside_statement", "tail_views",
]
