"""Reduction, vacuum, compaction, and the races of content addressing (real processes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from conftest import Root
from test_log_processes import CHILD, _assert_consistent, _env

import poimen_data as pdm
from poimen_data import events as E
from poimen_data import synth
from poimen_data.jobs._maint import lease
from poimen_data.log._lists import list_seq
from poimen_data.log._manifest import POINTER, blob_path, checkpoint_path, dumps


def _digest(t: pa.Table) -> str:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t.combine_chunks())
    return hashlib.sha256(sink.getvalue()).hexdigest()


def test_reduce_replaces_body_by_summary(root: Root) -> None:
    log = root.open()
    with log.transaction() as tx:
        big = tx.put_blob("acme", b"very long output " * 1000)
        tx.append(E.RunStarted("acme", "r", "wf"))
        tx.append(E.AttemptDispatched("acme", "r", 0, "s", 0, 1))
        tx.append(E.AttemptFinished("acme", "r", 0, "s", 1, "succeeded", output=big))
    rep = pdm.reduce(log, [big], lambda b: b"summary: " + str(len(b)).encode())
    assert len(rep.reduced) == 1 and rep.bytes_freed == big.size and rep.lsn == 4
    summary = rep.reduced[0][1]
    again = root.open()
    assert again.blobs.get(big) is None
    assert again.blobs.get(summary) == b"summary: 17000"
    assert not again.storage.exists(blob_path("acme", big.sha256))
    last = E.event_from_row(again.read_events().slice(3).to_pylist()[0])
    assert last == E.BlobReduced("acme", big, summary, ts=last.ts)
    assert pdm.reduce(again, [big], lambda b: b"x").skipped == (big,)
    with pytest.raises(pdm.ValidationError, match="body itself"):
        pdm.reduce(again, [summary], lambda b: b)
    _assert_consistent(again)


def test_lease_is_exclusive(root: Root) -> None:
    log = root.open()
    with lease(log):
        with pytest.raises(pdm.LeaseHeld):
            pdm.vacuum(log, grace=0)
    assert pdm.vacuum(log, grace=0).bodies_removed == 0  # released


def test_compact_keeps_every_event_and_lsn(root: Root) -> None:
    log = root.open()
    for i in range(60):
        with log.transaction() as tx:
            tx.append(E.AttemptDispatched("acme", f"r{i % 7}", 0, "s", i, 1))
            tx.append(E.AttemptFinished("acme", f"r{i % 7}", 0, "s", 1, "failed"))
    before = log.read_events()
    at_50 = log.read_events(at_lsn=50)
    rep = pdm.compact(log, target_rows=50)
    assert (rep.segments_before, rep.rewritten) == (60, 60)
    assert rep.segments_after == 3 and len(log.segments()) == 3
    for seg in log.segments():  # one record batch each: scans pay no per-old-segment cost
        reader = pa.ipc.open_file(pa.py_buffer(log.storage.read(seg.path)))
        assert reader.num_record_batches == 1
    fresh = root.open()
    assert _digest(fresh.read_events()) == _digest(before)
    assert _digest(fresh.read_events(at_lsn=50)) == _digest(at_50)
    kept = pdm.vacuum(fresh, grace=0, retention=3600)  # superseded, not for an hour yet
    assert (kept.segments_removed, kept.kept_young) == (0, 60)
    v = pdm.vacuum(fresh, grace=0)
    assert v.segments_removed == 60
    assert len(list(fresh.storage.walk_files("segments"))) == 3
    assert _digest(root.open().read_events()) == _digest(before)
    assert fresh.read_manifest(61).kind == "compact"
    # appends after compaction continue the LSNs
    with fresh.transaction() as tx:
        tx.append(E.RunStarted("acme", "after", "wf"))
    assert tx.commit_info == pdm.CommitInfo(62, 121, 121)


def _start(root: Root, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CHILD, args[0], root.url, *args[1:]],
                            env=_env(root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _wait_for(p: subprocess.Popen, word: bytes) -> None:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line == word + b"\n", (line, p.stderr.read() if p.stderr else b"")


class _Clock:
    """A clock the test moves by hand (the lease's TTL is about time, not rendezvous)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_lease_renewed_while_held_and_a_lost_lease_stops_maintenance(root: Root) -> None:
    log = root.open()
    clock = _Clock()
    with lease(log, ttl_s=10, renew=False, clock=clock) as held:
        clock.now += 8
        assert held.renew()  # what the renewer thread does every ttl/3
        clock.now += 5  # past the first expiry, before the renewed one
        with pytest.raises(pdm.LeaseHeld, match="held by"):
            with lease(log, clock=clock, renew=False):
                pass
        held.check()  # still ours
        clock.now += 10  # stalled past the renewed expiry: another process takes over
        with lease(log, clock=clock, renew=False) as other:
            assert not held.renew() and held.lost
            with pytest.raises(pdm.LeaseHeld, match="taken over"):
                held.check()
            assert other.renew()  # ours never touched the new holder's lease
    with lease(log, ttl_s=10, renew=False, clock=clock) as held:
        log.storage.write("_lease.json", b'{"owner": "someone else", "expires": 1e12}')
        held.check()  # the file is read at most every TTL/10 ...
        clock.now += 1
        with pytest.raises(pdm.LeaseHeld):  # ... and then names another owner
            held.check()
    assert log.storage.read("_lease.json") == b'{"owner": "someone else", "expires": 1e12}'
    log.storage.delete("_lease.json")
    with lease(log) as held:  # the real renewer thread: started, and joined at release
        assert held._renewer is not None and held._renewer.is_alive()
    assert not held._renewer.is_alive()
    assert log.storage.read_or_none("_lease.json") is None


def _release(p: subprocess.Popen) -> None:
    assert p.stdin is not None
    p.stdin.write(b"go\n")
    p.stdin.flush()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-2000:]


@pytest.mark.parametrize("rep", range(3))
def test_race_vacuum_while_writer_is_staged(proc_root: Root, rep: int) -> None:
    log = proc_root.open()
    writer = _start(proc_root, "paused", f"run-{rep}", f"fresh body {rep}")
    _wait_for(writer, b"staged")
    report = pdm.vacuum(log)  # default grace: the writer's staging is young
    assert report.staging_removed == 0 and report.kept_young >= 1
    _release(writer)
    after = proc_root.open()
    assert after.head == 1
    ref = E.event_from_row(after.read_events().to_pylist()[0]).prompt
    assert after.blobs.get(ref) == f"fresh body {rep}".encode()
    pdm.vacuum(after, grace=0)
    _assert_consistent(proc_root.open())


@pytest.mark.parametrize("rep", range(3))
def test_race_writer_reuses_body_while_reduce_deletes_it(proc_root: Root, rep: int) -> None:
    log = proc_root.open()
    body = f"shared body {rep} " * 20
    with log.transaction() as tx:
        ref = tx.put_blob("acme", body.encode())
        tx.append(E.AttemptDispatched("acme", "old", 0, "s", 0, 1, prompt=ref))
    writer = _start(proc_root, "paused", "new", body)
    _wait_for(writer, b"staged")  # the writer decided to reuse the committed body
    pdm.reduce(log, [ref], lambda b: b"short")
    assert not log.storage.exists(blob_path("acme", ref.sha256))
    _release(writer)
    after = proc_root.open()
    assert after.head == 3
    events = after.read_events().to_pylist()
    assert [e["kind"] for e in events] == ["attempt_dispatched", "blob_reduced",
                                           "attempt_dispatched"]
    # committed after the reduction: its body is there again, staged by the writer
    assert after.blobs.get(ref) == body.encode()
    pdm.vacuum(after, grace=0)
    again = proc_root.open()
    assert again.blobs.get(ref) == body.encode()
    _assert_consistent(again)


@pytest.mark.parametrize("rep", range(2))
def test_race_vacuum_while_writer_reuses_body(proc_root: Root, rep: int) -> None:
    log = proc_root.open()
    with log.transaction() as tx:
        ref = tx.put_blob("acme", b"kept body")
        tx.append(E.AttemptDispatched("acme", "old", 0, "s", 0, 1, prompt=ref))
    writer = _start(proc_root, "paused", "new", "kept body")
    _wait_for(writer, b"staged")
    pdm.vacuum(log, grace=0)  # the body is committed: vacuum must keep it
    _release(writer)
    after = proc_root.open()
    assert after.blobs.get(ref) == b"kept body"
    _assert_consistent(after)


@pytest.mark.parametrize("rep", range(2))
def test_race_compaction_while_appending(proc_root: Root, rep: int) -> None:
    log = proc_root.open()
    n0 = 30 if proc_root.backend == "local" else 10
    for i in range(n0):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"pre-{i}", "wf"))
    n = 40 if proc_root.backend == "local" else 10
    writer = _start(proc_root, "append", "w", str(n))
    _wait_for(writer, b"ready")
    assert writer.stdin is not None
    writer.stdin.write(b"go\n")
    writer.stdin.flush()
    rep_c = pdm.compact(log, target_rows=1000)
    assert rep_c.rewritten >= n0
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err.decode()[-2000:]
    after = proc_root.open()
    t = after.read_events()
    assert t.column("lsn").to_pylist() == list(range(1, n0 + n + 1))
    assert t.column("run_id").to_pylist()[:n0] == [f"pre-{i}" for i in range(n0)]
    assert t.filter(pa.compute.equal(t.column("run_id"), "run-w")).column(
        "step_index").to_pylist() == list(range(n))
    pdm.vacuum(after, grace=0)
    _assert_consistent(proc_root.open())


def test_vacuum_removes_state_files_a_crashed_materialize_left(tmp_path: Path) -> None:
    from poimen_data import synth

    url = str(tmp_path / "log")
    log = pdm.open_log(url)
    synth.generate(log, runs=6, seed=3, batch=8)
    pdm.materialize(log)
    kept = sorted(log.storage.walk_files("state"))
    synth.generate(log, runs=3, seed=4, batch=8, prefix="more")
    env = dict(os.environ, POIMEN_CRASH_AT="state_written")
    res = subprocess.run([sys.executable, "-c", "import sys, poimen_data as p; "
                          "p.materialize(p.open_log(sys.argv[1]))", url],
                         env=env, capture_output=True, timeout=120)
    assert res.returncode == 137, res.stderr.decode()[-2000:]
    orphans = sorted(set(log.storage.walk_files("state")) - set(kept))
    assert orphans  # the crashed run wrote files no pointer names
    with pytest.raises(pdm.WritersActive, match="state/_pending/"):
        pdm.vacuum(log, grace=0)  # seconds old: they may be a live materialize's
    assert sorted(set(log.storage.walk_files("state")) - set(kept)) == orphans
    report = pdm.vacuum(log, grace=0, force=True)  # its process is known dead
    assert report.state_files_removed == len(orphans)
    assert sorted(log.storage.walk_files("state")) == kept
    assert pdm.check(log).ok


def test_vacuum_removes_temp_files_a_dead_writer_left_under_log(tmp_path: Path) -> None:
    """A writer killed between its manifest's temp file and the link leaves
    ``_log/.tmp-<uuid>`` (and a pointer writer ``…json.tmp-<uuid>``): vacuum removes them
    once older than grace, and nothing else under ``_log/``."""
    log = pdm.open_log(str(tmp_path / "log"))
    synth.generate(log, runs=3, seed=5, batch=4)
    before = sorted(log.storage.list_dir("_log"))
    dead = ["_log/.tmp-0123456789abcdef", "_log/_last_checkpoint.json.tmp-fedcba9876543210"]
    for p in dead:
        log.storage.write(p, b'{"seq": 99')  # half a manifest
    assert pdm.vacuum(log, grace=3600).temp_files_removed == 0  # young: maybe a live writer
    with pytest.raises(pdm.WritersActive, match=r"_log/\.tmp-0123456789abcdef"):
        pdm.vacuum(log, grace=0)  # so young that a writer may be linking it right now
    report = pdm.vacuum(log, grace=0, force=True)
    assert report.temp_files_removed == 2
    assert sorted(log.storage.list_dir("_log")) == before
    assert pdm.open_log(str(tmp_path / "log")).head == log.head


def test_vacuum_keeps_the_two_newest_checkpoints_at_or_below_the_pointer(root: Root) -> None:
    """Each checkpoint lists every live segment: kept for ever, a never-compacted log's
    checkpoints grow with the square of its commits. Vacuum removes those below the two
    newest at or below the pointer's seq, once older than grace; one past the pointer is
    kept; opening still starts from the pointer's, and falls back to the one before it."""
    log = root.open(checkpoint_interval=2)
    for i in range(10):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    st = log.storage

    def checkpoints() -> list[int]:
        return sorted(int(n.split(".")[0]) for n in st.list_dir("_log")
                      if n.endswith(".checkpoint.json"))

    assert checkpoints() == [2, 4, 6, 8, 10]
    # each checkpoint wrote one segment list; 10 reuses 8's (8 segments) and adds its own
    assert _lists_named(st, 10) == [8, 10]
    report = pdm.vacuum(log, grace=3600)
    assert (report.checkpoints_removed, report.kept_young) == (0, 6)  # young: 2, 4, 6
    sizes = sum(st.size(p) or 0 for p in _written(st, [2, 4, 6]))
    report = pdm.vacuum(log, grace=0)
    assert (report.checkpoints_removed, report.bytes_removed) == (3, sizes)
    assert checkpoints() == [8, 10] and all(st.exists(p) for p in _written(st, [8, 10]))
    assert not any(st.exists(p) for p in _written(st, [2, 4, 6]))
    again = root.open()
    assert (again._state.checkpoint_seq, again.head_seq) == (10, 10)
    assert again.read_events().column("run_id").to_pylist() == [f"r{i}" for i in range(10)]
    early = root.open()  # at checkpoint 10, its segment list not read yet
    for i in range(10, 14):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    assert checkpoints() == [8, 10, 12, 14]
    # a pointer behind the newest checkpoint (its writer's pointer not written yet)
    st.write(POINTER, dumps({"format": "poimen-log", "version": 1, "seq": 12}))
    assert pdm.vacuum(log, grace=0).checkpoints_removed == 1  # 8; 14 is past the pointer
    assert checkpoints() == [10, 12, 14]
    assert _lists_named(st, 14) == [8, 12, 14]  # 8's list stays, reused
    [eights] = _written(st, [8])[1:]
    assert not st.exists(checkpoint_path(8)) and st.exists(eights)
    st.write(checkpoint_path(12), b"{garbage")  # the pointer's, damaged
    third = root.open()
    assert (third._state.checkpoint_seq, third.head_seq) == (10, 14)
    assert third.read_events().column("run_id").to_pylist() == [f"r{i}" for i in range(14)]
    _assert_consistent(third)
    st.write(POINTER, dumps({"format": "poimen-log", "version": 1, "seq": 14}))
    assert pdm.vacuum(log, grace=0).checkpoints_removed == 1 and checkpoints() == [12, 14]
    # a reader whose checkpoint went rebuilds its segment list from the manifests
    assert early.read_events().column("run_id").to_pylist() == [f"r{i}" for i in range(14)]


def test_vacuum_keeps_the_checkpoint_opening_falls_back_to(root: Root) -> None:
    """When the pointer's checkpoint is damaged, opening tries the earlier multiples of
    the interval: vacuum keeps the newest complete one of those, not a compaction's at
    another seq, and a segment list whose document never landed counts for nothing (it
    goes)."""
    log = root.open(checkpoint_interval=4)

    def commit(n: int) -> None:
        for _ in range(n):
            with log.transaction() as tx:
                tx.append(E.RunStarted("acme", f"r{log.head_seq}", "wf"))

    def checkpoints() -> list[int]:
        return sorted(int(n.split(".")[0]) for n in log.storage.list_dir("_log")
                      if n.endswith(".checkpoint.json"))

    def lists() -> list[int]:  # the checkpoints that wrote the lists there
        return sorted(s for n in log.storage.list_dir("_log")
                      if (s := list_seq(n)) is not None)

    commit(9)
    assert pdm.compact(log).seq == 10  # its checkpoint at 10, not a multiple of 4
    commit(2)
    assert checkpoints() == [4, 8, 10, 12]
    assert pdm.vacuum(log, grace=0).checkpoints_removed == 2
    assert checkpoints() == [8, 12] == lists()
    commit(4)  # checkpoint 16 (its list merges 12's: 3 <= 4 segments)
    assert _lists_named(log.storage, 16) == [16]
    log.storage.delete(checkpoint_path(12))  # its document lost (its put failed)
    report = pdm.vacuum(log, grace=0)
    assert (report.checkpoints_removed, report.segment_lists_removed) == (0, 1)  # 12's
    assert checkpoints() == [8, 16] == lists()
    log.storage.write(checkpoint_path(16), b"{garbage")
    again = root.open()
    assert (again._state.checkpoint_seq, again.head_seq) == (8, 16)
    assert again.read_events().column("run_id").to_pylist() == [f"r{i}" for i in range(9)] \
        + [f"r{i}" for i in range(10, 16)]


def test_vacuum_counts_a_checkpoints_grace_from_when_a_newer_one_superseded_it(
        tmp_path: Path) -> None:
    """A checkpoint written long ago but superseded a moment ago may still be what a
    reader just opened at: grace runs from its successor's writing, not its own."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for i in range(10):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    long_ago = time.time() - 7200
    two_four = _written(log.storage, [2, 4])
    for p in _written(log.storage, [2, 4, 6]):  # written two hours ago; 8 and 10 just now
        os.utime(log.storage.full(p), (long_ago, long_ago))
    report = pdm.vacuum(log, grace=3600)
    assert (report.checkpoints_removed, report.kept_young) == (2, 2)  # 2 and 4; 6 kept
    assert sorted(int(n.split(".")[0]) for n in log.storage.list_dir("_log")
                  if n.endswith(".checkpoint.json")) == [6, 8, 10]
    # 4's list stays: 6 names it; 2's goes
    assert _lists_named(log.storage, 6) == [4, 6]
    assert [log.storage.exists(p) for p in two_four] == [False, False, False, True]


def _lists_named(st: Any, seq: int) -> list[int]:
    """The checkpoints that wrote the segment lists checkpoint ``seq`` names, in order."""
    doc = json.loads(st.read(checkpoint_path(seq)))
    return [list_seq(e["path"].removeprefix("_log/")) for e in doc["segment_lists"]]


def _written(st: Any, seqs: list[int]) -> list[str]:
    """The documents of those checkpoints, then the segment lists they wrote."""
    return [checkpoint_path(s) for s in seqs] + sorted(
        f"_log/{n}" for n in st.list_dir("_log") if list_seq(n) in seqs)


_COMPACT_CHILD = r"""
import sys
import poimen_data as pdm

def peak_kib():  # this process's own peak: ru_maxrss would start at the parent's
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

log = pdm.open_log(sys.argv[1], create=False)
log.segments()
base = peak_kib()
report = pdm.compact(log)
print(report.rewritten, report.written, (peak_kib() - base) >> 10)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM (Linux)")
def test_compacting_thousands_of_tiny_segments_holds_a_few_hundred_at_a_time(
        tmp_path: Path) -> None:
    """A recorder's log is many segments of a few events. Compacting 3,000 one-event
    segments into one, in a child, adds 62 MB to its peak RSS here (192 MB when every
    segment read stayed held until the group was written, and 3.3 GB for 50,509)."""
    root = tmp_path / "log"
    log = pdm.open_log(root, durable=False, checkpoint_interval=100_000)
    for i in range(3_000):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    env = {k: v for k, v in os.environ.items() if k != "POIMEN_CRASH_AT"}
    res = subprocess.run([sys.executable, "-c", _COMPACT_CHILD, str(root)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rewritten, written, added_mib = map(int, res.stdout.split())
    assert (rewritten, written) == (3_000, 1)
    assert added_mib < 120, added_mib
    again = pdm.open_log(root)
    assert len(again.segments()) == 1
    assert again.read_events().column("run_id").to_pylist() == [f"r{i}" for i in range(3_000)]


def test_gathered_copies_the_batches_together_a_few_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from poimen_data.jobs import _maint

    monkeypatch.setattr(_maint, "GATHER_BATCHES", 3)
    log = pdm.open_log(f"memory://poimen-gather-{os.getpid()}-{time.monotonic_ns()}")
    for i in range(10):
        with log.transaction() as tx:
            tx.extend([E.RunStarted("acme", f"r{i}-{k}", "wf") for k in range(4)])
    batches = list(log.scan())
    assert len(batches) == 10
    got = _maint._gathered(iter(batches))
    assert got.num_rows == 40 and len(got.to_batches()) == 1
    assert got.equals(log.read_events().combine_chunks())
    assert _maint._gathered(iter([])).num_rows == 0


def test_a_scan_keeps_remote_segments_up_to_its_budget(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Remote segments a scan read are kept while their total stays within
    ``SCAN_CACHE_BYTES`` (a running total: a recorder's log has thousands of tiny ones)."""
    log = pdm.open_log(f"memory://poimen-scan-{os.getpid()}-{time.monotonic_ns()}")
    for i in range(6):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    sizes = [s.size for s in log.segments()]
    monkeypatch.setattr(type(log), "SCAN_CACHE_BYTES", sum(sizes[:4]))
    assert sum(b.num_rows for b in log.scan()) == 6
    assert sorted(log._scan_cache) == sorted(s.path for s in log.segments()[:4])
    assert log._scan_cache_bytes == sum(sizes[:4])
    assert sum(b.num_rows for b in log.scan()) == 6  # again: nothing counted twice
    assert log._scan_cache_bytes == sum(sizes[:4]) and len(log._scan_cache) == 4


def test_reduce_whose_summary_equals_another_reduced_body(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))

    def summarize(b: bytes) -> bytes:
        return b"[dropped %d bytes]" % len(b)

    c = log.blobs.put("acme", b"c" * 100)
    s1 = pdm.reduce(log, [c], summarize).reduced[0][1]
    a = log.blobs.put("acme", b"a" * 100)
    rep = pdm.reduce(log, [a, s1], summarize)  # a's summary is s1's bytes, s1 reduced too
    assert [o for o, _ in rep.reduced] == [a, s1]
    again = pdm.open_log(str(tmp_path / "log"))  # the log still opens
    assert (again.blobs.get(a), again.blobs.get(c), again.blobs.get(s1)) == (None, None, None)


def test_recommitted_body_stays_usable_after_vacuum_and_reduce_removes_every_copy(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "log")
    log = pdm.open_log(url)
    x = log.blobs.put("acme", b"body x " * 10)
    pdm.reduce(log, [x], lambda b: b"x'")
    assert log.blobs.put("acme", b"body x " * 10) == x  # committed again: kept in staging
    assert log.blobs.get(x) == b"body x " * 10
    pdm.vacuum(log, grace=0)  # promotes it under the lease
    for opened in (log, pdm.open_log(url)):
        with opened.transaction() as tx:
            tx.append(E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=x))
    log.write_checkpoint()
    fresh = pdm.open_log(url)
    rep = pdm.reduce(fresh, [x], lambda b: b"x''")
    assert rep.bytes_freed == x.size
    assert not any(x.sha256 in f for f in fresh.storage.walk_files(""))


def test_reduce_rejects_a_summarizer_that_returns_no_bytes(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    x = log.blobs.put("acme", b"body")
    with pytest.raises(pdm.ValidationError, match="summarize must return bytes or str"):
        pdm.reduce(log, [x], lambda b: 3)  # type: ignore[arg-type, return-value]
    assert log.blobs.get(x) == b"body"
