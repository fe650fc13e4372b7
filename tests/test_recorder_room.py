"""Back-pressure: what a recorder holds that is not committed yet is bounded
(``max_pending_events``, ``max_pending_bytes``); a producer past the bound waits in
``record`` (or awaits in ``arecord``) until commits make room, first come first in.

Nothing resolves while the gatherer is held opening its window (``_hold_transactions``);
a producer's arrival in its wait for room is the rendezvous (``_wait_room`` reports it).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from test_recorder import NEVER, _hardening, _hold_transactions

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log._recorder import Recorder, blob_ref


def _events(run: str, n: int) -> list[E.Event]:
    """``n`` events of one run (a start, then attempts finished)."""
    return [E.RunStarted("acme", run, "wf-1")] + [
        E.AttemptFinished("acme", run, 0, "s", k, "failed", error="x") for k in range(1, n)]


def _report_waits(monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """A semaphore released each time a producer thread starts waiting for room."""
    arrived = threading.Semaphore(0)
    wait_room = Recorder._wait_room

    def reported(self: Recorder, rec: Any) -> None:
        arrived.release()
        wait_room(self, rec)

    monkeypatch.setattr(Recorder, "_wait_room", reported)
    return arrived


def _producer(rec: Recorder, events: list[E.Event], out: dict[str, Any], name: str,
              **kw: Any) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = rec.record(events, **kw)
        except BaseException as exc:  # noqa: BLE001 - compared by the test
            out[name] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def _runs(log: pdm.EventLog) -> list[str]:
    return [r["run_id"] for r in log.read_events().to_pylist()]


def test_producers_past_the_bound_wait_and_go_in_in_the_order_they_came(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At ``max_pending_events`` a producer waits; when the first window's commit makes
    room for the small record behind a big one, the small one still waits its turn (it
    would have committed before the big one)."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, opened = _hold_transactions(log, monkeypatch)
    arrived = _report_waits(monkeypatch)
    out: dict[str, Any] = {}
    with log.recorder(max_delay_ms=NEVER, max_events=2, max_pending_events=4) as rec:
        r0, r1 = rec.record(_events("r0", 2)), rec.record(_events("r1", 2))
        assert entered.wait(timeout=30)  # the gatherer is held: nothing resolves
        assert rec.pending == (2, 4, 0)
        big = _producer(rec, _events("big", 4), out, "big")
        assert arrived.acquire(timeout=30)
        small = _producer(rec, _events("small", 1), out, "small")
        assert arrived.acquire(timeout=30)
        assert out == {} and rec.pending == (2, 4, 0)
        monkeypatch.setattr(log, "transaction", opened)
        release.set()
        # r0's window closes at max_events: room for "small" (3 <= 4), not for "big"
        assert r0.result(timeout=30).seq == 1
        rec.flush()  # r1's window: "big" goes in, "small" waits behind it ...
        big.join(timeout=30)
        # ... and "big"'s window, holding the whole bound, closes for it
        assert out["big"].result(timeout=30).seq == 3
        small.join(timeout=30)
        assert not big.is_alive() and not small.is_alive()
        rec.flush()
        infos = [r0.result(), r1.result(), out["big"].result(), out["small"].result()]
    assert infos == [pdm.CommitInfo(1, 1, 2), pdm.CommitInfo(2, 3, 4),
                     pdm.CommitInfo(3, 5, 8), pdm.CommitInfo(4, 9, 9)]
    assert rec.pending == (0, 0, 0)
    assert _runs(log) == ["r0"] * 2 + ["r1"] * 2 + ["big"] * 4 + ["small"]


def test_bodies_are_bounded_too_and_a_record_bigger_than_the_bound_goes_in_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, opened = _hold_transactions(log, monkeypatch)
    arrived = _report_waits(monkeypatch)
    out: dict[str, Any] = {}
    huge, small = b"h" * 150, b"s" * 10
    href, sref = blob_ref("acme", huge), blob_ref("acme", small)
    with log.recorder(max_delay_ms=NEVER, max_pending_bytes=100) as rec:
        t = _producer(rec, [E.AttemptDispatched("acme", "h", 0, "s", 0, 1, prompt=href)],
                      out, "huge", blobs={href: huge})
        t.join(timeout=30)  # nothing pending: it went in at once
        assert not t.is_alive() and rec.pending == (1, 1, 150)
        assert entered.wait(timeout=30)  # the gatherer is held: nothing resolves
        t = _producer(rec, [E.AttemptDispatched("acme", "s", 0, "s", 0, 1, prompt=sref)],
                      out, "small", blobs={sref: small})
        assert arrived.acquire(timeout=30)
        assert "small" not in out and rec.pending == (1, 1, 150)
        monkeypatch.setattr(log, "transaction", opened)
        release.set()
        t.join(timeout=30)  # the window of "huge" closed for it: no flush
        assert not t.is_alive() and rec.pending == (1, 1, 10)
        rec.flush()
        assert (out["huge"].result().seq, out["small"].result().seq) == (1, 2)
    assert log.blobs.get(href) == huge and log.blobs.get(sref) == small


class _Full(NamedTuple):
    log: pdm.EventLog
    rec: Recorder
    first: Future[pdm.CommitInfo]
    waiter: threading.Thread
    out: dict[str, Any]
    release: threading.Event


def _full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
          max_delay_ms: int = NEVER) -> _Full:
    """A recorder with room for one event, holding record "first" while its gatherer is
    held opening a window (``release`` lets it go), and a producer of record ``name``
    waiting for room (its outcome in ``out``)."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, opened = _hold_transactions(log, monkeypatch)
    arrived = _report_waits(monkeypatch)
    out: dict[str, Any] = {}
    rec = log.recorder(max_delay_ms=max_delay_ms, max_pending_events=1)
    first = rec.record(_events("first", 1))
    assert entered.wait(timeout=30)
    waiter = _producer(rec, _events(name, 1), out, name)
    assert arrived.acquire(timeout=30)
    monkeypatch.setattr(log, "transaction", opened)  # the held call still waits
    return _Full(log, rec, first, waiter, out, release)


def test_closing_refuses_the_producers_waiting_for_room_and_writes_nothing_of_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _full(tmp_path, monkeypatch, "late")
    closer = threading.Thread(target=f.rec.close)
    closer.start()
    f.waiter.join(timeout=30)  # refused at once, while the window it waited for is held
    assert not f.waiter.is_alive() and closer.is_alive()
    assert isinstance(f.out["late"], pdm.PoimenError) and str(f.out["late"]) == \
        "recorder is closed"
    f.release.set()
    closer.join(timeout=30)
    assert f.first.result(timeout=0).seq == 1
    assert _runs(f.log) == ["first"]


def test_a_record_cancelled_before_it_joins_gives_its_room_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _full(tmp_path, monkeypatch, "next")
    with f.rec:
        assert f.first.cancel()  # not in a window yet
        f.release.set()  # the gatherer drops it: its room goes to the producer waiting
        f.waiter.join(timeout=30)
        assert not f.waiter.is_alive()
        f.rec.flush()
        assert f.out["next"].result(timeout=0) == pdm.CommitInfo(1, 1, 1)
        assert f.rec.pending == (0, 0, 0)
    assert _runs(f.log) == ["next"]


def test_arecord_awaits_room_without_blocking_its_loop_and_a_cancelled_one_withdraws(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tasks wait for room on one event loop while the loop goes on. The first, too
    big for the room left, is cancelled while it waits: nothing of it is written, and the
    one behind it, which fits, goes in at once (before any commit)."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, opened = _hold_transactions(log, monkeypatch)

    async def main() -> list[pdm.CommitInfo]:
        with log.recorder(max_delay_ms=1, max_pending_events=2) as rec:
            first = rec.record(_events("first", 1))
            assert entered.wait(timeout=30)
            dropped = asyncio.create_task(rec.arecord(_events("dropped", 2)))
            kept = asyncio.create_task(rec.arecord(_events("kept", 1)))
            await asyncio.sleep(0)  # both ran up to their wait for room, and gave way
            assert not kept.done() and not dropped.done()
            assert rec.pending == (1, 1, 0)
            dropped.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dropped
            assert rec.pending == (2, 2, 0)  # "kept" is in; the gatherer is still held
            monkeypatch.setattr(log, "transaction", opened)
            release.set()
            return [await asyncio.wrap_future(first), await kept,
                    await rec.arecord(_events("after", 1))]

    first, kept, after = asyncio.run(main())
    assert [(i.first_lsn, i.last_lsn) for i in (first, kept, after)] == [(1, 1), (2, 2),
                                                                         (3, 3)]
    assert _runs(log) == ["first", "kept", "after"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_bad_bounds_are_refused(tmp_path: Path, bad: Any) -> None:
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    for name in ("max_pending_events", "max_pending_bytes"):
        with pytest.raises(pdm.ValidationError, match=f"recorder: {name} must be an int"):
            log.recorder(**{name: bad})


def test_the_default_bound_is_four_windows_at_their_limits(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    with log.recorder(max_events=10, max_bytes=1000) as rec:
        assert (rec.max_pending_events, rec.max_pending_bytes) == (40, 4000)


def test_a_done_callback_records_past_the_bound_without_waiting(tmp_path: Path) -> None:
    """A done-callback runs on the committer, which makes the room it would wait for: its
    record goes in past the bound (waiting there hung the recorder for ever), into its own
    recorder or another one (whose callbacks could wait on this one)."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    [out] = _hardening("room", root)
    assert out == {"again": [1, 2, 2], "across": [1, 1], "seen": [[2, 2, 0]],
                   "pending": [0, 0, 0, 0, 0, 0]}


def test_a_producer_faster_than_its_commits_is_held_to_the_bound(tmp_path: Path) -> None:
    """With room for one record, a producer recording five in a row waits for each
    commit before its next record goes in: five commits of one record each, and no
    flush needed (a window holding the whole bound closes for the producer waiting)."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    with log.recorder(max_delay_ms=NEVER, max_pending_events=1) as rec:
        futs: list[Future[pdm.CommitInfo]] = []

        def producer() -> None:
            for i in range(5):
                futs.append(rec.record(_events(f"p{i}", 1)))

        t = threading.Thread(target=producer)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive()
        rec.flush()
        assert [f.result(timeout=0).seq for f in futs] == [1, 2, 3, 4, 5]
    assert _runs(log) == [f"p{i}" for i in range(5)]


def test_a_window_holding_the_whole_bound_closes_for_the_producers_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a bound below the window's limits, the open window fills it: the producer
    waiting cannot join it, so it closes then (not at its delay, here never). The
    gatherer is waiting out that delay, both records taken, when the producer comes."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    out: dict[str, Any] = {}
    with log.recorder(max_delay_ms=NEVER, max_pending_events=2) as rec:
        full = threading.Event()
        wait = rec._cond.wait

        def timed(timeout: float | None = None) -> bool:
            if timeout is not None and rec._pending[0] == 2:
                full.set()  # both taken (the inbox is empty when it waits)
            return wait(timeout)

        monkeypatch.setattr(rec._cond, "wait", timed)
        first = [rec.record(_events(f"p{i}", 1)) for i in range(2)]
        assert full.wait(timeout=30)
        t = _producer(rec, _events("p2", 1), out, "p2")
        t.join(timeout=30)
        assert not t.is_alive()  # no flush: it went in once the first two committed
        assert [f.result(timeout=30).seq for f in first] == [1, 1]
        rec.flush()
        assert out["p2"].result(timeout=0).seq == 2


def _flush_started(rec: Recorder, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[threading.Event, threading.Event]:
    """``started`` is set once a flush waits; a flush woken after that waits for
    ``go``, off the recorder's lock, before it returns (a flush still in progress)."""
    started, go = threading.Event(), threading.Event()
    cv = rec._done_cv
    wait = cv.wait

    def waiting(timeout: float | None = None) -> bool:
        started.set()
        got = wait(timeout)
        cv.release()
        try:
            assert go.wait(timeout=30)
        finally:
            cv.acquire()
        return got

    monkeypatch.setattr(rec._done_cv, "wait", waiting)
    return started, go


def test_a_flush_does_not_shorten_the_window_of_a_record_let_in_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flushed commit makes room: the record let in then opens a window that keeps
    its delay while the flush is still returning (hand-moved clock; the gatherer is held
    until the flush waits, and its timed wait with that record taken is the
    rendezvous)."""
    from poimen_data.log import _recorder

    clock = [1000.0]
    monkeypatch.setattr(_recorder, "_now", lambda: clock[0])
    f = _full(tmp_path, monkeypatch, "later", max_delay_ms=1000)
    with f.rec as rec:
        later_waits = threading.Event()
        wait = rec._cond.wait

        def timed(timeout: float | None = None) -> bool:
            if timeout is not None and rec._next_no == 3:
                later_waits.set()  # the window of "later" waits out its delay
            return wait(timeout)

        monkeypatch.setattr(rec._cond, "wait", timed)
        started, go = _flush_started(rec, monkeypatch)
        flusher = threading.Thread(target=rec.flush)
        flusher.start()
        assert started.wait(timeout=30)  # it waits for "first" alone
        f.release.set()
        assert later_waits.wait(timeout=30)
        f.waiter.join(timeout=30)
        assert f.first.result(timeout=0).seq == 1 and not f.out["later"].done()
        go.set()
        flusher.join(timeout=30)
        assert not flusher.is_alive()
        clock[0] += 1.0
        assert f.out["later"].result(timeout=30).seq == 2


def test_a_flush_whose_record_was_cancelled_does_not_wait_out_the_delay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The window that took the cancelled record, and then a later one, is the flush's:
    it closes at once."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, opened = _hold_transactions(log, monkeypatch)
    with log.recorder(max_delay_ms=NEVER) as rec:
        gone = rec.record(_events("gone", 1))
        assert entered.wait(timeout=30) and gone.cancel()
        started, go = _flush_started(rec, monkeypatch)
        go.set()
        flusher = threading.Thread(target=rec.flush)
        flusher.start()
        assert started.wait(timeout=30)
        kept = rec.record(_events("kept", 1))
        monkeypatch.setattr(log, "transaction", opened)
        release.set()
        flusher.join(timeout=30)
        assert not flusher.is_alive() and kept.result(timeout=0).seq == 1
    assert _runs(log) == ["kept"]
