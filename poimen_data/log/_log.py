"""EventLog: transactions, the commit protocol, recovery, checkpoints and event reads.

A commit stages its blobs under ``_staging/<txn>/``, writes its events as one Arrow IPC
file ``segments/<txn>.arrow``, then publishes ``_log/<seq>.json`` put-if-absent. Losing
the race re-reads the head and retries under the next seq without rewriting anything.
Only after the publish are staged bodies promoted to ``blobs/``; a crash in between is
rolled forward by the next open. See README "Storage format" for the whole protocol.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import logging
import operator
import os
import random
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from concurrent.futures import Future, wait
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from poimen_data.errors import (
    CommitConflict,
    CommitUnknown,
    CorruptionError,
    LeaseHeld,
    NotFound,
    PoimenError,
    StorageError,
    ValidationError,
)
from poimen_data.log._blobs import FsBlobStore
from poimen_data.log._faults import crash_point
from poimen_data.log._lease import Lease
from poimen_data.log._lists import (
    KnownLists,
    Replan,
    SegmentList,
    checked_segments,
    list_bytes,
    list_entries,
    list_entry,
    list_path,
    plan_lists,
)
from poimen_data.log._manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    POINTER,
    Manifest,
    SegmentInfo,
    blob_path,
    checkpoint_path,
    dumps,
    loads,
    manifest_path,
)
from poimen_data.log._recorder import Recorder
from poimen_data.log._staged import Packs, piece_of, staged_exists, staged_file
from poimen_data.log._txn import BlobKey, CommitInfo, Transaction, now_iso
from poimen_data.model import _events as ev
from poimen_data.model import conform_segment
from poimen_data.model._limits import INT64_MAX, is_count, short_repr
from poimen_data.storage import (
    DEFAULT_RETRY_DEADLINE_S,
    PIECE_POOL,
    PROMOTE_POOL,
    Storage,
    open_regular,
    open_storage,
)

DEFAULT_CHECKPOINT_INTERVAL = 100
# passes a checkpoint makes off the log's lock over the commits it must promote, each over
# those that landed during the last (see ``write_checkpoint``)
CHECKPOINT_PASSES = 3
MAX_COMMIT_ATTEMPTS = 10_000
_logger = logging.getLogger("poimen_data")
_T = TypeVar("_T")
_R = TypeVar("_R")
_LIVE_LOGS: weakref.WeakSet[EventLog] = weakref.WeakSet()
RETAINED_PACK_BYTES = 64 << 20  # packs kept in memory for their promotion, at most


class _PackBudget:
    """Bytes of written packs held in memory until their promotion has copied them out,
    within a bound: past it a promotion reads its pack back (the promotion backlog on S3
    may be a hundred commits long, and a pack up to ``PACK_MAX``)."""

    def __init__(self) -> None:
        self.used = 0
        self._lock = threading.Lock()

    def take(self, packs: Mapping[str, bytes] | None) -> Mapping[str, bytes] | None:
        """``packs``, counted against the bound; None when they do not fit."""
        n = sum(len(b) for b in (packs or {}).values())
        with self._lock:
            if not n or self.used + n > RETAINED_PACK_BYTES:
                return None
            self.used += n
        return packs

    def give(self, packs: Mapping[str, bytes] | None) -> None:
        n = sum(len(b) for b in (packs or {}).values())
        with self._lock:
            self.used -= n

    def forget(self) -> None:
        """In a forked child: none of the parent's promotions run here."""
        self.used = 0
        self._lock = threading.Lock()


_RETAINED = _PackBudget()


def _forget_promotions() -> None:
    """A forked child does not wait for its parent's promotions (the parent finishes them,
    or the next open rolls them forward)."""
    for log in list(_LIVE_LOGS):
        log._promotions = []
        log._lock = threading.RLock()
        log._pointer_lock = threading.Lock()
        log._loading = threading.Lock()
    _RETAINED.forget()  # the parent's promotions hold those bytes, not the child's


os.register_at_fork(after_in_child=_forget_promotions)


@atexit.register
def _flush_all() -> None:
    """Finish background promotions before the interpreter exits."""
    for log in list(_LIVE_LOGS):
        try:
            log.flush()
        except Exception:  # noqa: BLE001 - the next open rolls forward what is left
            pass


class _State:
    """What a reader knows of the log: head, live segments, reductions, pending bodies."""

    def __init__(self) -> None:
        self.seq = 0
        self.lsn = 0
        self._segments: dict[str, SegmentInfo] = {}
        # A checkpoint's segment list is loaded on first use, so opening a log costs the
        # same with 10 or 10,000 segments; manifests applied before that are queued.
        self._loader: Callable[[], dict[str, SegmentInfo]] | None = None
        self._queued: list[Manifest] = []
        self.reduced: dict[BlobKey, int] = {}  # body -> seq of its latest reduction
        # bodies committed again after a reduction: they stay in staging (see _promote)
        self.recommitted: dict[BlobKey, tuple[int, str]] = {}
        # staged bodies of manifests read since the last checkpoint: not known promoted
        self.pending: dict[BlobKey, str] = {}
        # committed bodies found missing from staging and blobs/ (body -> seq): an error
        # for their readers only; a later commit of the same body repairs it
        self.lost: dict[BlobKey, int] = {}
        self.manifests_since_checkpoint: list[Manifest] = []
        self.checkpoint_seq = 0

    @property
    def segments(self) -> dict[str, SegmentInfo]:
        if self._loader is not None:
            self.install_segments(self._loader(), self._loader)
        return self._segments

    def install_segments(self, base: dict[str, SegmentInfo],
                         loader: Callable[[], dict[str, SegmentInfo]]) -> None:
        """Take the segment list ``loader`` read, with the manifests queued since applied
        to it; nothing if it is loaded already (by someone else meanwhile)."""
        if self._loader is not loader:
            return
        for m in self._queued:
            _apply_segments(base, m)
        self._loader, self._queued, self._segments = None, [], base

    def apply(self, m: Manifest) -> None:
        if m.seq != self.seq + 1:
            raise CorruptionError(f"{manifest_path(m.seq)}: expected seq {self.seq + 1}")
        if m.n_events and m.first_lsn != self.lsn + 1:
            raise CorruptionError(
                f"{manifest_path(m.seq)}: first_lsn {m.first_lsn} is not head + 1 "
                f"({self.lsn + 1})"
            )
        if self._loader is not None:
            self._queued.append(m)
        else:
            _apply_segments(self._segments, m)
        # A commit's bodies first, then its reductions: a commit that both carries and
        # reduces a body (a summary equal to another body it reduces) leaves it reduced.
        for b in m.blobs:
            key = (b.tenant, b.sha256)
            if b.staged is not None:
                if key in self.reduced:
                    self.recommitted[key] = (m.seq, b.staged)
                self.pending[key] = b.staged
                self.lost.pop(key, None)
            elif key in self.reduced and key not in self.recommitted:
                # reused a reduced body: the writer must have staged it (see commit)
                raise CorruptionError(f"{manifest_path(m.seq)}: reuses a reduced body")
        for t, sha in m.reduces:
            self.reduced[(t, sha)] = m.seq
            self.recommitted.pop((t, sha), None)
        self.seq = m.seq
        self.lsn += m.n_events
        self.manifests_since_checkpoint.append(m)

    def is_reduced(self, key: BlobKey) -> bool:
        return key in self.reduced and key not in self.recommitted

    def to_checkpoint(self, lists: list[dict[str, Any]]) -> dict[str, Any]:
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "seq": self.seq,
            "lsn": self.lsn,
            "segment_lists": lists,
            "reduced": sorted([t, sha, s] for (t, sha), s in self.reduced.items()),
            "recommitted": sorted([t, sha, s, p]
                                  for (t, sha), (s, p) in self.recommitted.items()),
        }
        if self.lost:  # only when there is damage: an intact log's checkpoint is unchanged
            doc["lost"] = sorted([t, sha, s] for (t, sha), s in self.lost.items())
        return doc

    @classmethod
    def from_checkpoint(cls, d: dict[str, Any],
                        loader: Callable[[], dict[str, SegmentInfo]]) -> _State:
        st = cls()
        st.seq = d["seq"]
        st.lsn = d["lsn"]
        st.checkpoint_seq = d["seq"]
        st._loader = loader
        st.reduced = {(t, sha): s for t, sha, s in d["reduced"]}
        st.recommitted = {(t, sha): (s, p) for t, sha, s, p in d["recommitted"]}
        st.lost = {(t, sha): s for t, sha, s in d.get("lost", ())}
        return st


def _apply_segments(segments: dict[str, SegmentInfo], m: Manifest) -> None:
    for p in m.supersedes:
        segments.pop(p, None)
    for s in m.segments:
        segments[s.path] = s


def _with_lsn_seq(t: Any, first_lsn: int, seq: int) -> Any:
    """A table or batch of a segment written without its ``lsn`` and ``seq`` columns, with
    them (from the manifest: consecutive LSNs from ``first_lsn``, one ``seq``). Built from
    buffers: ``pa.array(ndarray)`` would import pandas."""
    n = t.num_rows
    for name, col in (("seq", np.full(n, seq, np.int64)),
                      ("lsn", np.arange(first_lsn, first_lsn + n, dtype=np.int64))):
        arr = pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(col)])
        t = t.add_column(0, ev.LOG_SCHEMA.field(name), arr)
    return t

class EventLog:
    """One log under a root URL. Thread-safe for readers; one transaction at a time per
    thread. Several processes may write the same log concurrently."""

    def __init__(self, storage: Storage, config: dict[str, Any], *,
                 read_only: bool = False) -> None:
        self.storage = storage
        self.config = config
        self.read_only = read_only
        interval = config.get("checkpoint_interval", DEFAULT_CHECKPOINT_INTERVAL)
        if type(interval) is not int or interval < 1:  # written by hand, or by code that
            _logger.warning("%s: checkpoint_interval %s in _poimen.json is not a count of "
                            "commits; %d is used", storage.url, short_repr(interval),
                            DEFAULT_CHECKPOINT_INTERVAL)  # did not check it (0 divided)
            interval = DEFAULT_CHECKPOINT_INTERVAL
        self.checkpoint_interval = interval
        self._lock = threading.RLock()
        self._state = _State()
        self._tables: dict[str, pa.Table] = {}
        # txns whose publish failed without telling if it landed: the seq it was put
        # under and the manifest put there (see settle)
        self._unknown: dict[str, Manifest] = {}
        self._settling = threading.Lock()
        # one checkpoint of this process at a time reads the pointer, then writes it (see
        # write_checkpoint); commits never take it
        self._pointer_lock = threading.Lock()
        self._loading = threading.Lock()  # one thread reads a checkpoint's segment lists
        self._pid = os.getpid()
        self._settle_owner = f"settle-{uuid.uuid4().hex}"  # the lease settle takes
        self._promoted: set[str] = set()  # txns this process promoted since the checkpoint
        # the handle's seq at its last look at the pointer (a read-only handle forgets
        # what the pointer's checkpoint covers once per interval: _forget_checkpointed)
        self._pointer_looked = 0
        self._no_catch_up = 0  # a pointer whose checkpoints took it no further (_catch_up)
        # seqs of this process's commits promoted whole, for its next manifest to announce
        # (``Manifest.promoted``): taken off once a manifest carrying them is published
        self._to_announce: set[int] = set()
        self._promotions: list[Future[None]] = []
        # the segment lists of this process's latest checkpoint, read or written: its next
        # checkpoint writes only the lists that changed (see ``_lists``)
        self._known_lists: KnownLists | None = None
        self.blobs = FsBlobStore(self)
        self._load()

    # -- opening ------------------------------------------------------------------

    @property
    def root(self) -> str:
        return self.storage.url

    def __repr__(self) -> str:
        return f"EventLog({self.root!r}, head={self._state.lsn})"

    def _load(self) -> None:
        st = self._load_checkpoint()
        with self._lock:
            self._state = st
        self.refresh()
        if self.storage.writable and not self.read_only:
            self._roll_forward()

    def _load_checkpoint(self, seq: int | None = None) -> _State:
        """The newest intact checkpoint (the pointer's, or the one at ``seq`` when given:
        the pointer read already); a damaged one is skipped for the one before."""
        if seq is None:
            seq = self._pointer_seq()
        if seq <= 0:
            return _State()
        interval = self.checkpoint_interval
        # a range, never a list: a pointer naming a huge seq (damaged, or bogus) would make
        # one of that many entries
        candidates = [seq, *itertools.islice(
            range((seq - 1) // interval * interval, 0, -interval), 19)]
        for s in candidates:
            try:
                data = self.storage.read_or_none(checkpoint_path(s))
                if data is None:
                    continue
                doc = loads(data, checkpoint_path(s))
                entries = list_entries(doc)
                sizes = self._fan_out(self.storage.size, [e["path"] for e in entries])
                if sizes != [e["size"] for e in entries]:
                    continue  # incomplete: a segment list of it is not there
                return _State.from_checkpoint(doc, self._segment_loader(entries, s))
            except (CorruptionError, KeyError, ValueError, TypeError):
                continue
        return _State()

    def _segment_loader(self, entries: list[dict[str, Any]],
                        seq: int) -> Callable[[], dict[str, SegmentInfo]]:
        """Load a checkpoint's segment lists when first needed (``PIECE_POOL`` at a time
        on an object store), and remember them for this process's next checkpoint to
        reuse; if one turns out damaged, rebuild the segments from the manifests instead
        of trusting it."""

        def load() -> dict[str, SegmentInfo]:
            datas = self._fan_out(self.storage.read_or_none, [e["path"] for e in entries])
            try:
                read = [checked_segments(SegmentList(e), d, self.root)
                        for d, e in zip(datas, entries, strict=True)]
            except (CorruptionError, pa.ArrowInvalid):
                read = None
            if read is not None:
                if self._known_lists is None:
                    self._known_lists = KnownLists(seq, tuple(
                        SegmentList.read(e, segs) for e, segs in zip(entries, read, strict=True)))
                return {s.path: s for segs in read for s in segs}
            segments: dict[str, SegmentInfo] = {}
            for m in self.manifests():
                if m.seq > seq:
                    break
                _apply_segments(segments, m)
            return segments

        return load

    def refresh(self) -> int:
        """Read manifests published since the last look; returns the head LSN.

        Probes ``_log/<seq+1>.json`` until one is missing: no listing on this path.
        """
        with self._lock:
            st = self._state
            read = 0
            while True:
                if read == self.checkpoint_interval:
                    st = self._catch_up()  # a whole interval behind, or more
                m = self._read_manifest(st.seq + 1)
                if m is None:
                    break
                st.apply(m)
                read += 1
            if self.read_only and \
                    len(st.manifests_since_checkpoint) > 2 * self.checkpoint_interval and \
                    st.seq >= self._pointer_looked + self.checkpoint_interval:
                self._pointer_looked = st.seq  # a look per interval, not per refresh
                self._forget_checkpointed()
            return st.lsn

    def _catch_up(self) -> _State:
        """A handle that found itself an interval of commits behind (the viewer or a
        notebook after a pause; a writer that commits now and then to a busy log, such as
        a grader) starts again from the pointer's checkpoint when it is past what the
        handle read, as an open does, instead of reading every manifest since, one request
        each, and holding them until a checkpoint of its own. The manifests it skips are
        the ones ``_forget_checkpointed`` would forget, and the ones a writer's own
        checkpoint there would: that checkpoint's writer promoted their bodies first (a
        body committed again after a reduction is in its ``recommitted``; this process's
        promotions still running find them promoted), and its reductions and lost bodies
        are the log's up to it. A writer's checkpoint being written meanwhile is not
        harmed: it stops when the state's checkpoint is at or past its seq, and otherwise
        builds from what the state holds after the pointer's. A damaged checkpoint is
        passed over for the one before, as at open; none past the handle's head: it reads
        on. The state now read, lock held."""
        st = self._state
        ck = self._pointer_seq()
        self._pointer_looked = max(self._pointer_looked, st.seq)
        if ck <= st.seq or ck == self._no_catch_up:
            return st
        new = self._load_checkpoint(ck)
        if new.seq <= st.seq:
            self._no_catch_up = ck  # not tried again (20 reads) until the pointer moves
            return st
        self._state = new
        # a writer's next checkpoint reuses the lists of the one it now stands on (its
        # loader names them), not those of an older one of its own: with those it wrote
        # every live segment again
        self._known_lists = None
        return new

    def _forget_checkpointed(self) -> None:
        """A read-only handle (the viewer, a notebook) never writes a checkpoint, so it
        held every manifest it read since it opened (about 1.5 KB a commit, for ever, on a
        busy log): it now forgets those the pointer's checkpoint covers, as a writer does
        after its own. That checkpoint's writer promoted each of their bodies first, so
        none is looked for in staging any more; what stays there (a body committed again
        after a reduction) is in ``recommitted``, kept. The checkpoint's segment lists,
        when still unread, are read now, so the manifests queued for them go too. Lock
        held."""
        st = self._state
        ck = self._pointer_seq()
        if not st.checkpoint_seq < ck <= st.seq:
            return
        if st._loader is not None:
            st.install_segments(st._loader(), st._loader)
        keep = [m for m in st.manifests_since_checkpoint if m.seq > ck]
        st.manifests_since_checkpoint = keep
        st.pending = {(b.tenant, b.sha256): b.staged for m in keep for b in m.blobs
                      if b.staged is not None}
        st.checkpoint_seq = ck

    def _read_manifest(self, seq: int) -> Manifest | None:
        name = manifest_path(seq)
        data = self.storage.read_or_none(name)
        if data is None:
            return None
        return Manifest.from_bytes(data, self.storage.url_of(name))

    def read_manifest(self, seq: int) -> Manifest:
        """One committed manifest (for ``poimen log`` and maintenance)."""
        m = self._read_manifest(seq)
        if m is None:
            raise NotFound(f"no manifest for seq {seq} in {self.root}")
        return m

    @property
    def head(self) -> int:
        """The last committed LSN (0 when empty), after a fresh look at storage."""
        return self.refresh()

    @property
    def head_seq(self) -> int:
        self.refresh()
        return self._state.seq

    # -- blobs the log knows about -----------------------------------------------

    def _blob_location(self, key: BlobKey) -> tuple[bool, str | None]:
        """(reduced, staged path or None) for a body, as of the last refresh."""
        with self._lock:
            st = self._state
            if st.is_reduced(key):
                return True, None
            if key in st.recommitted:
                return False, st.recommitted[key][1]
            return False, st.pending.get(key)

    def _body_present(self, key: BlobKey) -> bool:
        """True when a committed, unreduced body is there to be reused without upload."""
        reduced, staged = self._blob_location(key)
        if reduced:
            return False
        if staged is not None and key in self._state.recommitted:
            # vacuum may have promoted it (under the lease) since
            return staged_exists(self.storage, staged) \
                or self.storage.exists(blob_path(*key))
        if self.storage.exists(blob_path(*key)):
            return True
        # committed but not promoted yet (promotion runs in the background on S3)
        return staged is not None and (staged_exists(self.storage, staged)
                                       or self.storage.exists(blob_path(*key)))

    # -- the commit protocol's interface (``LogInternals``) ------------------------
    # What transactions, the blob store and maintenance use; nothing else of the log's
    # private state is theirs to touch.

    def blob_location(self, key: BlobKey) -> tuple[bool, str | None]:
        """(reduced, staged path or None) for a body, as of the last refresh."""
        return self._blob_location(key)

    def body_present(self, key: BlobKey) -> bool:
        """True when a committed, unreduced body is there to be reused without upload."""
        return self._body_present(key)

    def is_reduced(self, key: BlobKey) -> bool:
        """Reduced by its latest mention (a body committed again since is not)."""
        with self._lock:
            return self._state.is_reduced(key)

    def ever_reduced(self, key: BlobKey) -> bool:
        """Reduced at some seq, whether or not it was committed again since."""
        with self._lock:
            return key in self._state.reduced

    def is_recommitted(self, key: BlobKey) -> bool:
        """Committed again after a reduction: its body lives in that commit's staging."""
        with self._lock:
            return key in self._state.recommitted

    def stored_copies(self, key: BlobKey) -> set[str]:
        """Every file a committed body may be stored in alone (``blobs/`` and staging):
        a piece of a pack goes with its pack (see ``_promote`` and ``vacuum``)."""
        with self._lock:
            st = self._state
            return {blob_path(*key)} | {
                p for p in (st.pending.get(key), st.recommitted.get(key, (0, None))[1])
                if p and piece_of(p) is None}

    def lost_bodies(self) -> dict[BlobKey, int]:
        """Committed bodies found missing (body -> seq of the commit that lost it), as
        of what this process has seen: for ``poimen log`` and checks."""
        with self._lock:
            return dict(self._state.lost)

    def lost_seq(self, key: BlobKey) -> int | None:
        with self._lock:
            return self._state.lost.get(key)

    def publish_unknown(self, txn: str) -> bool:
        """True when a publish of ``txn`` failed without telling whether it landed (and
        ``settle`` has not decided it yet)."""
        with self._lock:
            return txn in self._unknown

    def settle(self, txn: str) -> CommitInfo | None:
        """Decide a commit whose publish failed without telling whether it landed
        (``CommitUnknown``, raised by this ``EventLog``: the manifest in doubt is held
        here): its ``CommitInfo`` if it landed, None if it did not and never will. Raises
        ``StorageError`` (or another error of the storage) while storage still fails, and
        ``LeaseHeld`` while a maintenance job runs: the commit is still in doubt then, and
        ``settle`` may be called again.

        Its manifest was put under one seq, which nothing but that put can fill with it.
        Once that seq is taken, the manifest there says whose it is (ours: its bodies are
        promoted now, as any commit's, and an interval's checkpoint written). While it is
        free, the same manifest is put there again (put-if-absent, idempotent by ``txn``),
        under the maintenance lease, so that no ``vacuum`` removes the files it names
        meanwhile, and only if they are all still there (a vacuum during a long outage may
        have removed them: it did not land then, and they stay as vacuum left them).
        Decided "did not land", its staged files are left to ``vacuum`` (nothing reaches
        them).
        """
        if os.getpid() != self._pid:  # _settling may have been held at the fork
            raise PoimenError("settle in a forked child: a commit in doubt is settled by "
                              "the process that made it")
        with self._settling:  # one settle at a time in this EventLog: one lease owner
            with self._lock:
                m = self._unknown.get(txn)
            if m is None:
                raise ValidationError(f"settle: txn {txn!r} has no publish in doubt in "
                                      "this EventLog (decided already, never in doubt, or "
                                      "raised by another EventLog)")
            there = self._at_seq(m)
            if there is False:
                there = self._put_again(m)
            with self._lock:
                self._unknown.pop(txn, None)
                if isinstance(there, Manifest):  # announced by it: not again
                    self._to_announce.difference_update(there.promoted)
            if not isinstance(there, Manifest):
                return None
            self._settled_landed(there)  # ours, never promoted: this process saw it fail
            return CommitInfo(there.seq, there.first_lsn, there.last_lsn)

    def _put_again(self, m: Manifest) -> Manifest | bool:
        """Put ``m`` again under its seq, found free, holding the maintenance lease (a
        short one, this ``EventLog``'s own: one it left behind, its release failed, is
        taken back): ``m`` if it lands, the ``_at_seq`` answer if the seq was taken
        meanwhile, True if a file it names is gone."""
        held = Lease(self, self._settle_lease_ttl(), time.time, owner=self._settle_owner)
        held.acquire(renew=False)
        try:
            if not self._files_kept(m):
                return True  # vacuumed: never put a manifest naming missing files
            with self._lock:
                self.refresh()
                if self._state.seq < m.seq:  # still free
                    # still ours, long enough for the put: no vacuum can start before it
                    held.check()
                    if held.expires - time.time() < self.storage.retry.deadline_s + 5:
                        raise LeaseHeld(f"{self.root}: the lease for settling a commit in "
                                        "doubt ran short (storage is slow): settle again")
                    if self.storage.put_if_absent(manifest_path(m.seq), m.to_bytes()):
                        self._state.apply(m)
                        return m
            return self._at_seq(m)  # taken meanwhile: by an earlier put of ours, or another
        finally:
            try:
                held.release()
            except Exception as exc:  # noqa: BLE001 - it expires; this EventLog retakes it
                _logger.warning("%s: releasing the maintenance lease after settling failed "
                                "(it expires in %.0f s): %s", self.root, held.ttl_s, exc)

    def _settle_lease_ttl(self) -> float:
        """Long enough for ``_put_again``'s few requests, each retried up to the storage's
        deadline; short, since a lease left behind stops maintenance until it expires."""
        return 30.0 + 4 * self.storage.retry.deadline_s

    def _files_kept(self, m: Manifest) -> bool:
        """Every file ``m`` names is still there: a ``vacuum`` during a long outage may
        have removed a commit's staged files (older than its grace, reached by no
        manifest), and a manifest naming them must then never be put."""
        files = {s.path for s in m.segments}
        files |= {staged_file(b.staged) for b in m.blobs if b.staged}
        return all(self.storage.exists(f) for f in sorted(files))

    def _settled_landed(self, m: Manifest) -> None:
        """A commit ``settle`` found landed: its bodies are promoted and an interval's
        checkpoint written, as for any commit (a failure leaves them to the next open's
        roll-forward and a later commit, as a crash would)."""
        try:
            self._after_publish(m)
            self._maybe_checkpoint(m.seq)
        except Exception as exc:  # noqa: BLE001 - housekeeping a later open redoes
            _logger.warning("commit seq %d landed; promotion deferred: %s", m.seq, exc)

    def publish(self, make: Callable[[int, int], Manifest], txn: str) -> Manifest:
        """Publish ``make(seq, first_lsn)`` at the next free seq (see ``_publish``)."""
        return self._publish(make, txn)

    def promote(self, m: Manifest) -> None:
        """Promote a committed manifest's staged bodies now (see ``_promote``)."""
        self._promote(m)

    def staged_commit(self, key: BlobKey) -> Manifest | None:
        """The commit whose staging area holds ``key``'s body now, if one does."""
        with self._lock:
            st = self._state
            if key in st.recommitted:
                seq = st.recommitted[key][0]
            else:
                staged = st.pending.get(key)
                if staged is None:
                    return None
                txn = staged.split("/")[1]
                return next((m for m in st.manifests_since_checkpoint if m.txn == txn),
                            None)
        return self.read_manifest(seq)

    def after_publish(self, m: Manifest, *, packs: Mapping[str, bytes] | None = None
                      ) -> None:
        """Promote a just-published commit's bodies (see ``_after_publish``)."""
        self._after_publish(m, packs=packs)

    def maybe_checkpoint(self, seq: int) -> None:
        """Checkpoint when ``seq`` is a multiple of the interval."""
        self._maybe_checkpoint(seq)

    # -- transactions -------------------------------------------------------------

    def transaction(self) -> Transaction:
        """A new transaction: events and bodies staged, visible all at once at ``commit``
        (or leaving its ``with`` block); nothing of it if it aborts."""
        self.check_writable()
        return Transaction(self)

    def check_writable(self, what: str = "") -> None:
        """``PoimenError`` when this log was opened read-only: every writer (transactions,
        a recorder, checkpoints, maintenance, materialize) asks first."""
        if self.read_only:
            raise PoimenError(f"{self.root} was opened read-only"
                              + (f": {what} refused" if what else ""))

    # -- reading events -----------------------------------------------------------

    def _load_segments(self) -> None:
        """Read the checkpoint's segment list, if nobody has yet, without the log's lock:
        at 200,000 segments that takes 0.65 s, and this process's commits, which take the
        lock to publish, would wait for it (``_State.segments`` loads it under the lock
        when it is needed before this ran). The manifests applied meanwhile are applied to
        it under the lock. Threads that ask meanwhile wait for the one reading (at 200,000
        segments each would read them all again); never called with the log's lock held
        (the reader takes it to install them)."""
        with self._lock:
            st, loader = self._state, self._state._loader
        if loader is None:
            return
        with self._loading:  # one thread reads them; those that came meanwhile wait
            with self._lock:
                if st._loader is not loader:
                    return  # read by the thread before
            base = loader()
            with self._lock:
                st.install_segments(base, loader)

    def segments(self, at_lsn: int | None = None, min_lsn: int = 1) -> list[SegmentInfo]:
        """Live segments holding events with ``min_lsn <= lsn <= at_lsn``, in LSN order."""
        self._load_segments()
        with self._lock:
            hi = self._state.lsn if at_lsn is None else at_lsn
            segs = [s for s in self._state.segments.values()
                    if s.rows and s.first_lsn <= hi and s.last_lsn >= min_lsn]
        return sorted(segs, key=lambda s: s.first_lsn)

    def _segment_table(self, s: SegmentInfo) -> pa.Table:
        t = self._tables.get(s.path)
        if t is not None:
            return t
        data = self._read_verified(s.path, s.size, s.sha256)
        name = self.storage.url_of(s.path)
        try:
            reader = pa.ipc.open_file(pa.py_buffer(data))
            t = reader.read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptionError(f"{name}: not a readable Arrow IPC file: {exc}") from None
        if t.num_rows != s.rows:
            raise CorruptionError(f"{name}: {t.num_rows} rows, manifest says {s.rows}")
        if not s.has_lsn:
            t = _with_lsn_seq(t, s.first_lsn, s.seq)
        t = conform_segment(t, name)  # written under an older schema: missing columns null
        self._tables[s.path] = t
        return t

    def _read_verified(self, rel: str, size: int, sha256: str) -> bytes:
        name = self.storage.url_of(rel)
        try:
            data = self.storage.read(rel)
        except NotFound:
            raise CorruptionError(f"{name}: listed by a manifest but missing") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            raise CorruptionError(f"{name}: size or sha256 differs from its manifest")
        return data

    def _at_lsn(self, at_lsn: Any, min_lsn: Any) -> int:
        """The head after a refresh, or ``at_lsn`` once checked against it (an int in
        ``0..head``); ``min_lsn`` must be an int too. ``ValidationError`` otherwise."""
        head = self.refresh()
        for name, v in (("at_lsn", at_lsn), ("min_lsn", min_lsn)):
            # an int, or numpy's (what a query's result may hand over); not a bool
            if (v is not None or name == "min_lsn") and (
                    isinstance(v, bool) or not hasattr(type(v), "__index__")):
                raise ValidationError(f"{name} must be an int, got {type(v).__name__}")
        hi = head if at_lsn is None else operator.index(at_lsn)
        if hi < 0 or hi > head:
            raise ValidationError(f"at_lsn {hi} is outside 0..{head}")
        return hi

    def read_events(self, at_lsn: int | None = None, min_lsn: int = 1) -> pa.Table:
        """Every committed event with ``min_lsn <= lsn <= at_lsn`` as one LOG_SCHEMA table,
        in LSN order. Segment files are verified against their manifest once, then cached
        (they are immutable)."""
        hi = self._at_lsn(at_lsn, min_lsn)
        parts = []
        for s in self.segments(hi, min_lsn):
            t = self._segment_table(s)
            lo_i = max(0, min_lsn - s.first_lsn)
            hi_i = min(s.rows, hi - s.first_lsn + 1)
            parts.append(t.slice(lo_i, hi_i - lo_i) if (lo_i, hi_i) != (0, s.rows) else t)
        if not parts:
            return ev.LOG_SCHEMA.empty_table()
        return pa.concat_tables(parts)

    def seq_of_lsn(self, lsn: int) -> int:
        """The seq of the commit that holds ``lsn`` (0 for lsn 0)."""
        if lsn == 0:
            return 0
        for s in self.segments(lsn, lsn):
            t = self._segment_table(s)
            return int(t.column("seq")[lsn - s.first_lsn].as_py())
        raise NotFound(f"no event with lsn {lsn}")

    def manifests(self, since_seq: int = 0) -> Iterator[Manifest]:
        """Every manifest after ``since_seq`` (reads each one: maintenance and ``poimen log``)."""
        seq = since_seq + 1
        while True:
            m = self._read_manifest(seq)
            if m is None:
                return
            yield m
            seq += 1

    # -- promotion, recovery, checkpoints ----------------------------------------

    def _promote(self, m: Manifest, written: Mapping[str, bytes] | None = None, *,
                 gone: Set[str] = frozenset(), check: bool = True
                 ) -> list[tuple[BlobKey, str]]:
        """Move a committed manifest's staged bodies to ``blobs/`` (idempotent).

        A body committed again after a reduction stays in staging, where ``get`` finds it
        through the manifest: promoting it could race the reducer's delete of the same
        name. ``vacuum`` promotes those under the maintenance lease.

        A pack's pieces are copied out (each file written whole, then renamed or PUT);
        once they are durable the pack is removed, unless it holds a body ever reduced
        (vacuum's, then, as for the staging area ``keep_staging`` keeps).

        ``gone``: staged files the caller saw gone already (not looked for again). Returns
        the bodies found gone from staging (each with its staged file), checked here
        (``_check_missing``) unless ``check=False``: the caller checks them then, with
        those of other manifests.
        """
        packs = Packs(self.storage, written)
        kept: set[str] = set()
        pieces: list[tuple[str, bytes]] = []  # (blobs/ path, body) copied out of packs
        missing: list[tuple[BlobKey, str]] = []  # (body, its staged file) found gone
        for b in m.blobs:
            if b.staged is None:
                continue
            key = (b.tenant, b.sha256)
            piece = piece_of(b.staged)
            with self._lock:
                keep = key in self._state.reduced
                here = self._state.recommitted.get(key, (0, None))[1] == b.staged
            if keep:
                if piece is not None and here:
                    kept.add(piece.file)  # its body lives here now: vacuum's to move
                continue
            dst = blob_path(b.tenant, b.sha256)
            if staged_file(b.staged) in gone:  # its own file or its pack: not looked again
                missing.append((key, staged_file(b.staged)))
                continue
            try:
                if piece is None:
                    self.storage.move(b.staged, dst)
                    continue
                body = packs.body(piece)
                if body is None:
                    raise NotFound(f"no such file: {self.storage.url_of(piece.file)}")
                pieces.append((dst, body))
            except NotFound:
                missing.append((key, staged_file(b.staged)))
        if missing and check:
            self.refresh()  # once, after every look that found a body gone
            self._check_missing([(m, missing)])
        self._copy_out(pieces)
        if pieces:
            # A reducer that removed a body while we held its pack's bytes may have looked
            # before our copy landed: a body reduced by now is removed again here.
            self.refresh()
            with self._lock:
                reduced = [dst for dst, _data in pieces
                           if self._state.is_reduced(_key_of(dst))]
            for dst in reduced:
                self.storage.delete(dst)
        for f in packs.found:
            if f not in kept:
                self.storage.delete(f, check=False)  # read or written: no probe first
        return missing

    def _check_missing(self, found_gone: list[tuple[Manifest, list[tuple[BlobKey, str]]]]
                       ) -> None:
        """Bodies of committed manifests found gone from staging (each with its staged
        file), looked for in ``blobs/`` after a refresh that followed every look (16 at a
        time on an object store): promoted by another process (its writer, a roll-forward,
        vacuum), reduced meanwhile, or lost (deleted by hand, or by ``vacuum(grace=0,
        force=True)`` under a live writer), which is an error for their readers only,
        never for the log. Every body is looked for, once however many commits carry it: one
        found in ``blobs/`` says nothing of the others of its file (it may have been
        committed there by another commit)."""
        first: dict[BlobKey, tuple[str, int]] = {}  # a body once, with its first commit
        for m, missing in found_gone:
            for key, f in missing:
                if not self._state.is_reduced(key):  # reduced: its reducer removed it
                    first.setdefault(key, (f, m.seq))
        bodies = [(key, f, seq) for key, (f, seq) in first.items()]
        there = self._there([blob_path(*key) for key, _f, _seq in bodies])
        for (key, f, seq), found in zip(bodies, there, strict=True):
            if found:
                continue
            _logger.warning("%s: committed body (seq %d) missing from staging and from "
                            "blobs/; reading it will fail", self.storage.url_of(f), seq)
            with self._lock:
                self._state.lost.setdefault(key, seq)

    def _there(self, paths: list[str]) -> list[bool]:
        """Whether each file is there (``_fan_out``)."""
        return self._fan_out(self.storage.exists, paths)

    def _fan_out(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``fn`` of each item: ``PIECE_POOL`` at a time on an object store (each a request
        that waits on the network), one after the other elsewhere. Every call has ended
        when the first failure is raised."""
        if len(items) > 1 and self.storage.ambiguous_errors:
            futures = [PIECE_POOL.submit(fn, item) for item in items]
            wait(futures)
            return [f.result() for f in futures]
        return [fn(item) for item in items]

    def _copy_out(self, pieces: list[tuple[str, bytes]]) -> None:
        """Write bodies copied out of a pack to ``blobs/``, durable before the pack goes:
        on local disk without an fsync each, then one syncfs; on an object store one PUT
        each, ``PIECE_POOL`` at a time (a window's 64 one after the other would promote
        slower than windows commit)."""
        batch = self.storage.durable_batch() if pieces and self.storage.durable else None
        try:
            durable = None if batch is None else False  # None: each write durable itself
            self._fan_out(lambda piece: self.storage.write(*piece, durable=durable), pieces)
            if batch is not None:
                batch.sync()
        finally:
            if batch is not None:
                batch.close()

    def _after_publish(self, m: Manifest, *,
                       packs: Mapping[str, bytes] | None = None) -> None:
        """Promote a just-published commit's bodies on a background thread (renames on
        local disk, a copy and a delete per body on an object store), so the commit returns
        at its publish: readers find the bodies in staging meanwhile, ``flush()`` waits for
        them, and the next open rolls forward what a crash left. ``memory://`` promotes now.
        ``packs`` are the bytes of the packs the commit wrote: promotion copies from them
        instead of reading each back (a GET on S3), within ``RETAINED_PACK_BYTES``. A
        staging area holding a body ever reduced is kept (vacuum's, see ``_promote``)."""
        if not any(b.staged for b in m.blobs):
            crash_point("blobs_promoted")
            return
        keep_staging = any(b.staged and self.ever_reduced((b.tenant, b.sha256))
                           for b in m.blobs)
        if not self.storage.background_io:
            self._promote_commit(m, keep_staging, packs)
            return
        held = _RETAINED.take(packs)
        with self._lock:
            _LIVE_LOGS.add(self)
            self._promotions.append(PROMOTE_POOL.submit(self._promote_commit, m,
                                                        keep_staging, held, True))

    def _promote_commit(self, m: Manifest, keep_staging: bool,
                        packs: Mapping[str, bytes] | None = None,
                        release: bool = False) -> None:
        """Promote a commit this process published; one found whole (no body gone from
        its staging) is announced in this process's next manifest (``Manifest.promoted``),
        so that another process's checkpoint does not look at it again."""
        try:
            missing = self._promote(m, packs)
        finally:
            if release:
                _RETAINED.give(packs)
        with self._lock:
            self._promoted.add(m.txn)
            if not missing:
                self._to_announce.add(m.seq)
        if self.storage.has_directories and not keep_staging:  # S3 has no empty folders
            try:
                self.storage.delete_tree(f"_staging/{m.txn}")
            except OSError as exc:  # housekeeping: the next open or vacuum removes it
                _logger.warning("%s: removing the promoted staging of txn %s failed: %s",
                                self.root, m.txn, exc)
        crash_point("blobs_promoted")

    def flush(self) -> None:
        """Wait until every body this process committed is promoted to ``blobs/``."""
        with self._lock:
            pending, self._promotions = self._promotions, []
        for f in pending:
            try:
                f.result()
            except PoimenError:
                raise
            except OSError as exc:  # a PoimenError for the caller, never a raw OSError
                raise StorageError(f"{self.root}: promoting committed bodies failed "
                                   f"(the next open rolls them forward): {exc}") from exc

    def _roll_forward(self) -> int:
        """Promote bodies of committed manifests whose writer died before promoting them."""
        names = self.storage.list_dir("_staging")
        if not names:
            return 0
        with self._lock:
            by_txn = {m.txn: m for m in self._state.manifests_since_checkpoint}
        n = 0
        for txn in names:
            m = by_txn.get(txn)
            if m is not None:
                self._promote(m)
                if not self._staging_files(txn):
                    self.storage.delete_tree(f"_staging/{txn}")
                n += 1
        return n

    def _staging_files(self, txn: str) -> list[str]:
        return list(self.storage.walk_files(f"_staging/{txn}"))

    def checkpoint_due(self, seq: int) -> bool:
        """Whether the commit at ``seq`` owes a checkpoint: the writer of every
        interval-th seq writes one, at the head (which busy concurrent writers may have
        moved past its own seq: a checkpoint at any seq is valid), or at that seq for a
        recorder (``write_checkpoint(upto=...)``)."""
        return seq % self.checkpoint_interval == 0

    def _maybe_checkpoint(self, seq: int) -> None:
        if self.checkpoint_due(seq):
            self.write_checkpoint()

    def _adopt_newer_checkpoint(self) -> tuple[int, KnownLists | None]:
        """Another process's checkpoint past ours (read from the pointer): its writer
        promoted every commit it covers first, so none of them is looked at again here, and
        the bodies it found lost are recorded lost here too, unless committed again since.
        Two reads; one unreadable or damaged is passed over (everything is looked at).
        Returns the pointer's seq (0 when there is none, or it is unreadable), and that
        checkpoint's segment lists when it is past ours and names each with its span
        (what this process's checkpoint may reuse)."""
        ck = self._pointer_seq()
        lists = None
        try:
            with self._lock:
                if ck <= self._state.checkpoint_seq:
                    return ck, None
            data = self.storage.read_or_none(checkpoint_path(ck))
            if data is None:
                return ck, None
            doc = loads(data, checkpoint_path(ck))
            entries = list_entries(doc)
            if doc.get("seq") == ck and all(SegmentList.spanned(e) for e in entries):
                lists = KnownLists(ck, tuple(SegmentList(e) for e in entries))
            lost = doc.get("lost", ())
            with self._lock:
                self.refresh()
                st = self._state
                if st.checkpoint_seq >= ck:  # caught up to this one, or past it, meanwhile:
                    return ck, lists         # its lost bodies are the state's already
                covered = [m for m in st.manifests_since_checkpoint if m.seq <= ck]
                since = {(b.tenant, b.sha256) for m in st.manifests_since_checkpoint
                         if m.seq > ck for b in m.blobs if b.staged}
                for t, sha, seq in lost:
                    if (t, sha) not in since:
                        st.lost.setdefault((t, sha), seq)
                self._promoted.update(m.txn for m in covered)
        except (CorruptionError, KeyError, ValueError, TypeError):
            pass
        return ck, lists

    def _pointer_seq(self) -> int:
        """The seq ``_last_checkpoint.json`` points at; 0 when there is none, or it is
        unreadable."""
        try:
            raw = self.storage.read_or_none(POINTER)
            return 0 if raw is None else int(loads(raw, POINTER)["seq"])
        except (CorruptionError, KeyError, ValueError, TypeError):
            return 0

    def _unpromoted(self, upto: int | None = None) -> list[Manifest]:
        """Commits since the checkpoint (up to seq ``upto``) that this process neither
        promoted nor read announced as promoted whole by their writer
        (``Manifest.promoted``)."""
        with self._lock:
            ms = self._state.manifests_since_checkpoint
            announced = {s for m in ms for s in m.promoted}
            return [m for m in ms if m.txn not in self._promoted and m.seq not in announced
                    and (upto is None or m.seq <= upto)]

    def _promote_others(self, ms: list[Manifest]) -> None:
        """Promote, before a checkpoint, the commits this process has not promoted (other
        processes', nearly all promoted by their own writers): their staged files looked
        for first (16 at a time on an object store), those still there promoted here, then
        one refresh and the bodies of the gone ones looked for together
        (``_check_missing``), instead of a read, a refresh and a look per body, one after
        the other, under the log's lock."""
        files = sorted({staged_file(b.staged) for m in ms for b in m.blobs if b.staged})
        gone = {f for f, there in zip(files, self._there(files), strict=True) if not there}
        found_gone = [(m, self._promote(m, gone=gone, check=False)) for m in ms]
        if any(missing for _m, missing in found_gone):
            self.refresh()
            self._check_missing(found_gone)
        self._promoted.update(m.txn for m in ms)

    def write_checkpoint(self, seq: int | None = None, *, upto: int | None = None) -> int:
        """Write a checkpoint of the state at ``seq`` (default: head) once every commit it
        covers is promoted; point ``_last_checkpoint.json`` at it. Returns its seq, or 0
        when nothing was written (see below; a later commit writes the next one).

        ``upto``: a checkpoint at that committed seq, written once the commits up to it are
        promoted, without promoting those after it (this process's promotions queued by
        then are waited for, as always): for a writer that commits on while its
        checkpoint is written (a recorder, whose promotions run 150 ms and more behind its
        commits). Its state is the head's with the commits after ``upto`` left out
        (``_state_at``); 0 when one of them compacted or reduced, or when this process's
        checkpoint or the pointer is at or past ``upto`` already. ``ValidationError`` for
        a seq not committed.

        The live segments and the document are taken under the log's lock; the segment
        list's bytes are built, and the files and the pointer written, without it, so this
        process commits on meanwhile (the state's
        checkpoint is moved on after them, unless another thread's went further meanwhile;
        the pointer is read and written by one checkpoint of this process at a time).
        The pointer is read again just before it is written, and not written when it is
        at or past this checkpoint already (another checkpoint's, written meanwhile) and
        names a commit; one another process writes between that read and the write may
        still be passed back over (storage has no compare-and-swap), which costs a later
        open more manifests to read, nothing else.
        """
        self.check_writable("write_checkpoint")
        if upto is not None:
            with self._lock:
                if type(upto) is int and upto > self._state.seq:
                    self.refresh()  # a seq committed since this process last looked
                if type(upto) is not int or not 0 < upto <= self._state.seq:
                    raise ValidationError(f"write_checkpoint: upto must be a committed seq "
                                          f"(1 to {self._state.seq}), got {upto!r}")
        self.flush()
        self._load_segments()  # before the lock is taken for the state below
        pointed, pointer_lists = self._adopt_newer_checkpoint()
        # Commits not promoted by this process (other processes', and ours that staged no
        # body) are promoted here too, before the lock is taken: a request or two per body
        # of theirs, which would hold up this process's reads and transactions meanwhile.
        # Commits that land during a pass are taken by the next; the few that land during
        # the last are promoted under the lock, the same batched way.
        for _ in range(CHECKPOINT_PASSES):
            with self._lock:
                self.refresh()
                if seq is not None and seq != self._state.seq:
                    return 0  # the head moved on; a later commit writes the next one
                others = self._unpromoted(upto)
            if not others:
                break
            self._promote_others(others)
        with self._lock:
            self.refresh()
            st = self._state
            if seq is not None and seq != st.seq:
                return 0  # the head moved on; a later commit writes the next one
            if upto is not None and max(st.checkpoint_seq, pointed) >= upto:
                return 0  # ours, or another process's (the pointer), at or past it
            while late := self._unpromoted(upto):  # a refresh in there may bring more
                self._promote_others(late)
            at = st if upto is None or upto == st.seq else self._state_at(upto)
            if at is None:
                return 0
            at_seq = at.seq
            # a copy of what the checkpoint holds, at ``at_seq``: the live segments (a
            # dict of references, not the tables: building those and their bytes takes a
            # second at a million segments, and this process's commits wait for the lock),
            # the commits since the checkpoint whose segment lists it may reuse, and the
            # document, whose segment_lists are filled in below. It starts from the lists
            # of this process's last checkpoint when that is at or past the pointer, else
            # from the pointer's (vacuum keeps both), never from lists older than this
            # process's checkpoint (the commits since them are no longer all at hand);
            # otherwise every segment is written again (README "A checkpoint").
            live = dict(at.segments) if at is st else at.segments
            known = self._known_lists
            if known is None or not known.seq == st.checkpoint_seq >= pointed:
                known = pointer_lists  # past ours (see _adopt_newer_checkpoint)
            if known is not None and not st.checkpoint_seq <= known.seq <= at_seq:
                known = None  # another thread's checkpoint got past the pointer's meanwhile
            changes = [] if known is None else [
                m for m in st.manifests_since_checkpoint if known.seq < m.seq <= at_seq]
            doc = at.to_checkpoint([])
        # Planned, built and written outside the lock: the lists that changed, their
        # tables, bytes and hashes, then their files, made durable one after the other
        # (two fsyncs each on a local disk, a request each on an object store), while this
        # process's commits, which take the lock to publish, go on.
        lists = self._checkpoint_lists(at_seq, known, changes, live)
        doc["segment_lists"] = [sl.entry for sl in lists]
        crash_point("checkpoint_lists_written")
        named: list[dict[str, Any]] | None = [sl.entry for sl in lists]
        if not self.storage.put_if_absent(checkpoint_path(at_seq), dumps(doc)):
            named = self._named_at(at_seq)  # another writer's document, at this seq
        # A list named may have gone since it was looked for: vacuum removes one once no
        # checkpoint it keeps names it (a list whose name was taken may be a dead writer's,
        # alone), and another writer's pointer can pass back over a newer checkpoint. Then
        # the pointer is not moved to this checkpoint, and the next one writes every list.
        whole = named is not None and self._lists_there(named)
        with self._pointer_lock:  # not another checkpoint of this process in between
            pointer = self._pointer_seq()
            with self._lock:
                if pointer > self._state.seq:  # another writer's, past what this one
                    self.refresh()               # read; or bogus
                head = self._state.seq
            # not back past another writer's, written meanwhile (storage has no
            # compare-and-swap: another process's written between this read and the write
            # can still be passed back over); one past every commit names none: replaced
            if whole and not at_seq <= pointer <= head:
                self.storage.write(POINTER, dumps({"format": FORMAT_NAME,
                                                   "version": FORMAT_VERSION,
                                                   "seq": at_seq}))
        with self._lock:
            st = self._state
            if st.checkpoint_seq >= at_seq:
                return at_seq  # another thread's checkpoint here got past it meanwhile
            # what the checkpoint covers is promoted: only the commits after it are still
            # looked at (a checkpoint, the next open's roll-forward)
            after = [m for m in st.manifests_since_checkpoint if m.seq > at_seq]
            st.checkpoint_seq = at_seq
            self._known_lists = KnownLists(at_seq, tuple(lists)) if whole else None
            st.manifests_since_checkpoint = after
            self._promoted.intersection_update(m.txn for m in after)
            st.pending = {(b.tenant, b.sha256): b.staged for m in after for b in m.blobs
                          if b.staged is not None}
            return at_seq

    def _checkpoint_lists(self, at_seq: int, known: KnownLists | None,
                          changes: list[Manifest], live: Mapping[str, SegmentInfo]
                          ) -> list[SegmentList]:
        """The segment lists of the checkpoint at ``at_seq`` (``plan_lists``), those that
        changed written (put-if-absent: a name taken holds the same bytes). Lists to reuse
        are looked for first (``PIECE_POOL`` at a time on an object store): if one is
        gone, every list is written again."""

        def read(sl: SegmentList) -> list[SegmentInfo]:
            try:
                return checked_segments(sl, self.storage.read_or_none(sl.entry["path"]),
                                        self.root)
            except (CorruptionError, OSError, ValueError, KeyError, pa.ArrowInvalid):
                raise Replan from None

        plan = plan_lists(known, changes, live, read)
        if not self._lists_there([x.entry for x in plan if isinstance(x, SegmentList)]):
            plan = plan_lists(None, changes, live, read)
        lists: list[SegmentList] = []
        for item in plan:
            if isinstance(item, SegmentList):
                lists.append(item)
                continue
            data = list_bytes(item)
            entry = list_entry(list_path(at_seq, data), data, item)
            self.storage.put_if_absent(entry["path"], data)
            lists.append(SegmentList(entry, tuple(item)))
        return lists

    def _named_at(self, seq: int) -> list[dict[str, Any]] | None:
        """The segment lists the checkpoint document at ``seq`` names; None when it is
        missing or damaged."""
        try:
            data = self.storage.read_or_none(checkpoint_path(seq))
            return None if data is None else list_entries(loads(data, checkpoint_path(seq)))
        except (CorruptionError, KeyError, ValueError, TypeError):
            return None

    def _lists_there(self, entries: list[dict[str, Any]]) -> bool:
        """Whether every one of these segment lists is there, at its size."""
        sizes = self._fan_out(self.storage.size, [e["path"] for e in entries])
        return sizes == [e["size"] for e in entries]

    def _state_at(self, upto: int) -> _State | None:
        """The state as of seq ``upto`` (lock held), as a checkpoint needs it: the head's,
        with the commits after ``upto`` left out (their segments, events and lost bodies).
        None when one of them compacted or reduced, or staged a body ever reduced: what
        that changed cannot be taken back from here. A body recorded lost by a commit up
        to ``upto`` and committed again after it is not in it (the commit after it repairs
        it either way)."""
        st = self._state
        after = [m for m in st.manifests_since_checkpoint if m.seq > upto]
        if any(m.supersedes or m.reduces
               or any(b.staged is not None and (b.tenant, b.sha256) in st.reduced
                      for b in m.blobs) for m in after):
            return None
        added = {s.path for m in after for s in m.segments}
        at = _State()
        at.seq = upto
        at.lsn = st.lsn - sum(m.n_events for m in after)
        at._segments = dict(st.segments)  # a copy in C, then the few added popped: under
        for p in added:                     # the lock, a comprehension took 8x as long
            at._segments.pop(p, None)
        at.reduced = dict(st.reduced)
        at.recommitted = dict(st.recommitted)
        at.lost = {key: seq for key, seq in st.lost.items() if seq <= upto}
        return at

    # -- publishing ---------------------------------------------------------------

    def _at_seq(self, m: Manifest) -> Manifest | bool:
        """After a put of ``m`` that may have stored it: the manifest now under ``m.seq``
        if it is ours (our txn), True if it is another commit's, False while that seq is
        free; raises what storage raises when it cannot tell. Looks at that very seq:
        another thread's refresh may have read ours meanwhile."""
        with self._lock:
            try:
                self.refresh()
            except Exception:
                if self._state.seq < m.seq:
                    raise  # that seq unread: nobody can tell
            if self._state.seq < m.seq:
                return False
            there = next((x for x in self._state.manifests_since_checkpoint
                          if x.seq == m.seq), None)
        if there is None:  # a checkpoint was written past it meanwhile
            there = self.read_manifest(m.seq)
        return there if there.txn == m.txn else True

    def _in_doubt(self, m: Manifest, exc: BaseException) -> CommitUnknown:
        """``m`` may have landed, or may still: hold it for ``settle``."""
        with self._lock:
            self._unknown[m.txn] = m
        return CommitUnknown(
            f"txn {m.txn}: storage kept failing: {exc} (the commit may have landed as seq "
            f"{m.seq}: log.settle({m.txn!r}) on this EventLog tells once storage answers)",
            m.txn)

    def _publish(self, make: Any, txn: str) -> Manifest:
        """Publish the manifest ``make(seq, first_lsn)`` at the next free seq.

        Idempotent: where storage errors are ambiguous (an object store), a put that
        failed, or came back "taken", may have stored ours (an answer lost, the retry
        refused), so the seq it tried is read back at once: ours there means the commit
        landed, and it is never published twice. A failed put whose seq holds another's
        did not land (its error is raised); one whose seq is still free may land yet (a
        request still in flight), and one storage cannot show is unknown: the commit is
        then in doubt (``CommitUnknown``, see ``settle``; abort keeps its files).
        """
        ambiguous = self.storage.ambiguous_errors
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            with self._lock:
                # Optimistic first try at the head we know: if another commit took that
                # seq, put-if-absent fails and we read what we missed; if it succeeds,
                # no manifest existed that we had not read.
                if attempt and not ambiguous:
                    self.refresh()
                seq, first = self._state.seq + 1, self._state.lsn + 1
                self._to_announce = {s for s in self._to_announce
                                     if s > self._state.checkpoint_seq}  # covered: drop
                announce = tuple(sorted(self._to_announce))
                m: Manifest = make(seq, first)
                if announce:
                    m = replace(m, promoted=announce)
                data = m.to_bytes()
                try:
                    won = self.storage.put_if_absent(manifest_path(seq), data)
                except Exception as exc:
                    if not ambiguous:
                        raise  # a local error is not ambiguous: it did not land
                    # the retry layer spent its deadline (or storage refused): no second
                    # retry loop here; what the seq holds says whether it may still land
                    there = self._look(m, exc)
                    if isinstance(there, Manifest):
                        self._to_announce.difference_update(announce)
                        return there
                    if there:
                        raise  # another's: ours never lands there
                    raise self._in_doubt(m, exc) from exc
                if won:
                    self._state.apply(m)
                    self._to_announce.difference_update(announce)
                    return m
                if ambiguous:
                    there = self._look(m, None)
                    if isinstance(there, Manifest):
                        self._to_announce.difference_update(announce)
                        return there  # our own PUT, stored: no race was lost
                self.publish_retries += 1
            _lost_race_pause(attempt, remote=ambiguous)
        raise CommitConflict(f"gave up publishing txn {txn} after {MAX_COMMIT_ATTEMPTS} tries")

    def _look(self, m: Manifest, failed: BaseException | None) -> Manifest | bool:
        """``_at_seq(m)``; the commit is in doubt when storage cannot tell."""
        try:
            return self._at_seq(m)
        except Exception as exc:
            raise self._in_doubt(m, failed or exc) from exc

    # -- streaming reads: one segment in memory at a time --------------------------

    #: set on first use (``scan`` keeps out of ``__init__``): the local segments whose
    #: bytes it checked against their manifest, and the remote segments' bytes it keeps
    #: (with their total)
    _scan_checked: set[str]
    _scan_cache: dict[str, pa.Buffer]
    _scan_cache_bytes: int

    def scan(self, at_lsn: int | None = None, min_lsn: int = 1, *,
             columns: Sequence[str] | None = None,
             run_ids: Sequence[str] | pa.Array | None = None) -> Iterator[pa.RecordBatch]:
        """The events ``read_events`` returns, as record batches in LSN order, read one
        segment at a time and never cached: memory stays near one segment's size
        whatever the log's length (local segments are memory-mapped, so only the pages a
        consumer touches are read). ``columns`` projects to those ``LOG_SCHEMA`` names;
        ``run_ids`` keeps the events of those runs only. Each segment is checked against
        its manifest (size, sha256) once per ``EventLog``, streaming."""
        import pyarrow.compute as pc

        hi = self._at_lsn(at_lsn, min_lsn)
        try:
            schema = pa.schema([ev.LOG_SCHEMA.field(c) for c in (
                ev.LOG_SCHEMA.names if columns is None else columns)])
        except KeyError as exc:
            raise ValidationError(f"scan: no event column {exc}") from None
        keep = None
        if run_ids is not None:
            keep = run_ids if isinstance(run_ids, pa.Array) else pa.array(list(run_ids),
                                                                          pa.string())
        for s in self.segments(hi, min_lsn):
            lo_i, hi_i = max(0, min_lsn - s.first_lsn), min(s.rows, hi - s.first_lsn + 1)
            for offset, batch, has_lsn in self._scan_segment(s):
                a, b = max(lo_i, offset), min(hi_i, offset + batch.num_rows)
                if a >= b:
                    continue
                if (a, b) != (offset, offset + batch.num_rows):
                    batch = batch.slice(a - offset, b - a)
                if not has_lsn:
                    batch = _with_lsn_seq(batch, s.first_lsn + a, s.seq)
                if keep is not None:
                    batch = batch.filter(pc.is_in(batch.column("run_id"), keep))
                    if not batch.num_rows:
                        continue
                batch = conform_segment(batch, self.storage.url_of(s.path))
                yield batch if columns is None else batch.select(schema.names)

    def scan_events(self, at_lsn: int | None = None, min_lsn: int = 1, *,
                    batch_rows: int = 65_536) -> pa.RecordBatchReader:
        """``scan`` as a reader of ``LOG_SCHEMA`` batches of at most ``batch_rows`` rows
        (what DuckDB and the partitioned fold consume)."""
        def batches() -> Iterator[pa.RecordBatch]:
            for b in self.scan(at_lsn, min_lsn):
                for start in range(0, b.num_rows, batch_rows):
                    yield b.slice(start, batch_rows)

        return pa.RecordBatchReader.from_batches(ev.LOG_SCHEMA, batches())

    def _scan_segment(self, s: SegmentInfo) -> Iterator[tuple[int, pa.RecordBatch, bool]]:
        """(row offset, batch, has lsn/seq columns) of one segment, checked."""
        cached = self._tables.get(s.path)
        if cached is not None:
            offset = 0
            for batch in cached.to_batches():
                yield offset, batch, True
                offset += batch.num_rows
            return
        name = self.storage.url_of(s.path)
        checked = self.__dict__.setdefault("_scan_checked", set())
        source: Any
        native = self.storage.native_path(s.path)
        if native is not None:  # a local file: memory-mapped
            if s.path not in checked:
                with contextlib.suppress(FileNotFoundError):  # missing: said below
                    os.close(open_regular(native))  # a FIFO would block the hash for ever
                self._check_streaming(s, native)
                checked.add(s.path)
            self.storage.calls["read"] += 1
            try:
                source = pa.memory_map(native)
            except FileNotFoundError:
                raise CorruptionError(f"{name}: listed by a manifest but missing") from None
        else:
            source = self._remote_segment(s)
        try:
            reader = pa.ipc.open_file(source)
            n, offset = reader.num_record_batches, 0
            for i in range(n):
                batch = reader.get_batch(i)
                yield offset, batch, s.has_lsn
                offset += batch.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise CorruptionError(f"{name}: not a readable Arrow IPC file: {exc}") from None
        if offset != s.rows:
            raise CorruptionError(f"{name}: {offset} rows, manifest says {s.rows}")

    def _remote_segment(self, s: SegmentInfo) -> pa.Buffer:
        """A remote segment's checked bytes; kept while all kept stay under
        ``SCAN_CACHE_BYTES``, so repeated scans of a small log read each segment once."""
        cache = self.__dict__.setdefault("_scan_cache", {})
        buf = cache.get(s.path)
        if buf is None:
            buf = pa.py_buffer(self._read_verified(s.path, s.size, s.sha256))
            with self._lock:  # a running total: thousands of tiny segments fit in it
                kept = self.__dict__.get("_scan_cache_bytes", 0)
                if s.path not in cache and kept + buf.size <= self.SCAN_CACHE_BYTES:
                    cache[s.path] = buf
                    self.__dict__["_scan_cache_bytes"] = kept + buf.size
        return buf

    #: bytes of remote segments ``scan`` keeps between scans (the rest is read again)
    SCAN_CACHE_BYTES = 64 << 20

    def _check_streaming(self, s: SegmentInfo, path: str) -> None:
        """Size and sha256 of a local segment (at ``path``), read in pieces (never held
        whole)."""
        name = self.storage.url_of(s.path)
        h, size = hashlib.sha256(), 0
        try:
            with open(path, "rb") as f:
                while piece := f.read(1 << 22):
                    h.update(piece)
                    size += len(piece)
        except FileNotFoundError:
            raise CorruptionError(f"{name}: listed by a manifest but missing") from None
        if size != s.size or h.hexdigest() != s.sha256:
            raise CorruptionError(f"{name}: size or sha256 differs from its manifest")

    # -- group commit -------------------------------------------------------------

    #: Publishes of this process that lost the race for a seq to another writer.
    publish_retries = 0

    def recorder(self, *, max_delay_ms: float = 5.0, max_events: int = 10_000,
                 max_bytes: int = 64 << 20, max_pending_events: int | None = None,
                 max_pending_bytes: int | None = None) -> Recorder:
        """A group-commit recorder: many threads or asyncio tasks ``record`` events, one
        commit per window (README "Recording from many producers (group commit)");
        ``record`` waits while ``max_pending_*`` (default: 4 windows at their limits) are
        handed over and not committed yet."""
        return Recorder(self, max_delay_ms=max_delay_ms, max_events=max_events,
                        max_bytes=max_bytes, max_pending_events=max_pending_events,
                        max_pending_bytes=max_pending_bytes)


def _key_of(blob: str) -> BlobKey:
    """(tenant, sha256) of a path in ``blobs/``."""
    parts = blob.split("/")
    return parts[1], parts[3]


def _lost_race_pause(attempt: int, *, remote: bool) -> None:
    """After losing the race for a seq, wait a random time up to a bound that doubles with
    each loss ("full jitter"): writers that lost together do not all come back together.
    A remote store's round trip is ten times a local one, and so is its bound."""
    base = 0.005 if remote else 0.0005
    time.sleep(random.uniform(0, min(0.25, base * 2 ** min(attempt, 10))))


# -- opening ---------------------------------------------------------------------------


def open_log(
    root: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    create: bool = True,
    *,
    checkpoint_interval: int | None = None,
    durable: bool = True,
    read_only: bool = False,
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S,
) -> EventLog:
    """Open (or create) the log under ``root``: a local path or any fsspec URL.

    ``durable=False`` skips fsync on local disk: for scratch logs (benchmarks, tests that
    need thousands of commits); a power loss may then lose recent commits.
    ``read_only=True`` never writes: no roll-forward at open, no transactions, recorders,
    checkpoints, maintenance or materialize (``check_writable``; workers that only read a
    snapshot).
    ``retry_deadline_s`` bounds the time one storage operation spends retrying a failing
    object store (exponential backoff with jitter); past it the operation raises
    ``StorageError`` (or the commit ``CommitConflict``).
    """
    if isinstance(root, EventLog):
        return root
    if checkpoint_interval is not None:  # an int (numpy's too), not a bool
        if not is_count(checkpoint_interval) or not 1 <= checkpoint_interval <= INT64_MAX:
            raise ValidationError(f"open_log: checkpoint_interval must be an int >= 1 "
                                  f"(commits between checkpoints), got "
                                  f"{short_repr(checkpoint_interval)}")
        checkpoint_interval = int(checkpoint_interval)
    storage = open_storage(root, storage_options, durable=durable,
                           retry_deadline_s=retry_deadline_s)
    # what the storage's client raises for a bucket that is not there, or options it
    # could not use (found at the first request): one PoimenError naming the log
    unusable = (OSError, ValueError, TypeError, AttributeError)
    try:
        raw = storage.read_or_none("_poimen.json")
    except PoimenError:
        raise  # StorageError (an OSError too) says it already
    except unusable as exc:
        raise PoimenError(f"cannot read {storage.url}: {type(exc).__name__}: {exc}") from None
    if raw is None:
        if not create or read_only:
            raise NotFound(f"no poimen log at {storage.url} (open with create=True to make one)")
        config = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": now_iso(),
            "checkpoint_interval": checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL,
        }
        try:
            storage.put_if_absent("_poimen.json", dumps(config))
        except PoimenError:
            raise
        except unusable as exc:
            raise PoimenError(f"cannot create a log at {storage.url}: "
                              f"{type(exc).__name__}: {exc}") from None
        raw = storage.read("_poimen.json")
    config = loads(raw, storage.url_of("_poimen.json"))
    storage.pin_root()  # a log's directory deleted under it is never made again
    return EventLog(storage, config, read_only=read_only)


#: What every entry point takes as its log: an open ``EventLog``, or a root to open.
LogLike = EventLog | str | os.PathLike[str]


def as_log(log: LogLike, *, storage_options: dict[str, Any] | None = None,
           read_only: bool = False) -> EventLog:
    """The calling convention of every entry point: an open ``EventLog`` is used as it is
    (``storage_options`` must then be None); a root (path or fsspec URL) is opened, never
    created, with ``storage_options`` (credentials, endpoint) passed to fsspec; the
    entry points that only read (``connect``, ``episode``, ``export_live``, ``check``)
    open it ``read_only``, so a read never writes the log, not even a roll-forward."""
    if isinstance(log, EventLog):
        if storage_options:
            raise TypeError("storage_options apply to a root URL, not to an open EventLog")
        return log
    if not isinstance(log, str | os.PathLike):
        raise TypeError(f"expected an EventLog or a root URL, got {type(log).__name__}")
    return open_log(log, storage_options, create=False, read_only=read_only)


def commit_events(log: EventLog, events: Sequence[ev.Event]) -> CommitInfo:
    """Commit a list of events as one transaction (a convenience for scripts and tests)."""
    with log.transaction() as tx:
        tx.extend(events)
    assert tx.commit_info is not None
    return tx.commit_info
