"""Faults the log must survive (issue 16 D, E, F, G): a lost committed body, a lost answer
on the lease's conditional PUT, a 503 storm, and ``vacuum(grace=0)`` under a live writer.
S3 faults are real HTTP answers of the moto server on 127.0.0.1 (``s3_faults``)."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import BUCKET, Root, S3Endpoint, S3Faults, snapshot_files
from test_log_processes import _assert_consistent, _child
from test_maint import _release, _start, _wait_for
from typer.testing import CliRunner

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.cli import app
from poimen_data.jobs._maint import LEASE, lease
from poimen_data.log._recorder import blob_ref


def _s3_log(s3: S3Endpoint, **kw: object) -> tuple[str, pdm.EventLog]:
    prefix = uuid.uuid4().hex
    return prefix, pdm.open_log(f"s3://{BUCKET}/{prefix}", storage_options=s3.storage_options,
                                **kw)  # type: ignore[arg-type]


# --- D: a lost committed body is an error for its reader only ---------------------------


def test_a_lost_committed_body_fails_only_its_reader(proc_root: Root) -> None:
    log = proc_root.open()
    with log.transaction() as tx:
        kept = tx.put_blob("acme", b"a body nobody loses")
        tx.append(E.AttemptDispatched("acme", "run-a", 0, "s", 0, 1, prompt=kept))
    # a writer publishes, then dies before promoting its staged bodies ...
    res = _child(proc_root, "crash", "run-c", crash_at="manifest_published")
    assert res.returncode == 137, res.stderr.decode()[-2000:]
    m = log.read_manifest(2)
    staged = [b for b in m.blobs if b.staged is not None]
    assert len(staged) == 2
    # ... and one of them is then lost from under the log
    lost = staged[0]
    assert log.storage.delete(lost.staged)
    after = proc_root.open()  # rolls forward what is there; used to raise CorruptionError
    assert after.head == 3
    assert after.lost_bodies() == {(lost.tenant, lost.sha256): 2}
    ref = pdm.BlobRef(lost.tenant, lost.sha256, lost.size)
    with pytest.raises(pdm.NotFound, match=r"committed \(seq 2\) but is missing.*lost"):
        after.blobs.get(ref)
    other = staged[1]
    assert after.blobs.get(pdm.BlobRef(other.tenant, other.sha256, other.size)) is not None
    assert after.blobs.get(kept) == b"a body nobody loses"
    con = pdm.connect(after)
    assert con.execute("select count(*) from attempts").fetchone() == (2,)
    assert pdm.vacuum(after).staging_removed == 0  # maintenance goes on
    assert after.write_checkpoint() == 2
    again = proc_root.open()  # the checkpoint carries what was lost
    assert again.lost_bodies() == {(lost.tenant, lost.sha256): 2}
    with pytest.raises(pdm.NotFound, match="lost"):
        again.blobs.get(ref)
    if proc_root.backend == "local":
        r = CliRunner().invoke(app, ["log", "--root", proc_root.url])
        assert r.exit_code == 0, r.output
        assert f"warning: body {lost.tenant}/{lost.sha256} committed at seq 2 is lost" \
            in r.stderr


# --- E: the lease's own conditional PUT, stored but answered 500 ------------------------


@pytest.mark.s3
def test_a_lost_answer_on_the_lease_put_is_recognized_as_our_lease(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    prefix, log = _s3_log(s3)
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "run-e", "wf"))
    s3_faults.add("PUT", f"/{prefix}/{LEASE}", "lost-answer", times=1)
    report = pdm.vacuum(log)  # used to raise LeaseHeld naming its own owner
    assert s3_faults.fired() == 1
    assert report == pdm.jobs._maint.VacuumReport()
    assert log.storage.read_or_none(LEASE) is None  # released
    # another holder's lease still excludes us
    with lease(log, renew=False) as held:
        with pytest.raises(pdm.LeaseHeld, match=held.owner):
            pdm.vacuum(log)


def test_break_lease_removes_a_dead_holders_lease(root: Root) -> None:
    log = root.open()
    log.storage.write(LEASE, b'{"owner": "dead-job", "expires": 1e12}')
    with pytest.raises(pdm.LeaseHeld, match="dead-job"):
        pdm.vacuum(log)
    assert pdm.break_lease(log) == {"owner": "dead-job", "expires": 1e12}
    assert log.storage.read_or_none(LEASE) is None
    assert pdm.break_lease(log) is None
    log.storage.write(LEASE, b'{"owner": "cut')  # a damaged lease is broken as it reads
    assert pdm.break_lease(log) == {"damaged": '{"owner": "cut'}
    assert log.storage.read_or_none(LEASE) is None
    assert pdm.vacuum(log).staging_removed == 0
    if root.backend == "local":  # the CLI: show, then break with a warning
        log.storage.write(LEASE, b'{"owner": "dead-job", "expires": 1e12}')
        r = CliRunner().invoke(app, ["lease", "--root", root.url, "--json"])
        assert r.exit_code == 0 and '"owner": "dead-job"' in r.stdout, r.output
        assert log.storage.read_or_none(LEASE) is not None
        r = CliRunner().invoke(app, ["lease", "--break", "--root", root.url, "--json"])
        assert r.exit_code == 0 and '"broken": true' in r.stdout, r.output
        assert "warning: breaking the maintenance lease" in r.stderr
        assert log.storage.read_or_none(LEASE) is None
        r = CliRunner().invoke(app, ["vacuum", "--grace", "0", "--root", root.url])
        assert r.exit_code == 0, r.output


# --- F: a 503 storm is bounded by the retry deadline ------------------------------------


@pytest.mark.s3
def test_a_503_storm_is_bounded_by_the_retry_deadline(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    prefix, log = _s3_log(s3, retry_deadline_s=1.0)
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "run-f", "wf"))
    before = snapshot_files(log)
    s3_faults.add("PUT", "", "unavailable")  # every PUT of every key
    start = time.monotonic()
    with pytest.raises(pdm.PoimenError) as info:
        with log.transaction() as tx:
            ref = tx.put_blob("acme", b"a body that never lands")
            tx.append(E.AttemptDispatched("acme", "run-f", 0, "s", 0, 1, prompt=ref))
    elapsed = time.monotonic() - start
    puts = s3_faults.requests.get("PUT", 0)
    s3_faults.clear()
    assert isinstance(info.value, pdm.StorageError | pdm.CommitConflict)
    assert "kept failing" in str(info.value)
    # two writes (body, segment) of one second each, on a loaded machine: far from the
    # 224 s and ~340 PUTs of three stacked retry loops
    assert elapsed < 30, elapsed
    assert 2 <= puts <= 80, puts
    assert snapshot_files(log) == before
    with log.transaction() as tx:  # storage is back: commits go on
        tx.append(E.RunStarted("acme", "run-f2", "wf"))
    assert log.head == 2


@pytest.mark.s3
def test_one_503_on_the_manifest_put_is_retried_once(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    prefix, log = _s3_log(s3)
    s3_faults.add("PUT", f"/{prefix}/_log/{1:020d}.json", "lost-answer", times=1)
    with log.transaction() as tx:  # stored, answered 500, retried: 412; found as ours
        tx.append(E.RunStarted("acme", "run-m", "wf"))
    assert s3_faults.fired() == 1
    assert tx.commit_info == pdm.CommitInfo(1, 1, 1)
    assert log.head_seq == 1


# --- G: vacuum(grace=0) under a live writer ----------------------------------------------


def test_vacuum_grace_0_refuses_while_a_writer_is_staged_and_forcing_never_jams(
        proc_root: Root) -> None:
    log = proc_root.open()
    writer = _start(proc_root, "paused", "run-g", "fresh body g")
    try:
        _wait_for(writer, b"staged")
        before = snapshot_files(log)
        with pytest.raises(pdm.WritersActive, match="_staging/"):
            pdm.vacuum(log, grace=0)
        assert snapshot_files(log) == before  # refused before removing anything
        # the documented misuse, forced: the writer's staged body goes
        assert pdm.vacuum(log, grace=0, force=True).staging_removed == 1
    finally:
        _release(writer)  # it publishes a manifest naming the body it lost
    after = proc_root.open()
    assert after.head == 1
    row = after.read_events().to_pylist()[0]
    ref = pdm.BlobRef(row["prompt"]["tenant"], row["prompt"]["sha256"], row["prompt"]["size"])
    with pytest.raises(pdm.NotFound, match="lost"):
        after.blobs.get(ref)
    assert after.write_checkpoint() == 1  # checkpoints are not deferred for good
    for _ in range(3):
        with after.transaction() as tx:
            tx.append(E.AttemptFinished("acme", "run-g", 0, "s", 1, "failed"))
    assert pdm.compact(after, min_rows=10).rewritten == 4
    # committing the same body again repairs it
    with after.transaction() as tx:
        again = tx.put_blob("acme", b"fresh body g")
        tx.append(E.AttemptDispatched("acme", "run-h", 0, "s", 0, 1, prompt=again))
    assert again == ref
    fresh = proc_root.open()
    assert fresh.blobs.get(ref) == b"fresh body g" and fresh.lost_bodies() == {}
    pdm.vacuum(fresh, grace=0)
    _assert_consistent(proc_root.open())


# --- a full disk while writing a manifest or checkpoint temp file ----------------------

_FULL_DISK_CHILD = """
import errno, os, resource, signal, sys
import poimen_data as pdm
log = pdm.open_log(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE,
                   (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
for what in ("put_if_absent", "write"):
    try:
        getattr(log.storage, what)("_log/%s.json" % what, b"x" * 100_000)
    except OSError as exc:
        print(what, errno.errorcode[exc.errno])
"""


def test_a_failed_temp_file_write_leaves_no_temp_file(tmp_path: Path) -> None:
    """ENOSPC (here EFBIG, from a file-size limit: the same failed ``write``) on a
    manifest's or the pointer's temp file leaves nothing under ``_log/`` for vacuum."""
    root = str(tmp_path / "log")
    log = pdm.open_log(root)
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "run-x", "wf"))
    before = sorted(log.storage.list_dir("_log"))
    res = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, root],
                         capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout.decode().split("\n")[:2] == ["put_if_absent EFBIG", "write EFBIG"]
    assert sorted(log.storage.list_dir("_log")) == before


# A shim loaded into a child with LD_PRELOAD: fsync(2) of a directory fails with the errno
# in DIR_FSYNC_ERRNO (EIO: a failing disk; EINVAL: a file system that syncs no
# directories); files' fsyncs and everything else are the real calls.
_DIR_FSYNC_FAILS_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
int fsync(int fd) {
    static int (*real)(int);
    struct stat st;
    const char *e = getenv("DIR_FSYNC_ERRNO");
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (e && fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) { errno = atoi(e); return -1; }
    return real(fd);
}
"""

_COMMIT_CHILD = """
import logging, sys
import poimen_data as pdm
from poimen_data import events as E
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
log = pdm.open_log(sys.argv[1])
for run in ("run-a", "run-b"):
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", run, "wf"))
    print(tx.commit_info)
"""


def _commit_with_dir_fsync_failing(tmp_path: Path, err: int) -> tuple[str, list[str]]:
    """Two commits in a child whose directory fsyncs fail with ``err``: the log's root,
    and the child's log lines."""
    shim = tmp_path / "dir_fsync_fails.so"
    if not shim.exists():
        src = tmp_path / "dir_fsync_fails.c"
        src.write_text(_DIR_FSYNC_FAILS_C)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(src), "-ldl"],
                       check=True, capture_output=True, timeout=120)
    root = str(tmp_path / f"log-{err}")
    env = {k: v for k, v in os.environ.items() if k != "POIMEN_CRASH_AT"}
    preload = ":".join(p for p in (str(shim), env.get("LD_PRELOAD")) if p)
    res = subprocess.run([sys.executable, "-c", _COMMIT_CHILD, root],
                         env={**env, "LD_PRELOAD": preload, "DIR_FSYNC_ERRNO": str(err)},
                         capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout.decode().split("\n")[:2] == [
        "CommitInfo(seq=1, first_lsn=1, last_lsn=1)",
        "CommitInfo(seq=2, first_lsn=2, last_lsn=2)"]
    assert [r["run_id"] for r in pdm.open_log(root).read_events().to_pylist()] \
        == ["run-a", "run-b"]
    return root, res.stderr.decode().splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None,
                    reason="needs Linux (LD_PRELOAD) and a C compiler (.ci/run installs one)")
def test_a_failed_directory_sync_after_a_publish_is_reported(tmp_path: Path) -> None:
    """A manifest is linked into ``_log/`` and then its directory synced; when that sync
    fails (EIO: a shim over fsync(2) in a child), the commit is visible and cannot be
    taken back, so it returns, and an error names the directory whose new name may not
    survive a power loss, each time (the failure was swallowed silently before). A file
    system that syncs no directories (EINVAL) is said once, as a warning."""
    root, lines = _commit_with_dir_fsync_failing(tmp_path, errno.EIO)
    log_dir = str(Path(root) / "_log")
    failed = (f"ERROR {log_dir}: syncing the directory after a new file's link failed "
              "([Errno 5] Input/output error); that name may not survive a power loss")
    assert lines.count(failed) == 2
    root, lines = _commit_with_dir_fsync_failing(tmp_path, errno.EINVAL)
    assert [line.split(":", 1)[0] for line in lines] == [f"WARNING {root}"]
    assert lines[0].endswith("this file system does not sync directories ([Errno 22] "
                             "Invalid argument): a new file's name may not survive a "
                             "power loss (said once)")


@pytest.mark.s3
def test_flush_after_a_failing_staging_delete_raises_a_poimen_error(
        s3: S3Endpoint, s3_faults: S3Faults) -> None:
    """The promotion copies a body to ``blobs/`` and deletes its staged copy; when that
    DELETE keeps failing, ``flush()`` raises ``StorageError`` (a ``PoimenError``), and the
    body stays readable."""
    prefix, log = _s3_log(s3, retry_deadline_s=0.5)
    s3_faults.add("DELETE", "", "unavailable")
    with log.transaction() as tx:
        ref = tx.put_blob("acme", b"a body whose staged copy stays")
        tx.append(E.AttemptDispatched("acme", "run-d", 0, "s", 0, 1, prompt=ref))
    with pytest.raises(pdm.StorageError, match="kept failing"):
        log.flush()
    assert s3_faults.fired() >= 1
    s3_faults.clear()
    assert log.blobs.get(ref) == b"a body whose staged copy stays"
    assert proc_open_head(s3, prefix) == 1


def proc_open_head(s3: S3Endpoint, prefix: str) -> int:
    return pdm.open_log(f"s3://{BUCKET}/{prefix}", storage_options=s3.storage_options).head


def test_two_promoters_of_one_body_never_fail_with_a_raw_error(tmp_path: Path) -> None:
    """A roll-forward at open and the writer's background promoter may move the same
    staged body at once (two logs on one root): the one that finds it gone gets
    ``NotFound`` (which promotion treats as done elsewhere), never a raw OSError; before,
    a first move that had to create ``blobs/<t>/<aa>/`` lost the second race raw."""
    import threading

    from poimen_data.storage import open_storage

    outcomes = []
    for i in range(200):
        st = open_storage(str(tmp_path / f"r{i}"), None)
        st.write("_staging/t/x", b"body")
        barrier = threading.Barrier(2)
        got: list[str] = []

        def move(st: Any = st, i: int = i, barrier: threading.Barrier = barrier,
                 got: list[str] = got) -> None:
            barrier.wait()
            try:
                st.move("_staging/t/x", f"blobs/a/{i:03d}/x")
                got.append("moved")
            except pdm.NotFound:
                got.append("gone")
            except Exception as exc:  # noqa: BLE001 - what the test is about
                got.append(repr(exc))

        threads = [threading.Thread(target=move) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes.append(tuple(sorted(got)))
        assert st.read(f"blobs/a/{i:03d}/x") == b"body"
    assert set(outcomes) <= {("gone", "moved")}


def test_a_log_directory_moved_away_under_a_writer_is_not_made_again(tmp_path: Path) -> None:
    """A live writer whose log's directory is moved away (or deleted) fails its writes
    with ``StorageError`` naming it, through a transaction and through a recorder, and
    never makes that directory again (``os.makedirs`` did: a commit then landed in a new,
    partial log there); put back, the log goes on whole."""
    import os
    import re

    root, moved = tmp_path / "log", tmp_path / "moved"
    log = pdm.open_log(str(root))

    def attempt(run: str) -> tuple[list[E.Event], dict[pdm.BlobRef, bytes]]:
        body = f"prompt of {run} ".encode() * 50
        ref = blob_ref("acme", body)
        return [E.RunStarted("acme", run, "wf"),
                E.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=ref)], {ref: body}

    def commit(run: str) -> pdm.CommitInfo:
        evs, blobs = attempt(run)
        with log.transaction() as tx:
            for body in blobs.values():
                tx.put_blob("acme", body)
            tx.extend(evs)
        assert tx.commit_info is not None
        return tx.commit_info

    assert commit("before").seq == 1
    log.flush()  # its promotion done
    os.rename(root, moved)
    gone = f"{root}: the log's directory is gone (deleted or moved away while open"
    with pytest.raises(pdm.StorageError, match=re.escape(gone)):
        commit("moved")
    with log.recorder(max_delay_ms=0) as rec:
        evs, blobs = attempt("recorded")
        failed = rec.record(evs, blobs=blobs).exception(timeout=60)
    assert isinstance(failed, pdm.StorageError) and str(failed).startswith(gone)
    assert not root.exists()
    os.rename(moved, root)
    assert commit("after").seq == 2
    log.flush()
    again = pdm.open_log(str(root))
    events = again.read_events().to_pylist()
    assert [(e["run_id"], e["kind"]) for e in events] == [
        ("before", "run_started"), ("before", "attempt_dispatched"),
        ("after", "run_started"), ("after", "attempt_dispatched")]
    assert not list(again.storage.walk_files("_staging"))
    # deleted and made again (rm -rf; mkdir: a freed inode number is soon given again),
    # then a log made there: a writer of the old one never writes into either
    stale = pdm.open_log(str(root))  # opened, nothing written: no directory known
    shutil.rmtree(root)
    root.mkdir()
    with pytest.raises(pdm.StorageError, match=re.escape(gone)), stale.transaction() as tx:
        tx.put_blob("acme", b"into a directory made again")
        tx.append(E.RunStarted("acme", "stale", "wf"))
    assert list(root.iterdir()) == []
    fresh = pdm.open_log(str(root))
    with fresh.transaction() as tx:
        tx.append(E.RunStarted("acme", "fresh", "wf"))
    with pytest.raises(pdm.StorageError, match=re.escape(gone)):
        commit("stale")
    assert [e["run_id"] for e in pdm.open_log(str(root)).read_events().to_pylist()] == [
        "fresh"]


def test_a_pointer_naming_a_huge_seq_is_passed_over(tmp_path: Path) -> None:
    """A pointer with a valid checksum naming seq 10**12 (bogus, or damaged before its
    checksum was taken): opening looks at 20 candidate checkpoints, never builds a list of
    every multiple of the interval below it (a MemoryError, or all the RAM)."""
    from poimen_data.log._manifest import FORMAT_NAME, FORMAT_VERSION, POINTER, dumps

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for i in range(3):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    log.flush()
    for seq in (10**12, 2**63 - 1):
        log.storage.write(POINTER, dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION,
                                          "seq": seq}))
        assert pdm.open_log(str(tmp_path / "log")).head == 3


@pytest.mark.parametrize("interval", [0, -1, "abc", 1.5, None, True])
def test_a_checkpoint_interval_in_the_config_that_is_no_count_falls_back(
        tmp_path: Path, interval: object, caplog: pytest.LogCaptureFixture) -> None:
    """Written by hand, or by code that did not check it (0 then divided by zero at the
    first commit): the default is used, and said."""
    from poimen_data.log._manifest import dumps, loads

    root = tmp_path / "log"
    pdm.open_log(str(root))
    doc = loads((root / "_poimen.json").read_bytes(), "_poimen.json")
    doc["checkpoint_interval"] = interval
    (root / "_poimen.json").write_bytes(dumps(doc))
    log = pdm.open_log(str(root))
    assert log.checkpoint_interval == 100
    assert "is not a count of commits; 100 is used" in caplog.text
    for i in range(2):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    assert pdm.open_log(str(root)).head == 2


@pytest.mark.parametrize(("options", "text"), [
    ("endpoint=x", "storage_options must be a dict of fsspec options, got str"),
    ([("a", 1)], "storage_options must be a dict of fsspec options, got list"),
    ({"client_kwargs": "abc"}, "cannot read s3://"),
    ({"client_kwargs": {"endpoint_url": 5}}, "cannot read s3://"),
])
def test_storage_options_it_cannot_use_are_one_poimen_error(options: object,
                                                            text: str) -> None:
    with pytest.raises(pdm.PoimenError, match=re.escape(text)):
        pdm.open_log("s3://poimen-test/x", options, retry_deadline_s=1)  # type: ignore


def test_s3_refusals_are_storage_errors_and_a_missing_bucket_is_named(s3, s3_faults) -> None:
    """403 (credentials, policy) is a ``StorageError`` naming the key, not botocore's
    ``ClientError``; a log made in a bucket that is not there is one ``PoimenError``."""
    with pytest.raises(pdm.PoimenError, match=r"cannot create a log at s3://no-such-bucket"):
        pdm.open_log(f"s3://no-such-bucket/{uuid.uuid4().hex}",
                     storage_options=s3.storage_options)
    prefix = f"poimen-test/{uuid.uuid4().hex}"
    log = pdm.open_log(f"s3://{prefix}", storage_options=s3.storage_options)
    with log.transaction() as tx:
        ref = tx.put_blob("acme", b"a body")
        tx.append(E.RunStarted("acme", "r", "wf"))
    log.flush()
    s3_faults.add("GET", f"/{prefix}/blobs/acme/{ref.sha256[:2]}/{ref.sha256}", "forbidden")
    with pytest.raises(pdm.StorageError, match=r"get_object refused: AccessDenied \(HTTP 403\)"):
        log.blobs.get(ref)
    s3_faults.add("GET", f"/{prefix}/_poimen.json", "forbidden")
    with pytest.raises(pdm.StorageError, match=r"_poimen.json: get_object refused"):
        pdm.open_log(f"s3://{prefix}", storage_options=s3.storage_options)


@pytest.mark.parametrize("make", ["dir", "fifo"])
def test_a_log_file_that_is_not_a_regular_file_is_named_never_waited_on(
        tmp_path: Path, make: str) -> None:
    """A directory or a FIFO in place of one of a log's files: reading it is a
    ``CorruptionError`` naming it (a FIFO was opened and read for ever); a pointer or a
    checkpoint so replaced is passed over, as a damaged one is."""
    from poimen_data.log._manifest import POINTER, checkpoint_path

    def build(name: str) -> tuple[pdm.EventLog, Path]:
        root = tmp_path / name
        log = pdm.open_log(str(root), checkpoint_interval=2)
        for i in range(3):
            with log.transaction() as tx:
                tx.put_blob("acme", f"body {i}".encode())
                tx.append(E.RunStarted("acme", f"r{i}", "wf"))
        log.flush()
        return log, root

    def replace(p: Path) -> None:
        p.unlink()
        p.mkdir() if make == "dir" else os.mkfifo(p)

    for rel in (POINTER, checkpoint_path(2)):
        _log, root = build(f"{make}-{rel.replace('/', '-')}")
        replace(root / rel)
        assert pdm.open_log(str(root)).read_events().num_rows == 3
    log, root = build(f"{make}-segment")
    seg = next(iter(log.segments()))
    replace(root / seg.path)
    with pytest.raises(pdm.CorruptionError, match=r"not a regular file \((a directory|a FIFO)\)"):
        pdm.open_log(str(root)).read_events()
    log, root = build(f"{make}-manifest")
    replace(root / "_log" / f"{3:020d}.json")
    with pytest.raises(pdm.CorruptionError, match=f"{3:020d}.json: not a regular file"):
        pdm.open_log(str(root))


def test_vacuum_passes_over_a_directory_under_segments(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "r", "wf"))
    stray = tmp_path / "log" / "segments" / "not-a-segment"
    stray.mkdir()
    old = time.time() - 7200
    os.utime(stray, (old, old))
    assert pdm.vacuum(log, grace=3600).segments_removed == 0  # it raised IsADirectoryError
    assert stray.is_dir() and pdm.open_log(str(tmp_path / "log")).head == 1
