"""A commit whose manifest PUT failed without telling whether it landed (issue 17: a
future fails only when its events did not land). The object store keeps failing past the
retry deadline after a PUT it may have stored: the commit is in doubt (``CommitUnknown``),
``log.settle(txn)`` decides it once storage answers, and a recorder settles its window
itself instead of failing producers whose events may be committed. Faults are real HTTP
answers of the moto server on 127.0.0.1 (``s3_faults``)."""

from __future__ import annotations

import logging
import os
import pickle
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from conftest import BUCKET, S3Endpoint, S3Faults, snapshot_files
from test_log_processes import _assert_consistent

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log import lease, lease_holder

pytestmark = pytest.mark.s3

DEADLINE_S = 0.5  # each storage operation retries a failing store this long


def _log(s3: S3Endpoint) -> tuple[str, pdm.EventLog]:
    prefix = uuid.uuid4().hex
    log = pdm.open_log(f"s3://{BUCKET}/{prefix}", storage_options=s3.storage_options,
                       retry_deadline_s=DEADLINE_S)
    return prefix, log


def _reopen(s3: S3Endpoint, prefix: str) -> pdm.EventLog:
    return pdm.open_log(f"s3://{BUCKET}/{prefix}", storage_options=s3.storage_options)


HOW = ["stored", "stored-then-taken", "not-stored"]


def _manifest_down(faults: S3Faults, prefix: str, seq: int, how: str) -> None:
    """The PUT of manifest ``seq`` is stored but answered 500, and its retries answered
    503 (``stored``) or 412 "taken", so it reads as a lost race (``stored-then-taken``);
    or it is not stored, and every retry answered 503 (``not-stored``). Every look at
    that manifest answers 503."""
    assert how in HOW
    key = f"/{prefix}/_log/{seq:020d}.json"
    if how != "not-stored":
        faults.add("PUT", key, "lost-answer", times=1)
    methods = ("GET", "HEAD") if how == "stored-then-taken" else ("PUT", "GET", "HEAD")
    for method in methods:
        faults.add(method, key, "unavailable")


@dataclass
class _Reports:
    """What a recorder's committer reported while a window was in doubt."""

    first: threading.Event = field(default_factory=threading.Event)  # still in doubt
    second: threading.Event = field(default_factory=threading.Event)  # another txn
    lease: threading.Event = field(default_factory=threading.Event)  # ... for the lease
    txn: str = ""


@contextmanager
def _in_doubt_reported(hold: threading.Event | None = None) -> Iterator[_Reports]:
    """Events set as a recorder reports a commit still in doubt (its warnings: the first
    one, one for a maintenance lease held, one for another txn); with ``hold``, the
    committer reporting the first is held there until ``hold`` is set, before it settles
    again."""
    seen = _Reports()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "still in doubt" not in text:
                return
            if "lease held" in text:
                seen.lease.set()
            if seen.first.is_set() and str(record.args[1]) != seen.txn:  # type: ignore[index]
                seen.second.set()
            if not seen.first.is_set():
                seen.txn = str(record.args[1])  # type: ignore[index]
                seen.first.set()
                if hold is not None:
                    assert hold.wait(120)

    handler = Handler(logging.WARNING)
    logger = logging.getLogger("poimen_data.log._recorder")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


@contextmanager
def _recorder_in_doubt(s3: S3Endpoint, faults: S3Faults, how: str,
                       hold: threading.Event | None = None
                       ) -> Iterator[tuple[str, pdm.EventLog, pdm.Recorder, _Reports]]:
    """A recorder (no delay) on a fresh log whose manifest 1 is down (``_manifest_down``),
    and what its committer reports (``_in_doubt_reported``)."""
    prefix, log = _log(s3)
    _manifest_down(faults, prefix, 1, how)
    with _in_doubt_reported(hold=hold) as in_doubt, log.recorder(max_delay_ms=0) as rec:
        yield prefix, log, rec, in_doubt


def _attempt(rec: pdm.Recorder, run: str, body: bytes) -> tuple[list[E.Event], pdm.BlobRef]:
    ref = rec.ref("acme", body)
    return [E.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=ref),
            E.AttemptFinished("acme", run, 0, "s", 1, "succeeded")], ref


def _runs(log: pdm.EventLog) -> list[tuple[int, str, str]]:
    return [(r["lsn"], r["run_id"], r["kind"]) for r in log.read_events().to_pylist()]


@pytest.mark.parametrize("how", HOW)
def test_a_recorder_settles_a_window_in_doubt_once_storage_answers(
        s3: S3Endpoint, s3_faults: S3Faults, how: str) -> None:
    """Stored or not, the window lands exactly once as seq 1 and its futures resolve:
    found as ours, or put again under the seq nothing else took. Its files were kept
    (a lost race used to abort them, under a manifest that named them) and its bodies
    are promoted as any commit's."""
    body = b"a prompt recorded through an outage"
    with _recorder_in_doubt(s3, s3_faults, how) as (prefix, log, rec, in_doubt):
        events, ref = _attempt(rec, "run-d", body)
        fut = rec.record(events, blobs={ref: body})
        assert in_doubt.first.wait(120)  # the publish failed and a first settle too
        assert not fut.done()  # neither failed (it may have landed) nor resolved
        s3_faults.clear()
        assert fut.result(timeout=120) == pdm.CommitInfo(1, 1, 2)
        later = rec.record([E.RunStarted("acme", "run-e", "wf")])
        assert later.result(timeout=120) == pdm.CommitInfo(2, 3, 3)
    assert log.head_seq == 2
    assert _runs(log) == [(1, "run-d", "attempt_dispatched"),
                          (2, "run-d", "attempt_finished"), (3, "run-e", "run_started")]
    log.flush()  # its bodies promoted as any commit's, by this process
    assert list(log.storage.walk_files("_staging")) == []
    assert log.storage.read(f"blobs/acme/{ref.sha256[:2]}/{ref.sha256}") == body
    fresh = _reopen(s3, prefix)
    assert fresh.blobs.get(ref) == body
    assert [m.seq for m in fresh.manifests()] == [1, 2]
    _assert_consistent(fresh)


def test_close_fails_a_window_still_in_doubt_with_its_txn_to_settle(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """``close`` does not wait for storage to come back: the window's futures fail with
    ``CommitUnknown`` (not a plain failure: the PUT was stored), and ``log.settle`` with
    its ``txn`` then finds the commit landed."""
    prefix, log = _log(s3)
    _manifest_down(s3_faults, prefix, 1, "stored")
    with _in_doubt_reported() as in_doubt:
        rec = log.recorder(max_delay_ms=0)
        fut = rec.record([E.RunStarted("acme", "run-c", "wf")])
        assert in_doubt.first.wait(120)
        rec.close()  # one last try, storage still down
    exc = fut.exception(timeout=0)
    assert type(exc) is pdm.CommitUnknown
    assert "may have landed as seq 1" in str(exc) and exc.txn in str(exc)
    assert log.publish_unknown(exc.txn)
    again = pickle.loads(pickle.dumps(exc))  # its txn crosses processes, to be settled
    assert type(again) is pdm.CommitUnknown and again.txn == exc.txn
    s3_faults.clear()
    assert log.settle(exc.txn) == pdm.CommitInfo(1, 1, 1)
    assert not log.publish_unknown(exc.txn)
    with pytest.raises(pdm.ValidationError, match="no publish in doubt"):
        log.settle(exc.txn)  # decided once
    assert _runs(_reopen(s3, prefix)) == [(1, "run-c", "run_started")]


def _transaction_in_doubt(s3: S3Endpoint, faults: S3Faults, run: str
                          ) -> tuple[str, pdm.EventLog, str]:
    """A transaction whose manifest PUT was not stored and never answered: it raises
    ``CommitUnknown`` naming its txn; storage answers again afterwards."""
    prefix, log = _log(s3)
    _manifest_down(faults, prefix, 1, "not-stored")
    with pytest.raises(pdm.CommitUnknown) as info:
        with log.transaction() as tx:
            ref = tx.put_blob("acme", f"a body of {run}".encode())
            tx.append(E.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=ref))
    assert isinstance(info.value, pdm.CommitConflict)  # what callers caught before
    assert info.value.txn == tx.txn and log.publish_unknown(tx.txn)
    faults.clear()
    return prefix, log, tx.txn


def test_settle_says_did_not_land_once_another_commit_took_its_seq(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """A transaction's PUT was not stored; another writer takes seq 1 before it is
    settled: it did not land and never will, and nothing of it is published."""
    prefix, log, txn = _transaction_in_doubt(s3, s3_faults, "run-a")
    other = _reopen(s3, prefix)
    with other.transaction() as tx2:
        tx2.append(E.RunStarted("acme", "run-b", "wf"))
    assert tx2.commit_info == pdm.CommitInfo(1, 1, 1)
    assert log.settle(txn) is None
    assert log.head_seq == 1 and _runs(log) == [(1, "run-b", "run_started")]
    pdm.vacuum(other, grace=0, force=True)  # the files it left reach nothing
    _assert_consistent(_reopen(s3, prefix))


def test_settle_never_publishes_a_manifest_whose_files_were_vacuumed(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """A long outage: vacuum removed the staged files of the transaction in doubt (no
    manifest reached them). Its seq is still free, but putting its manifest there would
    name missing files: it did not land, and storage stays as vacuum left it."""
    prefix, log, txn = _transaction_in_doubt(s3, s3_faults, "run-v")
    other = _reopen(s3, prefix)
    report = pdm.vacuum(other, grace=0, force=True)
    assert report.segments_removed == 1 and report.staging_removed == 1
    before = snapshot_files(log)
    assert log.settle(txn) is None
    assert snapshot_files(log) == before
    assert log.head_seq == 0


def test_a_window_in_doubt_that_did_not_land_is_committed_again(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The window's PUT was not stored, and another writer takes seq 1 while the committer
    is held before settling again: the window never lands, so its records are committed
    again (once each, after the other writer's commit), not failed."""
    go = threading.Event()
    body = b"a prompt whose first window never landed"
    with _recorder_in_doubt(s3, s3_faults, "not-stored", hold=go) as (prefix, log, rec, in_doubt):
        events, ref = _attempt(rec, "run-r", body)
        fut = rec.record(events, blobs={ref: body})
        try:
            assert in_doubt.first.wait(120)
            s3_faults.clear()
            other = _reopen(s3, prefix)
            with other.transaction() as tx:
                tx.append(E.RunStarted("acme", "run-o", "wf"))
            assert tx.commit_info == pdm.CommitInfo(1, 1, 1)
        finally:
            go.set()
        assert fut.result(timeout=120) == pdm.CommitInfo(2, 2, 3)
    assert _runs(log) == [(1, "run-o", "run_started"), (2, "run-r", "attempt_dispatched"),
                          (3, "run-r", "attempt_finished")]
    log.flush()
    fresh = _reopen(s3, prefix)
    assert fresh.blobs.get(ref) == body
    pdm.vacuum(fresh, grace=0, force=True)  # the first window's files reach nothing
    _assert_consistent(_reopen(s3, prefix))


def test_settle_waits_while_maintenance_holds_the_lease(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The seq is free, so settling would put the manifest; while a maintenance job
    holds the lease (a vacuum could be removing its files) it does not: ``LeaseHeld``,
    still in doubt, nothing published. Once the lease is free, it lands."""
    prefix, log, txn = _transaction_in_doubt(s3, s3_faults, "run-l")
    other = _reopen(s3, prefix)
    with lease(other, renew=False):
        with pytest.raises(pdm.LeaseHeld):
            log.settle(txn)
        assert log.publish_unknown(txn) and other.head_seq == 0
    assert log.settle(txn) == pdm.CommitInfo(1, 1, 1)
    assert lease_holder(log) is None  # settle gave the lease back
    log.flush()
    assert list(log.storage.walk_files("_staging")) == []
    _assert_consistent(_reopen(s3, prefix))


def test_a_recorder_settles_again_while_maintenance_holds_the_lease(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """Storage answers again but a maintenance job holds the lease: the window stays in
    doubt (its future pending) until the lease is free, then lands."""
    go = threading.Event()
    with _recorder_in_doubt(s3, s3_faults, "not-stored", hold=go) as (prefix, log, rec, in_doubt):
        fut = rec.record([E.RunStarted("acme", "run-m", "wf")])
        try:
            assert in_doubt.first.wait(120)  # the committer is held before its next settle
            s3_faults.clear()
            held = lease(_reopen(s3, prefix), renew=False)
            held.__enter__()
        finally:
            go.set()
        try:
            assert in_doubt.lease.wait(120)  # it settled again and met the lease
            assert not fut.done()
        finally:
            held.__exit__(None, None, None)
        assert fut.result(timeout=120) == pdm.CommitInfo(1, 1, 1)
    assert _runs(log) == [(1, "run-m", "run_started")]


def test_a_settle_error_it_cannot_retry_fails_the_window_with_its_txn(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """Settling meets an error that is not storage still failing (here: the caller
    settled the txn itself meanwhile): the futures fail with the ``CommitUnknown``,
    whose txn says which commit to look for, not with that error."""
    go = threading.Event()
    with _recorder_in_doubt(s3, s3_faults, "stored", hold=go) as (prefix, log, rec, in_doubt):
        fut = rec.record([E.RunStarted("acme", "run-x", "wf")])
        try:
            assert in_doubt.first.wait(120)
            s3_faults.clear()
            txn = in_doubt.txn
            assert log.settle(txn) == pdm.CommitInfo(1, 1, 1)
        finally:
            go.set()
        exc = fut.exception(timeout=120)
    assert type(exc) is pdm.CommitUnknown and exc.txn == txn
    assert _runs(log) == [(1, "run-x", "run_started")]


def test_a_failed_manifest_put_whose_seq_is_free_stays_in_doubt(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The manifest PUT keeps failing and reading answers: its seq is free, but a request
    the client gave up on may still be stored, so the commit is in doubt and keeps its
    files; settling puts it there itself once storage answers."""
    prefix, log = _log(s3)
    s3_faults.add("PUT", f"/{prefix}/_log/{1:020d}.json", "unavailable")
    with pytest.raises(pdm.CommitUnknown) as info:
        with log.transaction() as tx:
            ref = tx.put_blob("acme", b"a body whose PUT may still land")
            tx.append(E.AttemptDispatched("acme", "run-p", 0, "s", 0, 1, prompt=ref))
    s3_faults.clear()
    assert log.head_seq == 0 and len(list(log.storage.walk_files("segments"))) == 1
    assert log.settle(info.value.txn) == pdm.CommitInfo(1, 1, 1)
    _assert_consistent(_reopen(s3, prefix))


def test_a_failed_manifest_put_whose_seq_holds_another_commit_is_a_plain_failure(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The writer's head is old: another commit already holds seq 1 when its PUT there
    keeps failing. Ours can never land under that seq: the storage error is raised (not
    in doubt) and the commit's files are removed as any failed commit's."""
    prefix, log = _log(s3)
    with _reopen(s3, prefix).transaction() as other:
        other.append(E.RunStarted("acme", "run-o", "wf"))
    before = snapshot_files(log)
    s3_faults.add("PUT", f"/{prefix}/_log/{1:020d}.json", "unavailable")
    with pytest.raises(pdm.StorageError, match="kept failing") as info:
        with log.transaction() as tx:
            ref = tx.put_blob("acme", b"a body whose commit failed")
            tx.append(E.AttemptDispatched("acme", "run-p", 0, "s", 0, 1, prompt=ref))
    assert not isinstance(info.value, pdm.CommitConflict)
    assert not log.publish_unknown(tx.txn)
    s3_faults.clear()
    assert snapshot_files(log) == before and log.head_seq == 1


def test_settle_takes_back_a_lease_it_left_behind(s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """Settling's lease PUT was stored but its answers kept failing: the lease it left
    is its own, so the next settle takes it back (it does not wait out the lease's
    expiry, nor does maintenance wait once it is done)."""
    prefix, log, txn = _transaction_in_doubt(s3, s3_faults, "run-l")
    key = f"/{prefix}/_lease.json"
    s3_faults.add("PUT", key, "lost-answer", times=1)
    s3_faults.add("PUT", key, "unavailable")
    with pytest.raises(pdm.StorageError):
        log.settle(txn)
    s3_faults.clear()
    assert lease_holder(log) is not None and log.publish_unknown(txn)
    assert log.settle(txn) == pdm.CommitInfo(1, 1, 1)
    assert lease_holder(log) is None
    pdm.vacuum(_reopen(s3, prefix), grace=0, force=True)  # the lease is free


def test_a_record_committed_again_is_settled_too_when_in_doubt(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The window did not land (another writer took seq 1), and the commit of its record
    on its own ends in doubt as well (storage fails again at seq 2): that record is
    settled like a window, its future pending meanwhile, and lands as seq 2."""
    go = threading.Event()
    with _recorder_in_doubt(s3, s3_faults, "not-stored", go) as (prefix, log, rec, in_doubt):
        fut = rec.record([E.RunStarted("acme", "run-e", "wf")])
        try:
            assert in_doubt.first.wait(120)
            s3_faults.clear()
            with _reopen(s3, prefix).transaction() as tx:
                tx.append(E.RunStarted("acme", "run-o", "wf"))
            s3_faults.add("PUT", f"/{prefix}/_log/{2:020d}.json", "unavailable")
        finally:
            go.set()
        assert in_doubt.second.wait(120)  # the record's own commit, in doubt
        assert not fut.done()
        s3_faults.clear()
        assert fut.result(timeout=120) == pdm.CommitInfo(2, 2, 2)
    assert _runs(log) == [(1, "run-o", "run_started"), (2, "run-e", "run_started")]


@pytest.mark.parametrize("where", ["retry", "look"])
def test_a_stored_put_whose_retry_or_look_is_refused_outright_is_found_or_in_doubt(
        s3: S3Endpoint, s3_faults: S3Faults, where: str) -> None:
    """The manifest PUT is stored, answered 500, and then storage refuses outright (403,
    not an ``OSError``, never retried): the PUT's retry, so the look finds the commit
    ours; or the look, so it is in doubt. Either way its files stay."""
    prefix, log = _log(s3)
    key = f"/{prefix}/_log/{1:020d}.json"
    s3_faults.add("PUT", key, "lost-answer", times=1)
    s3_faults.add("GET" if where == "look" else "PUT", key, "forbidden")
    if where == "retry":
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", "run-f", "wf"))
        assert tx.commit_info == pdm.CommitInfo(1, 1, 1)
    else:
        with pytest.raises(pdm.CommitUnknown) as info:
            with log.transaction() as tx:
                tx.append(E.RunStarted("acme", "run-f", "wf"))
        s3_faults.clear()
        assert log.settle(info.value.txn) == pdm.CommitInfo(1, 1, 1)
    s3_faults.clear()
    assert _runs(_reopen(s3, prefix)) == [(1, "run-f", "run_started")]


def test_a_stored_put_found_although_the_look_past_it_fails(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The PUT of manifest 1 is stored and answered 500, its retry "taken"; the look reads
    manifest 1 (ours) but then cannot read past it: what it read is enough, the commit
    landed and is not in doubt."""
    prefix, log = _log(s3)
    s3_faults.add("PUT", f"/{prefix}/_log/{1:020d}.json", "lost-answer", times=1)
    for method in ("GET", "HEAD"):
        s3_faults.add(method, f"/{prefix}/_log/{2:020d}.json", "unavailable")
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "run-n", "wf"))
    assert tx.commit_info == pdm.CommitInfo(1, 1, 1)
    assert s3_faults.fired() >= 2 and log.publish_retries == 0  # not a lost race
    s3_faults.clear()
    assert _runs(_reopen(s3, prefix)) == [(1, "run-n", "run_started")]


def test_settle_refuses_in_a_forked_child(s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """A forked child may hold the parent's settle lock as it was at the fork, and the
    commit in doubt is the parent's: ``settle`` there raises at once, never blocks."""
    prefix, log, txn = _transaction_in_doubt(s3, s3_faults, "run-k")
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only
        try:
            log.settle(txn)
        except pdm.PoimenError as exc:
            os._exit(3 if "forked child" in str(exc) else 4)
        except BaseException:  # noqa: BLE001 - reported by its status
            os._exit(5)
        os._exit(6)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert log.settle(txn) == pdm.CommitInfo(1, 1, 1)  # the parent's to settle
