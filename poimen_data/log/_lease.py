"""The maintenance lease: one process at a time may run the jobs that remove or rewrite
files (vacuum, reduce, compact), and a commit in doubt is settled under it
(``EventLog.settle``: the files it would publish must not be vacuumed meanwhile); a
commit never takes it. Here in the log layer so that the log can take it; ``jobs``
re-exports it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import orjson

from poimen_data.errors import LeaseHeld

if TYPE_CHECKING:
    from poimen_data.log._log import EventLog

LEASE = "_lease.json"
LEASE_TTL_S = 600.0
_logger = logging.getLogger("poimen_data")


class Lease:
    """The maintenance lease while held.

    A daemon thread renews it every third of its TTL while the operation makes progress
    (calls ``check()``; a hung operation is not kept alive, its lease expires). ``check()``
    raises ``LeaseHeld`` once this process may no longer hold the lease: past the last
    expiry it wrote (it stalled, or renewal kept failing), or when the lease file names
    another owner; the operation then stops before its next destructive step. A renewal
    is never written past our own expiry, so it cannot overwrite a lease another process
    took over from an expired one.
    """

    def __init__(self, log: EventLog, ttl_s: float, clock: Callable[[], float], *,
                 owner: str | None = None) -> None:
        self.log, self.ttl_s, self.clock = log, ttl_s, clock
        # a fresh owner per lease, or one its caller keeps: a lease that caller left
        # behind (its release failed, or the answer to its PUT was lost) is taken back
        self.owner = owner or uuid.uuid4().hex
        self.lost = False
        self.expires = 0.0  # the last expiry this process wrote
        self._progress = self._verified = clock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _body(self) -> bytes:
        self.expires = self.clock() + self.ttl_s
        return orjson.dumps({"owner": self.owner, "expires": self.expires})

    def acquire(self, renew: bool = True) -> None:
        st = self.log.storage
        if not st.put_if_absent(LEASE, self._body()) and \
                not self._ours(held := _read_lease(self.log)):
            if held is not None and held["expires"] > self.clock() \
                    and held.get("owner") != self.owner:
                raise LeaseHeld(f"{self.log.root}: maintenance lease held by "
                                f"{held.get('owner')} for "
                                f"{held['expires'] - self.clock():.0f} s more")
            st.delete(LEASE)
            if not st.put_if_absent(LEASE, self._body()) and \
                    not self._ours(_read_lease(self.log)):
                raise LeaseHeld(f"{self.log.root}: maintenance lease taken by another process")
        if renew:
            self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name="poimen-lease")
            self._renewer.start()

    def _ours(self, held: dict[str, Any] | None) -> bool:
        """Whether the lease file (``held``, as read) is the one we just wrote: a
        conditional PUT whose answer was lost (stored, then the retry refused) must not
        read as someone else's lease."""
        return held is not None and held.get("owner") == self.owner \
            and held.get("expires") == self.expires

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            if self.clock() - self._progress > self.ttl_s:
                continue  # no progress for a whole TTL: let the lease expire
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 - retried next tick; check() sees expiry
                _logger.warning("%s: renewing the maintenance lease failed: %s",
                                self.log.root, exc)

    def renew(self) -> bool:
        """Push the expiry a TTL ahead if the lease is still ours; False once it is not."""
        if self.clock() >= self.expires:
            self.lost = True  # expired: another process may hold it now, never overwrite
            return False
        held = _read_lease(self.log)
        if held is None or held.get("owner") != self.owner:
            self.lost = True
            return False
        self.log.storage.write(LEASE, self._body())
        return True

    def check(self) -> None:
        """Raise ``LeaseHeld`` unless this process still holds the lease (and note the
        progress that keeps it renewed). Reads the lease file at most every TTL/10."""
        now = self.clock()
        if not self.lost and now >= self.expires:
            self.lost = True
        if not self.lost and now - self._verified >= self.ttl_s / 10:
            held = _read_lease(self.log)
            self.lost = held is None or held.get("owner") != self.owner
            self._verified = now
        if self.lost:
            raise LeaseHeld(f"{self.log.root}: the maintenance lease expired or was taken "
                            "over while this process held it; stopped before changing "
                            "anything more")
        self._progress = now

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        held = _read_lease(self.log)
        if held is not None and held.get("owner") == self.owner:
            self.log.storage.delete(LEASE)


@contextlib.contextmanager
def lease(log: EventLog, ttl_s: float = LEASE_TTL_S, *, renew: bool = True,
          clock: Callable[[], float] = time.time) -> Iterator[Lease]:
    """Hold the maintenance lease of ``log`` for the block (renewed while held).

    A lease past its expiry is taken over (its holder died). Taking over is not atomic
    with the read of the stale lease; two processes breaking the same stale lease at the
    same instant is the one case this does not exclude.
    """
    log.check_writable("the maintenance lease")  # its holders write: compact, vacuum, ...
    held = Lease(log, ttl_s, clock)
    held.acquire(renew)
    try:
        yield held
    finally:
        held.release()


def lease_holder(log: EventLog) -> dict[str, Any] | None:
    """What the lease file says (``{"damaged": text}`` when it is unreadable), or None
    when there is no lease."""
    raw = log.storage.read_or_none(LEASE)
    if raw is None:
        return None
    held = _parse_lease(raw)
    return held if held is not None else {"damaged": raw.decode("utf-8", "replace")}


def _read_lease(log: EventLog) -> dict[str, Any] | None:
    """The lease document, or None when absent or unreadable (a damaged lease counts as
    expired: it names no live holder)."""
    return _parse_lease(log.storage.read_or_none(LEASE))


def _parse_lease(raw: bytes | None) -> dict[str, Any] | None:
    try:
        held = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(held, dict) or not isinstance(held.get("expires"), int | float):
        return None
    return held
