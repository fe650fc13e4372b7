"""Export for the learning loop (docs/DESIGN.md, "Export"): the live-branch trajectory of every
run as training data, at one fixed LSN, as chat ``jsonl``, flat ``parquet``, preference
``pairs`` or ATIF trajectories (``atif``, mapped in ``_atif``).

The bytes are a pure function of the log at that LSN, so a materialized state and a cold
re-fold give files with the same sha256: rows come from one SQL query over the fold's
views with a total order, batches are cut by a pure function of those rows, and every
writer setting is pinned (``_export_formats``). ``source="auto"`` serves from a
materialized state at or before the export LSN and folds again only the runs that later
commits touched (``_connect``). The export streams: rows (refs and metadata, never
bodies) come from DuckDB in Arrow batches; batch i is written while a bounded thread pool
fetches batch i+1's bodies (so S3 latency overlaps), in groups of refs (a pool task per
body would cost more than reading a small one), and a row is written as soon as its own
bodies are in. On remote storage, while the log is folded, the pool already reads the
bodies the first batch most likely needs (at most one batch budget; a wrong guess costs
reads, not bytes). Memory is about 2 x ``batch_size`` (3 x for parquet, whose row group is
assembled whole) plus a few MiB, whatever the size of the log or of its bodies. The
file is written under a temporary name next to ``dest`` and published at the end, so a
failed export leaves nothing at ``dest``.

Rules a consumer must know:

- Records: one per attempt of the live trajectory (inherited attempts below each fork
  point, then the live branch's own), runs by ``run_id``, attempts in the fold's
  trajectory order (``TABLE_KEYS["trajectories"]``: recording branch, so inherited
  before own, then ``(step_index NULLS LAST, attempt_no, step_id)``; in a well-formed
  run that is simply ``(step_index, attempt_no)``). Failed,
  timed-out, cancelled and still-dispatched attempts are kept with their ``state``
  unless ``only_succeeded``.
- Bodies are decoded as UTF-8 (invalid bytes become U+FFFD). In ``parquet`` an attempt
  with no body (no prompt ref, or no output yet) exports ``null``, never ``""``: "nothing
  captured" stays distinct from "captured empty". ``jsonl`` leaves such attempts out
  (counted in the report; ``keep_unanswered`` keeps those with a prompt as a user turn
  alone): a null assistant turn becomes an empty one in chat templates.
- A reduced body exports its summary text with ``prompt_reduced``/``output_reduced``
  true. The summary is found in the ``reductions`` view at the export LSN; a body reduced
  after that LSN (its original is gone) exports the summary of its latest reduction.
- ``verdicts``: the run verdicts recorded for the run's live branch (those that graded
  this trajectory; a verdict on a branch abandoned by a later rewind graded other
  attempts), on every record of the run, then the attempt verdicts of this very attempt
  (its branch, step and number, whatever the snapshot: the attempt did not change), each
  part ordered by ``(snapshot_lsn, verifier, lsn)``. An entry does not say which kind
  it is: a verifier has one scope, so its name does.
- ``pairs``: on one run's live trajectory, every attempt that ``failed`` or ``timed_out``
  is paired with the *first later* ``succeeded`` attempt of the same step (same
  ``step_id`` and ``step_index``, later in trajectory order). ``prompt`` is the failed
  attempt's prompt: the rejected output is on-policy for it, the lesson is "answer this
  prompt the way the retry did", and a retry prompt often quotes the failed output or its
  error, which would leak the rejected answer into the prompt. A pair is skipped when the
  failed prompt, the rejected output or the chosen output has no body; ``cancelled``
  attempts are not rejections (the model did not fail). Pairs are ordered like records,
  by the failed attempt.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import NotFound, ValidationError
from poimen_data.fold import _fold
from poimen_data.fold._connect import connect
from poimen_data.jobs._atif import AtifWriter
from poimen_data.jobs._export_formats import SLOTS, VERDICT_TYPE, WRITERS, Bodies, Sink
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.model._events import BlobRef

_WRITERS: dict[str, Callable[..., Any]] = {**WRITERS, "atif": AtifWriter}
_SLOTS: dict[str, tuple[str, ...]] = {**SLOTS, "atif": AtifWriter.slots}
FORMATS = tuple(_WRITERS)
SOURCES = ("auto", "state", "log")
DEFAULT_BATCH_BYTES = 64 << 20
MAX_BATCH_ROWS = 8192


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote. ``reduced`` counts bodies exported as their summary;
    ``sha256`` is the file's, so two exports can be compared without reading them."""

    path: str
    format: str
    source: str
    export_lsn: int
    runs: int
    records: int
    bytes: int
    reduced: int
    sha256: str
    #: chat formats (``jsonl``): attempts left out because no output body was captured
    #: (still dispatched, timed out, or resolved by recovery), unless ``keep_unanswered``
    skipped_no_output: int = 0
    #: chat formats: attempts left out because no prompt body was captured (no user turn)
    skipped_no_prompt: int = 0


@dataclass(frozen=True)
class ExportProgress:
    """Handed to the ``progress`` callback after each batch is written."""

    runs_done: int
    runs_total: int
    records: int
    bytes: int


_LIVE_SQL = """
WITH red AS (
    SELECT tenant, original.sha256 AS sha256, arg_max(summary, lsn) AS summary
    FROM reductions GROUP BY tenant, original.sha256
), vd AS (
    SELECT v.run_id,
           list({{'verifier': v.verifier, 'passed': v.passed, 'score': v.score::DOUBLE,
                  'snapshot_lsn': v.snapshot_lsn::BIGINT}}
                ORDER BY v.snapshot_lsn, v.verifier, v.lsn) AS verdicts
    FROM verdicts v JOIN runs r ON r.run_id = v.run_id AND v.branch_id = r.live_branch
    WHERE v.step_id IS NULL
    GROUP BY v.run_id
), va AS (
    SELECT v.run_id, v.branch_id, v.step_id, v.attempt_no,
           list({{'verifier': v.verifier, 'passed': v.passed, 'score': v.score::DOUBLE,
                  'snapshot_lsn': v.snapshot_lsn::BIGINT}}
                ORDER BY v.snapshot_lsn, v.verifier, v.lsn) AS verdicts
    FROM verdicts v WHERE v.step_id IS NOT NULL
    GROUP BY v.run_id, v.branch_id, v.step_id, v.attempt_no
)
SELECT t.run_id, t.tenant, t.branch_id, t.step_id, t.step_index, t.attempt_no, t.state,
       t.workflow_version, t.usage, t.tools, t.error, t.trajectory_branch_id AS live_branch,
       coalesce(rp.summary, t.prompt) AS prompt_ref, rp.summary IS NOT NULL AS prompt_reduced,
       coalesce(ro.summary, t.output) AS output_ref, ro.summary IS NOT NULL AS output_reduced,
       list_concat(coalesce(vd.verdicts, []::{verdict_type}[]),
                   coalesce(va.verdicts, []::{verdict_type}[])) AS verdicts,
       row_number() OVER (PARTITION BY t.run_id ORDER BY {trajectory_order}) AS pos
FROM trajectories t
LEFT JOIN red rp ON rp.tenant = t.prompt.tenant AND rp.sha256 = t.prompt.sha256
LEFT JOIN red ro ON ro.tenant = t.output.tenant AND ro.sha256 = t.output.sha256
LEFT JOIN vd ON vd.run_id = t.run_id
LEFT JOIN va ON va.run_id = t.run_id AND va.branch_id = t.branch_id
            AND va.step_id = t.step_id AND va.attempt_no = t.attempt_no
WHERE t.is_live {where}
"""

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


def export_live(
    log: LogLike,
    dest: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    dest_options: dict[str, Any] | None = None,
    format: str = "jsonl",
    source: str = "auto",
    at_lsn: int | None = None,
    runs: Iterable[str] | None = None,
    only_succeeded: bool = False,
    keep_unanswered: bool = False,
    batch_size: int = DEFAULT_BATCH_BYTES,
    max_workers: int = 8,
    progress: Callable[[ExportProgress], None] | None = None,
) -> ExportReport:
    """Export the live trajectory of each run (or of ``runs``) to ``dest`` (any fsspec URL).

    ``batch_size`` is the body budget of one batch in bytes (a batch holds at least one
    row, so one body larger than it is still exported); files are byte-identical for the
    same log, LSN and options. ``source`` picks where the rows come from: ``"state"``
    (a materialized state at exactly the export LSN, else ``NotFound``), ``"log"`` (a
    cold re-fold) or ``"auto"`` (a state at or before the export LSN, the runs touched
    after it folded again; else the log). ``ExportReport.source`` says which was used:
    ``"state"``, ``"state+log"`` or ``"log"``; the bytes are the same whichever it is.
    ``max_workers`` bounds the pool that reads bodies. Unknown ``runs`` raise ``NotFound``.
    ``jsonl`` never writes a null message: attempts with no output body are left out
    (``ExportReport.skipped_no_output``) unless ``keep_unanswered``, which keeps them as
    a user turn alone; attempts with no prompt body are always left out
    (``skipped_no_prompt``).
    """
    log = as_log(log, storage_options=storage_options)
    if format not in FORMATS:
        raise ValidationError(f"export: format must be one of {FORMATS}, got {format!r}")
    if source not in SOURCES:
        raise ValidationError(f"export: source must be one of {SOURCES}, got {source!r}")
    if keep_unanswered and format != "jsonl":
        raise ValidationError(f"export: keep_unanswered applies to the jsonl chat format, "
                              f"not {format!r} (which keeps every attempt)")
    if format == "pairs" and only_succeeded:
        raise ValidationError("export: only_succeeded leaves no failed attempt to pair")
    if type(batch_size) is not int or batch_size < 1:
        raise ValidationError(f"export: batch_size must be an int >= 1, got {batch_size!r}")
    if type(max_workers) is not int or max_workers < 1:
        raise ValidationError(f"export: max_workers must be an int >= 1, got {max_workers!r}")
    head = log.head
    lsn = head if at_lsn is None else at_lsn
    if type(lsn) is not int or not 0 <= lsn <= head:
        raise ValidationError(f"export: at_lsn {at_lsn!r} is outside 0..{head}")
    pool = ThreadPoolExecutor(max_workers, thread_name_prefix="poimen-export")
    fetcher = _Fetcher(log, pool)
    try:
        con, used = _connect(log, source, lsn)
        try:
            _select(con, runs, only_succeeded)
            query = _PAIRS_SQL if format == "pairs" else \
                f"SELECT * FROM export_live {_chat_filter(format, keep_unanswered)} " \
                "ORDER BY run_id, pos"
            skipped = _skipped(con, format, keep_unanswered)
            total = int(con.sql(f"SELECT count(DISTINCT run_id) FROM ({query})"
                                ).fetchall()[0][0])
            reader = con.sql(query).to_arrow_reader(MAX_BATCH_ROWS)

            def report(runs_done: int, records: int) -> None:
                if progress is not None:
                    progress(ExportProgress(runs_done, total, records, out.bytes))

            with Sink(os.fspath(dest), dest_options) as out:
                writer = _WRITERS[format](out, lsn)
                stats = _pump(reader, writer, fetcher, _SLOTS[format], batch_size, report)
                writer.close()
        finally:
            con.close()
    finally:  # after a failure, fetches still queued are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)
    return ExportReport(out.url, format, used, lsn, stats[0], stats[1], out.bytes,
                        stats[2], out.sha256, *skipped)


def _chat_filter(format: str, keep_unanswered: bool) -> str:
    """The chat format needs a user turn, and an assistant turn unless ``keep_unanswered``:
    a null message would train a model to stop at once."""
    if format != "jsonl":
        return ""
    return "WHERE prompt_ref IS NOT NULL" + ("" if keep_unanswered
                                             else " AND output_ref IS NOT NULL")


def _skipped(con: Any, format: str, keep_unanswered: bool) -> tuple[int, int]:
    """(no output, no prompt) attempts the chat filter leaves out."""
    if format != "jsonl":
        return 0, 0
    no_out, no_prompt = con.execute(
        "SELECT count(*) FILTER (prompt_ref IS NOT NULL AND output_ref IS NULL), "
        "count(*) FILTER (prompt_ref IS NULL) FROM export_live").fetchall()[0]
    return (0 if keep_unanswered else int(no_out)), int(no_prompt)


def _connect(log: EventLog, source: str, lsn: int) -> tuple[Any, str]:
    """A connection with the fold's views at ``lsn`` (``fold.connect``, so memory stays
    bounded: the state's files and the segments are scanned, never loaded whole), and the
    source used: ``"state"`` (a state at exactly ``lsn``), ``"state+log"`` (an older state,
    the runs later commits touched folded again), or ``"log"`` (a cold fold). The rows are
    the same whichever it is, so the bytes are too."""
    try:
        con = connect(log, lsn, source=source)  # type: ignore[arg-type]
    except NotFound as exc:
        raise NotFound(str(exc).replace("connect:", "export:", 1)) from None
    used = con.execute("SELECT getvariable('poimen_source')").fetchall()[0][0]
    return con, str(used)


def _select(con: Any, runs: Iterable[str] | None, only_succeeded: bool) -> None:
    """Create the temp table ``export_live``: the rows to export, refs and metadata only."""
    where = []
    params: dict[str, Any] = {}
    if runs is not None:
        wanted = sorted(set(runs if not isinstance(runs, str) else [runs]))
        if not all(isinstance(r, str) for r in wanted):
            raise ValidationError("export: runs must be run ids (str)")
        found = {r for (r,) in con.execute(
            "SELECT run_id FROM runs WHERE list_contains($runs, run_id)",
            {"runs": wanted}).fetchall()}
        missing = [r for r in wanted if r not in found]
        if missing:
            raise NotFound(f"export: no run {', '.join(missing[:5])} in the log at this LSN")
        where.append("AND list_contains($runs, t.run_id)")
        params["runs"] = wanted
    if only_succeeded:
        where.append("AND t.state = 'succeeded'")
    sql = _LIVE_SQL.format(where=" ".join(where), verdict_type=_duck_type(VERDICT_TYPE),
                           trajectory_order=_trajectory_order())
    con.execute(f"CREATE OR REPLACE TEMP TABLE export_live AS {sql}", params)


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


# --- the pipeline ------------------------------------------------------------------------


def _batches(reader: pa.RecordBatchReader, slots: tuple[str, ...], budget: int
             ) -> Iterator[pa.RecordBatch]:
    """Re-cut DuckDB's batches (whose sizes vary between runs) by a pure function of the
    rows: at most ``MAX_BATCH_ROWS`` rows and ``budget`` body bytes (at least one row)."""
    pending: list[pa.RecordBatch] = []
    for b in reader:
        if b.num_rows:
            pending.append(b)
        if sum(p.num_rows for p in pending) >= MAX_BATCH_ROWS:
            yield from _cut(pending, slots, budget, final=False)
    yield from _cut(pending, slots, budget, final=True)


def _cut(pending: list[pa.RecordBatch], slots: tuple[str, ...], budget: int,
         final: bool) -> Iterator[pa.RecordBatch]:
    if not pending:
        return
    t = pa.Table.from_batches(pending).combine_chunks()
    pending.clear()
    sizes = None
    for s in slots:
        sz = pc.fill_null(pc.struct_field(t.column(f"{s}_ref"), "size"), 0)
        sizes = sz if sizes is None else pc.add(sizes, sz)
    size_list = sizes.to_pylist() if sizes is not None else [0] * t.num_rows
    start, acc = 0, 0
    for i, sz in enumerate(size_list):
        if i > start and (acc + sz > budget or i - start >= MAX_BATCH_ROWS):
            yield from t.slice(start, i - start).to_batches(max_chunksize=MAX_BATCH_ROWS)
            start, acc = i, 0
        acc += sz
    rest = t.slice(start)
    if rest.num_rows:
        if final:
            yield from rest.to_batches(max_chunksize=MAX_BATCH_ROWS)
        else:
            pending.extend(rest.to_batches())


#: Bodies are fetched in groups (one pool task each) of about this many bytes or refs:
#: a future per body cost more than reading a small one, and groups small enough keep
#: every worker busy and let the writer start on a batch's first rows early.
_GROUP_BYTES = 1 << 20
_GROUP_REFS = 64


_Cell = tuple[Future[list[tuple[bytes, bool]]], int]


class _Fetcher:
    """Fetches bodies through ``log.blobs`` on a bounded pool, a group of refs per task."""

    def __init__(self, log: EventLog, pool: ThreadPoolExecutor) -> None:
        self.log, self.pool = log, pool
        self._late: dict[tuple[str, str], BlobRef] | None = None
        self._lock = threading.Lock()
        self._ahead: Future[dict[tuple[str, str], _Cell]] | None = None

    def submit(self, batch: pa.RecordBatch, slots: tuple[str, ...]) -> Bodies:
        """Start fetching every body of ``batch`` (each distinct ref once), in row order,
        so the writer's first rows are the first to arrive."""
        ahead: dict[tuple[str, str], _Cell] = {}
        if self._ahead is not None:
            ahead, self._ahead = self._ahead.result(), None
        groups = _Groups(self, ahead)
        cols = [batch.column(f"{s}_ref").to_pylist() for s in slots]
        cells: list[list[_Cell | None]] = [[None] * batch.num_rows for _ in slots]
        for i, row in enumerate(zip(*cols, strict=True)):
            for k, d in enumerate(row):
                if d is not None:
                    groups.add((d["tenant"], d["sha256"]), d["size"], cells[k], i)
        used = {id(c[0]) for c in groups.close().values()}
        for fut, _ in ahead.values():  # guessed wrong: not read yet, not read at all
            if id(fut) not in used:
                fut.cancel()
        return Bodies(dict(zip(slots, cells, strict=True)),
                      {s: batch.column(f"{s}_reduced").to_pylist() for s in slots})

    def _bodies(self, refs: list[BlobRef]) -> list[tuple[bytes, bool]]:
        return [self._body(r) for r in refs]

    def _body(self, ref: BlobRef) -> tuple[bytes, bool]:
        """The body, and whether a reduction after the export LSN replaced it by its summary.
        Bytes, not text: writers decode one record at a time, so a batch is held once."""
        late = False
        for _ in range(8):
            data = self.log.blobs.get(ref)
            if data is not None:
                return data, late
            summary = self._late_reductions().get((ref.tenant, ref.sha256))
            if summary is None:
                break
            ref, late = summary, True
        raise NotFound(f"export: body {ref.tenant}/{ref.sha256} was reduced and no summary "
                       "of it is in the log")

    def _late_reductions(self) -> dict[tuple[str, str], BlobRef]:
        with self._lock:
            if self._late is None:
                ev = self.log.read_events()
                red = ev.filter(pc.equal(ev.column("kind"), "blob_reduced"))
                self._late = {}
                for o, s in zip(red.column("original").to_pylist(),
                                red.column("summary").to_pylist(), strict=True):
                    self._late[(o["tenant"], o["sha256"])] = BlobRef(**s)
            return self._late


class _Groups:
    """Cuts refs, in the order given, into pool tasks of about ``_GROUP_BYTES`` or
    ``_GROUP_REFS`` each (each distinct ref once), and fills in the cells that wait for
    them; refs already under way (``known``) are reused."""

    def __init__(self, fetcher: _Fetcher, known: dict[tuple[str, str], _Cell] | None = None
                 ) -> None:
        self.fetcher, self.known = fetcher, known or {}
        self.at: dict[tuple[str, str], _Cell] = {}
        self.refs: list[BlobRef] = []
        self.index: dict[tuple[str, str], int] = {}
        self.waiting: list[tuple[list[_Cell | None], int, int]] = []
        self.size = 0

    def add(self, key: tuple[str, str], size: int,
            col: list[_Cell | None] | None = None, i: int = 0) -> None:
        cell = self.at.get(key) or self.known.get(key)
        if cell is not None:
            self.at[key] = cell
            if col is not None:
                col[i] = cell
            return
        j = self.index.get(key)
        if j is None:
            if self.refs and (self.size >= _GROUP_BYTES or len(self.refs) >= _GROUP_REFS):
                self._flush()
            j = self.index[key] = len(self.refs)
            self.refs.append(BlobRef(*key, size))
            self.size += size
        if col is not None:
            self.waiting.append((col, i, j))

    def _flush(self) -> None:
        fut = self.fetcher.pool.submit(self.fetcher._bodies, self.refs)
        for key, j in self.index.items():
            self.at[key] = (fut, j)
        for col, i, j in self.waiting:
            col[i] = (fut, j)
        self.refs, self.index, self.waiting, self.size = [], {}, [], 0

    def close(self) -> dict[tuple[str, str], _Cell]:
        """Submit the last group; every ref added, with its task and place in it."""
        if self.refs:
            self._flush()
        return self.at


def _pump(reader: pa.RecordBatchReader, writer: Any, fetcher: _Fetcher,
          slots: tuple[str, ...], budget: int,
          report: Callable[[int, int], None] | None) -> tuple[int, int, int]:
    """Write batch i while batch i+1's bodies are fetched; within a batch, a row is
    written as soon as its own bodies are in. Returns (runs, records, reduced)."""
    runs = records = reduced = 0
    last_run: str | None = None
    ahead: tuple[pa.RecordBatch, Bodies] | None = None
    it = _batches(reader, slots, budget)
    while True:
        nxt = next(it, None)
        queued = None if nxt is None else (nxt, fetcher.submit(nxt, slots))
        if ahead is not None:
            (batch, bodies), ahead = ahead, None
            writer.write(batch, bodies)
            reduced += bodies.reduced_count()
            del bodies
            ids = batch.column("run_id").to_pylist()
            runs += len({r for r in ids if r != last_run})
            last_run = ids[-1]
            records += batch.num_rows
            if report is not None:
                report(runs - (nxt is not None), records)
        if queued is None:
            return runs, records, reduced
        ahead = queued
