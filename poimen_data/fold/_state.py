"""Materialized state: the fold's tables as canonical parquet, plus one pointer file.

Runs are numbered in start order (by their first LSN) and cut into chunks of
``RUNS_PER_CHUNK``; each per-run table has one file per chunk, sorted by ``TABLE_KEYS``.
A new run always lands in the last chunk, so an incremental materialize rewrites only
the chunks that new commits touched, and a chunk's bytes depend only on the fold at that
LSN: incremental and cold builds give the same files (names carry their sha256).
``state/run_index`` (sorted by run_id, small row groups) finds a run's chunk without
scanning the others. ``state/_current.json`` lists every file with its sha256 and is
replaced atomically, so a reader sees the old state or the new one, never a mix.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from poimen_data.errors import CorruptionError
from poimen_data.fold._fold import (
    FOLD_VERSION,
    PER_RUN_TABLES,
    TABLE_KEYS,
    VIEWS,
    create_fold_tables,
    fold_tables,
    new_connection,
    run_events,
)
from poimen_data.log._faults import crash_point
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.log._manifest import FORMAT_NAME, FORMAT_VERSION, dumps, loads
from poimen_data.model import _events as ev

POINTER = "state/_current.json"
INDEX = "run_index"
RUNS_PER_CHUNK = 2048
REDUCTIONS_PER_CHUNK = 65536
ROW_GROUP_SIZE = 2048
WRITE_THREADS = min(8, os.cpu_count() or 1)
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
        "runs_per_chunk": RUNS_PER_CHUNK,
        "reductions_per_chunk": REDUCTIONS_PER_CHUNK,
        "row_group_size": ROW_GROUP_SIZE,
        "parquet": PARQUET_OPTIONS,
        "pyarrow": pa.__version__,
        "duckdb": duckdb.__version__,
    }


STATE_TABLES = (*VIEWS, INDEX)


@dataclass(frozen=True, slots=True)
class FileEntry:
    chunk: int
    path: str
    rows: int
    size: int
    sha256: str

    def to_json(self) -> list[Any]:
        return [self.chunk, self.path, self.rows, self.size, self.sha256]


@dataclass(frozen=True)
class Pointer:
    """What ``state/_current.json`` says: the LSN covered and every file of the state."""

    lsn: int
    seq: int
    fold_version: str
    settings: dict[str, Any]
    tables: dict[str, tuple[FileEntry, ...]]
    prev_files: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return self.fold_version == FOLD_VERSION and self.settings == current_settings()

    def files(self) -> set[str]:
        return {f.path for entries in self.tables.values() for f in entries}

    def to_doc(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": "state",
                "lsn": self.lsn, "seq": self.seq, "fold_version": self.fold_version,
                "settings": self.settings, "prev_files": sorted(self.prev_files),
                "tables": {t: [f.to_json() for f in e] for t, e in sorted(self.tables.items())}}

    @classmethod
    def from_doc(cls, d: Mapping[str, Any]) -> Pointer:
        return cls(d["lsn"], d["seq"], d["fold_version"], d["settings"],
                   {t: tuple(FileEntry(*f) for f in e) for t, e in d["tables"].items()},
                   tuple(d.get("prev_files", ())))


def read_pointer(log: EventLog) -> Pointer | None:
    """The current state pointer, or None when there is none (``CorruptionError`` when
    it is damaged)."""
    data = log.storage.read_or_none(POINTER)
    if data is None:
        return None
    doc = loads(data, log.storage.url_of(POINTER))
    try:
        return Pointer.from_doc(doc)
    except (KeyError, TypeError, ValueError):
        raise CorruptionError(f"{log.storage.url_of(POINTER)}: not a state pointer") from None


def usable_pointer(log: EventLog) -> Pointer | None:
    try:
        ptr = read_pointer(log)
    except CorruptionError:
        return None
    return ptr if ptr is not None and ptr.usable else None


# --- canonical files ----------------------------------------------------------------


@functools.cache
def table_schemas() -> dict[str, pa.Schema]:
    """The schema of every state table, as the fold of no events gives it."""
    out = {k: v.schema for k, v in fold_tables(ev.LOG_SCHEMA.empty_table()).items()}
    out[INDEX] = pa.schema([("run_id", pa.string()), ("chunk", pa.int64()),
                            ("first_lsn", pa.int64())])
    return out


def parquet_bytes(table: pa.Table) -> bytes:
    """The canonical parquet bytes of a sorted table (settings pinned in ``current_settings()``)."""
    sink = io.BytesIO()
    pq.write_table(table.combine_chunks(), sink, row_group_size=ROW_GROUP_SIZE,
                   **PARQUET_OPTIONS)
    return sink.getvalue()


def _entry(table: str, chunk: int, t: pa.Table, out: dict[str, bytes]) -> FileEntry:
    data = parquet_bytes(t.cast(table_schemas()[table]))
    sha = hashlib.sha256(data).hexdigest()
    path = f"state/{table}/{chunk:06d}-{sha[:16]}.parquet"
    out[path] = data
    return FileEntry(chunk, path, t.num_rows, len(data), sha)


def _split(table: str, sorted_: pa.Table, out: dict[str, bytes]) -> dict[int, FileEntry]:
    """Cut a table sorted by ``_chunk`` into one file per chunk."""
    if sorted_.num_rows == 0:
        return {}
    chunks = sorted_.column("_chunk").to_numpy()
    body = sorted_.drop_columns(["_chunk"])
    starts = np.flatnonzero(np.diff(chunks)) + 1
    bounds = [0, *starts.tolist(), len(chunks)]

    def one(lo: int, hi: int) -> FileEntry:
        return _entry(table, int(chunks[lo]), body.slice(lo, hi - lo), out)

    # Each file's bytes depend on its rows only, so encoding them on threads (pyarrow
    # releases the GIL) cannot change a byte.
    with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
        entries = list(pool.map(one, bounds[:-1], bounds[1:]))
    return {f.chunk: f for f in entries}


def read_file(log: EventLog, f: FileEntry) -> pa.Table:
    """A whole state file, checked against the sha256 the pointer lists."""
    data = log.storage.read_or_none(f.path)
    name = log.storage.url_of(f.path)
    if data is None:
        raise CorruptionError(f"{name}: listed by the state pointer but missing")
    if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
        raise CorruptionError(f"{name}: size or sha256 differs from the state pointer")
    return pq.read_table(pa.py_buffer(data))


def read_run(log: EventLog, f: FileEntry, run_id: str) -> pa.Table:
    """The rows of one run from a file sorted by run_id: only the row groups whose
    statistics can hold it are read, and their pages are checked by CRC."""
    st = log.storage
    try:
        with (open(st.full(f.path), "rb") if st.kind == "local"
              else st.fs.open(st.full(f.path), "rb")) as src, \
                pq.ParquetFile(src, page_checksum_verification=True) as pf:
            col = pf.schema_arrow.get_field_index("run_id")
            groups = []
            for i in range(pf.metadata.num_row_groups):
                s = pf.metadata.row_group(i).column(col).statistics
                if s is None or not s.has_min_max or s.min <= run_id <= s.max:
                    groups.append(i)
            t = pf.read_row_groups(groups) if groups else pf.schema_arrow.empty_table()
    except FileNotFoundError:
        raise CorruptionError(f"{st.url_of(f.path)}: listed by the state pointer but "
                              "missing") from None
    except (OSError, pa.ArrowInvalid) as exc:
        raise CorruptionError(f"{st.url_of(f.path)}: unreadable ({exc})") from None
    return t.filter(pc.equal(t.column("run_id"), run_id))


# --- building -----------------------------------------------------------------------


@dataclass
class _Build:
    tables: dict[str, dict[int, FileEntry]] = field(default_factory=dict)
    data: dict[str, bytes] = field(default_factory=dict)


def _order(table: str) -> str:
    return ", ".join(["_chunk", *TABLE_KEYS[table]])


def _chunked(con: duckdb.DuckDBPyConnection, table: str, source: str, index: str) -> pa.Table:
    return con.sql(f"SELECT i.chunk AS _chunk, t.* FROM {source} t JOIN {index} i "
                   f"USING (run_id) ORDER BY {_order(table)}").to_arrow_table()


def _build_full(log: EventLog, lsn: int) -> _Build:
    """Fold every event up to ``lsn`` and cut the tables into chunk files."""
    b = _Build()
    con = new_connection(log.read_events(lsn))
    try:
        create_fold_tables(con, ordered=False)
        con.execute(f"""CREATE TEMP TABLE _index AS
            SELECT run_id, (row_number() OVER (ORDER BY first_lsn) - 1) // {RUNS_PER_CHUNK}
                   AS chunk, first_lsn
            FROM (SELECT run_id, min(lsn) AS first_lsn FROM events
                  WHERE run_id IS NOT NULL GROUP BY run_id)""")
        for t in PER_RUN_TABLES:
            b.tables[t] = _split(t, _chunked(con, t, t, "_index"), b.data)
        red = con.sql(f"SELECT (row_number() OVER (ORDER BY lsn) - 1) // "
                      f"{REDUCTIONS_PER_CHUNK} AS _chunk, * FROM reductions "
                      "ORDER BY lsn").to_arrow_table()
        b.tables["reductions"] = _split("reductions", red, b.data)
        index = con.sql("SELECT 0::BIGINT AS _chunk, * FROM _index ORDER BY run_id")
        b.tables[INDEX] = _split(INDEX, index.to_arrow_table(), b.data)
    finally:
        con.close()
    return b


def _concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    return pa.concat_tables([t.cast(schema) for t in tables]) if tables \
        else schema.empty_table()


def _build_incremental(log: EventLog, ptr: Pointer, lsn: int) -> _Build:
    """Re-fold only the runs that commits after ``ptr.lsn`` touched; rewrite their chunks."""
    b = _Build({t: {f.chunk: f for f in ptr.tables.get(t, ())} for t in STATE_TABLES})
    new = log.read_events(lsn, ptr.lsn + 1)
    if pc.any(pc.equal(new.column("kind"), "blob_reduced")).as_py():
        _merge_reductions(log, b, new)
    touched = pc.unique(new.column("run_id").drop_null())
    if len(touched):
        _merge_runs(log, ptr, b, touched, lsn)
    return b


def _merge_runs(log: EventLog, ptr: Pointer, b: _Build, touched: pa.Array, lsn: int) -> None:
    """Fold the touched runs' whole histories (from the first LSN of the earliest one) and
    merge them into their chunks; new runs go to the end, in start order."""
    old_index = _concat([read_file(log, f) for f in ptr.tables.get(INDEX, ())],
                        table_schemas()[INDEX])
    is_touched = pc.is_in(old_index.column("run_id"), touched)
    old_touched = old_index.filter(is_touched)
    lo = min([ptr.lsn + 1, *old_touched.column("first_lsn").to_pylist()])
    con = new_connection(run_events(log, touched.to_pylist(), at_lsn=lsn, min_lsn=lo))
    try:
        create_fold_tables(con, PER_RUN_TABLES, ordered=False)
        con.register("_old_index", old_index)
        con.execute(f"""CREATE TEMP TABLE _new_runs AS
            SELECT run_id, {old_index.num_rows} + row_number() OVER (ORDER BY first_lsn) - 1
                   AS ord, first_lsn
            FROM (SELECT run_id, min(lsn) AS first_lsn FROM events GROUP BY run_id)
            WHERE run_id NOT IN (SELECT run_id FROM _old_index)""")
        con.execute(f"""CREATE TEMP TABLE _new_index AS
            SELECT run_id, ord // {RUNS_PER_CHUNK} AS chunk, first_lsn FROM _new_runs""")
        chunks = sorted(set(old_touched.column("chunk").to_pylist())
                        | {r[0] for r in con.execute(
                            "SELECT DISTINCT chunk FROM _new_index").fetchall()})
        con.register("_chunks", pa.table({"chunk": pa.array(chunks, pa.int64())}))
        con.execute("""CREATE TEMP TABLE _index AS
            SELECT * FROM _old_index WHERE chunk IN (SELECT chunk FROM _chunks)
            UNION ALL SELECT * FROM _new_index""")
        for t in PER_RUN_TABLES:
            schema = table_schemas()[t]
            olds = [read_file(log, b.tables[t][c]) for c in chunks if c in b.tables[t]]
            old = _concat(olds, schema)
            con.register("_old", old.filter(pc.invert(pc.is_in(old.column("run_id"),
                                                                touched))))
            merged = _chunked(con, t, f"(SELECT * FROM _old UNION ALL SELECT * FROM {t})",
                              "_index")
            for c in chunks:
                b.tables[t].pop(c, None)
            b.tables[t].update(_split(t, merged, b.data))
        if con.execute("SELECT count(*) FROM _new_index").fetchall()[0][0]:
            index = con.sql("SELECT 0::BIGINT AS _chunk, * FROM (SELECT * FROM _old_index "
                            "UNION ALL SELECT * FROM _new_index) ORDER BY run_id")
            b.tables[INDEX] = _split(INDEX, index.to_arrow_table(), b.data)
    finally:
        con.close()


def _merge_reductions(log: EventLog, b: _Build, new: pa.Table) -> None:
    red = fold_tables(new, ("reductions",))["reductions"]
    if red.num_rows == 0:
        return
    have = b.tables["reductions"]
    n_old = sum(f.rows for f in have.values())
    ords = np.arange(n_old, n_old + red.num_rows) // REDUCTIONS_PER_CHUNK
    red = red.add_column(0, "_chunk", pa.array(ords, pa.int64()))
    first = int(ords[0])
    if first in have:  # the last chunk is not full yet: append to it
        old = read_file(log, have.pop(first)).cast(table_schemas()["reductions"])
        old = old.add_column(0, "_chunk", pa.array([first] * old.num_rows, pa.int64()))
        red = pa.concat_tables([old, red.cast(old.schema)])
    have.update(_split("reductions", red, b.data))


# --- publishing ---------------------------------------------------------------------


def _publish(log: EventLog, b: _Build, lsn: int, old: Pointer | None) -> Pointer:
    """Write the new files, then replace the pointer (one atomic write), then remove the
    files that neither the new pointer nor the one it replaces lists."""
    have = old.files() if old is not None else set()
    tables = {t: tuple(sorted(b.tables.get(t, {}).values(), key=lambda f: f.chunk))
              for t in STATE_TABLES}
    files = {f.path for e in tables.values() for f in e}
    todo = [(p, d) for p, d in sorted(b.data.items()) if p in files and p not in have]
    with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
        list(pool.map(lambda pd: log.storage.write(*pd), todo))
    crash_point("state_written")
    try:
        current = read_pointer(log)
    except CorruptionError:
        current = None
    newer = current is not None and current.usable and current.lsn >= lsn
    if newer and (old is None or current.lsn != old.lsn):
        return current  # a concurrent materialize published this LSN or a newer one
    # A reader may have started on ``current``: its files stay one more generation.
    prev = current.files() if current is not None else set()
    ptr = Pointer(lsn, log.seq_of_lsn(lsn), FOLD_VERSION, current_settings(), tables,
                  tuple(sorted(prev)))
    log.storage.write(POINTER, dumps(ptr.to_doc()))
    crash_point("state_published")
    for path in sorted(set(current.prev_files) - files - prev) if current else ():
        log.storage.delete(path)
    return ptr


def materialize(log: LogLike, *, storage_options: dict[str, Any] | None = None,
                full: bool = False) -> int:
    """Bring ``state/`` up to the head and return the LSN it covers.

    Incremental when a usable state exists: only the runs touched since are folded again
    (their whole history: every fold rule is per run) and only their chunks rewritten.
    ``full=True`` (or a state made by another fold version or settings) rebuilds.
    """
    log = as_log(log, storage_options=storage_options)
    lsn = log.head
    old = None
    try:
        old = read_pointer(log)
    except CorruptionError:
        pass
    usable = old if old is not None and old.usable and old.lsn <= lsn else None
    if usable is not None and usable.lsn == lsn and not full:
        return lsn
    if usable is None or full:
        b = _build_full(log, lsn)
    else:
        b = _build_incremental(log, usable, lsn)
    _publish(log, b, lsn, old)
    return lsn


__all__ = ["POINTER", "Pointer", "materialize", "read_pointer", "read_file", "table_schemas",
           "usable_pointer"]
