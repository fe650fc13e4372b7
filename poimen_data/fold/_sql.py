"""SQL over the materialized state plus the tail: the sources ``connect()`` serves.

A view reads the parquet files the state pointer names (never a glob: other generations
may sit beside them); the rows of the runs that later commits touched are replaced by a
fold of those runs' events, as ``episode(source="auto")`` and the incremental materialize
do (every fold rule looks at one run). ``events`` streams the segments on each scan.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import CorruptionError, NotFound, ValidationError
from poimen_data.fold._fold import (
    PER_RUN_TABLES,
    TABLE_KEYS,
    VIEW_SQL,
    VIEWS,
    fold_tables,
    new_connection,
    register_blob_text,
    run_events,
)
from poimen_data.fold._state import INDEX, Pointer, usable_pointer
from poimen_data.log._log import EventLog
from poimen_data.model import _events as ev

SOURCES = ("auto", "state", "log")
#: Prefix of the helper tables a state connection holds (temp tables, out of the views' way).
_PREFIX = "_poimen"


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


@dataclass(frozen=True)
class Tail:
    """The fold of the runs that commits after the state touched (their whole history),
    plus the reductions those commits made: what replaces and extends the state's rows."""

    touched: pa.Array
    tables: dict[str, pa.Table]


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _files_sql(log: EventLog, ptr: Pointer, table: str) -> str | None:
    """``read_parquet([...])`` over exactly the files the pointer lists, or None."""
    files = [log.storage.url_of(f.path) for f in ptr.tables.get(table, ())]
    if not files:
        return None
    return f"read_parquet([{', '.join(_quote(f) for f in files)}])"


def _temp_table(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
    con.register(f"{_PREFIX}_arrow", table)
    try:
        con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS SELECT * FROM {_PREFIX}_arrow")
    finally:
        con.unregister(f"{_PREFIX}_arrow")


def _first_lsn(con: duckdb.DuckDBPyConnection, log: EventLog, ptr: Pointer,
               touched: pa.Array) -> int:
    """The first LSN of the earliest of ``touched`` that the state holds (from its run
    index, read with the runs as a filter); 1 when the state has no index."""
    src = _files_sql(log, ptr, INDEX)
    if src is None:
        return 1 if ptr.tables.get("runs") else ptr.lsn + 1
    _temp_table(con, f"{_PREFIX}_wanted", pa.table({"run_id": touched}))
    row = con.execute(f"SELECT min(first_lsn) FROM {src} WHERE run_id IN "
                      f"(SELECT run_id FROM {_PREFIX}_wanted)").fetchall()
    con.execute(f"DROP TABLE {_PREFIX}_wanted")
    return ptr.lsn + 1 if row[0][0] is None else int(row[0][0])


def fold_tail(con: duckdb.DuckDBPyConnection, log: EventLog, ptr: Pointer,
              lsn: int) -> Tail:
    """Fold the runs touched by commits in ``(ptr.lsn, lsn]``, each from its first event
    (found through the state's run index), plus those commits' reductions. Reads the
    tail and the earlier segments that hold those runs' events, keeping only theirs."""
    new = pa.Table.from_batches(list(log.scan(lsn, ptr.lsn + 1)), ev.LOG_SCHEMA)
    touched = pc.unique(new.column("run_id").drop_null())
    lo = _first_lsn(con, log, ptr, touched) if len(touched) else ptr.lsn + 1
    parts = [new]
    if lo <= ptr.lsn:
        parts.insert(0, run_events(log, touched, at_lsn=ptr.lsn, min_lsn=lo))
    return Tail(touched, fold_tables(pa.concat_tables(parts), VIEWS))


def _state_views(con: duckdb.DuckDBPyConnection, log: EventLog, ptr: Pointer,
                 lsn: int) -> None:
    """Create the views over the state's files, topped up with the tail's fold."""
    if log.storage.kind != "local":
        con.register_filesystem(log.storage.fs)
    tail = fold_tail(con, log, ptr, lsn) if ptr.lsn < lsn else None
    if tail is not None:
        _temp_table(con, f"{_PREFIX}_touched", pa.table({"run_id": tail.touched}))
        for t in VIEWS:
            _temp_table(con, f"{_PREFIX}_tail_{t}", tail.tables[t])
    for t, sql in VIEW_SQL.items():  # in dependency order, for the empty ones
        # A table with no file is the fold's text over no rows (DuckDB never scans for it).
        src = _files_sql(log, ptr, t) or f"(SELECT * FROM ({sql}) WHERE false)"
        body = f"SELECT * FROM {src}"
        if tail is not None:
            if t in PER_RUN_TABLES:
                body += f" WHERE run_id NOT IN (SELECT run_id FROM {_PREFIX}_touched)"
            body += f" UNION ALL BY NAME SELECT * FROM {_PREFIX}_tail_{t}"
        con.execute(f"CREATE OR REPLACE VIEW {t} AS SELECT * FROM ({body}) "
                    f"ORDER BY {', '.join(TABLE_KEYS[t])}")


def _log_views(con: duckdb.DuckDBPyConnection) -> None:
    for name, sql in VIEW_SQL.items():  # DuckDB binds a view at creation: dependencies first
        con.execute(f"CREATE OR REPLACE VIEW {name} AS {sql}")


def open_views(log: EventLog, at_lsn: int | None, *, source: str = "auto",
               memory: int | str | None = None) -> duckdb.DuckDBPyConnection:
    """The connection ``fold.connect`` returns (see there)."""
    if source not in SOURCES:
        raise ValidationError(f"connect: source must be one of {SOURCES}, got {source!r}")
    if at_lsn is not None and (isinstance(at_lsn, bool) or not isinstance(at_lsn, int)):
        raise ValidationError(f"connect: at_lsn must be an int, got {at_lsn!r}")
    head = log.head
    lsn = head if at_lsn is None else at_lsn
    if not 0 <= lsn <= head:
        raise ValidationError(f"connect: at_lsn {at_lsn} is outside 0..{head}")
    # a progress bar only on a terminal: in Jupyter DuckDB's bar needs ipywidgets
    con = new_connection(progress=sys.stderr.isatty(), memory=memory)
    try:
        con.register("events", EventStream(log, lsn))
        used = "log"
        for attempt in range(2):  # a concurrent materialize may remove what we just read
            ptr = None if source == "log" else usable_pointer(log)
            if source == "state" and (ptr is None or ptr.lsn != lsn):
                have = "no usable materialized state" if ptr is None else \
                    f"the materialized state covers lsn {ptr.lsn}"
                raise NotFound(f"connect: {have}, not lsn {lsn} (run materialize, or use "
                               "source='auto' or 'log')")
            if ptr is None or ptr.lsn > lsn:
                break
            try:
                _state_views(con, log, ptr, lsn)
            except (duckdb.IOException, CorruptionError) as exc:
                if attempt or source == "state":
                    if source == "state":
                        raise CorruptionError(f"connect: the state at lsn {ptr.lsn} is "
                                              f"unreadable: {exc}") from None
                    break  # serve the log instead
                continue
            used = "state" if ptr.lsn == lsn else "state+log"
            break
        if used == "log":
            _log_views(con)
        con.execute("SET VARIABLE poimen_source = ?", [used])
        con.execute("SET VARIABLE poimen_lsn = ?", [lsn])
        register_blob_text(con, log)
    except BaseException:
        con.close()
        raise
    return con


__all__ = ["SOURCES", "EventStream", "Tail", "fold_tail", "open_views"]
