"""The SQL page's sandbox: one read-only SELECT over the views, on a connection of its own.

Two locks: the statement must parse as a single SELECT (or EXPLAIN), and the connection
has external access off (no file reads or writes but the state files its views read, no
ATTACH, INSTALL or LOAD), Python replacement scans off, and its configuration locked so a
query cannot turn them back on (``fold._connect.lock_down``).
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Literal

import duckdb
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from poimen_data.errors import one_line, raised_in_scan
from poimen_data.fold._connect import connect, explained_statements, lock_down
from poimen_data.log._log import EventLog

#: Rows the page shows; a download carries up to ``DOWNLOAD_ROWS``.
SHOW_ROWS = 500
DOWNLOAD_ROWS = 1_000_000
#: A query still running after this many seconds is interrupted.
TIMEOUT_S = 60.0
ALLOWED = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)

Format = Literal["csv", "parquet"]


class QueryRefused(ValueError):
    """The query is not one read-only statement, or DuckDB refused it: one line."""


def sandbox(log: EventLog, at_lsn: int) -> duckdb.DuckDBPyConnection:
    """A connection over the views at ``at_lsn`` that can only read what they read."""
    con = connect(log, at_lsn=at_lsn)
    try:
        lock_down(con)
    except BaseException:
        con.close()
        raise
    return con


def check_statement(query: str) -> str:
    """The query stripped; ``QueryRefused`` unless it is one SELECT or EXPLAIN."""
    q = query.strip().rstrip(";").strip()
    if not q:
        raise QueryRefused("empty query")
    try:
        stmts = duckdb.extract_statements(q)
    except duckdb.Error as exc:
        raise QueryRefused(f"SQL: {one_line(exc)}") from None
    if len(stmts) != 1:
        raise QueryRefused(f"one statement at a time, got {len(stmts)}")
    kind = stmts[0].type
    if kind not in ALLOWED:
        raise QueryRefused(f"read-only: {kind.name} statements are refused "
                           "(only SELECT and EXPLAIN run here)")
    if kind == duckdb.StatementType.EXPLAIN:  # of a SELECT only: EXPLAIN ANALYZE runs it
        inner = explained_statements(stmts[0].query)
        if not inner or set(inner) != {"SELECT"}:
            raise QueryRefused("read-only: EXPLAIN of a SELECT only, got EXPLAIN of "
                               + ("a statement that cannot be read" if not inner
                                  else " or ".join(sorted(set(inner) - {"SELECT"}))))
    return q


@dataclass(frozen=True)
class Result:
    columns: tuple[str, ...]
    rows: list[tuple[object, ...]]
    more: bool               # the query has more rows than shown


def _run(con: duckdb.DuckDBPyConnection, query: str, rows: int) -> pa.Table:
    q = check_statement(query)
    timer = threading.Timer(TIMEOUT_S, con.interrupt)
    timer.start()
    try:
        rel = con.sql(q)
        if rel is None:
            raise QueryRefused("the statement returned no result")
        reader = rel.to_arrow_reader(min(rows + 1, 65_536))
        batches, n = [], 0
        for batch in reader:
            batches.append(batch)
            n += batch.num_rows
            if n > rows:
                break
        table = pa.Table.from_batches(batches, reader.schema)
    except duckdb.Error as exc:
        ours = raised_in_scan(exc)  # a damaged segment: not the query's fault
        if ours is not None:
            raise ours from None
        raise QueryRefused(f"SQL: {one_line(exc)}") from None
    finally:
        timer.cancel()
    return table.slice(0, rows + 1)


#: what turning a result's values into Python or CSV can raise for a value DuckDB holds
#: and they cannot (an infinite date, an interval in CSV)
_UNSHOWABLE = (OverflowError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError)


def run_query(con: duckdb.DuckDBPyConnection, query: str, rows: int = SHOW_ROWS) -> Result:
    table = _run(con, query, rows)
    shown = table.slice(0, rows)
    try:
        data = list(zip(*(c.to_pylist() for c in shown.columns), strict=True)) \
            if shown.num_columns else []
    except _UNSHOWABLE as exc:
        raise QueryRefused(f"the result holds a value this page cannot show: "
                           f"{one_line(exc)}") from None
    return Result(tuple(table.column_names), data, table.num_rows > rows)


def download(con: duckdb.DuckDBPyConnection, query: str, fmt: Format) -> bytes:
    """The query's result (up to ``DOWNLOAD_ROWS``) as CSV or parquet bytes, in memory."""
    table = _run(con, query, DOWNLOAD_ROWS).slice(0, DOWNLOAD_ROWS)
    sink = io.BytesIO()
    try:
        _write(table, fmt, sink)
    except _UNSHOWABLE as exc:
        raise QueryRefused(f"the result holds a value {fmt} cannot carry here: "
                           f"{one_line(exc)}") from None
    return sink.getvalue()


def _write(table: pa.Table, fmt: Format, sink: io.BytesIO) -> None:
    if fmt == "csv":
        flat = pa.Table.from_arrays(
            [c if _flat(c.type) else pa.array(
                [None if v is None else str(v) for v in c.to_pylist()], pa.string())
             for c in table.columns], names=table.column_names)
        pacsv.write_csv(flat, sink)
    else:
        pq.write_table(table, sink)


def _flat(t: pa.DataType) -> bool:
    return not (pa.types.is_nested(t) or pa.types.is_dictionary(t))
