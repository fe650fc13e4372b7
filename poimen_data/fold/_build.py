"""The partitioned fold behind the materialized state.

Every fold rule is per run, so events go to buckets by a stable hash of ``run_id`` (md5,
see ``bucket_sql``) and a group of buckets folds alone: DuckDB scans the segments lazily,
keeps the group's events and fold tables as TEMP tables under ``memory_limit`` (spilling
to a temp directory), and streams the rows out, sorted, as one canonical parquet file per
(bucket, chunk). A file's bytes depend only on its runs, never on how buckets were grouped.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from poimen_data.errors import raised_in_scan
from poimen_data.fold._fold import (
    MEMORY_ENV,
    PER_RUN_TABLES,
    TABLE_KEYS,
    VIEW_SQL,
    VIEWS,
    create_fold_tables,
    fold_tables,
    memory_bytes,
)
from poimen_data.log._log import EventLog
from poimen_data.model import _events as ev

INDEX = "run_index"
STATE_TABLES = (*VIEWS, INDEX)
N_BUCKETS = 16
RUNS_PER_CHUNK = 2048
REDUCTIONS_PER_CHUNK = 65536
ROW_GROUP_SIZE = 2048
WRITE_THREADS = min(4, os.cpu_count() or 1)
BATCH_ROWS = 65_536
SPILL_ROW_GROUP = 16_384
PARQUET_OPTIONS: dict[str, Any] = {
    "version": "2.6",
    "data_page_version": "1.0",
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": True,
    "write_statistics": True,
    "write_page_checksum": True,
    "data_page_size": 1 << 20,
}


def current_settings() -> dict[str, Any]:
    """Everything besides the data that decides the bytes of a state; a state made under
    other settings is rebuilt, never served. Read at call time (tests shrink chunks)."""
    return {
        "n_buckets": N_BUCKETS,
        "runs_per_chunk": RUNS_PER_CHUNK,
        "reductions_per_chunk": REDUCTIONS_PER_CHUNK,
        "row_group_size": ROW_GROUP_SIZE,
        "parquet": PARQUET_OPTIONS,
        "pyarrow": pa.__version__,
        "duckdb": duckdb.__version__,
    }


def bucket_sql(col: str = "run_id") -> str:
    """The bucket of a run in SQL: the first 8 hex digits of md5(run_id) as an integer,
    modulo ``N_BUCKETS`` (md5 is pinned by its RFC; DuckDB's ``hash`` is not stable)."""
    return f"((('0x' || left(md5({col}), 8))::UBIGINT) % {N_BUCKETS})::BIGINT"


def bucket_of(run_id: str) -> int:
    """``bucket_sql`` in Python (for readers and tests)."""
    return int(hashlib.md5(run_id.encode()).hexdigest()[:8], 16) % N_BUCKETS


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One state file: its (bucket, chunk) key, path relative to the root, rows, size and
    sha256."""

    chunk: int
    path: str
    rows: int
    size: int
    sha256: str
    bucket: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.bucket, self.chunk)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]

    @property
    def table(self) -> str:
        return self.path.split("/")[1]

    def to_json(self) -> list[Any]:
        return [self.chunk, self.path, self.rows, self.size, self.sha256, self.bucket]


@functools.cache
def _schemas(_settings_key: str) -> dict[str, pa.Schema]:
    out = {k: v.schema for k, v in fold_tables(ev.LOG_SCHEMA.empty_table()).items()}
    out[INDEX] = pa.schema([("run_id", pa.string()), ("bucket", pa.int64()),
                            ("chunk", pa.int64()), ("first_lsn", pa.int64())])
    return out


def table_schemas() -> dict[str, pa.Schema]:
    """The schema of every state table, as the fold of no events gives it."""
    return _schemas("v1")


def parquet_bytes(table: pa.Table) -> bytes:
    """The canonical parquet bytes of a sorted table (settings pinned in
    ``current_settings()``)."""
    sink = io.BytesIO()
    pq.write_table(table.combine_chunks(), sink, row_group_size=ROW_GROUP_SIZE,
                   **PARQUET_OPTIONS)
    return sink.getvalue()


def encode(table: str, bucket: int, chunk: int, t: pa.Table) -> tuple[FileEntry, bytes]:
    data = parquet_bytes(t.cast(table_schemas()[table]))
    sha = hashlib.sha256(data).hexdigest()
    path = f"state/{table}/{bucket:02d}-{chunk:06d}-{sha[:16]}.parquet"
    return FileEntry(chunk, path, t.num_rows, len(data), sha, bucket), data


#: Where a finished file goes: ``(table, entry, bytes)``; called on writer threads.
Sink = Callable[[str, FileEntry, bytes], None]


# --- DuckDB under a budget ---------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """What one fold may hold: DuckDB's ``memory_limit`` in bytes (it spills the rest to
    ``temp_directory``, a fresh temp dir when None)."""

    memory_limit: int
    temp_directory: str | None = None


def default_memory_limit() -> int:
    """A quarter of the machine, at most 1.5 GiB (measured: a full materialize of 10M
    events then peaks at 2.0 GiB RSS, the rest being Arrow batches and encoders)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return max(64 << 20, min(3 << 29, total // 4))


def budget_of(memory_limit: int | str | None, temp_directory: str | None = None) -> Budget:
    """The budget of a job: ``memory_limit`` (bytes, or a size such as ``"2GB"``), else
    ``$POIMEN_MEMORY_LIMIT``, else ``default_memory_limit()``."""
    value: int | str | None = memory_limit
    if value is None:
        value = os.environ.get(MEMORY_ENV) or None
    if value is None:
        return Budget(default_memory_limit(), temp_directory)
    where = "memory_limit" if memory_limit is not None else MEMORY_ENV
    return Budget(memory_bytes(value, where), temp_directory)


class scan_errors(contextlib.ContextDecorator):  # noqa: N801 - reads as a decorator
    """Within it (a ``with`` block, or a job it decorates: ``@scan_errors()``), the error a
    scan DuckDB read raised (``raised_in_scan``) is raised as itself, not as DuckDB's
    ``InvalidInputException`` quoting it: a damaged segment is a ``CorruptionError``
    naming its file."""

    def __enter__(self) -> scan_errors:
        return self

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        ours = raised_in_scan(exc) if isinstance(exc, duckdb.Error) else None
        if ours is not None:
            raise ours from None


@contextmanager
def connection(budget: Budget) -> Iterator[duckdb.DuckDBPyConnection]:
    with tempfile.TemporaryDirectory(prefix="poimen-fold-",
                                     dir=budget.temp_directory) as tmp:
        con = duckdb.connect(":memory:")
        try:
            con.execute("SET TimeZone = 'UTC'")
            try:
                con.execute("SET enable_progress_bar = false")
            except duckdb.InvalidInputException:
                pass
            con.execute(f"SET memory_limit = '{max(1, budget.memory_limit >> 20)}MiB'")
            con.execute(f"SET temp_directory = '{tmp}'")
            con.execute("SET preserve_insertion_order = false")
            yield con
        finally:
            con.close()


# --- streaming sorted rows into files ----------------------------------------------------


class Writer:
    """Encodes (table, bucket, chunk) groups into canonical files on a few threads and
    hands each to ``sink``; at most a few groups are in flight (bounded memory)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.entries: dict[str, dict[tuple[int, int], FileEntry]] = {}
        self._pool = ThreadPoolExecutor(max_workers=WRITE_THREADS)
        self._inflight: list[Future[None]] = []

    def submit(self, table: str, bucket: int, chunk: int, t: pa.Table) -> None:
        while len(self._inflight) >= 2 * WRITE_THREADS:
            self._inflight.pop(0).result()
        self._inflight.append(self._pool.submit(self._one, table, bucket, chunk, t))

    def _one(self, table: str, bucket: int, chunk: int, t: pa.Table) -> None:
        entry, data = encode(table, bucket, chunk, t)
        self.sink(table, entry, data)
        self.entries.setdefault(table, {})[entry.key] = entry

    def drain(self) -> None:
        """Wait for every file submitted so far (raises the first failure)."""
        try:
            for f in self._inflight:
                f.result()
        finally:
            self._inflight = []

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown()


def stream_sorted(con: duckdb.DuckDBPyConnection, table: str, sql: str, w: Writer) -> int:
    """Run ``sql`` (rows of ``table`` with leading ``_bucket, _chunk`` columns, ordered by
    them) and submit one group per (bucket, chunk). Returns the rows seen."""
    reader = con.sql(sql).to_arrow_reader(BATCH_ROWS)
    parts: list[pa.RecordBatch] = []
    key: tuple[int, int] | None = None
    n = 0

    def flush() -> None:
        if key is not None and parts:
            t = pa.Table.from_batches(parts).drop_columns(["_bucket", "_chunk"])
            w.submit(table, key[0], key[1], t)
        parts.clear()

    for rb in reader:
        if not rb.num_rows:
            continue
        n += rb.num_rows
        b = rb.column(0).to_numpy(zero_copy_only=False)
        c = rb.column(1).to_numpy(zero_copy_only=False)
        cuts = np.flatnonzero((np.diff(b) != 0) | (np.diff(c) != 0)) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), rb.num_rows], strict=True):
            k = (int(b[lo]), int(c[lo]))
            if k != key:
                flush()
                key = k
            parts.append(rb.slice(lo, hi - lo))
    flush()
    return n


def _order(table: str) -> str:
    return ", ".join(["_bucket", "_chunk", *TABLE_KEYS[table]])


def write_per_run(con: duckdb.DuckDBPyConnection, w: Writer, table: str,
                  source: str) -> int:
    """Rows of ``source`` (one per-run table's rows) into files by ``_index``."""
    sql = (f"SELECT i.bucket AS _bucket, i.chunk AS _chunk, t.* FROM {source} t "
           f"JOIN _index i USING (run_id) ORDER BY {_order(table)}")
    return stream_sorted(con, table, sql, w)


def write_reductions(con: duckdb.DuckDBPyConnection, w: Writer, first_ord: int = 0) -> None:
    sql = (f"SELECT 0::BIGINT AS _bucket, ({first_ord} + row_number() OVER (ORDER BY lsn) "
           f"- 1) // {REDUCTIONS_PER_CHUNK} AS _chunk, * FROM reductions ORDER BY lsn")
    stream_sorted(con, "reductions", sql, w)


# --- a full pass: the fold of one group of buckets ---------------------------------------

INDEX_SQL = """CREATE TEMP TABLE _index AS
    SELECT run_id, bucket,
           (row_number() OVER (PARTITION BY bucket ORDER BY first_lsn) - 1) // {rpc}
               AS chunk, first_lsn
    FROM (SELECT run_id, {bucket} AS bucket, min(lsn) AS first_lsn FROM events
          WHERE run_id IS NOT NULL GROUP BY run_id)"""


def bucket_filter(buckets: tuple[int, ...], with_reductions: bool) -> str:
    if len(set(buckets)) == N_BUCKETS and with_reductions:
        return ""
    cond = f"{bucket_sql()} IN ({', '.join(map(str, sorted(buckets)))})" if buckets \
        else "false"
    return f"WHERE {cond}" + (" OR run_id IS NULL" if with_reductions else "")


def _fold_group(con: duckdb.DuckDBPyConnection, w: Writer, *, with_reductions: bool) -> pa.Table:
    """Fold the ``events`` table of ``con`` (one group's events) into files; drop it and
    return the group's run index rows."""
    con.execute(INDEX_SQL.format(rpc=RUNS_PER_CHUNK, bucket=bucket_sql()))
    names = PER_RUN_TABLES + (("reductions",) if with_reductions else ())
    create_fold_tables(con, names, ordered=False, temp=True)
    con.execute("DROP TABLE events")  # the fold tables hold what is left to write
    for t in PER_RUN_TABLES:
        write_per_run(con, w, t, t)
    if with_reductions:
        write_reductions(con, w)
    index = con.sql("SELECT run_id, bucket, chunk, first_lsn FROM _index").to_arrow_table()
    for t in (*names, "attempts", "branches", "_index"):
        con.execute(f"DROP TABLE IF EXISTS {t}")
    return index


def full_pass(log: EventLog, lsn: int, buckets: tuple[int, ...], w: Writer, budget: Budget,
              *, with_reductions: bool) -> pa.Table:
    """Fold the runs of ``buckets`` (and the reductions when asked) at ``lsn`` into files,
    scanning the segments for them (what a Dask worker does); returns their index rows."""
    with connection(budget) as con:
        con.register("_scan", log.scan_events(lsn, batch_rows=BATCH_ROWS))
        con.execute("CREATE TEMP TABLE events AS SELECT * FROM _scan "
                    + bucket_filter(buckets, with_reductions))
        con.unregister("_scan")
        return _fold_group(con, w, with_reductions=with_reductions)


def full_passes(log: EventLog, lsn: int, groups: list[tuple[int, ...]], w: Writer,
                budget: Budget) -> list[pa.Table]:
    """Every group in one process, with one scan of the segments: each event is spilled
    to the parquet partition of its group in the temp directory (DuckDB's partitioned
    COPY, bounded memory), then each group is read back from its partition and folded
    alone. Reductions (events of no run) fold with the first group."""
    if len(groups) == 1:
        return [full_pass(log, lsn, groups[0], w, budget, with_reductions=True)]
    out = []
    with connection(budget) as con:
        tmp = con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0]
        parts = spill_groups(con, log, lsn, groups, os.path.join(tmp, "parts"))
        for i, where in enumerate(parts):
            load_group(con, where)
            out.append(_fold_group(con, w, with_reductions=i == 0))
            shutil.rmtree(where, ignore_errors=True)
    return out


def spill_groups(con: duckdb.DuckDBPyConnection, log: EventLog, lsn: int,
                 groups: list[tuple[int, ...]], parts: str, *, where: str = "",
                 min_lsn: int = 1) -> list[str]:
    """One scan of the segments up to ``lsn``: each event is spilled to the parquet
    partition of its group of buckets under the folder ``parts`` (DuckDB's partitioned
    COPY, bounded memory; ``con`` should not preserve insertion order, which makes it
    slow); events of no run go to group 0. ``where`` (SQL over the
    events, e.g. a semi-join on a table registered in ``con``) keeps only some. Returns
    each group's folder, in order (``load_group`` reads one back). ``min_lsn`` bounds
    the scan from below."""
    group_of = {b: i for i, g in enumerate(groups) for b in g}
    cases = " ".join(f"WHEN {b} THEN {i}" for b, i in sorted(group_of.items()))
    con.register("_scan", log.scan_events(lsn, min_lsn, batch_rows=BATCH_ROWS))
    # DuckDB buffers this many rows per thread before it writes them out by partition
    # (524,288 by default: wide events then overrun a small budget)
    con.execute(f"SET partitioned_write_flush_threshold = {SPILL_ROW_GROUP}")
    try:
        con.execute(f"COPY (SELECT *, CASE {bucket_sql()} {cases} ELSE 0 END AS _g "
                    f"FROM _scan {where}) TO '{parts}' (FORMAT parquet, PARTITION_BY (_g), "
                    # every partition's writer buffers a row group: keep them small
                    f"ROW_GROUP_SIZE {SPILL_ROW_GROUP})")
    finally:
        con.unregister("_scan")
        con.execute("RESET partitioned_write_flush_threshold")
    return [os.path.join(parts, f"_g={i}") for i in range(len(groups))]


def load_group(con: duckdb.DuckDBPyConnection, where: str, table: str = "events") -> None:
    """The TEMP TABLE ``table`` of ``con``: the events ``spill_groups`` put in ``where``
    (none when the group got none)."""
    if os.path.isdir(where):
        con.execute(f"CREATE TEMP TABLE {table} AS SELECT * FROM read_parquet("
                    f"'{where}/*.parquet', hive_partitioning = false)")
    else:
        con.register("_empty", ev.LOG_SCHEMA.empty_table())
        con.execute(f"CREATE TEMP TABLE {table} AS SELECT * FROM _empty")
        con.unregister("_empty")


def index_file(w: Writer, index: pa.Table) -> None:
    """The run index: every run's (bucket, chunk, first_lsn), sorted by run_id, one file."""
    t = index.cast(table_schemas()[INDEX]).sort_by("run_id")
    w.submit(INDEX, 0, 0, t)


def reductions_sql() -> str:
    return VIEW_SQL["reductions"]
