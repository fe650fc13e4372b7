"""Group commit: many producers (threads and asyncio tasks) record through one recorder.

Windows are made deterministic where a test counts commits: a huge ``max_delay_ms`` closes
a window only by its limits or by ``flush``, after a rendezvous of every producer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from conftest import BUCKET, Root
from test_log_processes import _env

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.fold._fold import VIEWS
from poimen_data.log._recorder import Recorder, blob_ref

CHILD = str(Path(__file__).with_name("child_recorder.py"))
HARDENING = str(Path(__file__).with_name("child_recorder_hardening.py"))
TS = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
SHARED = b"shared system output " * 200  # the same body in many records (deduplicated)
NEVER = 10**9  # max_delay_ms: windows close only by their limits or by flush

Rec = tuple[list[E.Event], dict[pdm.BlobRef, bytes]]


def _plan(run: str, k: int) -> list[Rec]:
    """One producer's records: a run with a failed attempt, a retry and a verdict."""
    ts = iter(TS + timedelta(seconds=k, microseconds=j) for j in range(100))
    p = f"prompt of {run} ✓ ".encode() * 300
    pref, sref = blob_ref("acme", p), blob_ref("acme", SHARED)
    return [
        ([E.RunStarted("acme", run, "wf-1", labels={"p": run}, ts=next(ts)),
          E.AttemptDispatched("acme", run, 0, "plan", 0, 1, prompt=pref,
                              context=E.ContextPartition(("a",), ("b",), ()), ts=next(ts))],
         {pref: p}),
        ([E.AttemptFinished("acme", run, 0, "plan", 1, "failed", error="boom",
                            usage=E.Usage(10, 5, cost_usd=Decimal("0.0125")), ts=next(ts))],
         {}),
        ([E.AttemptDispatched("acme", run, 0, "plan", 0, 2, prompt=pref, ts=next(ts))],
         {pref: p}),  # passed again: the first record may not be committed yet
        ([E.AttemptFinished("acme", run, 0, "plan", 2, "succeeded", output=sref,
                            usage=E.Usage(7, 3, cost_usd=Decimal("0.5")), ts=next(ts)),
          E.VerifyingEntered("acme", run, ts=next(ts))], {sref: SHARED}),
        ([E.RunFinished("acme", run, "succeeded", ts=next(ts))], {}),
    ]


def _key(e: E.Event) -> tuple[str, str, datetime | None]:
    return (e.kind, getattr(e, "run_id", ""), e.ts)


def _rows(log: pdm.EventLog) -> list[tuple[str, str, datetime | None]]:
    return [_key(E.event_from_row(r)) for r in log.read_events().to_pylist()]


def _fold(log: pdm.EventLog) -> dict[str, list[tuple[Any, ...]]]:
    con = pdm.connect(log)
    try:
        out = {v: con.execute(f"SELECT * FROM {v} ORDER BY ALL").fetchall() for v in VIEWS}
        out["events"] = con.execute("SELECT * EXCLUDE (seq) FROM events ORDER BY lsn"
                                    ).fetchall()
        return out
    finally:
        con.close()


def _thread_producer(rec: Recorder, run: str, k: int, wait_each: bool,
                     barrier: threading.Barrier, out: dict[str, list[Future[Any]]]) -> None:
    barrier.wait()
    futs = []
    for events, blobs in _plan(run, k):
        f = rec.record(events, blobs=blobs)
        futs.append(f)
        if wait_each:
            f.result()
    out[run] = futs


async def _task_producer(rec: Recorder, run: str, k: int, wait_each: bool
                         ) -> list[pdm.CommitInfo]:
    if wait_each:
        return [await rec.arecord(events, blobs=blobs) for events, blobs in _plan(run, k)]
    futs = [asyncio.wrap_future(rec.record(events, blobs=blobs))
            for events, blobs in _plan(run, k)]
    return list(await asyncio.gather(*futs))


def test_64_threads_and_64_tasks_commit_in_order_and_fold_like_one_by_one(
        tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "group"), durable=False)
    n = 64
    barrier = threading.Barrier(n + 1)
    thread_futs: dict[str, list[Future[Any]]] = {}
    task_infos: dict[str, list[pdm.CommitInfo]] = {}

    async def tasks(rec: Recorder) -> None:
        runs = [(f"a{i}", 1000 + i) for i in range(n)]
        got = await asyncio.gather(*(_task_producer(rec, r, k, k % 2 == 0) for r, k in runs))
        task_infos.update(zip([r for r, _ in runs], got, strict=True))

    with log.recorder(max_delay_ms=5) as rec:
        threads = [threading.Thread(target=_thread_producer,
                                    args=(rec, f"t{i}", i, i % 2 == 0, barrier, thread_futs))
                   for i in range(n)]
        for t in threads:
            t.start()

        def loop() -> None:
            barrier.wait()
            asyncio.run(tasks(rec))

        aio = threading.Thread(target=loop)
        aio.start()
        for t in [*threads, aio]:
            t.join()
    n_commits = rec.commits
    infos = {run: [f.result(timeout=0) for f in fs] for run, fs in thread_futs.items()}
    infos.update(task_infos)
    assert len(infos) == 2 * n

    events = log.read_events()
    total = sum(len(evs) for run in infos for evs, _ in _plan(run, 0))
    assert events.column("lsn").to_pylist() == list(range(1, total + 1))  # gapless
    assert log.head_seq == n_commits < 5 * 2 * n  # windows held several records
    rows = _rows(log)
    seqs = events.column("seq").to_pylist()
    ks = {f"t{i}": i for i in range(n)} | {f"a{i}": 1000 + i for i in range(n)}
    for run, run_infos in infos.items():
        plan = _plan(run, ks[run])
        # every event once, in the producer's order
        assert [r for r in rows if r[1] == run] == [_key(e) for evs, _ in plan for e in evs]
        for (evs, _), info in zip(plan, run_infos, strict=True):
            # the future names exactly this record's LSNs, all in the commit it names
            assert info.last_lsn - info.first_lsn + 1 == len(evs)
            assert rows[info.first_lsn - 1:info.last_lsn] == [_key(e) for e in evs]
            assert set(seqs[info.first_lsn - 1:info.last_lsn]) == {info.seq}

    # the same records committed one by one, in the order they landed, fold the same
    order = sorted((info.first_lsn, run, i) for run, ri in infos.items()
                   for i, info in enumerate(ri))
    one = pdm.open_log(str(tmp_path / "one"), durable=False)
    for _, run, i in order:
        evs, blobs = _plan(run, ks[run])[i]
        with one.transaction() as tx:
            for ref, data in blobs.items():
                assert tx.put_blob(ref.tenant, data) == ref
            tx.extend(evs)
    assert one.head_seq == 5 * 2 * n
    folded = _fold(log)
    assert folded == _fold(one)
    assert len(folded["attempts"]) == 2 * 2 * n and len(folded["runs"]) == 2 * n
    for run in ("t3", "a7"):
        p = _plan(run, ks[run])
        ref = next(iter(p[0][1]))
        assert log.blobs.get(ref) == p[0][1][ref]
    assert log.blobs.get(blob_ref("acme", SHARED)) == SHARED


def _start(n: int) -> list[Rec]:
    return [([E.RunStarted("acme", f"run-{i}", "wf-1")], {}) for i in range(n)]


def test_bad_records_fail_alone_and_the_window_commits(root: Root) -> None:
    log = root.open()
    with log.transaction() as tx:
        old = tx.put_blob("acme", b"committed earlier")
    body = b"a body of its own"
    ref = blob_ref("acme", body)
    ghost = blob_ref("acme", b"never stored")
    rec = log.recorder(max_delay_ms=NEVER)
    good = [rec.record(evs) for evs, _ in _start(3)]
    bad = {
        "run_id": rec.record([E.RunStarted("acme", "bad id!", "wf-1")]),
        "attempt_no": rec.record([E.RunStarted("acme", "ok-but", "wf-1"),
                                  E.AttemptDispatched("acme", "ok-but", 0, "s", 0, 0)]),
        "no committed body": rec.record([E.AttemptDispatched("acme", "g", 0, "s", 0, 1,
                                                             prompt=ghost)]),
        "does not match": rec.record([E.AttemptDispatched("acme", "m", 0, "s", 0, 1,
                                                          prompt=ref)],
                                     blobs={ref: b"other bytes"}),
        "another tenant": rec.record([E.AttemptDispatched("acme", "x", 0, "s", 0, 1,
                                                          prompt=blob_ref("zeta", body))],
                                     blobs={blob_ref("zeta", body): body}),
    }
    good.append(rec.record([E.AttemptDispatched("acme", "run-0", 0, "s", 0, 1, prompt=ref),
                            E.AttemptFinished("acme", "run-0", 0, "s", 1, "succeeded",
                                              output=old)], blobs={ref: body}))
    for what, f in bad.items():  # failed at once, before any commit
        exc = f.exception(timeout=0)
        assert isinstance(exc, pdm.ValidationError) and what in str(exc), (what, exc)
    assert log.head_seq == 1
    rec.flush()
    infos = [f.result(timeout=0) for f in good]
    assert [i.seq for i in infos] == [2] * 4 and log.head_seq == 2  # one commit
    assert [(i.first_lsn, i.last_lsn) for i in infos] == [(1, 1), (2, 2), (3, 3), (4, 5)]
    assert [r[:2] for r in _rows(log)] == [("run_started", "run-0"), ("run_started", "run-1"),
                                           ("run_started", "run-2"),
                                           ("attempt_dispatched", "run-0"),
                                           ("attempt_finished", "run-0")]
    assert log.blobs.get(ref) == body
    rec.close()
    with pytest.raises(pdm.PoimenError, match="closed"):
        rec.record([])


def test_a_window_the_transaction_rejects_is_committed_record_by_record(
        tmp_path: Path) -> None:
    """A body reduced between a record's own check and its window's commit: the
    transaction rejects the window whole, so the recorder commits each record alone."""
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    with log.transaction() as tx:
        old = tx.put_blob("acme", b"to be reduced")
    rec = log.recorder(max_delay_ms=NEVER)
    first = [rec.record(evs) for evs, _ in _start(2)]
    doomed = rec.record([E.AttemptDispatched("acme", "run-0", 0, "s", 0, 1, prompt=old)])
    last = rec.record([E.RunFinished("acme", "run-0", "succeeded")])
    pdm.reduce(log, [old], lambda b: b"summary")  # lsn 1, seq 2
    rec.flush()
    assert isinstance(doomed.exception(timeout=0), pdm.ValidationError)
    assert [(f.result(timeout=0).first_lsn, f.result(timeout=0).seq)
            for f in [*first, last]] == [(2, 3), (3, 4), (4, 5)]
    assert [r[:2] for r in _rows(log)] == [("blob_reduced", ""), ("run_started", "run-0"),
                                           ("run_started", "run-1"), ("run_finished", "run-0")]
    rec.close()


def test_windows_close_at_their_limits_and_cancel_before_joining(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    two = [[E.RunStarted("acme", f"r{i}", "wf-1"), E.RunCancelled("acme", f"r{i}")]
           for i in range(7)]
    with log.recorder(max_delay_ms=NEVER, max_events=4) as rec:
        futs = [rec.record(evs) for evs in two]
        rec.flush()
        assert [f.result(timeout=0).seq for f in futs] == [1, 1, 2, 2, 3, 3, 4]
        body = b"x" * 100
        big = rec.record([], blobs={blob_ref("acme", body): body})
        with log.recorder(max_delay_ms=NEVER, max_bytes=150) as rec2:
            f1 = rec2.record([], blobs={blob_ref("acme", b"y" * 100): b"y" * 100})
            f2 = rec2.record([], blobs={blob_ref("acme", b"z" * 100): b"z" * 100})
        assert f1.result(timeout=0).seq + 1 == f2.result(timeout=0).seq
    assert big.result(timeout=0).seq == 7  # its window closed only with its recorder
    assert log.head == 14


def _hold_transactions(log: pdm.EventLog, monkeypatch: pytest.MonkeyPatch
                       ) -> tuple[threading.Event, threading.Event, Any]:
    """Hold whoever opens a transaction of ``log`` next (the gatherer opening a window):
    ``entered`` is set once it waits, ``release`` lets it go; the original method is
    returned to put back."""
    entered, release = threading.Event(), threading.Event()
    opened = log.transaction

    def held() -> Any:
        entered.set()
        assert release.wait(timeout=30)
        return opened()

    monkeypatch.setattr(log, "transaction", held)
    return entered, release, opened


def test_a_window_closes_its_delay_after_its_first_record_was_handed_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delay runs from the record's hand-over, not from when the gatherer thread got
    to it (after a commit, 64 woken producers hold the GIL before it for milliseconds).
    The windows' clock is moved by hand: the gatherer is held while the first record's
    delay runs out, and its window then closes at once; a later record still waits."""
    from poimen_data.log import _recorder

    clock = [1000.0]
    monkeypatch.setattr(_recorder, "_now", lambda: clock[0])
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, opened = _hold_transactions(log, monkeypatch)
    with log.recorder(max_delay_ms=1000) as rec:
        first = rec.record(_start(1)[0][0])
        assert entered.wait(timeout=30)  # the gatherer is past its wake-up, window unopened
        clock[0] += 1.0  # the record has waited its delay meanwhile
        release.set()
        assert first.result(timeout=30).seq == 1  # not another second of the clock
        monkeypatch.setattr(log, "transaction", opened)
        later = rec.record([E.RunFinished("acme", "run-0", "succeeded")])
        assert not later.done()  # its delay has not run: the clock stands still
        clock[0] += 1.0
        assert later.result(timeout=30).seq == 2
    assert log.head == 2


def test_a_cancelled_first_record_does_not_start_its_window_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delay runs from the first record that joins: a record cancelled before its
    window opened does not shorten the next one's wait (hand-moved clock, the gatherer
    held until both were handed over; a timed wait of the gatherer is the rendezvous)."""
    from poimen_data.log import _recorder

    clock = [1000.0]
    monkeypatch.setattr(_recorder, "_now", lambda: clock[0])
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    entered, release, _opened = _hold_transactions(log, monkeypatch)
    with log.recorder(max_delay_ms=1000) as rec:
        waiting = threading.Event()
        wait = rec._cond.wait

        def timed(timeout: float | None = None) -> bool:
            if timeout is not None:
                waiting.set()  # the gatherer holds an open window whose delay runs
            return wait(timeout)

        monkeypatch.setattr(rec._cond, "wait", timed)
        first = rec.record(_start(1)[0][0])
        assert entered.wait(timeout=30)
        assert first.cancel()  # still waiting to join
        clock[0] += 1.0
        second = rec.record([E.RunStarted("acme", "run-9", "wf-1")])
        release.set()
        assert waiting.wait(timeout=30)  # joined; its window waits out its own delay
        assert not second.done()
        clock[0] += 1.0
        assert second.result(timeout=30).seq == 1
    assert first.cancelled() and log.head == 1


def test_a_window_waits_its_delay_after_the_last_resolution_for_the_producers_it_woke(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window that opened while the one before it was committing waits ``max_delay_ms``
    from that commit's resolution too, not only from its own first record: the producers
    the resolution woke join it, one commit instead of a straggler's and theirs. The
    windows' clock is moved by hand; the committer is held in a done-callback while the
    window before resolves; a timed wait of the gatherer (or the window's commit) is the
    rendezvous after each step."""
    from poimen_data.log import _recorder

    clock = [1000.0]
    monkeypatch.setattr(_recorder, "_now", lambda: clock[0])
    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    with log.recorder(max_delay_ms=100) as rec:
        idle, looked = threading.Event(), threading.Event()
        moved = [False]
        wait = rec._cond.wait

        def timed(timeout: float | None = None) -> bool:
            if timeout is not None and rec._next_no == 3 and not rec._busy:
                idle.set()  # the committer is done with the first window; b1's waits
                if moved[0]:
                    looked.set()  # ... and the gatherer looked at it after the clock moved
            return wait(timeout)

        monkeypatch.setattr(rec._cond, "wait", timed)
        resolving, go_on = threading.Event(), threading.Event()
        a1 = rec.record(_start(1)[0][0])
        a1.add_done_callback(lambda _f: (resolving.set(), go_on.wait(timeout=30)))
        clock[0] += 0.1  # its window's delay runs out: it commits
        assert resolving.wait(timeout=30)  # resolving, held in the callback
        b1 = rec.record([E.RunStarted("acme", "straggler", "wf-1")])  # opens at 1000.1
        clock[0] += 0.09
        go_on.set()  # resolved at 1000.19: b1's window now waits until 1000.29
        assert idle.wait(timeout=30)
        b1.add_done_callback(lambda _f: looked.set())  # (what it did before)
        clock[0] += 0.06  # 1000.25: past b1's own delay, not past the resolution's
        moved[0] = True
        assert looked.wait(timeout=30)
        a2 = rec.record([E.RunFinished("acme", "run-0", "succeeded")])  # the woken producer
        clock[0] += 0.1
        assert b1.result(timeout=30).seq == a2.result(timeout=30).seq == 2
    assert a1.result(timeout=0).seq == 1 and log.head_seq == 2


def test_a_forked_child_holds_none_of_its_parents_pack_bytes(tmp_path: Path) -> None:
    """Pack bytes held for the parent's promotions are not counted in a forked child
    (its promotions would read every pack back otherwise); the parent gives them back."""
    from poimen_data.log import _log
    from poimen_data.storage import PROMOTE_POOL

    log = pdm.open_log(str(tmp_path / "log"))
    body = b"a prompt " * 100
    ref = blob_ref("acme", body)
    gate = threading.Event()
    held = PROMOTE_POOL.submit(gate.wait)  # the one promotion thread waits here
    try:
        with log.recorder(max_delay_ms=NEVER) as rec:
            fut = rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=ref)],
                             blobs={ref: body})
            rec.flush()
        assert fut.result(timeout=0).seq == 1
        assert _log._RETAINED.used == len(body)  # the window's pack, queued
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            os._exit(0 if _log._RETAINED.used == 0 else 1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        gate.set()
        held.result(timeout=60)
    log.flush()
    assert _log._RETAINED.used == 0 and log.blobs.get(ref) == body


FORKED = ("PoimenError: this recorder belongs to the process that forked this one (its "
          "threads are not here): open a recorder in this process")


def _hardening(kind: str, root: Path) -> list[Any]:
    """Run ``child_recorder_hardening.py``: what it checks hung for ever before."""
    import json

    done = subprocess.run([sys.executable, HARDENING, kind, str(root)],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_window_without_a_descriptor_for_syncfs_is_synced_file_by_file(
        tmp_path: Path) -> None:
    """Out of file descriptors, the gatherer cannot open the one ``syncfs`` needs (the
    thread died of it, and every later record waited for ever). The window then fsyncs
    each file: it fails whole while descriptors stay short, and lands whole, as one
    commit, once they are back before its files are written."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    [out] = _hardening("emfile", root)
    assert out == {"during": ["OSError", True], "refused": [True, True], "before": 1,
                   "a": 2, "b": 2, "after": 3}
    log = pdm.open_log(str(root))
    assert [r[1] for r in _rows(log)] == ["before", "a", "b", "after"]
    assert not list(log.storage.walk_files("_staging"))  # nothing of "during" is left


def test_a_forked_child_refuses_its_parents_recorder_and_exits(tmp_path: Path) -> None:
    """A forked child has none of the recorder's threads, and the recorder's lock and a
    future's were held at the fork: recording, waiting for a pending record and flushing
    raise ``PoimenError`` there at once, a resolved record reads as usual, ``close`` and
    the child's exit return; the parent goes on."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    child, parent = _hardening("fork", root)
    assert child == {"record": FORKED, "result": FORKED, "exception": FORKED,
                     "flush": FORKED, "close": None, "pending": FORKED,
                     "states": [False, True, False, False, True],
                     "done": str(pdm.CommitInfo(1, 1, 1))}
    assert parent == {"child_status": 0, "pending": 2}
    assert [r[1] for r in _rows(pdm.open_log(str(root)))] == ["done", "pending"]


def test_done_callbacks_cannot_wait_on_the_committer_or_stop_it(tmp_path: Path) -> None:
    """Done-callbacks run on the committer thread: waiting there for a record it has not
    resolved yet (the next of the same window) or flushing would wait for itself, and a
    ``sys.exit()`` there would end it; all raise or are logged, and it goes on."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    [out] = _hardening("callback", root)
    wait = ("PoimenError: waiting for a record on the recorder's own thread (from a "
            "done-callback) would never end: hand the wait to another thread, or use arecord")
    assert out == {"seen": [wait, wait, "PoimenError: flush on the recorder's own thread "
                            "(from a done-callback) would never end: call it from another "
                            "thread", "TimeoutError: ", str(pdm.CommitInfo(1, 1, 1))],
                   "seqs": [1, 1, 2]}


def test_a_recorder_whose_thread_stopped_fails_its_records_and_refuses(
        tmp_path: Path) -> None:
    """The net under the recorder's threads: should one stop on an error it was not made
    for (here the gatherer cannot open a transaction), every pending record fails with
    that error, ``record`` refuses, ``flush`` and ``close`` return."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    [out] = _hardening("stopped", root)
    assert out == {"failed_by_flush": True, "lost": "RuntimeError: no transaction",
                   "again": "PoimenError: recorder stopped: RuntimeError('no transaction')",
                   "close": None, "head": 0, "pending": [0, 0, 0]}


def test_a_recorder_whose_committer_stopped_fails_the_gatherers_window(
        tmp_path: Path) -> None:
    """The same net on the committer's side, while the gatherer holds an open window: the
    gatherer fails that window's records off its lock, so a callback retrying there is
    refused instead of deadlocking, and ``flush`` returns once they have failed."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    [out] = _hardening("committer", root)
    stopped = "recorder stopped: RuntimeError('committer broke')"
    assert out == {"failed_by_flush": True, "held": "RuntimeError: committer broke",
                   "retried": [f"PoimenError: {stopped}"], "close": None, "head": 0,
                   "pending": [0, 0, 0]}


def test_s3_many_producers_make_one_manifest(s3: Any) -> None:
    import uuid

    root = Root(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3.storage_options, "s3")
    log = root.open()
    n = 16
    barrier = threading.Barrier(n + 2)
    futs: dict[str, list[Future[Any]]] = {}

    with log.recorder(max_delay_ms=NEVER) as rec:
        def thread(i: int) -> None:
            futs[f"t{i}"] = [rec.record(evs, blobs=b) for evs, b in _plan(f"t{i}", i)[:2]]
            barrier.wait()

        async def one(i: int) -> list[Future[Any]]:
            return [rec.record(evs, blobs=b) for evs, b in _plan(f"a{i}", 100 + i)[:2]]

        def aio() -> None:
            async def main() -> None:
                got = await asyncio.gather(*(one(i) for i in range(n)))
                futs.update({f"a{i}": g for i, g in enumerate(got)})

            asyncio.run(main())
            barrier.wait()

        threads = [threading.Thread(target=thread, args=(i,)) for i in range(n)]
        threads.append(threading.Thread(target=aio))
        for t in threads:
            t.start()
        barrier.wait()  # every producer has handed its records over
        rec.flush()
        assert rec.commits == 1
        for t in threads:
            t.join()
    infos = [f.result(timeout=0) for fs in futs.values() for f in fs]
    assert {i.seq for i in infos} == {1} and len(infos) == 4 * n
    assert sorted(lsn for i in infos for lsn in range(i.first_lsn, i.last_lsn + 1)) \
        == list(range(1, 6 * n + 1))
    again = root.open()
    assert again.head_seq == 1 and again.head == 6 * n
    assert len(list(again.storage.walk_files("_log"))) == 1
    p = _plan("a3", 103)[0][1]
    ref = next(iter(p))
    assert again.blobs.get(ref) == p[ref]


# -- crash --------------------------------------------------------------------------------


def _parse(lines: list[bytes]) -> dict[str, tuple[int, int, int]]:
    out = {}
    for line in lines:
        if line.endswith(b"\n"):  # a line cut by the kill is not a report
            run, seq, first, last = line.decode().split()
            out[run] = (int(seq), int(first), int(last))
    return out


CRASHES = [("local", "sigkill"), ("local", "blob_staged"), ("local", "segment_written"),
           ("local", "manifest_published"), ("s3", "segment_written"),
           ("s3", "manifest_published")]


@pytest.mark.parametrize(("backend", "how"), CRASHES)
def test_a_killed_recorder_loses_only_unresolved_records(request: pytest.FixtureRequest,
                                                         tmp_path: Path, backend: str,
                                                         how: str) -> None:
    from child_recorder import prompt

    if backend == "local":
        root = Root(str(tmp_path / "log"), None, "local")
    else:
        import uuid

        s3 = request.getfixturevalue("s3")
        root = Root(f"s3://{BUCKET}/{uuid.uuid4().hex}", s3.storage_options, "s3")
    root.open()
    crash_at = None if how == "sigkill" else how
    p = subprocess.Popen([sys.executable, CHILD, root.url, "8"], env=_env(root, crash_at),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    lines: list[bytes] = []
    if how == "sigkill":
        while len(lines) < 40:  # the rendezvous: 40 futures resolved, more in flight
            line = p.stdout.readline()
            assert line, p.stderr.read().decode()[-2000:] if p.stderr else ""
            lines.append(line)
        os.kill(p.pid, signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    lines += out.splitlines(keepends=True)
    assert p.returncode == (-signal.SIGKILL if how == "sigkill" else 137), err.decode()[-2000:]
    resolved = _parse(lines)
    if how == "sigkill":
        assert len(resolved) >= 40
    else:
        assert resolved == {}  # the first window died before any future resolved

    if how == "manifest_published":
        # published, never promoted: a reader (read-only, so no roll-forward) reads each
        # body from its piece of the window's pack
        reader = pdm.open_log(root.url, storage_options=root.storage_options,
                              read_only=True)
        staged = [b for m in reader.manifests() for b in m.blobs]
        assert staged and all(b.staged and "/bodies.pack#" in b.staged for b in staged)
        assert list(reader.storage.walk_files("blobs")) == []
        prompts = [E.event_from_row(r).prompt for r in reader.read_events().to_pylist()
                   if r["kind"] == "attempt_dispatched"]
        assert [reader.blobs.get(ref) for ref in prompts if ref] == \
            [prompt(r["run_id"]) for r in reader.read_events().to_pylist()
             if r["kind"] == "attempt_dispatched"]
    pdm.vacuum(root.open(), grace=0, force=True)
    log = root.open()
    events = log.read_events()
    assert events.column("lsn").to_pylist() == list(range(1, log.head + 1))
    rows = events.to_pylist()
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r)
    for run, (seq, first, last) in resolved.items():
        assert [(r["lsn"], r["seq"]) for r in by_run[run]] == [(first, seq), (last, seq)]
    for run, rs in by_run.items():  # resolved or not: whole, in one commit, with its body
        assert [r["kind"] for r in rs] == ["run_started", "attempt_dispatched"], run
        assert rs[1]["lsn"] == rs[0]["lsn"] + 1 and rs[0]["seq"] == rs[1]["seq"]
        ref = E.event_from_row(rs[1]).prompt
        assert ref is not None and log.blobs.get(ref) == prompt(run)
    if how in ("blob_staged", "segment_written"):
        assert log.head == 0
    if how == "manifest_published":
        assert log.head_seq == 1 and log.head > 0
    covered = {(b.tenant, b.sha256) for m in log.manifests() for b in m.blobs}
    assert {tuple(f.split("/")[1:4:2]) for f in log.storage.walk_files("blobs")} <= covered
    assert list(log.storage.walk_files("_staging")) == []
    listed = {s.path for m in log.manifests() for s in m.segments}
    assert set(log.storage.walk_files("segments")) == listed


def test_a_body_is_uploaded_once_per_recorder_and_staged_again_when_unknown(
        root: Root) -> None:
    log = root.open()
    with log.transaction() as tx:
        ref = tx.put_blob("acme", b"committed by another writer")
    body = b"first seen by the recorder"
    new = blob_ref("acme", body)
    with log.recorder(max_delay_ms=NEVER) as rec:
        def dispatch(run: str, r: pdm.BlobRef, data: bytes) -> Future[pdm.CommitInfo]:
            return rec.record([E.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=r)],
                              blobs={r: data})

        f1 = [dispatch("a", new, body), dispatch("b", ref, b"committed by another writer")]
        rec.flush()
        f2 = [dispatch("c", new, body)]
    assert [f.result(timeout=0).seq for f in f1 + f2] == [2, 2, 3]
    staged = {m.seq: {b.sha256: b.staged is not None for b in m.blobs}
              for m in log.manifests()}
    # unknown to the recorder: staged (the other writer's body too, without a lookup);
    # committed by its own earlier window: reused, not uploaded again
    assert staged[2] == {new.sha256: True, ref.sha256: True}
    assert staged[3] == {new.sha256: False}
    again = root.open()
    assert again.blobs.get(new) == body
    assert again.blobs.get(ref) == b"committed by another writer"


def test_a_ref_to_a_committed_body_is_checked_without_reading_it(root: Root) -> None:
    """A record pointing at a body committed earlier (not passed again) is checked on the
    producer's thread from the storage's metadata: existence and size, no body read."""
    log = root.open()
    with log.transaction() as tx:
        ref = tx.put_blob("acme", b"a committed prompt")
    with log.recorder(max_delay_ms=NEVER) as rec:
        reads = log.storage.calls["read"]
        ok = rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=ref)])
        assert log.storage.calls["read"] == reads
        wrong = pdm.BlobRef("acme", ref.sha256, ref.size + 1)
        bad = rec.record([E.AttemptDispatched("acme", "w", 0, "s", 0, 1, prompt=wrong)])
    assert ok.result(timeout=0).seq == 2
    with pytest.raises(pdm.ValidationError, match="no committed body of that size"):
        bad.result(timeout=0)


def _durability_calls(monkeypatch: pytest.MonkeyPatch, *,
                      fsync_and_link: bool = False) -> list[str]:
    """The names of the durability calls made from now on, in order: ``syncfs``, the
    unlink of a pack, and with ``fsync_and_link`` each ``fsync`` and ``link``. The real
    calls run: they are only counted. Skips where there is no syncfs (Linux only)."""
    from poimen_data.storage import _local

    if _local._syncfs is None:
        pytest.skip("syncfs(2) is Linux only")
    calls: list[str] = []
    real_fsync, real_link, real_syncfs = os.fsync, os.link, _local._syncfs
    real_unlink = os.unlink

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def link(src: str, dst: str) -> None:
        calls.append("link")
        real_link(src, dst)

    def syncfs(fd: int) -> int:
        calls.append("syncfs")
        return real_syncfs(fd)

    def unlink(path: Any, *a: Any, **kw: Any) -> None:
        if str(path).endswith("bodies.pack"):
            calls.append("unlink pack")
        real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(_local, "_syncfs", syncfs)
    if fsync_and_link:
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "link", link)
    return calls


def test_a_window_is_made_durable_by_one_syncfs_before_its_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On Linux a window's pack of bodies and its segment are written without an fsync
    each and made durable together by one syncfs, before the manifest's link; promotion
    then copies the bodies out of the pack and makes them durable by one more syncfs
    before it removes the pack. Elsewhere (no syncfs) each file is fsynced as it is
    written. The real calls run: they are only counted."""
    from poimen_data.storage import _local

    log = pdm.open_log(str(tmp_path / "log"))
    calls = _durability_calls(monkeypatch, fsync_and_link=True)
    bodies = [f"body {i}".encode() * 100 for i in range(6)]
    with log.recorder(max_delay_ms=NEVER) as rec:
        futs = [rec.record([E.AttemptDispatched("acme", f"r{i}", 0, "s", 0, 1,
                                                prompt=blob_ref("acme", b))],
                           blobs={blob_ref("acme", b): b}) for i, b in enumerate(bodies)]
        rec.flush()
        assert {f.result(timeout=0).seq for f in futs} == {1}
        log.flush()  # the promotion
        # one syncfs for the pack of 6 bodies and the segment, then the manifest: its
        # temp file's fsync, the link, its directory's fsync; then the promotion's, and
        # only then is the pack removed
        assert calls == ["syncfs", "fsync", "link", "fsync", "syncfs", "unlink pack"]
        assert sorted(log.storage.walk_files("_staging")) == []
        assert len(list(log.storage.walk_files("blobs"))) == 6

        monkeypatch.setattr(_local, "_syncfs", None)  # as on a system without syncfs
        assert log.storage.durable_batch() is None
        calls.clear()
        more = [b"other " * 50 + bytes([i]) for i in range(3)]
        futs = [rec.record([E.AttemptDispatched("acme", f"q{i}", 0, "s", 0, 1,
                                                prompt=blob_ref("acme", b))],
                           blobs={blob_ref("acme", b): b}) for i, b in enumerate(more)]
        rec.flush()
        assert {f.result(timeout=0).seq for f in futs} == {2}
        assert calls.count("syncfs") == 0
        assert calls.index("link") == 1 + 1 + 1  # the pack, the segment, the manifest
        log.flush()
        assert calls.count("fsync") == 1 + 1 + 2 + 3  # ... and the 3 bodies copied out
    again = pdm.open_log(str(tmp_path / "log"))
    assert [again.blobs.get(blob_ref("acme", b)) for b in bodies + more] == bodies + more


def test_defer_sync_comes_before_any_staged_file(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    tx = log.transaction()
    tx.put_blob("acme", b"already staged")
    with pytest.raises(pdm.PoimenError, match="before staging"):
        tx.defer_sync()
    tx.abort()
    assert pdm.open_log(str(tmp_path / "log"), durable=False).storage.durable_batch() is None


def test_a_window_stages_its_bodies_as_pieces_of_one_pack(tmp_path: Path) -> None:
    """600 bodies in one window: one staged file, each body a piece of it (at its offset,
    in the order staged), readable from blobs/ after promotion, with the pack gone (the
    crash test reads bodies from a pack that was never promoted)."""
    from poimen_data.log._staged import piece_of

    log = pdm.open_log(str(tmp_path / "log"))
    bodies = [f"body {i} ".encode() * 3 for i in range(600)]
    refs = [blob_ref("acme", b) for b in bodies]
    with log.recorder(max_delay_ms=NEVER) as rec:
        fut = rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, i + 1, prompt=r)
                          for i, r in enumerate(refs)], blobs=dict(zip(refs, bodies, strict=True)))
        rec.flush()
        assert fut.result(timeout=0).seq == 1
    m = log.read_manifest(1)
    pieces = {b.sha256: piece_of(b.staged) for b in m.blobs if b.staged is not None}
    assert len(pieces) == 600 and len({p.file for p in pieces.values() if p}) == 1
    offsets = [0]
    for b in bodies[:-1]:
        offsets.append(offsets[-1] + len(b))
    assert [(pieces[r.sha256].offset, pieces[r.sha256].size) for r in refs] == \
        list(zip(offsets, [len(b) for b in bodies], strict=True))
    log.flush()
    assert list(log.storage.walk_files("_staging")) == []
    again = pdm.open_log(str(tmp_path / "log"))
    assert [again.blobs.get(r) for r in refs] == bodies
    assert again.read_manifest(1).n_events == 600


@pytest.mark.parametrize("budget", ["default", "none"])
def test_promotion_copies_from_the_pack_it_wrote_without_reading_it_back(
        root: Root, budget: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit hands its pack's bytes to its promotion: no read of the pack (a GET on
    S3) and no existence probe before removing it (a HEAD); past the memory bound for
    packs awaiting a background promotion, the pack is read back once."""
    from poimen_data.log import _log

    if budget == "none":
        monkeypatch.setattr(_log, "RETAINED_PACK_BYTES", 0)
    log = root.open()
    reads: list[str] = []
    read_or_none = log.storage.read_or_none

    def counted(rel: str) -> bytes | None:
        reads.append(rel)
        return read_or_none(rel)

    monkeypatch.setattr(log.storage, "read_or_none", counted)
    bodies = [f"prompt {i}".encode() * 50 for i in range(8)]
    refs = [blob_ref("acme", b) for b in bodies]
    probes = log.storage.calls["size"], log.storage.calls["exists"]
    with log.recorder(max_delay_ms=NEVER) as rec:
        futs = [rec.record([E.AttemptDispatched("acme", f"r{i}", 0, "s", 0, 1, prompt=r)],
                           blobs={r: b}) for i, (r, b) in enumerate(zip(refs, bodies,
                                                                      strict=True))]
        rec.flush()
    assert {f.result(timeout=0).seq for f in futs} == {1}
    log.flush()
    read_back = budget == "none" and root.backend != "memory"  # memory:// promotes at once
    assert len([r for r in reads if r.endswith("bodies.pack")]) == read_back
    assert (log.storage.calls["size"], log.storage.calls["exists"]) == probes
    assert list(log.storage.walk_files("_staging")) == []
    again = root.open()
    assert [again.blobs.get(r) for r in refs] == bodies
    assert _log._RETAINED.used == 0  # every promotion gave its pack back


def test_a_body_recorded_again_after_its_reduction_stays_in_its_pack_until_vacuum(
        root: Root) -> None:
    """A body committed again after a reduction stays in staging (promoting it could
    race a reducer), here as a piece of its window's pack: the window's other body is
    copied out, the pack is kept and serves the kept body, and vacuum promotes that body
    and removes the pack; a later reduction removes every copy."""
    from poimen_data.log._staged import piece_of

    log = root.open()
    x_body, y_body = b"body x " * 40, b"body y " * 40
    x = log.blobs.put("acme", x_body)
    pdm.reduce(log, [x], lambda b: b"x'")
    assert log.blobs.get(x) is None
    y = blob_ref("acme", y_body)
    with log.recorder(max_delay_ms=NEVER) as rec:
        fut = rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=x),
                          E.AttemptDispatched("acme", "r", 0, "s", 1, 2, prompt=y)],
                         blobs={x: x_body, y: y_body})
        rec.flush()
    log.flush()
    m = log.read_manifest(fut.result(timeout=0).seq)
    pieces = {b.sha256: piece_of(b.staged or "") for b in m.blobs}
    pack = pieces[x.sha256]
    assert pack is not None and pieces[y.sha256] is not None
    assert pieces[y.sha256].file == pack.file
    assert log.storage.exists(pack.file)  # kept for x
    assert not log.storage.exists(f"blobs/acme/{x.sha256[:2]}/{x.sha256}")
    assert log.storage.exists(f"blobs/acme/{y.sha256[:2]}/{y.sha256}")  # copied out
    assert (log.blobs.get(x), log.blobs.get(y)) == (x_body, y_body)

    rep = pdm.vacuum(log, grace=0)
    assert rep.staging_promoted == 1
    assert list(log.storage.walk_files("_staging")) == []
    fresh = root.open()
    assert (fresh.blobs.get(x), fresh.blobs.get(y)) == (x_body, y_body)
    assert pdm.reduce(fresh, [x], lambda b: b"x''").bytes_freed == x.size
    assert not any(x.sha256 in f for f in fresh.storage.walk_files(""))


def test_reducing_a_body_still_in_its_pack_promotes_the_others_and_removes_the_pack(
        tmp_path: Path) -> None:
    """A body reduced while its window's pack still waits for promotion (the promotion
    thread is held): reduce copies the pack's other body out, removes the pack and counts
    the reduced piece as freed; the writer's own promotion, let go afterwards, copies from
    the pack bytes its commit handed it, loses nothing and brings no copy of x back."""
    import threading

    from poimen_data.storage import PROMOTE_POOL

    log = pdm.open_log(str(tmp_path / "log"))
    x_body, y_body = b"prompt x " * 50, b"prompt y " * 50
    x, y = blob_ref("acme", x_body), blob_ref("acme", y_body)
    gate = threading.Event()
    held = PROMOTE_POOL.submit(gate.wait)  # the one promotion thread waits here
    try:
        with log.recorder(max_delay_ms=NEVER) as rec:
            fut = rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=x),
                              E.AttemptDispatched("acme", "r", 0, "s", 1, 2, prompt=y)],
                             blobs={x: x_body, y: y_body})
            rec.flush()
        pack = f"_staging/{log.read_manifest(fut.result(timeout=0).seq).txn}/bodies.pack"
        assert log.storage.exists(pack)
        assert list(log.storage.walk_files("blobs")) == []  # not promoted yet
        rep = pdm.reduce(log, [x], lambda b: b"x summary")
        assert rep.bytes_freed == x.size
        assert not log.storage.exists(pack)
        assert log.blobs.get(y) == y_body  # copied out to blobs/ by the reduction
    finally:
        gate.set()
        held.result(timeout=60)
    log.flush()  # the writer's promotion: the pack is gone, y is in blobs/ already
    assert log.lost_bodies() == {}
    fresh = pdm.open_log(str(tmp_path / "log"))
    assert (fresh.blobs.get(x), fresh.blobs.get(y)) == (None, y_body)
    assert not any(x.sha256 in f for f in fresh.storage.walk_files(""))


def test_a_pack_takes_small_bodies_up_to_its_cap_and_bigger_ones_stage_alone(
        tmp_path: Path) -> None:
    """Promotion and vacuum read a pack whole, so it holds bodies of at most 64 KiB and
    at most 8 MiB of them; a bigger body, or one past the cap, is a file of its own."""
    from poimen_data.log._staged import piece_of
    from poimen_data.log._txn import PACK_MAX, PACK_PIECE_MAX

    log = pdm.open_log(str(tmp_path / "log"), durable=False)
    big = os.urandom(PACK_PIECE_MAX + 1)
    small = [os.urandom(PACK_PIECE_MAX) for _ in range(PACK_MAX // PACK_PIECE_MAX + 2)]
    bodies = [big, *small]
    refs = [blob_ref("acme", b) for b in bodies]
    with log.recorder(max_delay_ms=NEVER, max_bytes=64 << 20) as rec:
        fut = rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, i + 1, prompt=r)
                          for i, r in enumerate(refs)],
                         blobs=dict(zip(refs, bodies, strict=True)))
        rec.flush()
    m = log.read_manifest(fut.result(timeout=0).seq)
    where = {b.sha256: b.staged for b in m.blobs}
    packed = [r for r in refs if piece_of(where[r.sha256] or "") is not None]
    assert refs[0] not in packed  # the big one
    assert packed == refs[1:1 + PACK_MAX // PACK_PIECE_MAX]  # small ones, up to the cap
    log.flush()
    assert [pdm.open_log(str(tmp_path / "log")).blobs.get(r) for r in refs] == bodies


def test_vacuum_makes_copies_durable_before_it_removes_a_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Vacuum may find a pack's bodies already in blobs/, copied there by their writer
    but not yet synced: it syncs the file system before it unlinks the pack."""
    log = pdm.open_log(str(tmp_path / "log"))
    x_body, y_body = b"body x " * 40, b"body y " * 40
    x = log.blobs.put("acme", x_body)
    pdm.reduce(log, [x], lambda b: b"x'")
    y = blob_ref("acme", y_body)
    with log.recorder(max_delay_ms=NEVER) as rec:  # x recommitted: its pack is kept
        rec.record([E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=x),
                    E.AttemptDispatched("acme", "r", 0, "s", 1, 2, prompt=y)],
                   blobs={x: x_body, y: y_body})
    log.flush()
    calls = _durability_calls(monkeypatch)
    assert pdm.vacuum(log, grace=0).staging_promoted == 1
    assert "unlink pack" in calls
    assert "syncfs" in calls[:calls.index("unlink pack")]


def test_windows_commit_on_while_the_checkpoint_owed_waits_for_promotions(
        tmp_path: Path) -> None:
    """The commit at a checkpoint seq owes a checkpoint, which waits for the promotions of
    the commits it covers; neither the window's producers nor the next window wait with
    it: the futures resolve at the publish, and the committer publishes on (here the
    promotion thread is held). The checkpoint is then written at the owing seq, behind
    the head, with exactly the bytes a log that ended there writes; ``flush`` waits for
    it."""
    import shutil

    from poimen_data.log._manifest import POINTER, checkpoint_path, manifest_path

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    # the third window commits while seq 2's checkpoint waits
    rec, gate, held, bodies = _held_recorder_windows(log, 3)
    try:
        assert log.storage.read_or_none(POINTER) is None
    finally:
        gate.set()
        held.result(timeout=60)
    rec.flush()
    assert json.loads(log.storage.read(POINTER))["seq"] == 2
    assert log.head_seq == 3
    rec.close()
    ck = checkpoint_path(2)
    [seg] = [e["path"] for e in json.loads(log.storage.read(ck))["segment_lists"]]
    # the same log, ended at seq 2: its checkpoint there, written at the head
    shutil.copytree(tmp_path / "log", tmp_path / "ended")
    ended = pdm.open_log(str(tmp_path / "ended"))
    for name in (POINTER, ck, seg, manifest_path(3)):
        ended.storage.delete(name)
    ended = pdm.open_log(str(tmp_path / "ended"))
    assert ended.head_seq == 2 and ended.write_checkpoint() == 2
    assert [ended.storage.read(f) for f in (ck, seg)] == [log.storage.read(f)
                                                           for f in (ck, seg)]
    again = pdm.open_log(str(tmp_path / "log"))
    assert again.head_seq == 3 and again.read_events().num_rows == 3
    assert [again.blobs.get(blob_ref("acme", b)) for b in bodies] == bodies


def test_a_checkpoint_writes_its_files_while_this_process_commits_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's files are made durable without the log's lock: while the one seq 2
    owes is held in the put of its file, the recorder's next window publishes (seq 3),
    and a checkpoint at the head written meanwhile by another thread stays the log's:
    the held one, let go, moves neither the pointer nor this log's checkpoint back."""
    from poimen_data.log._manifest import POINTER, checkpoint_path

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    entered, gate = threading.Event(), threading.Event()
    put = log.storage.put_if_absent

    def held_put(rel: str, data: bytes) -> bool:
        if rel == checkpoint_path(2):
            entered.set()
            assert gate.wait(timeout=120)
        return put(rel, data)

    monkeypatch.setattr(log.storage, "put_if_absent", held_put)
    rec = log.recorder(max_delay_ms=0)
    bodies = [f"prompt {i} ".encode() * 30 for i in range(3)]
    try:
        for i, body in enumerate(bodies[:2]):
            ref = blob_ref("acme", body)
            ev = E.AttemptDispatched("acme", f"c{i}", 0, "s", 0, 1, prompt=ref)
            assert rec.record([ev], blobs={ref: body}).result(timeout=60).seq == i + 1
        assert entered.wait(timeout=60)  # seq 2's checkpoint, in the put of its file
        ref = blob_ref("acme", bodies[2])
        ev = E.AttemptDispatched("acme", "c2", 0, "s", 0, 1, prompt=ref)
        assert rec.record([ev], blobs={ref: bodies[2]}).result(timeout=60).seq == 3
        assert log.write_checkpoint() == 3  # at the head, from this thread
        assert json.loads(log.storage.read(POINTER))["seq"] == 3
    finally:
        gate.set()
        rec.close()  # waits for the held checkpoint
    assert log.storage.exists(checkpoint_path(2))
    assert json.loads(log.storage.read(POINTER))["seq"] == 3
    assert log._state.checkpoint_seq == 3 and log._state.manifests_since_checkpoint == []
    again = pdm.open_log(str(tmp_path / "log"))
    assert again.head_seq == 3 and again.read_events().num_rows == 3
    assert [again.blobs.get(blob_ref("acme", b)) for b in bodies] == bodies


class _WatchedLock:
    """A lock that sets ``waiting`` when an acquire finds it held, before it blocks."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock, self._waiting = threading.Lock(), waiting

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._waiting.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_two_checkpoints_of_one_process_never_move_the_pointer_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint behind the head (seq 2) has read the pointer and is about to write it
    when another thread of the same process writes one at the head (seq 3): the pointer
    ends at 3, as a fresh open finds it."""
    from poimen_data.log._log import commit_events
    from poimen_data.log._manifest import POINTER

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=1000)
    for i in range(2):
        commit_events(log, [E.AttemptDispatched("acme", f"c{i}", 0, "s", 0, 1)])
    held, go, progress = threading.Event(), threading.Event(), threading.Event()
    read, reads = log._pointer_seq, []

    def pointer_seq() -> int:
        seq = read()
        if threading.current_thread() is behind:
            reads.append(seq)
            if len(reads) == 2:  # its read just before its write
                held.set()
                assert go.wait(timeout=60)
        return seq

    def at_head() -> None:
        assert log.write_checkpoint() == 3
        progress.set()  # done (the code before: it passed the held one)

    monkeypatch.setattr(log, "_pointer_seq", pointer_seq)
    monkeypatch.setattr(log, "_pointer_lock", _WatchedLock(progress))  # ... or waiting
    written = []
    behind = threading.Thread(target=lambda: written.append(log.write_checkpoint(upto=2)))
    behind.start()
    try:
        assert held.wait(timeout=60)
        commit_events(log, [E.AttemptDispatched("acme", "c2", 0, "s", 0, 1)])  # seq 3
        head = threading.Thread(target=at_head)
        head.start()
        assert progress.wait(timeout=60)
    finally:
        go.set()
    behind.join()
    head.join()
    assert reads == [0, 0] and written == [2]  # its files written, its pointer passed
    assert json.loads(log.storage.read(POINTER))["seq"] == 3
    assert pdm.open_log(str(tmp_path / "log"))._state.checkpoint_seq == 3


def test_close_after_a_stop_waits_for_the_checkpoint_owed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorder whose threads stopped (its gatherer could not open a window) still has
    the checkpoint seq 2 owed being written on its own thread: ``close`` waits for it."""
    from poimen_data.log._manifest import POINTER, checkpoint_path

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    joining = threading.Event()  # someone waits for the checkpoint
    join, put = Recorder._join_checkpoint, log.storage.put_if_absent

    def watched_join(self: Recorder) -> None:
        joining.set()
        join(self)

    def held_put(rel: str, data: bytes) -> bool:
        if rel == checkpoint_path(2):
            assert joining.wait(timeout=60)
        return put(rel, data)

    monkeypatch.setattr(Recorder, "_join_checkpoint", watched_join)
    monkeypatch.setattr(log.storage, "put_if_absent", held_put)
    rec = log.recorder(max_delay_ms=0)
    _body_windows(rec, 2, "w")

    def broken() -> Any:
        raise RuntimeError("no transaction")

    monkeypatch.setattr(log, "transaction", broken)  # the gatherer stops the recorder
    ev = E.AttemptDispatched("acme", "stopped", 0, "s", 0, 1)
    with pytest.raises(RuntimeError, match="no transaction"):
        rec.record([ev]).result(timeout=60)
    rec._gatherer.join()
    rec._committer.join()
    rec.close()
    assert json.loads(log.storage.read(POINTER))["seq"] == 2
    assert log.storage.exists(checkpoint_path(2))


def test_the_checkpoint_owed_is_written_inline_when_no_thread_can_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At interpreter exit (Python 3.12 on) no thread starts: the committer then writes the
    checkpoint its commit owed itself, and commits on."""
    from poimen_data.log._manifest import POINTER

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    rec = log.recorder(max_delay_ms=0)  # its own threads started
    start = threading.Thread.start
    refused = []

    def no_new_thread(self: threading.Thread) -> None:
        if self.name == "poimen-recorder-checkpoint":
            refused.append(self.name)
            raise RuntimeError("can't create new thread at interpreter shutdown")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", no_new_thread)
    bodies = _body_windows(rec, 2, "w")
    ev = E.AttemptDispatched("acme", "third", 0, "s", 0, 1)
    assert rec.record([ev]).result(timeout=60).seq == 3
    rec.close()
    assert refused == ["poimen-recorder-checkpoint"]
    assert json.loads(log.storage.read(POINTER))["seq"] == 2
    again = pdm.open_log(str(tmp_path / "log"))
    assert again.head_seq == 3 and again.read_events().num_rows == 3
    assert [again.blobs.get(blob_ref("acme", b)) for b in bodies] == bodies


def test_a_checkpoint_behind_the_head_skips_what_a_later_commit_reduced(
        tmp_path: Path) -> None:
    """A checkpoint at a seq behind the head is the head's state with the later commits
    left out. Another process's reduction after that seq cannot be left out that way (the
    state keeps only a body's latest reduction): no checkpoint is written there, and the
    head's can be."""
    from poimen_data.log._manifest import POINTER, checkpoint_path

    a = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=1000)
    bodies = [f"prompt {i} ".encode() * 30 for i in range(4)]
    refs = []
    for i, body in enumerate(bodies):
        with a.transaction() as tx:
            refs.append(tx.put_blob("acme", body))
            tx.append(E.AttemptDispatched("acme", f"r{i}", 0, "s", 0, 1, prompt=refs[-1]))
    assert a.write_checkpoint(upto=2) == 2  # behind the head (4)
    b = pdm.open_log(str(tmp_path / "log"))  # the other process: reduces (seq 5)
    assert len(pdm.reduce(b, [refs[0]], lambda body: b"summary").reduced) == 1
    assert a.write_checkpoint(upto=3) == 0
    assert not a.storage.exists(checkpoint_path(3))
    assert json.loads(a.storage.read(POINTER))["seq"] == 2
    assert a.write_checkpoint() == 5
    again = pdm.open_log(str(tmp_path / "log"))
    assert again.blobs.get(refs[0]) is None and again.blobs.get(refs[3]) == bodies[3]


_DEAD_WRITER = """
import hashlib, json, os, sys
import poimen_data as pdm
from poimen_data import events as E
so = os.environ.get("POIMEN_TEST_STORAGE_OPTIONS")
log = pdm.open_log(sys.argv[1], storage_options=json.loads(so) if so else None)
how = sys.argv[2]  # "pack": its bodies in one pack, as a recorder's; "files": a file each
bodies = [b"a body lost with its %s %d " % (how.encode(), i) * 40 for i in range(3)]
bodies.append(b"body 0-0 " * 100)  # committed by another writer: in blobs/ already
with log.transaction() as tx:
    tx.pack_bodies = how == "pack"
    # staged without a look for a committed copy, as a recorder stages a body it has not
    # committed itself
    refs = [tx.put_checked("acme", hashlib.sha256(b).hexdigest(), b, reuse=False)
            for b in bodies]
    tx.extend([E.AttemptDispatched("acme", how, 0, "s", 0, i + 1, prompt=r)
               for i, r in enumerate(refs)])
"""


def _body_windows(rec: Recorder, n: int, run: str) -> list[bytes]:
    """Seq 1 to ``n`` committed by ``rec`` (a fresh log's), a window of one body each;
    returns the bodies."""
    bodies = [f"{run} prompt {i} ".encode() * 30 for i in range(n)]
    for i, body in enumerate(bodies):
        ref = blob_ref("acme", body)
        ev = E.AttemptDispatched("acme", f"{run}{i}", 0, "s", 0, 1, prompt=ref)
        assert rec.record([ev], blobs={ref: body}).result(timeout=60).seq == i + 1
    return bodies


def _held_recorder_windows(log: Any, n: int
                           ) -> tuple[Recorder, threading.Event, Future[Any], list[bytes]]:
    """A recorder of ``log`` that has committed ``n`` one-body windows (seq 1 to n) with
    the promotion thread held (so the checkpoint a window owes waits), and their bodies;
    the caller sets the gate, then waits for the held task (set here if a window fails)."""
    from poimen_data.storage import PROMOTE_POOL

    assert PROMOTE_POOL.workers == 1  # promotions queue behind the held task, in order
    gate = threading.Event()
    held = PROMOTE_POOL.submit(gate.wait)
    rec = log.recorder(max_delay_ms=0)
    try:
        bodies = _body_windows(rec, n, "held")
    except BaseException:
        gate.set()  # the pool is this worker's: never leave it held
        raise
    return rec, gate, held, bodies


def test_a_recorder_reads_the_checkpoints_segment_list_before_anyone_records(
        tmp_path: Path) -> None:
    """Opening leaves a checkpoint's segment list unread; the checkpoints a recorder owes
    need it, so the recorder reads it as it is made, not while producers wait."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for i in range(3):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    again = pdm.open_log(str(tmp_path / "log"))
    assert again._state.checkpoint_seq == 2 and again._state._loader is not None
    with again.recorder() as rec:
        assert again._state._loader is None
        assert [s.first_lsn for s in again._state.segments.values()] == [1, 2, 3]
        assert rec.record([E.RunStarted("acme", "r3", "wf")]).result(timeout=60).seq == 4
    assert pdm.open_log(str(tmp_path / "log")).read_events().num_rows == 4


def test_the_committer_never_waits_for_a_checkpoint_and_the_newest_owed_follows(
        tmp_path: Path) -> None:
    """While seq 2's checkpoint waits for the held promotions, seqs 4 and 6 owe theirs:
    the committer does not wait (windows 3 to 7 commit), and once the first is written
    its thread writes the newest owed, at 6, passing 4 over."""
    from poimen_data.log._manifest import POINTER, checkpoint_path

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    rec, gate, held, bodies = _held_recorder_windows(log, 7)
    try:
        assert log.head_seq == 7 and log.storage.read_or_none(POINTER) is None
    finally:
        gate.set()
        held.result(timeout=60)
    rec.flush()  # waits for both
    assert json.loads(log.storage.read(POINTER))["seq"] == 6
    assert [log.storage.exists(checkpoint_path(s)) for s in (2, 4, 6)] == [True, False, True]
    rec.close()
    again = pdm.open_log(str(tmp_path / "log"))
    assert (again._state.checkpoint_seq, again.head_seq) == (6, 7)
    assert again.read_events().num_rows == 7
    assert [again.blobs.get(blob_ref("acme", b)) for b in bodies] == bodies


def _held_checkpoints(log: Any) -> tuple[Callable[[int], threading.Event],
                                         Callable[[int], threading.Event]]:
    """``write_checkpoint(upto=n)`` of ``log`` sets ``entered(n)``, then waits for
    ``released(n)``."""
    events: dict[tuple[str, int], threading.Event] = {}
    lock = threading.Lock()
    write = log.write_checkpoint

    def event(kind: str, n: int) -> threading.Event:
        with lock:
            return events.setdefault((kind, n), threading.Event())

    def held(*args: Any, upto: int | None = None, **kw: Any) -> int:
        assert upto is not None
        event("entered", upto).set()
        assert event("released", upto).wait(timeout=120)
        return int(write(*args, upto=upto, **kw))

    log.write_checkpoint = held
    return (lambda n: event("entered", n)), (lambda n: event("released", n))


def _one(rec: Recorder, i: int) -> int | None:
    return rec.record([E.RunStarted("acme", f"r{i}", "wf")]).result(timeout=60).seq


def test_flush_waits_for_the_checkpoints_owed_before_it_not_after(tmp_path: Path) -> None:
    """Recording on end, each checkpoint is followed by a newer one owed: ``flush`` waits
    for those its records' commits owed (4 here, written after 2), not for 6, owed by a
    window committed after it began (a review's find: it waited for the checkpoint
    thread to run out of work, which a busy recorder never lets it)."""
    from poimen_data.log._manifest import POINTER

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    entered, released = _held_checkpoints(log)
    rec = log.recorder(max_delay_ms=0)
    try:
        assert [_one(rec, i) for i in range(2)] == [1, 2]
        assert entered(2).wait(timeout=60)  # seq 2's, being written
        assert [_one(rec, i) for i in range(2, 5)] == [3, 4, 5]  # 4 owed
        joining, flushed = threading.Event(), threading.Event()
        join = rec._join_checkpoint

        def watched_join() -> None:
            joining.set()
            join()

        rec._join_checkpoint = watched_join  # type: ignore[method-assign]
        flusher = threading.Thread(target=lambda: (rec.flush(), flushed.set()))
        flusher.start()
        assert joining.wait(timeout=60)  # its records resolved; it waits for 4's
        released(2).set()
        assert entered(4).wait(timeout=60)
        assert [_one(rec, i) for i in range(5, 7)] == [6, 7]  # after it began: 6 owed
        released(4).set()
        assert entered(6).wait(timeout=60)  # 4 written; the thread goes on to 6
        assert json.loads(log.storage.read(POINTER))["seq"] == 4
        assert flushed.wait(timeout=60)  # not waiting for 6
        flusher.join(timeout=60)
    finally:
        for n in (2, 4, 6, 8):
            released(n).set()
        rec.close()
    assert json.loads(log.storage.read(POINTER))["seq"] == 6


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_checkpoints_go_on_after_one_raised_what_no_checkpoint_catches(
        tmp_path: Path) -> None:
    """A ``BaseException`` out of a checkpoint (not an ``Exception``, which is logged)
    ends its thread; the next checkpoint owed starts a new one, and flush does not wait
    for the dead one."""
    from poimen_data.log._manifest import POINTER

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    write = log.write_checkpoint
    asked: list[int] = []

    class Stop(BaseException):
        pass

    def failing(*args: Any, upto: int | None = None, **kw: Any) -> int:
        assert upto is not None
        asked.append(upto)
        if upto == 2:
            raise Stop
        return int(write(*args, upto=upto, **kw))

    log.write_checkpoint = failing  # type: ignore[method-assign]
    rec = log.recorder(max_delay_ms=0)
    assert [_one(rec, i) for i in range(6)] == [1, 2, 3, 4, 5, 6]
    ender = threading.Thread(target=lambda: (rec.flush(), rec.close()), daemon=True)
    ender.start()
    ender.join(timeout=60)
    assert not ender.is_alive()  # neither waits for the thread that died
    assert asked[0] == 2 and asked[-1] == 6 and set(asked) <= {2, 4, 6}
    assert json.loads(log.storage.read(POINTER))["seq"] == 6


def test_a_recorder_starts_when_the_checkpoints_segment_list_cannot_be_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the list as the recorder is made is housekeeping: storage failing there
    is logged, and the list is read when first needed, as before."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for i in range(3):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    again = pdm.open_log(str(tmp_path / "log"))
    read = again.storage.read_or_none
    failing = [True]

    def flaky(rel: str) -> bytes | None:
        if ".checkpoint.segments." in rel and failing[0]:
            raise OSError("storage said no")
        return read(rel)

    monkeypatch.setattr(again.storage, "read_or_none", flaky)
    with again.recorder(max_delay_ms=0) as rec:
        assert again._state._loader is not None  # not read: later
        failing[0] = False
        assert rec.record([E.RunStarted("acme", "r3", "wf")]).result(timeout=60).seq == 4
        rec.flush()
    assert again._state._loader is None
    assert [s.first_lsn for s in again.segments()] == [1, 2, 3, 4]


def test_a_checkpoint_behind_the_head_leaves_later_commits_for_the_next(
        proc_root: Root) -> None:
    """After a checkpoint behind the head, the commits after it are still looked at: a
    writer killed after its publish (seq 3, its pack in staging, never promoted) is
    promoted by the next checkpoint, and a reader opening from that one finds its bodies."""
    from poimen_data.log._manifest import POINTER

    log = proc_root.open(checkpoint_interval=2)
    rec, gate, held, _ = _held_recorder_windows(log, 2)  # seq 2 owes a checkpoint
    try:
        dead = subprocess.run([sys.executable, "-c", _DEAD_WRITER, proc_root.url, "pack"],
                              env=_env(proc_root, "manifest_published"),
                              capture_output=True, timeout=120)
        assert dead.returncode == 137, dead.stderr.decode()[-2000:]
    finally:
        gate.set()
        held.result(timeout=60)
    rec.flush()
    assert json.loads(log.storage.read(POINTER))["seq"] == 2 and log.head_seq == 3
    body = b"after the checkpoint " * 30
    ref = blob_ref("acme", body)
    ev = E.AttemptDispatched("acme", "after", 0, "s", 0, 1, prompt=ref)
    assert rec.record([ev], blobs={ref: body}).result(timeout=60).seq == 4
    rec.close()  # seq 4's checkpoint written: it covers the dead writer's seq 3
    assert json.loads(log.storage.read(POINTER))["seq"] == 4
    assert list(log.storage.walk_files("_staging")) == []
    reader = proc_root.open(read_only=True)
    dead_refs = [E.event_from_row(r).prompt for r in reader.read_events().to_pylist()
                 if r["run_id"] == "pack"]
    assert len(dead_refs) == 4
    assert [reader.blobs.get(r) for r in dead_refs] == \
        [b"a body lost with its pack %d " % i * 40 for i in range(3)] + [b"body 0-0 " * 100]


def test_a_checkpoint_behind_the_head_never_moves_the_pointer_back(
        proc_root: Root) -> None:
    """A recorder's checkpoint owed at seq 2 waits for promotions while another writer
    commits on and checkpoints at seq 4: the pointer stays at 4, and none is written at 2."""
    from poimen_data.log._manifest import POINTER, checkpoint_path

    a = proc_root.open(checkpoint_interval=2)
    b = proc_root.open()  # another writer, with a state of its own
    rec, gate, held, _ = _held_recorder_windows(a, 2)
    try:
        for i in range(2):  # seq 3 and 4 (no body: nothing to promote); 4 checkpoints
            with b.transaction() as tx:
                tx.append(E.AttemptDispatched("acme", f"b{i}", 0, "s", 0, 1))
        assert json.loads(a.storage.read(POINTER))["seq"] == 4
    finally:
        gate.set()
        held.result(timeout=60)
    rec.close()
    assert json.loads(a.storage.read(POINTER))["seq"] == 4
    assert not a.storage.exists(checkpoint_path(2))
    with pytest.raises(pdm.ValidationError, match="upto must be a committed seq"):
        a.write_checkpoint(upto=5)
    assert json.loads(a.storage.read(POINTER))["seq"] == 4


def test_a_pointer_past_every_commit_is_replaced_by_the_next_checkpoint(
        tmp_path: Path) -> None:
    """A checkpoint does not move the pointer back past another writer's, but a pointer
    past every commit (a root restored from an older copy, or edited) names no state: the
    next checkpoint replaces it, and opening reads that one."""
    from poimen_data.log._manifest import POINTER, dumps, loads

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=1000)
    for i in range(3):
        with log.transaction() as tx:
            tx.append(E.AttemptDispatched("acme", f"r{i}", 0, "s", 0, 1))
        if i == 1:
            assert log.write_checkpoint() == 2
            doc = loads(log.storage.read(POINTER), POINTER)  # intact, with its checksum
            log.storage.write(POINTER, dumps({**doc, "seq": 500}))
    assert log.write_checkpoint() == 3
    assert json.loads(log.storage.read(POINTER))["seq"] == 3
    again = pdm.open_log(str(tmp_path / "log"))
    assert again._state.checkpoint_seq == 3 and again.read_events().num_rows == 3


_CLOSED_IN_A_CALLBACK = """
import sys, threading
import poimen_data as pdm
from poimen_data import events as E
log = pdm.open_log(sys.argv[1])
# a window per record, each closed by the next record (or by close): none commits alone
rec = log.recorder(max_delay_ms=600_000, max_events=1, max_pending_events=100)
handed, closed = threading.Event(), threading.Event()
def close_it(fut):  # on the committer: once the others are handed over, close
    handed.wait()
    rec.close()
    closed.set()
first = rec.record([E.AttemptDispatched("acme", "r0", 0, "s", 0, 1)])
first.add_done_callback(close_it)  # before r1 is handed over: r0 is not committed yet
for i in range(1, 6):
    rec.record([E.AttemptDispatched("acme", f"r{i}", 0, "s", 0, 1)])
handed.set()
closed.wait()
print("exiting", flush=True)  # records 1 to 5 handed over, most not committed yet
"""


def test_a_recorder_closed_from_a_done_callback_is_still_drained_at_exit(
        tmp_path: Path) -> None:
    """``close`` from a done-callback cannot wait (it runs on the committer): the records
    handed over before it are committed by the recorder's threads, and at interpreter exit
    the recorder is drained like one left open, not dropped with them unresolved."""
    root = tmp_path / "log"
    pdm.open_log(str(root))
    out = subprocess.run([sys.executable, "-c", _CLOSED_IN_A_CALLBACK, str(root)],
                         capture_output=True, timeout=120)
    assert out.returncode == 0 and out.stdout == b"exiting\n", out.stderr.decode()[-2000:]
    log = pdm.open_log(str(root))
    assert sorted(log.read_events().column("run_id").to_pylist()) == \
        [f"r{i}" for i in range(6)]


def _windows(log: Any, first: int, n: int) -> None:
    """``n`` recorder windows of 5 bodies each, from ``log``, promoted by their writer, each
    before the next is published: so each announces the one before it as promoted
    (``Manifest.promoted``), and only the last is left for another writer's checkpoint to
    look at."""
    with log.recorder(max_delay_ms=NEVER) as rec:
        for w in range(first, first + n):
            futs = []
            for i in range(5):
                body = f"body {w}-{i} ".encode() * 100
                ref = rec.ref("acme", body)
                futs.append(rec.record([E.AttemptDispatched("acme", f"b{w}", 0, "s", 0, i + 1,
                                                            prompt=ref)], blobs={ref: body}))
            rec.flush()
            assert len({f.result(timeout=0).seq for f in futs}) == 1
            log.flush()  # its own writer promoted every body: the pack is gone


def _looks_off_the_lock(log: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count ``log``'s looks at and reads of staged files and bodies, by kind and top
    folder; fail any made under the log's lock."""
    looked: list[str] = []
    for name in ("exists", "read_or_none", "read", "read_range"):
        orig = getattr(log.storage, name)

        def counted(rel: str, *args: Any, _orig: Any = orig, _name: str = name,
                    **kw: Any) -> Any:
            if not rel.startswith("_log/"):
                assert not log._lock._is_owned(), f"{_name} {rel} under the log's lock"
                looked.append(f"{_name} {rel.split('/')[0]}")
            return _orig(rel, *args, **kw)

        monkeypatch.setattr(log.storage, name, counted)
    return looked


def test_a_checkpoint_looks_once_for_each_staged_file_of_other_writers(
        proc_root: Root, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint drops the staging locations of the commits it covers, so it promotes
    other processes' commits too; their writers promoted nearly all of them already. It
    looks for each of their staged files once, off the log's lock, and for the bodies of
    the gone ones in blobs/, each body once, with no read of a gone file and no refresh per
    body (which took a checkpoint of a busy S3 log 11 to 15 s, under the log's lock).
    Staged files removed before their promotion (writers killed after their publish, a
    pack and a file per body then deleted by hand) have every body that is not in blobs/
    recorded lost, whichever of a file's bodies another commit put there."""
    from poimen_data.log._staged import staged_file

    a = proc_root.open()
    b = proc_root.open()  # another writer, with a state of its own
    _windows(b, 0, 3)
    assert list(b.storage.walk_files("_staging")) == []
    dead_ms = []
    for seq, how, n_files in ((4, "pack", 1), (5, "files", 4)):
        # each removed before the next writer opens the log (and would roll it forward)
        dead = subprocess.run([sys.executable, "-c", _DEAD_WRITER, proc_root.url, how],
                              env=_env(proc_root, "manifest_published"),
                              capture_output=True, timeout=120)
        assert dead.returncode == 137, dead.stderr.decode()[-2000:]
        m = a.read_manifest(seq)
        files = {staged_file(x.staged) for x in m.blobs if x.staged}
        assert len(files) == n_files and len(m.blobs) == 4
        assert all(a.storage.delete(f) for f in files)
        dead_ms.append(m)
    looked = _looks_off_the_lock(a, monkeypatch)
    assert a.write_checkpoint(seq=3) == 0 and looked == []  # not the head: nothing done
    assert a.write_checkpoint() == 5
    # b's last pack (seqs 1 and 2 announced promoted by 2 and 3), the dead writers' pack and
    # 4 files: looked for, all gone, none read; then each body once in blobs/: b's last 5
    # and the 4 + 4 of the dead writers, the shared one (b's seq 1) once
    assert sorted(looked) == ["exists _staging"] * 6 + ["exists blobs"] * 12
    shared = hashlib.sha256(b"body 0-0 " * 100).hexdigest()
    lost = {(x.tenant, x.sha256): m.seq for m in dead_ms for x in m.blobs
            if x.sha256 != shared}
    assert len(lost) == 6 and set(lost.values()) == {4, 5}
    assert a.lost_bodies() == lost
    again = proc_root.open()  # the checkpoint carries them
    assert again.lost_bodies() == lost and again.head_seq == 5
    ref = E.event_from_row(again.read_events().to_pylist()[0]).prompt
    assert ref is not None and again.blobs.get(ref) == b"body 0-0 " * 100


def test_a_checkpoint_does_not_look_at_commits_their_writer_announced_promoted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer announces, in its next manifest (``promoted``), each of its commits it
    promoted whole, and another process's checkpoint does not look at those (at N = 8 on S3
    the looks were 2 of the 5.4 requests a record cost). A promotion that finds a body gone
    from staging announces nothing: the checkpoint then looks for itself, and records the
    body lost. Manifests with nothing to announce carry no ``promoted`` key."""
    from poimen_data.log._staged import staged_file

    root = str(tmp_path / "log")
    a, b = pdm.open_log(root), pdm.open_log(root)
    _windows(b, 0, 3)  # seqs 1 to 3
    promote = b._promote

    def pack_gone_first(m: Any, written: Any = None, **kw: Any) -> Any:
        """Seq 4's pack removed (as by hand) before its promotion, its bytes not kept."""
        if m.seq == 4:
            assert all(b.storage.delete(f) for f in {staged_file(x.staged) for x in m.blobs})
            written = None
        return promote(m, written, **kw)

    monkeypatch.setattr(b, "_promote", pack_gone_first)
    _windows(b, 3, 3)  # seqs 4 (its promotion finds the pack gone) to 6
    raw = [b.storage.read(f"_log/{s:020d}.json") for s in range(1, 7)]
    assert [b.read_manifest(s).promoted for s in range(1, 7)] == \
        [(), (1,), (2,), (3,), (), (5,)]
    assert [b'"promoted"' in r for r in raw] == [False, True, True, True, False, True]
    lost = {(x.tenant, x.sha256): 4 for x in b.read_manifest(4).blobs}
    assert b.lost_bodies() == lost  # its writer found them lost, and announced nothing
    looked = _looks_off_the_lock(a, monkeypatch)
    assert a.write_checkpoint() == 6
    # seq 4 (not announced) and seq 6 (the last): their packs, then their 5 + 5 bodies
    assert sorted(looked) == ["exists _staging"] * 2 + ["exists blobs"] * 10
    assert a.lost_bodies() == lost and pdm.open_log(root).lost_bodies() == lost


def test_a_promotion_that_failed_is_not_announced(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A promotion that raised (its bodies' writes to blobs/ failed) announces nothing: its
    commit is looked at, and promoted, by another writer's checkpoint, and every body reads
    back after a reopen."""
    from poimen_data.log._staged import staged_file

    root = str(tmp_path / "log")
    a, b = pdm.open_log(root), pdm.open_log(root)
    copy_out = b._copy_out

    def failing_once(pieces: list[tuple[str, bytes]]) -> None:
        if not failing_once.failed:  # type: ignore[attr-defined]
            failing_once.failed = True  # type: ignore[attr-defined]
            raise OSError(28, "No space left on device")
        copy_out(pieces)

    failing_once.failed = False  # type: ignore[attr-defined]
    monkeypatch.setattr(b, "_copy_out", failing_once)
    with pytest.raises(pdm.StorageError, match="promoting committed bodies failed"):
        _windows(b, 0, 1)  # seq 1: its promotion fails (its flush raises it)
    _windows(b, 1, 2)  # seqs 2 and 3, promoted whole
    assert [b.read_manifest(s).promoted for s in (1, 2, 3)] == [(), (), (2,)]
    m1 = b.read_manifest(1)
    assert all(b.storage.exists(staged_file(x.staged)) for x in m1.blobs)  # still staged
    looked = _looks_off_the_lock(a, monkeypatch)
    assert a.write_checkpoint() == 3
    # seqs 1 (its pack there: read and promoted here, none of its bodies looked for) and 3
    # (gone: its 5 bodies looked for)
    assert sorted(x for x in looked if x.startswith("exists")) == \
        ["exists _staging"] * 2 + ["exists blobs"] * 5
    assert {x for x in looked if not x.startswith("exists")} <= {"read _staging",
                                                                  "read_or_none _staging"}
    again = pdm.open_log(root)
    assert again.lost_bodies() == {}
    for x in m1.blobs:
        assert again.blobs.get(E.BlobRef(x.tenant, x.sha256, x.size)) == \
            b.storage.read(f"blobs/{x.tenant}/{x.sha256[:2]}/{x.sha256}")
    assert not any(b.storage.exists(staged_file(x.staged)) for x in m1.blobs)


def test_commits_landing_during_a_checkpoint_are_promoted_off_the_lock_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commits another writer makes while a checkpoint looks for the staged files it knew
    of are taken by its next pass, still off the log's lock: on a busy S3 log they were
    promoted under it, a read, a refresh and a look per body, for 13 s in one bench run."""
    root = str(tmp_path / "log")
    a, b = pdm.open_log(root), pdm.open_log(root)
    _windows(b, 0, 3)
    there = a._there
    passes: list[int] = []

    def busy(paths: list[str]) -> list[bool]:
        passes.append(len(paths))
        if len(passes) == 1:
            _windows(b, 3, 5)  # others commit meanwhile, once
        return there(paths)

    monkeypatch.setattr(a, "_there", busy)
    looked = _looks_off_the_lock(a, monkeypatch)
    assert a.write_checkpoint() == 8
    # the first pass's pack (seq 3: 1 and 2 announced) and its 5 bodies, then, of the 5
    # commits that landed meanwhile (announcing 3 to 7), the last's pack and 5 bodies
    assert passes == [1, 5, 1, 5]
    assert sorted(looked) == ["exists _staging"] * 2 + ["exists blobs"] * 10
    assert a.lost_bodies() == {} and pdm.open_log(root).head_seq == 8


def test_a_commit_landing_during_a_checkpoints_last_pass_is_promoted_under_its_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commits still landing after the last pass off the lock are promoted under it before
    the checkpoint is written: a checkpoint drops the staging locations of what it covers,
    so a body left in staging then would be unreadable."""
    root = str(tmp_path / "log")
    a, b = pdm.open_log(root), pdm.open_log(root)
    _windows(b, 0, 1)
    there = a._there
    staged_passes: list[list[str]] = []

    def busy(paths: list[str]) -> list[bool]:
        if paths[0].startswith("_staging/"):
            staged_passes.append(paths)
            if len(staged_passes) < 3:
                _windows(b, len(staged_passes), 1)
            elif len(staged_passes) == 3:  # during the last pass: a writer killed after
                # its publish
                dead = subprocess.run([sys.executable, "-c", _DEAD_WRITER, root, "pack"],
                                      env=_env(Root(root, None, "local"), "manifest_published"),
                                      capture_output=True, timeout=120)
                assert dead.returncode == 137, dead.stderr.decode()[-2000:]
        return there(paths)

    monkeypatch.setattr(a, "_there", busy)
    assert a.write_checkpoint() == 4
    # three passes off the lock, each over the window that landed during the last; then
    # the dead writer's pack, under the lock
    assert [len(p) for p in staged_passes] == [1, 1, 1, 1]
    assert list(a.storage.walk_files("_staging")) == []  # its pack promoted, then removed
    again = pdm.open_log(root)
    assert again.head_seq == 4 and again.lost_bodies() == {}
    events = [E.event_from_row(r) for r in again.read_events().to_pylist()]
    refs = [e.prompt for e in events if e.run_id == "pack"]
    assert len(refs) == 4 and all(again.blobs.get(r) for r in refs if r is not None)


def test_a_checkpoint_skips_what_another_processes_newer_checkpoint_covered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint past this process's own (another writer's, read from the pointer)
    covers commits its writer promoted first: they are not looked at again (at N = 8 on S3
    the checkpoint at seq 200 looked at 190 manifests, 1,240 requests). The bodies it found
    lost are lost here too, except one committed again since."""
    root = str(tmp_path / "log")
    a, b = pdm.open_log(root), pdm.open_log(root)
    _windows(b, 0, 2)
    dead = subprocess.run([sys.executable, "-c", _DEAD_WRITER, root, "pack"],
                          env=_env(Root(root, None, "local"), "manifest_published"),
                          capture_output=True, timeout=120)
    assert dead.returncode == 137, dead.stderr.decode()[-2000:]
    m3 = b.read_manifest(3)
    assert all(b.storage.delete(f) for f in {x.staged.partition("#")[0] for x in m3.blobs
                                             if x.staged})
    assert b.write_checkpoint() == 3
    shared = hashlib.sha256(b"body 0-0 " * 100).hexdigest()
    lost3 = {(x.tenant, x.sha256): 3 for x in m3.blobs if x.sha256 != shared}
    assert len(lost3) == 3 and b.lost_bodies() == lost3
    again = b"a body lost with its pack 0 " * 40  # committed again, at seq 4
    with b.recorder(max_delay_ms=NEVER) as rec:
        ref = rec.ref("acme", again)
        fut = rec.record([E.AttemptDispatched("acme", "again", 0, "s", 0, 1, prompt=ref)],
                         blobs={ref: again})
    assert fut.result(timeout=0).seq == 4
    b.flush()
    _windows(b, 5, 1)  # seq 5
    looked = _looks_off_the_lock(a, monkeypatch)
    assert a.write_checkpoint() == 5
    # seq 5 only (4 announced by 5): its pack, then its 5 bodies
    assert sorted(looked) == ["exists _staging"] + ["exists blobs"] * 5
    del lost3[("acme", hashlib.sha256(again).hexdigest())]
    assert a.lost_bodies() == lost3 and pdm.open_log(root).lost_bodies() == lost3
    assert a.blobs.get(ref) == again
