"""Materialized state: the fold's tables as canonical parquet, published by one pointer.

Each per-run table has one file per (bucket, chunk): runs go to ``N_BUCKETS`` buckets by
md5 of run_id and, within a bucket, to chunks of ``RUNS_PER_CHUNK`` in start order (first
LSN), so a new run lands in its bucket's last chunk and a file's bytes depend only on
its runs: partitioned, single-pass and incremental builds give the same files. Only the
current generation lives under ``state/<table>/`` (a plain glob reads the state; empty
tables hold one zero-row file). A new generation is written under ``state/_pending/``,
published by creating ``state/_gen/<gen>.json`` put-if-absent (so of two materializers
one wins), then moved into place; the files it replaced move to ``state/_prev/`` for
readers of the older pointer and are deleted one generation later.
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from poimen_data.errors import CorruptionError, PoimenError, StateChanged
from poimen_data.fold import _build as B
from poimen_data.fold._build import (
    INDEX,
    STATE_TABLES,
    Budget,
    FileEntry,
    Writer,
    current_settings,
    parquet_bytes,
    table_schemas,
)
from poimen_data.fold._fold import FOLD_VERSION, PER_RUN_TABLES, create_fold_tables
from poimen_data.log._faults import crash_point
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.log._manifest import FORMAT_NAME, FORMAT_VERSION, dumps, loads

POINTER = "state/_current.json"
GEN_DIR = "state/_gen"
PENDING_DIR = "state/_pending"
PREV_DIR = "state/_prev"
MAX_PUBLISH_TRIES = 8
PASS_FACTOR = 8


def gen_path(gen: int) -> str:
    return f"{GEN_DIR}/{gen:020d}.json"


def pending_path(token: str, path: str) -> str:
    return f"{PENDING_DIR}/{token}/{path.removeprefix('state/')}"


def prev_path(path: str) -> str:
    return f"{PREV_DIR}/{path.removeprefix('state/')}"


@dataclass(frozen=True)
class Pointer:
    """One generation of the state: the LSN covered and every file of it.

    ``FileEntry.path`` is where the file lives while this generation is current
    (``state/<table>/...``, relative to the root); ``locations(f)`` lists where else a
    reader may find it (still pending, or moved aside by the next generation)."""

    lsn: int
    seq: int
    fold_version: str
    settings: dict[str, Any]
    tables: dict[str, tuple[FileEntry, ...]]
    prev_files: tuple[str, ...] = ()
    gen: int = 0
    token: str = ""

    @property
    def usable(self) -> bool:
        return self.fold_version == FOLD_VERSION and self.settings == current_settings()

    def files(self) -> set[str]:
        return {f.path for entries in self.tables.values() for f in entries}

    def locations(self, f: FileEntry) -> tuple[str, ...]:
        pending = (pending_path(self.token, f.path),) if self.token else ()
        return (f.path, *pending, prev_path(f.path))

    def to_doc(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": "state",
                "lsn": self.lsn, "seq": self.seq, "fold_version": self.fold_version,
                "settings": self.settings, "prev_files": sorted(self.prev_files),
                "gen": self.gen, "token": self.token,
                "tables": {t: [f.to_json() for f in e] for t, e in sorted(self.tables.items())}}

    @classmethod
    def from_doc(cls, d: Mapping[str, Any]) -> Pointer:
        return cls(d["lsn"], d["seq"], d["fold_version"], d["settings"],
                   {t: tuple(FileEntry(*f) for f in e) for t, e in d["tables"].items()},
                   tuple(d.get("prev_files", ())), int(d.get("gen", 0)),
                   str(d.get("token", "")))


def _parse(log: EventLog, data: bytes, rel: str) -> Pointer:
    doc = loads(data, log.storage.url_of(rel))
    try:
        return Pointer.from_doc(doc)
    except (KeyError, TypeError, ValueError):
        raise CorruptionError(f"{log.storage.url_of(rel)}: not a state pointer") from None


def read_pointer(log: EventLog) -> Pointer | None:
    """The newest state generation, or None when there is none (``CorruptionError`` when
    it is damaged). ``state/_current.json`` is a hint that may lag a generation whose
    publisher died before rewriting it: the generations after it are probed."""
    data = log.storage.read_or_none(POINTER)
    ptr = None if data is None else _parse(log, data, POINTER)
    gen = ptr.gen if ptr is not None else 0
    while True:
        nxt = log.storage.read_or_none(gen_path(gen + 1))
        if nxt is None:
            return ptr
        ptr = _parse(log, nxt, gen_path(gen + 1))
        gen += 1


def usable_pointer(log: EventLog) -> Pointer | None:
    try:
        ptr = read_pointer(log)
    except CorruptionError:
        return None
    return ptr if ptr is not None and ptr.usable else None


# --- reading files ---------------------------------------------------------------------


def _missing(log: EventLog, f: FileEntry) -> PoimenError:
    """A named file is nowhere: ``StateChanged`` when a newer generation no longer lists
    it (the reader's pointer is two generations old: re-read it and retry), else the file
    is truly lost."""
    try:
        now = read_pointer(log)
    except CorruptionError:
        now = None
    if now is not None and f.path not in now.files():
        return StateChanged(f"{log.storage.url_of(f.path)}: the state moved on while it "
                            "was read; read the pointer again")
    return CorruptionError(f"{log.storage.url_of(f.path)}: listed by the state pointer "
                           "but missing")


def locate(log: EventLog, f: FileEntry, ptr: Pointer) -> str:
    """Where a named file is now (its table folder, the generation's pending folder, or
    ``_prev/`` once a newer publish moved it aside): for readers that hand paths to another
    engine (DuckDB's ``read_parquet``) instead of reading the bytes here."""
    for rel in ptr.locations(f):
        if log.storage.exists(rel):
            return rel
    raise _missing(log, f)


def read_bytes(log: EventLog, f: FileEntry, ptr: Pointer | None = None) -> bytes:
    """A state file's bytes from wherever it is, checked against its sha256."""
    places = ptr.locations(f) if ptr is not None else (f.path, prev_path(f.path))
    for rel in places:
        data = log.storage.read_or_none(rel)
        if data is None:
            continue
        if len(data) != f.size or hashlib.sha256(data).hexdigest() != f.sha256:
            raise CorruptionError(f"{log.storage.url_of(rel)}: size or sha256 differs "
                                  "from the state pointer")
        return data
    raise _missing(log, f)


def read_file(log: EventLog, f: FileEntry, ptr: Pointer | None = None) -> pa.Table:
    """A whole state file, checked against the sha256 the pointer lists."""
    return pq.read_table(pa.py_buffer(read_bytes(log, f, ptr)))


def read_run(log: EventLog, f: FileEntry, run_id: str, ptr: Pointer | None = None) -> pa.Table:
    """The rows of one run from a file sorted by run_id: only the row groups whose
    statistics can hold it are read, and their pages are checked by CRC."""
    t = _row_groups_between(log, f, run_id, run_id, ptr)
    return t.filter(pc.equal(t.column("run_id"), run_id))


def read_runs(log: EventLog, f: FileEntry, run_ids: pa.Array, ptr: Pointer) -> pa.Table:
    """The rows of some runs from a file sorted by run_id. Every row group is read,
    pages checked by CRC: the footer's statistics, which no checksum covers, decide
    nothing (for a reader that takes a run's absence as a fact)."""
    t = _row_groups_between(log, f, None, None, ptr)
    return t.filter(pc.is_in(t.column("run_id"), run_ids))


def _row_groups_between(log: EventLog, f: FileEntry, lo: str | None, hi: str | None,
                        ptr: Pointer | None) -> pa.Table:
    """The row groups of ``f`` whose run_id statistics overlap ``[lo, hi]`` (all of them
    for None), pages checked by CRC, from where the file is (or went)."""
    st = log.storage
    places = ptr.locations(f) if ptr is not None else (f.path, prev_path(f.path))
    for rel in places:
        try:
            with st.open_read(rel) as src, \
                    pq.ParquetFile(src, page_checksum_verification=True) as pf:
                col = pf.schema_arrow.get_field_index("run_id")
                groups = []
                for i in range(pf.metadata.num_row_groups):
                    s = pf.metadata.row_group(i).column(col).statistics
                    if lo is None or hi is None or s is None or not s.has_min_max or (
                            s.min <= hi and lo <= s.max):
                        groups.append(i)
                return pf.read_row_groups(groups) if groups \
                    else pf.schema_arrow.empty_table()
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowInvalid) as exc:
            raise CorruptionError(f"{st.url_of(rel)}: unreadable ({exc})") from None
    raise _missing(log, f)


def _concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    return pa.concat_tables([t.cast(schema) for t in tables]) if tables \
        else schema.empty_table()


# --- the report --------------------------------------------------------------------------


@dataclass(frozen=True)
class MaterializeReport:
    """What ``materialize`` did. ``lsn`` is the LSN the state covers (``head`` was the
    head when it started); ``full`` when every run was folded again; ``files_written``
    new state files; ``buckets`` the run buckets folded (all of them for a full build)."""

    lsn: int
    head: int
    full: bool
    runs_folded: int
    files_written: int
    buckets: int
    seconds: float

    def __str__(self) -> str:
        if not self.full and not self.runs_folded and not self.files_written:
            return f"state covers LSN {self.lsn} (head {self.head}): already current"
        how = "full rebuild" if self.full else "incremental"
        return (f"state covers LSN {self.lsn} (head {self.head}): {how}, "
                f"{self.runs_folded:,} runs folded into {self.files_written} files "
                f"({self.buckets} buckets) in {self.seconds:.2f} s")


# --- building ------------------------------------------------------------------------------


@dataclass
class _Build:
    tables: dict[str, dict[tuple[int, int], FileEntry]]
    runs_folded: int = 0
    buckets: int = 0
    full: bool = False


def plan_groups(log: EventLog, lsn: int, budget: Budget,
                passes: int | None, min_lsn: int = 1) -> list[tuple[int, ...]]:
    """Buckets per pass: as many passes as it takes for a pass's events (their Arrow size,
    about their segments' size, from ``min_lsn`` to ``lsn``) to take at most
    1/``PASS_FACTOR`` of the budget (the fold's hash tables of nested values need several
    times the events they read)."""
    if passes is None:
        size = sum(s.size for s in log.segments(lsn, min_lsn))
        passes = -(-size * PASS_FACTOR // max(1, budget.memory_limit))
    n = max(1, min(B.N_BUCKETS, passes))
    return [tuple(range(g, B.N_BUCKETS, n)) for g in range(n)]


def _finish(b: _Build, sink: B.Sink) -> None:
    """Every table present: one zero-row file when a table has no rows."""
    for t in STATE_TABLES:
        have = b.tables.setdefault(t, {})
        for k in [k for k, f in have.items() if f.rows == 0 and len(have) > 1]:
            del have[k]
        if not have:
            entry, data = B.encode(t, 0, 0, table_schemas()[t].empty_table())
            sink(t, entry, data)
            have[entry.key] = entry


def build_full(log: EventLog, lsn: int, w: Writer, budget: Budget,
               groups: list[tuple[int, ...]], executor: Any = None,
               remote: Any = None) -> _Build:
    """Fold every run at ``lsn``, one group of buckets at a time (on Dask workers when
    ``executor`` is given: ``remote(buckets, with_reductions)`` runs there)."""
    b = _Build({}, full=True, buckets=B.N_BUCKETS)
    if executor is None:
        index = B.full_passes(log, lsn, groups, w, budget)
    else:
        futures = [executor.submit(remote, g, i == 0, pure=False)
                   for i, g in enumerate(groups)]
        index = []
        for fut in futures:
            entries, idx = fut.result()
            for t, es in entries.items():
                w.entries.setdefault(t, {}).update({e.key: e for e in es})
            index.append(idx)
    whole = _concat(index, table_schemas()[INDEX])
    B.index_file(w, whole)
    w.drain()
    b.tables = {t: dict(w.entries.get(t, {})) for t in STATE_TABLES}
    b.runs_folded = whole.num_rows
    return b


def build_incremental(log: EventLog, ptr: Pointer, lsn: int, w: Writer,
                      budget: Budget) -> _Build:
    """Fold again only the runs that commits after ``ptr.lsn`` touched (their whole
    history, read from the first LSN of the earliest of them, filtered to those runs) and
    rewrite only their (bucket, chunk) files; new runs go to the end of their bucket."""
    b = _Build({t: {f.key: f for f in ptr.tables.get(t, ())} for t in STATE_TABLES})
    with B.connection(budget) as con:
        con.register("_scan", log.scan_events(lsn, ptr.lsn + 1))
        con.execute("CREATE TEMP TABLE _new AS SELECT * FROM _scan")
        con.unregister("_scan")
        n_red = con.execute("SELECT count(*) FROM _new WHERE kind = 'blob_reduced'"
                            ).fetchall()[0][0]
        if n_red:
            _merge_reductions(log, ptr, b, con, w)
        touched = con.sql("SELECT DISTINCT run_id FROM _new WHERE run_id IS NOT NULL"
                          ).to_arrow_table()
        if touched.num_rows:
            _merge_runs(log, ptr, b, con, w, touched, lsn)
        w.drain()
    for t, es in w.entries.items():
        b.tables.setdefault(t, {}).update(es)
    return b


def _merge_runs(log: EventLog, ptr: Pointer, b: _Build, con: Any, w: Writer,
                touched: pa.Table, lsn: int) -> None:
    old_index = _concat([read_file(log, f, ptr) for f in ptr.tables.get(INDEX, ())],
                        table_schemas()[INDEX])
    old_index = old_index.filter(pc.greater(old_index.column("bucket"), -1))
    con.register("_old_index", old_index)
    con.register("_touched", touched)
    lo = con.execute("SELECT min(first_lsn) FROM _old_index WHERE run_id IN "
                     "(SELECT run_id FROM _touched)").fetchall()[0][0]
    if lo is None or lo > ptr.lsn:
        con.execute("CREATE TEMP TABLE events AS SELECT * FROM _new WHERE run_id IS NOT NULL")
    else:
        con.register("_scan", log.scan_events(lsn, lo))
        con.execute("CREATE TEMP TABLE events AS SELECT * FROM _scan "
                    "WHERE run_id IN (SELECT run_id FROM _touched)")
        con.unregister("_scan")
    con.execute(f"""CREATE TEMP TABLE _new_index AS
        SELECT n.run_id, n.bucket,
               (coalesce(c.n, 0) + row_number() OVER (PARTITION BY n.bucket
                ORDER BY n.first_lsn) - 1) // {B.RUNS_PER_CHUNK} AS chunk, n.first_lsn
        FROM (SELECT run_id, {B.bucket_sql()} AS bucket, min(lsn) AS first_lsn FROM events
              WHERE run_id NOT IN (SELECT run_id FROM _old_index) GROUP BY run_id) n
        LEFT JOIN (SELECT bucket, count(*) AS n FROM _old_index GROUP BY bucket) c
        USING (bucket)""")
    con.execute("""CREATE TEMP TABLE _keys AS
        SELECT DISTINCT bucket, chunk FROM _old_index WHERE run_id IN
            (SELECT run_id FROM _touched)
        UNION SELECT DISTINCT bucket, chunk FROM _new_index""")
    keys = {(int(x), int(y)) for x, y in con.execute("SELECT * FROM _keys").fetchall()}
    con.execute("""CREATE TEMP TABLE _index AS
        SELECT * FROM _old_index WHERE (bucket, chunk) IN (SELECT (bucket, chunk) FROM _keys)
        UNION ALL SELECT * FROM _new_index""")
    create_fold_tables(con, PER_RUN_TABLES, ordered=False, temp=True)
    b.runs_folded = touched.num_rows
    b.buckets = len({k[0] for k in keys})
    for t in PER_RUN_TABLES:
        schema = table_schemas()[t]
        olds = [read_file(log, b.tables[t][k], ptr) for k in sorted(keys) if k in b.tables[t]]
        old = _concat(olds, schema)
        old = old.filter(pc.invert(pc.is_in(old.column("run_id"), touched.column(0))))
        con.register(f"_old_{t}", old)
        for k in keys:
            b.tables[t].pop(k, None)
        B.write_per_run(con, w, t, f"(SELECT * FROM _old_{t} UNION ALL SELECT * FROM {t})")
        con.unregister(f"_old_{t}")
    n_new = con.execute("SELECT count(*) FROM _new_index").fetchall()[0][0]
    if n_new:
        new_index = con.sql("SELECT * FROM _new_index").to_arrow_table()
        b.tables[INDEX] = {}
        B.index_file(w, _concat([old_index, new_index], table_schemas()[INDEX]))


def _merge_reductions(log: EventLog, ptr: Pointer, b: _Build, con: Any, w: Writer) -> None:
    have = b.tables["reductions"]
    n_old = sum(f.rows for f in have.values())
    first = n_old // B.REDUCTIONS_PER_CHUNK
    con.execute(f"CREATE TEMP TABLE reductions AS SELECT * FROM "
                f"({B.reductions_sql().replace('FROM events', 'FROM _new')})")
    old_rows = B.table_schemas()["reductions"].empty_table()
    if (0, first) in have and have[(0, first)].rows:  # the last chunk is not full: extend it
        old_rows = read_file(log, have[(0, first)], ptr)
    for k in [k for k, f in have.items() if f.rows == 0 or k == (0, first)]:
        del have[k]
    con.register("_old_red", old_rows)
    con.execute("CREATE OR REPLACE TEMP TABLE reductions AS SELECT * FROM _old_red "
                "UNION ALL SELECT * FROM reductions")
    B.write_reductions(con, w, first * B.REDUCTIONS_PER_CHUNK)
    con.execute("DROP TABLE reductions")


def cold_files(log: EventLog, lsn: int, *, passes: int | None = None,
               memory_limit: int | str | None = None) -> dict[str, tuple[FileEntry, ...]]:
    """The entries a cold full build at ``lsn`` gives, sorted by key (nothing written)."""
    budget = B.budget_of(memory_limit)
    w = Writer(lambda *_a: None)
    try:
        b = build_full(log, lsn, w, budget, plan_groups(log, lsn, budget, passes))
        _finish(b, w.sink)
    finally:
        w.close()
    return {t: tuple(sorted(b.tables.get(t, {}).values(), key=lambda f: f.key))
            for t in STATE_TABLES}


# --- publishing ---------------------------------------------------------------------------


def _pending_sink(log: EventLog, token: str, have: set[str]) -> B.Sink:
    def sink(table: str, f: FileEntry, data: bytes) -> None:
        if f.path not in have:
            log.storage.write(pending_path(token, f.path), data)
    return sink


def _publish(log: EventLog, b: _Build, lsn: int, old: Pointer | None,
             token: str, present: set[str]) -> Pointer | None:
    """Create the next generation put-if-absent; on success move its files into place and
    the replaced ones aside. None when another materializer took that generation.
    ``present``: the old generation's files that were not written again (all of them,
    unless a full build found some missing); the rest must be in the pending folder, or
    nothing is published (a vacuum with a short grace, or forced, removed them)."""
    gen = old.gen + 1 if old is not None else 1
    tables = {t: tuple(sorted(b.tables.get(t, {}).values(), key=lambda f: f.key))
              for t in STATE_TABLES}
    have = old.files() if old is not None else set()
    ptr = Pointer(lsn, _seq_of(log, lsn), FOLD_VERSION, current_settings(), tables,
                  tuple(sorted(have - {f.path for e in tables.values() for f in e})),
                  gen, token)
    files = ptr.files()
    pending = set(log.storage.walk_files(f"{PENDING_DIR}/{token}"))
    gone = sorted(p for p in files - present if pending_path(token, p) not in pending)
    if gone:
        log.storage.delete_tree(f"{PENDING_DIR}/{token}")
        raise PoimenError(f"materialize: {len(gone)} of its new state files were removed "
                          f"while it ran (e.g. {pending_path(token, gone[0])}): a vacuum with "
                          "a grace shorter than the materialize, or forced; nothing was "
                          "published, run it again")
    crash_point("state_written")
    if not log.storage.put_if_absent(gen_path(gen), dumps(ptr.to_doc())):
        log.storage.delete_tree(f"{PENDING_DIR}/{token}")
        return None
    with ThreadPoolExecutor(max_workers=B.WRITE_THREADS) as pool:
        list(pool.map(lambda p: log.storage.move(pending_path(token, p), p),
                      sorted(files - present)))
        list(pool.map(lambda p: _move_aside(log, p), sorted(ptr.prev_files)))
    log.storage.write(POINTER, dumps(ptr.to_doc()))
    crash_point("state_published")
    if old is not None:  # the generation before ``old``: no reader may start on it now
        for p in sorted(set(old.prev_files) - files - have):
            log.storage.delete(prev_path(p))
        if old.gen > 0:
            log.storage.delete(gen_path(old.gen))
        if old.token:
            log.storage.delete_tree(f"{PENDING_DIR}/{old.token}")
    log.storage.delete_tree(f"{PENDING_DIR}/{token}")
    return ptr


def files_in_use(log: EventLog) -> set[str] | None:
    """Every file under ``state/`` that a reader of the current or the previous generation
    may open (for vacuum), or None when the pointer cannot be read (then keep everything)."""
    try:
        ptr = read_pointer(log)
    except CorruptionError:
        return None
    keep = {POINTER}
    if ptr is None:
        return keep
    keep |= {gen_path(ptr.gen), gen_path(ptr.gen - 1)}
    for f in (f for es in ptr.tables.values() for f in es):
        keep |= set(ptr.locations(f))
    keep |= {prev_path(p) for p in ptr.prev_files}
    return keep


def _seq_of(log: EventLog, lsn: int) -> int:
    """The seq of the commit holding ``lsn``, streaming (never a whole segment held)."""
    for rb in log.scan_events(lsn, lsn, batch_rows=1):
        return int(rb.column("seq")[0].as_py())
    return 0


def _move_aside(log: EventLog, path: str) -> None:
    try:
        log.storage.move(path, prev_path(path))
    except (FileNotFoundError, PoimenError):
        pass  # already aside (a publisher that died half way)


def _settle(log: EventLog, ptr: Pointer) -> None:
    """Finish the moves of a generation whose publisher died after creating it."""
    for p in sorted(ptr.files()):
        src = pending_path(ptr.token, p)
        if ptr.token and not log.storage.exists(p) and log.storage.exists(src):
            log.storage.move(src, p)
    for p in ptr.prev_files:
        if log.storage.exists(p):
            _move_aside(log, p)
    log.storage.write(POINTER, dumps(ptr.to_doc()))


@B.scan_errors()
def materialize(log: LogLike, *, storage_options: dict[str, Any] | None = None,
                full: bool = False, memory_limit: int | str | None = None,
                temp_directory: str | None = None, executor: Any = None,
                passes: int | None = None) -> MaterializeReport:
    """Bring ``state/`` up to the head.

    Incremental when a usable state exists: only the runs touched since are folded again
    (their whole history: every fold rule is per run) and only their files rewritten.
    ``full=True`` (or a state made by another fold version or settings) rebuilds, in
    passes over groups of run buckets sized to ``memory_limit`` (bytes or e.g. ``"2GB"``;
    default a quarter of the machine, at most 1.5 GiB; DuckDB spills the rest to
    ``temp_directory``). ``executor=`` a ``distributed.Client`` folds the groups on Dask
    workers (same bytes); ``passes`` forces the number of bucket groups (the bytes never
    depend on it). Of two concurrent materializers one publishes; the other returns the
    state the winner published, or builds on top of it.
    """
    log = as_log(log, storage_options=storage_options)
    log.check_writable("materialize")  # it writes state/
    budget = B.budget_of(memory_limit, temp_directory)
    t0 = time.perf_counter()
    for _ in range(MAX_PUBLISH_TRIES):
        lsn = log.head
        try:
            old = read_pointer(log)
        except CorruptionError:
            old = None
        if old is not None and _hint_stale(log, old):
            _settle(log, old)
        usable = old if old is not None and old.usable and old.lsn <= lsn else None
        if usable is not None and usable.lsn == lsn and not full:
            return MaterializeReport(lsn, lsn, False, 0, 0, 0, time.perf_counter() - t0)
        token = uuid.uuid4().hex
        present = old.files() if old is not None else set()
        if full and present:  # a rebuild writes again what the old pointer names but lost
            present &= set(log.storage.walk_files("state"))
        w = Writer(_pending_sink(log, token, present))
        try:
            if usable is None or full:
                groups = plan_groups(log, lsn, budget, passes)
                remote = None
                if executor is not None:
                    remote = _remote_fold(log, lsn, budget, token, present)
                b = build_full(log, lsn, w, budget, groups, executor, remote)
            else:
                b = build_incremental(log, usable, lsn, w, budget)
            w.close()
            _finish(b, w.sink)
        except BaseException:
            w.close()
            log.storage.delete_tree(f"{PENDING_DIR}/{token}")
            raise
        written = sum(1 for es in b.tables.values() for f in es.values()
                      if f.path not in present)
        ptr = _publish(log, b, lsn, old, token, present)
        if ptr is not None:
            return MaterializeReport(lsn, lsn, b.full, b.runs_folded, written, b.buckets,
                                     time.perf_counter() - t0)
        # lost the race: the winner's state serves if it covers as much
        won = usable_pointer(log)
        if won is not None and won.lsn >= lsn and not full:
            return MaterializeReport(won.lsn, lsn, False, 0, 0, 0, time.perf_counter() - t0)
    raise PoimenError(f"materialize: lost {MAX_PUBLISH_TRIES} races to concurrent "
                      "materializers in a row")


def _hint_stale(log: EventLog, ptr: Pointer) -> bool:
    data = log.storage.read_or_none(POINTER)
    if data is None:
        return ptr.gen > 0
    try:
        return _parse(log, data, POINTER).gen != ptr.gen
    except CorruptionError:
        return True


def _remote_fold(log: EventLog, lsn: int, budget: Budget, token: str,
                 have: set[str]) -> Any:
    """The function a Dask worker runs for one group of buckets: open the log read-only,
    fold, write the files to the pending folder, return their entries and index rows."""
    return functools.partial(_fold_on_worker, log.root, log.storage.storage_options, lsn,
                             budget.memory_limit, token, frozenset(have))


def _fold_on_worker(root: str, storage_options: dict[str, Any], lsn: int, memory: int,
                    token: str, have: frozenset[str], buckets: tuple[int, ...],
                    with_reductions: bool) -> tuple[dict[str, list[FileEntry]], pa.Table]:
    from poimen_data.log._log import open_log

    log = open_log(root, storage_options or None, create=False, read_only=True)
    sink = _pending_sink(log, token, set(have)) if token else (lambda *_a: None)
    w = Writer(sink)
    try:
        index = B.full_pass(log, lsn, buckets, w, Budget(memory), with_reductions=with_reductions)
    finally:
        w.close()
    return {t: list(es.values()) for t, es in w.entries.items()}, index


__all__ = ["INDEX", "POINTER", "STATE_TABLES", "FileEntry", "MaterializeReport", "Pointer",
           "files_in_use", "locate", "materialize", "parquet_bytes", "read_bytes", "read_file",
           "read_pointer",
           "read_run", "table_schemas", "usable_pointer"]
