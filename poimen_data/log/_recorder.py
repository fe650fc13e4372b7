"""Group commit: many concurrent producers (threads or asyncio tasks) record into one log,
and the recorder gathers what they hand it into one transaction per window.

See README "Recording from many producers (group commit)" for the contract.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from poimen_data.errors import (
    CommitConflict,
    CommitUnknown,
    LeaseHeld,
    PoimenError,
    ValidationError,
)
from poimen_data.log._txn import BlobKey, CommitInfo, Transaction, ref_problem
from poimen_data.model import _events as ev
from poimen_data.model._arrow import events_to_table
from poimen_data.model._limits import short_repr

if TYPE_CHECKING:
    from poimen_data.log._log import EventLog

_logger = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[Recorder] = weakref.WeakSet()
_now = time.monotonic  # the windows' clock (a test moves it by hand)
_OWN = threading.local()  # .recorder is set on every recorder's gatherer and committer
KNOWN_BODIES = 65_536
# What a recorder holds that is not resolved yet is bounded, by default, by this many
# windows at their limits (one gathering, one closed, one publishing, and the next's)
PENDING_WINDOWS = 4
# a window in doubt (its publish failed without telling whether it landed) is settled
# again after this pause, doubled after each failure up to the second figure
SETTLE_PAUSE_S = (0.1, 5.0)
# a record whose commit settled as not landed is committed again, this many times at most
RECOMMITS = 8
SMALL_BODY = 64 << 10
# the longest a window waits for more records: about 31 years, i.e. only flush, close and
# the size limits close it (past threading's own limit, a wait would fail)
MAX_DELAY_MS = 10**12


@atexit.register
def _close_all() -> None:
    """Drain recorders left open at exit (before the log finishes its promotions)."""
    for rec in list(_LIVE):
        try:
            rec.close()
        except Exception:  # noqa: BLE001 - unresolved records are lost, as in a crash
            pass


class _RecordFuture(Future[CommitInfo]):
    """A record's future, as ``concurrent.futures`` makes them, with three guards.

    - Its done-callbacks run on the recorder's committer thread. One that raised a
      ``BaseException`` (``sys.exit()``) would escape into the committer, so it is logged
      like any other callback error; and one that waited there without a timeout for a
      record not yet resolved would wait for itself, so that raises ``PoimenError``.
    - In a forked child the recorder's threads are gone and this future's lock may have
      been held at the fork: its state is read without the lock, a pending one raises
      ``PoimenError`` when waited for, and it cannot be cancelled or given callbacks
      (``concurrent.futures.wait`` and ``as_completed`` take the lock: not there).
    """

    def __init__(self, pid: int, threads: tuple[threading.Thread, ...]) -> None:
        super().__init__()
        self._pid = pid
        self._threads = threads  # the gatherer and the committer (not the recorder)

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _check_wait(self, timeout: float | None) -> None:
        if timeout is None and threading.current_thread() in self._threads \
                and not super().done():
            raise PoimenError("waiting for a record on the recorder's own thread (from a "
                              "done-callback) would never end: hand the wait to another "
                              "thread, or use arecord")

    def _in_child(self) -> BaseException | None:
        """This future as a forked child sees it, read without its lock: the exception
        it finished with, or ``PoimenError`` while it is pending."""
        if self._state in _UNDONE:
            raise PoimenError(_FORKED)
        if self._state != "FINISHED":
            raise CancelledError()
        return self._exception

    def done(self) -> bool:
        if self._forked():
            return self._state not in _UNDONE
        return super().done()

    def running(self) -> bool:
        return self._state == "RUNNING" if self._forked() else super().running()

    def cancelled(self) -> bool:
        if self._forked():
            return self._state in ("CANCELLED", "CANCELLED_AND_NOTIFIED")
        return super().cancelled()

    def result(self, timeout: float | None = None) -> CommitInfo:
        if self._forked():
            exc = self._in_child()
            if exc is not None:
                raise exc
            return self._result  # type: ignore[return-value]
        self._check_wait(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._forked():
            return self._in_child()
        self._check_wait(timeout)
        return super().exception(timeout)

    def cancel(self) -> bool:
        return False if self._forked() else super().cancel()

    def add_done_callback(self, fn: Any) -> None:
        if self._forked():
            raise PoimenError(_FORKED)
        threads = self._threads

        def guarded(fut: Future[CommitInfo]) -> None:
            try:
                fn(fut)
            except BaseException:
                if threading.current_thread() not in threads:
                    raise  # the caller's own thread (a future already done): as usual
                _logger.exception("exception calling callback for %r", fut)

        super().add_done_callback(guarded)


_UNDONE = ("PENDING", "RUNNING")  # concurrent.futures' states of a future not done yet
_FORKED = ("this recorder belongs to the process that forked this one (its threads are not "
           "here): open a recorder in this process")


def blob_ref(tenant: str, data: bytes) -> ev.BlobRef:
    """The ref a body gets in the blob store (sha256 of the bytes, within ``tenant``)."""
    ev.check_tenant(tenant, "blob_ref")
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValidationError(f"blob_ref: field 'data' must be bytes, got "
                              f"{type(data).__name__}")
    if type(data) is not bytes:  # a view of 4-byte items: its bytes, as put_blob takes them
        data = bytes(data)
    return ev.BlobRef(tenant, _sha256(data), len(data))


def _sha256(data: bytes | bytearray | memoryview) -> str:
    """sha256 of a body. hashlib lets go of the GIL for 2,048 bytes or more; among dozens
    of producer threads, taking it back after a 3 us hash of a small body costs more
    than the hash (up to the 5 ms switch interval), so small bodies go in pieces below
    that size, and big ones in one call that other threads run beside."""
    if len(data) > SMALL_BODY:
        return hashlib.sha256(data).hexdigest()
    h = hashlib.sha256()
    view = memoryview(data)
    for i in range(0, len(view), 2047):
        h.update(view[i:i + 2047])
    return h.hexdigest()


@dataclass(eq=False)
class _Record:
    no: int
    events: tuple[ev.Event, ...]
    bodies: dict[BlobKey, bytes]
    nbytes: int
    # every ref its events point at (checked by _check): each plain one once, every
    # other object once (``ev.Checked``: no equality of theirs is asked)
    refs: tuple[ev.BlobRef, ...]
    future: Future[CommitInfo]
    at: float = 0.0  # when it was handed over to the gatherer (_let_in)
    room: Future[None] | None = None  # while it waits for room: resolved when let in


@dataclass(eq=False)
class _Window:
    tx: Transaction
    # the hand-over of its first record to join (set by _join), not when the gatherer got
    # the GIL back after it (up to several ms behind the producers a commit woke)
    opened: float = 0.0
    records: list[_Record] = field(default_factory=list)
    n_records: int = 0  # the records that joined (failed ones too: see _release)
    n_events: int = 0
    nbytes: int = 0
    first_no: int = 0  # the first and last records taken, cancelled ones included
    last_no: int = 0
    events: list[ev.Event] = field(default_factory=list)
    stamps: list[datetime] = field(default_factory=list)
    keys: list[BlobKey] = field(default_factory=list)
    refs: list[ev.BlobRef] = field(default_factory=list)  # its records' refs
    poisoned: bool = False  # building the transaction failed: commit record by record


_STOP = object()


class Recorder:
    """Gathers the records of concurrent producers into one commit per window.

    A window opens with its first record and closes once that record has waited
    ``max_delay_ms`` since ``record`` took it and the window before it has been taken by
    the committer (which may still be publishing it), and no sooner than ``max_delay_ms``
    after the committer last resolved a window (the producers it woke join this one), or
    as soon as one more record would take it past ``max_events`` events or ``max_bytes`` of
    bodies (a record is never split: a bigger one is a window of its own). While one
    window publishes, the next may wait closed (its pack and segment being written) and a
    third gathers, so a busy recorder makes bigger windows, and producers of the next
    window do their Python work while the disk syncs.

    A window stages its new bodies as one file, its pack (``log._staged``): one file
    created and written (or one PUT) on the I/O pool when the window closes, beside its
    segment; on local disk both are made durable by one ``syncfs`` just before the publish
    (``Transaction.defer_sync``; an fsync each where there is no syncfs). Promotion copies
    the pieces out to ``blobs/`` in the background. What bounds it, measured on the 2
    shared cores of this project's machines (README "Recording from many producers"): the
    GIL and the window's cycle, not fsync. A record costs about 100 us of user CPU, mostly
    Python, which runs one thread at a time, and with all producers in one window a cycle
    is the delay (the woken producers hand their records over within it), the window's
    table and the commit: about 10 ms for 64. The kernel's part is thread switches, futex
    hand-offs and creating each body's file in ``blobs/`` at promotion (about 100 us of
    CPU per record in all; ext4 without a journal adds 20 to 500 us per new inode,
    scanning past inodes freed in the last 60 to 360 s). At 2 events per record that caps a
    2-core machine at about 10 to 12 thousand events per second, short of 20,000.

    The checkpoint a window's commit owes (every ``checkpoint_interval``-th seq) waits for
    every promotion this process queued. Written by the committer as the commit's futures
    resolved, it waited for the promotions running behind a busy committer (145 to 380 ms
    here), and every producer waited with it. It is written on a thread of its own, at the
    window's seq, once the commits up to it are promoted, without promoting those that
    land meanwhile (``EventLog.write_checkpoint(upto=...)``); the committer publishes on,
    and never waits for it: the next one owed while it is written is written after it,
    at the newest seq owed by then. ``flush`` waits for those owed before it, ``close``
    for all.
    """

    def __init__(self, log: EventLog, *, max_delay_ms: float = 5.0,
                 max_events: int = 10_000, max_bytes: int = 64 << 20,
                 max_pending_events: int | None = None,
                 max_pending_bytes: int | None = None) -> None:
        if isinstance(max_delay_ms, bool) or not isinstance(max_delay_ms, int | float) \
                or not 0 <= max_delay_ms <= MAX_DELAY_MS:  # NaN too (no comparison holds)
            raise ValidationError(f"recorder: max_delay_ms must be a number in [0, "
                                  f"{MAX_DELAY_MS}], got {short_repr(max_delay_ms)}")
        if max_pending_events is None:
            max_pending_events = PENDING_WINDOWS * max_events
        if max_pending_bytes is None:
            max_pending_bytes = PENDING_WINDOWS * max_bytes
        for name, v in (("max_events", max_events), ("max_bytes", max_bytes),
                        ("max_pending_events", max_pending_events),
                        ("max_pending_bytes", max_pending_bytes)):
            if type(v) is not int or v < 1:
                raise ValidationError(f"recorder: {name} must be an int >= 1, got "
                                      f"{short_repr(v)}")
        log.check_writable("a recorder")
        # The checkpoints it owes need the checkpoint's segment list, which opening left
        # unread: read it now, before any producer waits (0.65 s of Python at 200,000
        # segments, which slowed every thread while a busy recorder ran; 0.8 s of every
        # commit waiting while it was read under the log's lock, before that).
        try:
            log._load_segments()
        except Exception as exc:  # noqa: BLE001 - read when first needed then, as before
            _logger.warning("%s: reading the checkpoint's segment list: %s", log.root, exc)
        self.log = log
        self.max_delay = max_delay_ms / 1000
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.max_pending_events = max_pending_events
        self.max_pending_bytes = max_pending_bytes
        self.commits = 0  # window commits published (a fallback commit counts too)
        # one lock, a condition per waiter: the gatherer (records, a free hand-over slot,
        # an idle committer), the committer (a closed window), flush (resolved records)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._commit_cv = threading.Condition(lock)
        self._done_cv = threading.Condition(lock)
        self._inbox: deque[_Record] = deque()
        # records waiting for room, in order (see _release); what was let in and is not
        # resolved yet: records, events, bytes of bodies
        self._waiting: deque[_Record] = deque()
        self._pending = [0, 0, 0]
        self._next_no = 1
        self._done_no = 0  # every record numbered up to this one is resolved
        # records up to this one are awaited by a flush: their windows close without
        # the delay (later records' windows keep theirs)
        self._flush_to = 0
        # when the committer last resolved a window's records (see _next_for)
        self._resolved_at = 0.0
        self._closed = False
        self._pid = os.getpid()  # a forked child's copy refuses (see _check_process)
        self._broken: BaseException | None = None  # what stopped a thread of it
        self._alive = 2  # its threads still running (see _stop)
        self._ready: _Window | object | None = None  # closed window handed to the committer
        self._busy = False  # the committer is publishing a window
        self._committing: _Window | None = None  # ... this one
        self._contended = False  # the last publish lost a race to another writer
        self._retries = log.publish_retries
        self._checkpointing: threading.Thread | None = None  # see _start_checkpoint
        # the newest seq owed a checkpoint; the newest one written (or tried)
        self._ckpt_asked = self._ckpt_done = 0
        # bodies this recorder committed lately (the gatherer reads, the committer writes)
        self._known: OrderedDict[BlobKey, None] = OrderedDict()
        self._gatherer = threading.Thread(target=self._gather_loop, daemon=True,
                                          name="poimen-recorder-gather")
        self._committer = threading.Thread(target=self._commit_loop, daemon=True,
                                           name="poimen-recorder-commit")
        self._threads = (self._gatherer, self._committer)
        self._gatherer.start()
        self._committer.start()
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"Recorder({self.log.root!r}, max_delay_ms={self.max_delay * 1000:g})"

    @property
    def pending(self) -> tuple[int, int, int]:
        """(records, events, bytes of bodies) handed over and not resolved yet: what the
        ``max_pending_*`` limits bound (records waiting for room are not counted)."""
        self._check_process()
        with self._cond:
            n, n_events, nbytes = self._pending
        return n, n_events, nbytes

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- producers -------------------------------------------------------------------

    ref = staticmethod(blob_ref)

    def record(self, events: Iterable[ev.Event], *,
               blobs: Mapping[ev.BlobRef, bytes] | None = None) -> Future[CommitInfo]:
        """Queue ``events`` (and the bodies they point at) for the next window.

        ``blobs`` maps each new body's ref (``recorder.ref(tenant, data)``) to its bytes;
        an event may also point at a body committed earlier. The future resolves to a
        ``CommitInfo`` whose ``seq`` is the commit that made these events durable and
        whose ``first_lsn..last_lsn`` are these events' LSNs; it fails with
        ``ValidationError`` when one of them is bad (nothing of them is written, the
        other producers' records are not affected). Safe from any thread of this process
        (a forked child gets ``PoimenError``); ``cancel()`` succeeds until the record joins
        a window. Its done-callbacks run on the committer thread: see ``_RecordFuture``.

        Blocks while the records handed over and not resolved yet hold
        ``max_pending_events`` events or ``max_pending_bytes`` bytes of bodies, until
        commits make room (producers are let in in the order they came; ``arecord``
        awaits instead). Raises ``PoimenError`` when the recorder closes meanwhile.
        """
        rec = self._submit(events, blobs)
        if isinstance(rec, _Record):
            if rec.room is not None:
                self._wait_room(rec)
            return rec.future
        return rec

    async def arecord(self, events: Iterable[ev.Event], *,
                      blobs: Mapping[ev.BlobRef, bytes] | None = None) -> CommitInfo:
        """``record`` for asyncio: await room and the commit without blocking the event
        loop. Cancelled while it waits for room, the record is withdrawn (or cancelled, if
        it was let in meanwhile and has not joined a window)."""
        rec = self._submit(events, blobs)
        if not isinstance(rec, _Record):
            return await asyncio.wrap_future(rec)
        if rec.room is not None:
            try:
                await asyncio.wrap_future(rec.room)
            except PoimenError:
                raise  # refused: closed or stopped while it waited
            except BaseException:
                self._withdraw(rec)
                raise
        return await asyncio.wrap_future(rec.future)

    def _refusal(self) -> PoimenError:
        return PoimenError("recorder is closed" if self._broken is None
                           else f"recorder stopped: {self._broken!r}")

    def _submit(self, events: Iterable[ev.Event], blobs: Mapping[ev.BlobRef, bytes] | None
                ) -> _Record | Future[CommitInfo]:
        """Check a record and let it in, or queue it for room (``room`` set); a future
        already failed with ``ValidationError`` for a bad one."""
        self._check_process()
        with self._cond:
            if self._closed:
                raise self._refusal()
        try:
            evs, bodies, nbytes, refs = self._check(events, blobs)
        except ValidationError as exc:
            failed: Future[CommitInfo] = Future()
            failed.set_exception(exc)
            return failed
        rec = _Record(0, evs, bodies, nbytes, refs, _RecordFuture(self._pid, self._threads))
        with self._cond:
            if self._closed:
                raise self._refusal()
            # a done-callback (on a committer) never waits: the room it would wait for is
            # made by the thread it runs on, or by another recorder's that may wait on it
            if (self._waiting or not self._fits(rec)) \
                    and not getattr(_OWN, "recorder", False):
                rec.room = Future()
                self._waiting.append(rec)
                self._cond.notify()  # the open window may hold the bound: it closes
            else:
                self._let_in(rec)
        return rec

    def _fits(self, rec: _Record) -> bool:
        """Room for ``rec`` (lock held): within both limits, or nothing else pending (a
        record bigger than a limit goes in alone)."""
        n, n_events, nbytes = self._pending
        return n == 0 or (n_events + len(rec.events) <= self.max_pending_events
                          and nbytes + rec.nbytes <= self.max_pending_bytes)

    def _let_in(self, rec: _Record) -> None:
        """Hand ``rec`` over to the gatherer (lock held): numbered, and counted pending."""
        rec.no = self._next_no
        rec.at = _now()
        self._next_no += 1
        self._pending[0] += 1
        self._pending[1] += len(rec.events)
        self._pending[2] += rec.nbytes
        self._inbox.append(rec)
        self._cond.notify()

    def _release(self, n: int, n_events: int, nbytes: int) -> None:
        """Records resolved (or cancelled) no longer count (lock held): let in those
        waiting for room, first come first in, while they fit."""
        p = self._pending
        p[0], p[1], p[2] = p[0] - n, p[1] - n_events, p[2] - nbytes
        while self._waiting and self._fits(self._waiting[0]):
            rec = self._waiting.popleft()
            assert rec.room is not None
            if rec.room.set_running_or_notify_cancel():  # else its awaiting task was
                self._let_in(rec)                        # cancelled: withdrawn
                rec.room.set_result(None)

    def _refuse_waiting(self) -> None:
        """Closed or stopped (lock held): producers waiting for room are refused."""
        exc = self._refusal()
        while self._waiting:
            room = self._waiting.popleft().room
            assert room is not None
            if room.set_running_or_notify_cancel():
                room.set_exception(exc)

    def _wait_room(self, rec: _Record) -> None:
        """Block the producer until ``rec`` is let in (``PoimenError`` if refused)."""
        assert rec.room is not None
        try:
            rec.room.result()
        except PoimenError:
            raise
        except BaseException:  # interrupted (KeyboardInterrupt): not handed over then
            self._withdraw(rec)
            raise

    def _withdraw(self, rec: _Record) -> None:
        """Take back a record whose producer stopped waiting for room: out of the queue,
        or cancelled if it was let in meanwhile (it commits if it has joined a window)."""
        with self._cond:
            if rec in self._waiting:
                self._waiting.remove(rec)
                self._release(0, 0, 0)  # those behind it may fit now
                return
        rec.future.cancel()

    def _check(self, events: Iterable[ev.Event], blobs: Mapping[ev.BlobRef, bytes] | None
               ) -> tuple[tuple[ev.Event, ...], dict[BlobKey, bytes], int,
                          tuple[ev.BlobRef, ...]]:
        """What a transaction would reject whole, checked for this record alone."""
        if isinstance(events, ev.Event):
            raise ValidationError("record: events must be a sequence of events, not one")
        try:
            evs = tuple(events)
        except TypeError:
            raise ValidationError(f"record: events must be a sequence of events, got "
                                  f"{type(events).__name__}") from None
        seen = ev.Checked()
        for i, e in enumerate(evs):
            ev.validate_event(e, i, seen)
        bodies: dict[BlobKey, bytes] = {}
        if blobs is not None and not isinstance(blobs, Mapping):
            raise ValidationError("record: blobs must map BlobRef -> bytes")
        for ref, data in (blobs or {}).items():
            ev.check_ref(ref, "record", "blobs")
            if not isinstance(data, bytes | bytearray | memoryview):
                raise ValidationError(f"record: body of ref {ref.sha256[:12]}… must be "
                                      f"bytes, got {type(data).__name__}")
            data = bytes(data)
            if len(data) != ref.size or _sha256(data) != ref.sha256:
                raise ValidationError(f"record: body given for ref {ref.sha256[:12]}… does "
                                      "not match its sha256 and size")
            bodies[(ref.tenant, ref.sha256)] = data
        for i, e in enumerate(evs):
            for name, ref in ev.event_refs(e):
                body = bodies.get((ref.tenant, ref.sha256))
                if body is not None and len(body) == ref.size:
                    continue
                if body is None and ref_problem(self.log, ref) is None:
                    continue
                raise ValidationError(
                    f"event {i} ({e.kind}): field {name!r}: ref {ref.sha256[:12]}… of "
                    f"tenant {ref.tenant!r} has no committed body of that size (pass the "
                    "body in blobs=)")
        return evs, bodies, sum(len(b) for b in bodies.values()), tuple(seen.all_refs())

    # -- draining --------------------------------------------------------------------

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            raise PoimenError(_FORKED)

    def flush(self) -> None:
        """Wait until every record handed over before this call is resolved (and the
        checkpoint their commits owed is written)."""
        self._check_process()
        if threading.current_thread() in self._threads:
            raise PoimenError("flush on the recorder's own thread (from a done-callback) "
                              "would never end: call it from another thread")
        with self._cond:
            target = self._next_no - 1
            self._flush_to = max(self._flush_to, target)
            self._cond.notify()
            while self._done_no < target and (self._broken is None or self._alive):
                self._done_cv.wait()
        self._join_checkpoint()  # one their commits owed

    def close(self) -> None:
        """Commit what was handed over, then stop; ``record`` refuses from now on. In a
        forked child it does nothing: what was handed over is the parent's to commit."""
        if os.getpid() != self._pid:
            return
        with self._cond:
            ended = self._closed and not self._gatherer.is_alive() \
                and not self._committer.is_alive()  # closed before, or stopped
            if not ended:
                self._closed = True
                self._refuse_waiting()
                self._cond.notify_all()
                self._commit_cv.notify_all()
        if threading.current_thread() not in self._threads:
            self._gatherer.join()
            self._committer.join()
            self._join_checkpoint()  # a checkpoint may still be written after a stop
            _LIVE.discard(self)  # from a done-callback: still drained at exit (_close_all)

    # -- the gatherer: opens a window, stages each record's bodies and events into it ---

    def _gather_loop(self) -> None:
        _OWN.recorder = True
        try:
            while self._gather():
                pass
        except BaseException as exc:  # noqa: BLE001 - never leave a record pending
            self._stop(exc)
        finally:
            self._exited()

    def _exited(self) -> None:
        """A recorder thread ends, with nothing pending left in its hands."""
        with self._cond:
            self._alive -= 1
            self._done_cv.notify_all()

    def _gather(self) -> bool:
        """Open, fill and close one window, and hand it over; False once stopped."""
        with self._cond:
            while not self._inbox and not self._closed:
                self._cond.wait()
            if not self._inbox:
                self._hand(_STOP)
                return False
        tx = self.log.transaction()
        tx.pack_bodies = True  # one file (or one PUT) for the window's new bodies
        tx.defer_checkpoint = True  # after the futures resolve (see _commit)
        win = _Window(tx)
        try:
            tx.defer_sync()  # the pack and the segment made durable by one syncfs
        except OSError as exc:
            # no descriptor for it (EMFILE, the root gone): each file is then fsynced as
            # it is written, and the window lands or fails whole as any commit does
            _logger.warning("%s: a window's files are synced one by one: %s",
                            self.log.root, exc)
        try:
            self._fill(win)
            if self._broken is None:
                self._close(win)
        except BaseException as exc:  # noqa: BLE001 - its producers hear of it
            win.poisoned = True
            self._fail(win.records, exc)
            win.records = []
        with self._cond:
            handed = self._hand(win)
        if not handed:  # stopped: failed here, off the lock (callbacks, abort's I/O)
            assert self._broken is not None
            self._drop(win, self._broken)
        return handed

    def _stop(self, exc: BaseException) -> None:
        """A thread of the recorder met what it cannot go on from (it does not, by design;
        this is the net under that): every record not resolved yet fails with ``exc``,
        ``record`` refuses from now on, ``flush`` returns once both threads have ended,
        ``close`` returns. Each thread fails what it holds: a window the committer is
        publishing is its own to finish (it then takes the stop mark), a window the
        gatherer fills is the gatherer's to drop."""
        _logger.error("%s: recorder stopped: %r", self.log.root, exc)
        committer = threading.current_thread() is self._committer
        with self._cond:
            self._broken = exc
            self._closed = True
            self._refuse_waiting()
            records = list(self._inbox)
            self._inbox.clear()
            self._release(len(records), sum(len(r.events) for r in records),
                          sum(r.nbytes for r in records))
            windows = [self._ready, self._committing] if committer else [self._ready]
            dropped = [w for w in windows if isinstance(w, _Window)]
            self._ready = _STOP  # the committer, if alive, ends; _hand drops windows
            self._cond.notify_all()
            self._commit_cv.notify_all()
        for rec in records:
            rec.future.set_running_or_notify_cancel()
        self._fail(records, exc)
        for win in dropped:
            self._drop(win, exc)

    def _fill(self, win: _Window) -> None:
        while True:
            with self._cond:
                rec = self._next_for(win)
            if rec is None:
                return
            self._join(win, rec)

    def _next_for(self, win: _Window) -> _Record | None:
        """The next record for ``win``, or None when ``win`` should close (lock held)."""
        while True:
            if self._broken is not None:
                return None  # stopped: _hand fails what it gathered
            if self._inbox:
                rec = self._inbox[0]
                if win.records and (win.n_events + len(rec.events) > self.max_events
                                    or win.nbytes + rec.nbytes > self.max_bytes):
                    return None
                return self._inbox.popleft()
            if not win.records:
                return None  # every record so far was cancelled
            # the committer may still publish the window before, unless publishes lose
            # races to other writers: then one window at a time, bigger, fewer to race
            idle = self._ready is None and not (self._busy and self._contended)
            # its delay runs from its first record's hand-over, and from the committer's
            # last resolution: the producers that woke get as long to join it. Producers
            # that wait for each record (an engine's runs) then make one window per cycle,
            # not a big one and a straggler that each cost a commit.
            left = max(win.opened, self._resolved_at) + self.max_delay - _now()
            # a flush waits for it; or producers wait for room that only its commit makes
            flushed = win.first_no <= self._flush_to or bool(self._waiting)
            if idle and (left <= 0 or flushed or self._closed):
                return None
            self._cond.wait(timeout=left if left > 0 else None)

    def _join(self, win: _Window, rec: _Record) -> None:
        win.first_no = win.first_no or rec.no
        win.last_no = rec.no
        if not rec.future.set_running_or_notify_cancel():
            with self._cond:  # cancelled by its producer before joining
                self._release(1, len(rec.events), rec.nbytes)
            return
        if not win.records:
            win.opened = rec.at  # its delay runs from its first record's hand-over
        win.records.append(rec)
        win.n_records += 1
        win.n_events += len(rec.events)
        win.nbytes += rec.nbytes
        if win.poisoned:
            return
        now = datetime.now(UTC)
        win.events += rec.events
        win.refs += rec.refs
        win.stamps += [now if e.ts is None else e.ts for e in rec.events]
        try:
            for key, data in rec.bodies.items():
                # a piece of the window's pack; a body this recorder has not committed
                # yet is staged without looking for a committed copy first
                win.tx.put_checked(key[0], key[1], data, reuse=key in self._known)
                win.keys.append(key)
        except Exception:  # noqa: BLE001 - the commit then goes record by record
            win.poisoned = True

    @staticmethod
    def _close(win: _Window) -> None:
        """Hand the window's events to its transaction as one table: its segment is then
        written in the background while the bodies land (see ``Transaction.extend``)."""
        if win.poisoned:
            return
        try:
            win.tx.start_writes()  # the last bodies, short of a full task
            if win.events:
                win.tx._extend_validated(events_to_table(win.events, win.stamps), win.refs)
        except Exception:  # noqa: BLE001 - the commit then goes record by record
            win.poisoned = True

    def _hand(self, win: _Window | object) -> bool:
        """Give a closed window (or the stop mark) to the committer (lock held); False
        when the recorder has stopped (nobody takes it)."""
        while self._ready is not None and self._broken is None:
            self._cond.wait()
        if self._broken is not None:
            return False
        self._ready = win
        self._commit_cv.notify()
        return True

    def _drop(self, win: _Window, exc: BaseException) -> None:
        """Fail a window's records and remove what it staged (a stopped recorder's)."""
        self._fail(win.records, exc)
        with self._cond:
            self._release(win.n_records, win.n_events, win.nbytes)
        self._abort(win)

    def _abort(self, win: _Window) -> None:
        """Abort a window's transaction; a cleanup error fails no record (vacuum removes
        what it left)."""
        try:
            win.tx.abort()
        except Exception as exc:  # noqa: BLE001 - logged, see above
            _logger.warning("%s: aborting a window failed: %s", self.log.root, exc)

    # -- the committer: publishes windows in order -------------------------------------

    def _commit_loop(self) -> None:
        _OWN.recorder = True
        try:
            self._commit_windows()
        except BaseException as exc:  # noqa: BLE001 - never leave a record pending
            self._stop(exc)
        finally:
            self._exited()

    def _commit_windows(self) -> None:
        while True:
            with self._cond:
                while self._ready is None:
                    self._commit_cv.wait()
                win, self._ready = self._ready, None
                if win is _STOP:
                    return
                assert isinstance(win, _Window)
                self._busy, self._committing = True, win
                self._cond.notify()
            try:
                self._commit(win)
            except BaseException as exc:  # noqa: BLE001 - never leave a future pending
                self._fail(win.records, exc)
            with self._cond:
                self._busy, self._committing = False, None
                self._done_no = win.last_no  # windows are published in order
                self._release(win.n_records, win.n_events, win.nbytes)
                self._cond.notify()
                self._done_cv.notify_all()

    def _commit(self, win: _Window) -> None:
        if not win.records or win.poisoned:
            self._abort(win)
            self._one_by_one(win.records)
            return
        settled = False
        try:
            info = win.tx.commit()
        except ValidationError:
            self._one_by_one(win.records)  # a fault we did not see per record: isolate it
            return
        except CommitUnknown as exc:  # it may have landed: never fail it as if it did not
            outcome = self._settle(exc)
            if outcome is None:  # it did not land and never will: this is its first time
                self._one_by_one(win.records)
                return
            if not isinstance(outcome, CommitInfo):
                self._fail(win.records, outcome)
                return
            info, settled = outcome, True
        except BaseException as exc:  # noqa: BLE001 - storage failed: nothing landed
            self._fail(win.records, exc)
            return
        self.commits += info.seq is not None
        retries = self.log.publish_retries
        self._contended, self._retries = retries > self._retries, retries
        for key in win.keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_BODIES:
            self._known.popitem(last=False)
        lsn = info.first_lsn
        for rec in win.records:
            n = len(rec.events)
            rec.future.set_result(CommitInfo(info.seq, lsn, lsn + n - 1))
            lsn += n
        with self._cond:
            self._resolved_at = _now()  # its producers woke: see _next_for
        if info.seq is not None and not settled \
                and self.log.checkpoint_due(info.seq):  # (settle wrote the one owed)
            self._start_checkpoint(info.seq)

    def _start_checkpoint(self, seq: int) -> None:
        """Write the checkpoint a window's commit owes on a thread of its own (see the
        class docstring). While one is being written, a newer one owed is left to that
        thread, which writes the newest owed once it is done (those between are passed
        over: a checkpoint at any seq is valid): the committer never waits for a
        checkpoint, whose promotions may run seconds behind a busy recorder. A failure is
        logged: a later commit writes the next one."""
        with self._cond:
            self._ckpt_asked = max(self._ckpt_asked, seq)
            if self._checkpointing is not None:
                return  # its thread writes it next

        def write() -> None:
            upto = seq
            try:
                while True:
                    try:
                        self.log.write_checkpoint(upto=upto)
                    except Exception as exc:  # noqa: BLE001 - housekeeping a later one redoes
                        _logger.warning("%s: checkpoint deferred: %s", self.log.root, exc)
                    with self._cond:  # one step with _start_checkpoint's look: none is lost
                        self._ckpt_done = max(self._ckpt_done, upto)
                        self._done_cv.notify_all()
                        if self._ckpt_asked <= upto:
                            self._checkpointing = None
                            return
                        upto = self._ckpt_asked
            finally:
                with self._cond:
                    if self._checkpointing is threading.current_thread():
                        self._checkpointing = None  # died: the next owed starts anew
                    self._done_cv.notify_all()

        thread = threading.Thread(target=write, daemon=True,
                                  name="poimen-recorder-checkpoint")
        with self._cond:  # started before anyone can see it (a join before start raises)
            try:
                thread.start()
                started = True
            except RuntimeError:  # at interpreter exit (3.12 starts no thread then)
                started = False
            self._checkpointing = thread if started else None
        if not started:
            write()

    def _join_checkpoint(self) -> None:
        """Wait until a checkpoint at or past the newest owed so far is written (or tried),
        or no checkpoint thread is left (``flush``, ``close``); not for those owed by
        windows committed after this call, which a busy recorder never runs out of."""
        with self._cond:  # the newest owed so far, not those owed after this call
            need = self._ckpt_asked
            while self._checkpointing is not None and self._ckpt_done < need:
                self._done_cv.wait()

    def _settle(self, exc: CommitUnknown) -> CommitInfo | BaseException | None:
        """Decide a window whose publish failed without telling whether it landed
        (``EventLog.settle``), again and again while storage still fails (or maintenance
        holds the lease), after a pause that doubles (``SETTLE_PAUSE_S``); later windows
        wait, since records commit in the order they were handed over. Returns the
        window's ``CommitInfo`` if it landed, None if it did not (another commit took its
        seq, or its files are gone: it never will), else what its records fail with:
        ``exc`` itself (its ``txn`` still in doubt, to settle) when the recorder closed
        (or stopped) first, since after one last try ``close`` does not wait for storage
        to come back, or when settling met an error it cannot retry."""
        pause, longest = SETTLE_PAUSE_S
        while True:
            with self._cond:
                last = self._closed
            try:
                info = self.log.settle(exc.txn)
            except (OSError, LeaseHeld) as err:  # still in doubt (StorageError is one)
                if last:
                    return exc
                _logger.warning("%s: txn %s still in doubt, settling again in %.1f s: %s",
                                self.log.root, exc.txn, pause, err)
                deadline = time.monotonic() + pause
                with self._cond:  # only close (or stop) ends the pause early
                    while not self._closed and (left := deadline - time.monotonic()) > 0:
                        self._commit_cv.wait(left)
                pause = min(2 * pause, longest)
                continue
            except BaseException as err:  # noqa: BLE001 - the producers get the txn
                _logger.error("%s: settling txn %s failed: %r", self.log.root, exc.txn, err)
                return exc
            if info is None:
                _logger.warning("%s: txn %s settled: it did not land; its records are "
                                "committed again, one by one", self.log.root, exc.txn)
                return None
            _logger.info("%s: txn %s settled: landed as seq %d", self.log.root, exc.txn,
                         info.seq)
            return info

    def _one_by_one(self, records: list[_Record]) -> None:
        """Commit each record in its own transaction: a bad one fails alone; one in doubt
        is settled as a window is (and committed again if it did not land)."""
        for rec in records:
            for _ in range(RECOMMITS):
                try:
                    with self.log.transaction() as tx:
                        for (tenant, sha), data in rec.bodies.items():
                            tx.put_checked(tenant, sha, data)  # hashed by _check
                        tx.extend(rec.events)
                except CommitUnknown as exc:
                    outcome = self._settle(exc)
                    if outcome is None:
                        continue  # it did not land: this is its first time again
                    if isinstance(outcome, CommitInfo):
                        self.commits += 1
                        rec.future.set_result(outcome)
                    else:
                        rec.future.set_exception(outcome)
                except BaseException as exc:  # noqa: BLE001 - handed to its producer
                    rec.future.set_exception(exc)
                else:
                    assert tx.commit_info is not None
                    self.commits += tx.commit_info.seq is not None
                    rec.future.set_result(tx.commit_info)
                break
            else:
                rec.future.set_exception(CommitConflict(
                    f"record did not land in {RECOMMITS} commits, each settled as not "
                    "landed (other writers took their seqs)"))
        with self._cond:
            self._resolved_at = _now()  # their producers woke: see _next_for

    @staticmethod
    def _fail(records: list[_Record], exc: BaseException) -> None:
        for rec in records:
            if not rec.future.done():
                rec.future.set_exception(exc)
