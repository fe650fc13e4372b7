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
  after that LSN (its original is gone) exports the summary of its latest reduction. A
  body committed again after its reduction still exports its summary (events alone say
  what is reduced, so every source writes the same bytes), though ``blob_text`` reads it.
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
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, get_args

import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import NotFound, ValidationError
from poimen_data.fold._build import budget_of, scan_errors
from poimen_data.fold._fold import SOURCES, Source
from poimen_data.jobs._atif import AtifWriter
from poimen_data.jobs._export_formats import SLOTS, WRITERS, Bodies, Sink, dest_parts
from poimen_data.jobs._export_rows import Options, export_rows, wanted_runs
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.model._events import BlobRef

_WRITERS: dict[str, Callable[..., Any]] = {**WRITERS, "atif": AtifWriter}
_SLOTS: dict[str, tuple[str, ...]] = {**SLOTS, "atif": AtifWriter.slots}
#: the export formats, a ``Literal`` for type checkers; ``FORMATS`` at run time
ExportFormat = Literal["jsonl", "parquet", "pairs", "atif"]
FORMATS: tuple[str, ...] = get_args(ExportFormat)
assert set(FORMATS) == set(_WRITERS), "every format has a writer"
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


#: what a log keeps right under its root (README, "Storage layout"): never an export's
LOG_OWN = ("_poimen.json", "_lease.json", "_log", "_staging", "segments", "blobs", "state")


def _log_part(log: EventLog, dest: str) -> str | None:
    """The part of the log's own layout that ``dest`` names or lies in (None: none). Local
    paths are compared with their folders' symlinks resolved, URLs as written."""
    def where(url: str) -> tuple[str, str]:
        proto, folder, name = dest_parts(url)
        if proto in ("", "file"):  # file:// URLs name local paths too
            folder = os.path.realpath(folder if proto == "" else f"/{folder.lstrip('/')}")
            proto = "file"
        return proto, f"{folder}/{name}".strip("/")

    (dproto, dpath), (rproto, rpath) = where(dest), where(log.root)
    if dproto != rproto or not dpath.startswith(rpath + "/"):
        return None
    first = dpath[len(rpath) + 1:].split("/", 1)[0]
    return first if first in LOG_OWN or ".tmp-" in first else None


@scan_errors()
def export_live(
    log: LogLike,
    dest: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    dest_options: dict[str, Any] | None = None,
    format: ExportFormat = "jsonl",
    source: Source = "auto",
    at_lsn: int | None = None,
    runs: Iterable[str] | None = None,
    only_succeeded: bool = False,
    keep_unanswered: bool = False,
    batch_size: int = DEFAULT_BATCH_BYTES,
    max_workers: int = 8,
    progress: Callable[[ExportProgress], None] | None = None,
    memory_limit: int | str | None = None,
) -> ExportReport:
    """Export the live trajectory of each run (or of ``runs``) to ``dest`` (any fsspec URL,
    opened with ``dest_options``) as ``format``: ``"jsonl"`` (chat messages),
    ``"parquet"``, ``"pairs"`` (prompt/completion) or ``"atif"`` (README, "Export").

    ``at_lsn`` exports the log as it stood at that LSN (default: the head);
    ``only_succeeded`` keeps only the ``succeeded`` attempts; ``progress`` is called
    with an ``ExportProgress`` as runs are written; ``memory_limit`` caps the fold's DuckDB
    (as ``connect``'s does).
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
    log = as_log(log, storage_options=storage_options, read_only=True)
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
    own = _log_part(log, os.fspath(dest))
    if own is not None:
        raise ValidationError(f"export: {os.fspath(dest)!r} is inside the log's own "
                              f"{own!r}; write it elsewhere (a folder of your own under the "
                              "root, such as exports/, is fine)")
    head = log.head
    lsn = head if at_lsn is None else at_lsn
    if type(lsn) is not int or not 0 <= lsn <= head:
        raise ValidationError(f"export: at_lsn {at_lsn!r} is outside 0..{head}")
    opts = Options(format, wanted_runs(runs), only_succeeded, keep_unanswered)
    budget = budget_of(memory_limit)
    pool = ThreadPoolExecutor(max_workers, thread_name_prefix="poimen-export")
    fetcher = _Fetcher(log, pool)
    try:
        with tempfile.TemporaryDirectory(prefix="poimen-export-",
                                         dir=budget.temp_directory) as tmp, \
                export_rows(log, source, lsn, opts, budget, tmp) as rows:

            def report(runs_done: int, records: int) -> None:
                if progress is not None:
                    progress(ExportProgress(runs_done, rows.total_runs, records, out.bytes))

            with Sink(os.fspath(dest), dest_options) as out:
                writer = _WRITERS[format](out, lsn)
                stats = _pump(rows.batches, writer, fetcher, _SLOTS[format], batch_size,
                              report)
                writer.close()
    finally:  # after a failure, fetches still queued are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)
    return ExportReport(out.url, format, rows.source, lsn, stats[0], stats[1], out.bytes,
                        stats[2], out.sha256, *rows.skipped)


# --- the pipeline ------------------------------------------------------------------------


def _batches(reader: Iterable[pa.RecordBatch], slots: tuple[str, ...], budget: int
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

    def submit(self, batch: pa.RecordBatch, slots: tuple[str, ...]) -> Bodies:
        """Start fetching every body of ``batch`` (each distinct ref once), in row order,
        so the writer's first rows are the first to arrive."""
        groups = _Groups(self)
        cols = [batch.column(f"{s}_ref").to_pylist() for s in slots]
        cells: list[list[_Cell | None]] = [[None] * batch.num_rows for _ in slots]
        for i, row in enumerate(zip(*cols, strict=True)):
            for k, d in enumerate(row):
                if d is not None:
                    groups.add((d["tenant"], d["sha256"]), d["size"], cells[k], i)
        groups.close()
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
            if summary is None:  # reduced after the reductions were read: read them again
                summary = self._late_reductions(again=True).get((ref.tenant, ref.sha256))
            if summary is None:
                break
            ref, late = summary, True
        raise NotFound(f"export: body {ref.tenant}/{ref.sha256} was reduced and no summary "
                       "of it is in the log")

    def _late_reductions(self, again: bool = False) -> dict[tuple[str, str], BlobRef]:
        """Every reduction in the log, original -> summary (read once; ``again`` reads
        them anew, for a body reduced since)."""
        with self._lock:
            if self._late is None or again:
                self.log.refresh()
                self._late = {}  # the reductions only, as the segments stream past
                for b in self.log.scan(columns=("kind", "original", "summary")):
                    red = b.filter(pc.equal(b.column("kind"), "blob_reduced"))
                    for o, s in zip(red.column("original").to_pylist(),
                                    red.column("summary").to_pylist(), strict=True):
                        self._late[(o["tenant"], o["sha256"])] = BlobRef(**s)
            return self._late


class _Groups:
    """Cuts refs, in the order given, into pool tasks of about ``_GROUP_BYTES`` or
    ``_GROUP_REFS`` each (each distinct ref once), and fills in the cells that wait for
    them."""

    def __init__(self, fetcher: _Fetcher) -> None:
        self.fetcher = fetcher
        self.at: dict[tuple[str, str], _Cell] = {}
        self.refs: list[BlobRef] = []
        self.index: dict[tuple[str, str], int] = {}
        self.waiting: list[tuple[list[_Cell | None], int, int]] = []
        self.size = 0

    def add(self, key: tuple[str, str], size: int, col: list[_Cell | None], i: int) -> None:
        cell = self.at.get(key)
        if cell is not None:
            col[i] = cell
            return
        j = self.index.get(key)
        if j is None:
            if self.refs and (self.size >= _GROUP_BYTES or len(self.refs) >= _GROUP_REFS):
                self._flush()
            j = self.index[key] = len(self.refs)
            self.refs.append(BlobRef(*key, size))
            self.size += size
        self.waiting.append((col, i, j))

    def _flush(self) -> None:
        fut = self.fetcher.pool.submit(self.fetcher._bodies, self.refs)
        for key, j in self.index.items():
            self.at[key] = (fut, j)
        for col, i, j in self.waiting:
            col[i] = (fut, j)
        self.refs, self.index, self.waiting, self.size = [], {}, [], 0

    def close(self) -> None:
        """Submit the last group."""
        if self.refs:
            self._flush()


def _pump(reader: Iterable[pa.RecordBatch], writer: Any, fetcher: _Fetcher,
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
