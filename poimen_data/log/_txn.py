"""Transactions: a batch of blobs and events that becomes visible at once, or not at all.

A transaction stages its new bodies, validates its events, writes them as one segment and
asks the log to publish the manifest (``LogInternals.publish``); see README "Committing".
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import uuid
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import PoimenError, ValidationError
from poimen_data.log._faults import crash_point, write_in_flight
from poimen_data.log._manifest import BlobEntry, Manifest, SegmentInfo, blob_path, staged_blob_path
from poimen_data.log._staged import Piece, pack_path, staged_size
from poimen_data.model import _events as ev
from poimen_data.model._arrow import check_conformed, conform_table, events_to_table, table_refs
from poimen_data.storage import CHECK_POOL, IO_POOL, DurableBatch

if TYPE_CHECKING:
    from poimen_data.log._internals import LogInternals

BlobKey = tuple[str, str]  # (tenant, sha256)
_logger = logging.getLogger("poimen_data")
# A bulk table of this many rows or more is checked on a thread while the commit writes
# its segment (its ValidationError is then raised by commit, not by extend).
BACKGROUND_CHECK_ROWS = 50_000
# put_blob writes bodies in the background, but at most this many (or bytes) at a time
# per transaction: memory stays bounded and one busy writer does not starve the others
MAX_IO_IN_FLIGHT = 8
MAX_IO_BYTES_IN_FLIGHT = 32 << 20
# A pack (``pack_bodies``) takes bodies up to PACK_PIECE_MAX bytes until it holds PACK_MAX:
# promotion and vacuum read a pack whole, so it stays small; bigger bodies, and those past
# the cap, are staged as files of their own.
PACK_PIECE_MAX = 64 << 10
PACK_MAX = 8 << 20


def _utcnow() -> datetime:
    return datetime.now(UTC)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True, slots=True)
class CommitInfo:
    seq: int | None
    first_lsn: int
    last_lsn: int



NO_BODY = "no committed body"


def ref_problem(log: LogInternals, ref: ev.BlobRef) -> str | None:
    """Why ``ref`` is not a committed, unreduced body of its size (None when it is), from
    the storage's metadata alone (no body is read)."""
    key = (ref.tenant, ref.sha256)
    if not log.body_present(key):
        log.refresh()  # committed by another process since we last looked?
        if not log.body_present(key):
            return NO_BODY
    if ref.size != _committed_size(log, key):
        return f"size {ref.size} does not match the body"
    return None


def _committed_size(log: LogInternals, key: BlobKey) -> int | None:
    """Its size in ``blobs/``, else in staging, else in ``blobs/`` again: a background
    promotion may move it between the first two looks (as ``get`` reads it)."""
    home = blob_path(*key)
    size = log.storage.size(home)
    if size is None:
        _reduced, staged = log.blob_location(key)
        size = staged_size(log.storage, staged) if staged else None
        if size is None:
            size = log.storage.size(home)
    return size

class Transaction:
    """A batch of blobs and events that becomes visible at once, or not at all."""

    # Stage the bodies put before ``start_writes`` as one file, the pack (see ``_staged``):
    # the recorder's windows of many small bodies.
    pack_bodies: bool = False
    # the caller writes the checkpoint the commit owes (a recorder: behind the head, on a
    # thread of its own, ``EventLog.write_checkpoint(upto=...)``)
    defer_checkpoint: bool = False

    def __init__(self, log: LogInternals) -> None:
        self.log = log
        self.txn = uuid.uuid4().hex
        self._events: list[ev.Event] = []
        self._stamps: list[datetime] = []
        self._tables: list[pa.Table] = []
        self._staged: dict[BlobKey, BlobEntry] = {}
        self._reused: dict[BlobKey, bytes] = {}
        self._failed: BaseException | None = None
        self._done = False
        self._n_table_rows = 0
        self._segment_written = False
        self._seen_refs = ev.Checked()  # what validation checked: refs, ids
        self._bulk: list[pa.Table] = []  # tables given to extend (their refs are unchecked)
        self._checks: list[Future[None]] = []  # checks of big tables still running
        self._io: list[Future[Any]] = []  # staged bodies and segment being written
        self._io_bytes = 0
        self._pack: list[bytes] = []  # bodies of the pack, in order (see pack_bodies)
        self._pack_size = 0
        self._pack_written = False
        self._pack_bytes: dict[str, bytes] = {}  # the pack written, for its promotion
        self._spec: tuple[pa.Table, Future[SegmentInfo]] | None = None  # see extend
        self._batch: DurableBatch | None = None  # see defer_sync
        self.commit_info: CommitInfo | None = None

    def defer_sync(self) -> bool:
        """Write this transaction's files without an fsync each and make them durable
        together just before the publish (one ``syncfs`` on local disk: see
        ``SyncFsBatch``). False when the storage has no such batch: then each file is
        synced as it is written, as usual. Call before staging anything."""
        if self._staged or self._segment_written or self._io:
            raise PoimenError("defer_sync: call it before staging anything")
        self._batch = self.log.storage.durable_batch()
        return self._batch is not None

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    @property
    def n_events(self) -> int:
        return self._n_table_rows + len(self._events)

    def _check_open(self) -> None:
        if self._done:
            raise PoimenError("transaction already committed or aborted")

    # -- blobs --------------------------------------------------------------------

    def put_blob(self, tenant: str, data: bytes, *, reuse: bool = True) -> ev.BlobRef:
        """Stage a body (or reuse the committed one with the same hash) and return its ref.
        ``reuse=False`` stages it without looking for a committed copy (a HEAD on S3):
        for bodies known to be new."""
        self._check_open()
        ev.check_tenant(tenant, "put_blob")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValidationError(f"put_blob: field 'data' must be bytes, got "
                                  f"{type(data).__name__}")
        data = bytes(data)
        return self.put_checked(tenant, hashlib.sha256(data).hexdigest(), data, reuse=reuse)

    def put_checked(self, tenant: str, sha256: str, data: bytes, *,
                    reuse: bool = True) -> ev.BlobRef:
        """``put_blob`` of a body whose tenant and ``sha256`` the caller has checked
        already (the recorder, per record): not hashed again."""
        key = (tenant, sha256)
        ref = ev.BlobRef(tenant, sha256, len(data))
        if key in self._staged or key in self._reused:
            return ref
        if reuse and self.log.body_present(key):
            self._reused[key] = data
            return ref
        self._stage(key, data, wait=False)
        return ref

    def _stage(self, key: BlobKey, data: bytes, *, wait: bool = True) -> None:
        if self.pack_bodies and not wait and not self._pack_written \
                and len(data) <= PACK_PIECE_MAX and self._pack_size + len(data) <= PACK_MAX:
            piece = Piece(pack_path(self.txn), self._pack_size, len(data))
            self._staged[key] = BlobEntry(key[0], key[1], len(data), piece.location)
            self._pack.append(data)
            self._pack_size += len(data)
            return
        path = staged_blob_path(self.txn, *key)
        self._staged[key] = BlobEntry(key[0], key[1], len(data), path)
        if wait or not self.log.storage.background_io:
            self._write_new(path, data, "blob_staged")
        else:  # written while the caller goes on; commit waits for it before publishing
            self._write_behind(path, data)

    def _write_behind(self, path: str, data: bytes) -> None:
        """Write a staged file on the I/O pool, at most ``MAX_IO_IN_FLIGHT`` files (and
        ``MAX_IO_BYTES_IN_FLIGHT``) of this transaction at a time."""
        if len(self._io) >= MAX_IO_IN_FLIGHT or self._io_bytes >= MAX_IO_BYTES_IN_FLIGHT:
            self._wait_io()  # (not _join_io: the pack may still take bodies)
        self._io_bytes += len(data)
        self._io.append(IO_POOL.submit(self._write_new, path, data, "blob_staged"))

    def start_writes(self) -> None:
        """Write the pack now, on the I/O pool; it takes no more bodies after this
        (``commit`` does it too)."""
        if not self._pack or self._pack_written:
            return
        self._pack_written = True
        pack, self._pack = b"".join(self._pack), []
        self._pack_bytes = {pack_path(self.txn): pack}
        if self.log.storage.background_io:
            self._write_behind(pack_path(self.txn), pack)
        else:
            self._write_new(pack_path(self.txn), pack, "blob_staged")

    def _write_new(self, path: str, data: Any, point: str) -> None:
        with write_in_flight():
            self.log.storage.write_new(path, data, sync=self._batch is None)
        crash_point(point)

    def flush(self) -> None:
        """Wait until the bodies put so far are on storage (``put_blob`` writes them in
        the background); raise the first write error. ``commit`` does this itself."""
        self._check_open()
        self._join_io()

    def _join_io(self) -> None:
        """Write the pack, then wait for this transaction's files in flight; raise the
        first write error."""
        self.start_writes()
        self._wait_io()

    def _wait_io(self) -> None:
        errors = [exc for f in self._io if (exc := f.exception()) is not None]
        self._io, self._io_bytes = [], 0  # only once all landed: abort waits for the rest
        if errors:
            raise errors[0]

    # -- events -------------------------------------------------------------------

    def append(self, event: ev.Event) -> None:
        """Append one event, validated now (``ValidationError``: the transaction is then
        rejected whole at commit); its ``ts`` is stamped now when None."""
        if self._done:
            self._check_open()
        try:
            ev.validate_event(event, self._n_table_rows + len(self._events), self._seen_refs)
        except ValidationError as exc:
            self._failed = exc
            raise
        self._events.append(event)
        self._stamps.append(_utcnow() if event.ts is None else event.ts)

    def extend(self, events: Iterable[ev.Event] | pa.Table) -> None:
        """Append many events: event objects, or a ``pyarrow.Table`` (the bulk fast path)."""
        self._check_open()
        if isinstance(events, pa.Table | pa.RecordBatch):
            table = pa.Table.from_batches([events]) if isinstance(events, pa.RecordBatch) \
                else events
            where = f"table (events from {self.n_events})"
            try:
                t = conform_table(table, where)
            except ValidationError as exc:
                self._failed = exc
                raise
            self._speculate(t)  # written while it is checked
            if t.num_rows >= BACKGROUND_CHECK_ROWS:
                self._checks.append(CHECK_POOL.submit(check_conformed, t, where))
            else:
                try:
                    check_conformed(t, where)
                except ValidationError as exc:
                    self._failed = exc
                    raise
            if self._events:
                self._flush_objects()
            self._tables.append(t)
            self._bulk.append(t)
            self._n_table_rows += t.num_rows
            return
        try:
            items = iter(events)
        except TypeError:
            raise ValidationError(f"extend: events must be event objects or a pyarrow.Table, "
                                  f"got {type(events).__name__}") from None
        for e in items:
            self.append(e)

    def _extend_validated(self, table: pa.Table, refs: Iterable[ev.BlobRef]) -> None:
        """Append a table that ``events_to_table`` made of events ``validate_event``
        passed (a recorder's window), with every ref those events point at: nothing is
        checked again (as events given one by one are converted at commit unchecked),
        and commit checks ``refs`` instead of searching the table for them. Its segment
        is written in the background at once when it is the whole commit so far."""
        self._check_open()
        self._speculate(table)
        self._seen_refs.add_refs(refs)
        self._flush_objects()
        self._tables.append(table)
        self._n_table_rows += table.num_rows

    def _speculate(self, table: pa.Table) -> None:
        """The first table is usually the whole commit: start writing its segment now, in
        the background (``_segment_for`` discards it if more events come)."""
        if table.num_rows and not self._tables and not self._events \
                and self.log.storage.background_io:
            self._segment_written = True
            future = IO_POOL.submit(self._write_segment, table)
            self._io.append(future)
            self._spec = (table, future)

    def _flush_objects(self) -> None:
        if self._events:
            self._tables.append(events_to_table(self._events, self._stamps))
            self._n_table_rows += len(self._events)
            self._events, self._stamps = [], []

    # -- commit -------------------------------------------------------------------

    def abort(self) -> None:
        """Drop everything staged; nothing of this transaction becomes visible."""
        if self._done:
            return
        self._done = True
        for f in self._checks:
            f.cancel()
        for f in self._io:  # writes not started never will; those running land first,
            f.cancel()      # so the cleanup below sees them
        for f in self._io:
            if not f.cancelled():
                f.exception()
        self._io, self._io_bytes = [], 0
        self._close_batch()
        if self.log.publish_unknown(self.txn):
            return  # it may have landed: leave its files to vacuum's reachability check
        if self._staged:
            self.log.storage.delete_tree(f"_staging/{self.txn}")
        if self._segment_written:
            self.log.storage.delete(self._segment_path)

    def _check_refs(self) -> None:
        """Every ref must be a body of this transaction or a committed, unreduced one, of
        its size."""
        mine = {k: e.size for k, e in self._staged.items()}
        mine.update((k, len(data)) for k, data in self._reused.items())
        plain = set(self._seen_refs.refs)  # each body looked up once, however many
        for t in self._bulk:                # events and tables point at it
            plain |= table_refs(t)  # built from Arrow's rows: exact types all through
        for ref in itertools.chain(plain, self._seen_refs.other_refs.values()):
            size = mine.get((ref.tenant, ref.sha256))
            if size is not None:
                problem = None if ref.size == size else \
                    f"size {ref.size} does not match the body"
            else:
                problem = ref_problem(self.log, ref)
            if problem is not None:
                hint = " (put it with tx.put_blob in this transaction)" \
                    if problem == NO_BODY else ""
                self._failed = ValidationError(
                    f"event ref {ref.sha256[:12]}… of tenant {ref.tenant!r}: {problem}{hint}")
                raise self._failed

    def commit(self) -> CommitInfo:
        """Publish this transaction's events and bodies in one manifest (README,
        "Committing"), durable first; its ``CommitInfo`` (seq and LSN range)."""
        self._check_open()
        if self._failed is not None:
            self.abort()
            raise ValidationError(f"transaction rejected whole: {self._failed}")
        try:
            self._flush_objects()
            table = None
            if self._n_table_rows:
                table = pa.concat_tables(self._tables) if len(self._tables) > 1 \
                    else self._tables[0]
            if table is None and not self._staged and not self._reused:
                self._done = True
                head = self.log.head
                self.commit_info = CommitInfo(None, head + 1, head)
                return self.commit_info
            seg = self._segment_for(table) if table is not None else None
            self._join_checks()  # a fault found meanwhile: abort removes the segment
            if table is not None:
                self._check_refs()
            self._join_io()  # every body and the segment are on storage (and fsynced)
            if self._batch is not None:
                self._batch.sync()  # ... or made durable now, all at once
                self._close_batch()
            # once, outside the log's lock (a lost race makes the manifest again)
            reduces = _reduced_originals(table)
            m = self.log.publish(lambda seq, first: self._manifest(seq, first, seg, reduces),
                                  self.txn)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self.commit_info = CommitInfo(m.seq, m.first_lsn, m.last_lsn)
        crash_point("manifest_published")
        try:  # the commit has landed: what follows is housekeeping a later open redoes
            packs, self._pack_bytes = self._pack_bytes, {}  # its promotion's now
            self.log.after_publish(m, packs=packs)
        except Exception as exc:  # noqa: BLE001
            _logger.warning("commit seq %d landed; promotion deferred: %s", m.seq, exc)
        if not self.defer_checkpoint:
            self._checkpoint()
        return self.commit_info

    def _checkpoint(self) -> None:
        """Checkpoint the log if this commit's seq is a multiple of the interval (unless
        ``defer_checkpoint``)."""
        assert self.commit_info is not None and self.commit_info.seq is not None
        try:
            self.log.maybe_checkpoint(self.commit_info.seq)
        except Exception as exc:  # noqa: BLE001 - housekeeping a later commit redoes
            _logger.warning("commit seq %d landed; checkpoint deferred: %s",
                            self.commit_info.seq, exc)

    def _close_batch(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.close()

    def _join_checks(self) -> None:
        """Wait for the background checks of big tables; raise the first fault found."""
        checks, self._checks = self._checks, []
        for f in checks:
            exc = f.exception()
            if exc is not None and self._failed is None:
                self._failed = ValidationError(f"transaction rejected whole: {exc}") \
                    if isinstance(exc, ValidationError) else exc
        if self._failed is not None:
            raise self._failed

    def _segment_for(self, table: pa.Table) -> SegmentInfo:
        """The segment of ``table``: the one ``extend`` started, when it was the whole
        commit; else that one is discarded and the whole table written now."""
        spec, self._spec = self._spec, None
        if spec is not None:
            if spec[0] is table:
                return spec[1].result()
            if spec[1].exception() is None:
                self.log.storage.delete(self._segment_path)
        return self._write_segment(table)

    @property
    def _segment_path(self) -> str:
        return f"segments/{self.txn}.arrow"

    def _write_segment(self, table: pa.Table) -> SegmentInfo:
        """Write, fsync and hash the segment (on the I/O pool when ``extend`` started it)."""
        def fill(sink: Any) -> None:
            with pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)

        path = self._segment_path
        self._segment_written = True
        # nbytes walks every buffer (0.1 ms on a small table): asked of big tables only;
        # write_hashed streams a big one to local disk and serializes the rest in memory
        hint = table.nbytes if table.num_rows > 10_000 else 0
        with write_in_flight():
            size, sha = self.log.storage.write_hashed(path, fill, hint,
                                                      sync=self._batch is None)
        crash_point("segment_written")
        return SegmentInfo(path, table.num_rows, size, sha, 0, 0)

    def _manifest(self, seq: int, first: int, seg: SegmentInfo | None,
                  reduces: tuple[tuple[str, str], ...]) -> Manifest:
        # A body reused at put time may have been reduced since: stage it ourselves now,
        # before the publish, so this commit never points at a body a reducer deletes.
        for key, data in list(self._reused.items()):
            if self.log.is_reduced(key) or not self.log.body_present(key):
                del self._reused[key]
                self._stage(key, data)
        blobs = [self._staged[k] for k in sorted(self._staged)]
        blobs += [ev_entry for k in sorted(self._reused)
                  for ev_entry in (BlobEntry(k[0], k[1], len(self._reused[k]), None),)]
        segs: tuple[SegmentInfo, ...] = ()
        n = 0
        if seg is not None:
            segs = (SegmentInfo(seg.path, seg.rows, seg.size, seg.sha256, first, seq),)
            n = seg.rows
        return Manifest(
            seq=seq, txn=self.txn, kind="append" if n else "blobs", first_lsn=first,
            n_events=n, ts=now_iso(), segments=segs, blobs=tuple(blobs),
            reduces=reduces,
        )


def _reduced_originals(table: pa.Table | None) -> tuple[tuple[str, str], ...]:
    """The (tenant, sha256) of each body the table's ``blob_reduced`` events reduce,
    sorted, once each (what a manifest's ``reduces`` lists)."""
    if table is None or not table.num_rows:
        return ()
    mask = pc.equal(table.column("kind"), "blob_reduced")
    if not pc.any(mask).as_py():
        return ()
    originals = table.filter(mask).column("original").to_pylist()
    return tuple(sorted({(d["tenant"], d["sha256"]) for d in originals}))
