"""A checkpoint's segment lists: each checkpoint writes only the lists that changed since
the one before it (poimen_data/log/_lists.py), and every reader sees the same segments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from conftest import Root
from hypothesis import given, settings
from hypothesis import strategies as st

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log._lists import (
    MAX_SEGMENT_LISTS,
    KnownLists,
    SegmentList,
    list_bytes,
    list_entry,
    list_seq,
    plan_lists,
)
from poimen_data.log._manifest import Manifest, SegmentInfo, checkpoint_path, dumps


def _commit(log: pdm.EventLog, rows: int = 1) -> None:
    with log.transaction() as tx:
        for _ in range(rows):
            tx.append(E.RunStarted("acme", f"r{log.head}", "wf"))


def _lists(log: pdm.EventLog, seq: int) -> list[tuple[int | None, int]]:
    """(the checkpoint that wrote it, its rows) for each list checkpoint ``seq`` names."""
    doc = json.loads(log.storage.read(checkpoint_path(seq)))
    return [(list_seq(e["path"].removeprefix("_log/")),
             pa.ipc.open_file(pa.py_buffer(log.storage.read(e["path"]))).read_all().num_rows)
            for e in doc["segment_lists"]]


def _lowbit(n: int) -> int:
    return n & -n


def test_each_checkpoint_writes_one_list_of_its_lowest_binary_digit(root: Root) -> None:
    """One segment a commit, a checkpoint each: checkpoint n names lists of the binary
    digits of n, largest first, and writes only the last, of n's lowest digit; before,
    each wrote all n segments again (a log's checkpoints grew with the square of its
    commits). A reader opening at any of them reads the same segments as the writer."""
    log = root.open(checkpoint_interval=1)
    written = 0
    for n in range(1, 13):
        _commit(log)
        digits = [1 << b for b in reversed(range(n.bit_length())) if n >> b & 1]
        assert [rows for _seq, rows in _lists(log, n)] == digits
        assert _lists(log, n)[-1] == (n, _lowbit(n))
        written += _lowbit(n)
        again = root.open()
        assert again._state.checkpoint_seq == n
        assert again.segments() == log.segments()
        known = again._known_lists  # read from the lists, not rebuilt from the manifests
        assert known is not None and (known.seq, len(known.lists)) == (n, len(digits))
    assert written == sum(_lowbit(n) for n in range(1, 13)) == 28  # not 1 + 2 + ... + 12


def test_a_compaction_rewrites_only_the_lists_it_took_segments_from(root: Root) -> None:
    """Eight commits of 2 events, four of 1, two of 2: checkpoint 14 names lists of 8, 4
    and 2 segments. A compaction of the four small ones (seq 15) takes segments out of the
    second list only: its checkpoint reuses the first as it is, and writes the compacted
    segment with the last two in one list."""
    log = root.open(checkpoint_interval=1)
    for rows in [2] * 8 + [1] * 4 + [2] * 2:
        _commit(log, rows)
    assert _lists(log, 14) == [(8, 8), (12, 4), (14, 2)]
    report = pdm.compact(log, target_rows=4, min_rows=2)
    assert (report.seq, report.segments_before, report.segments_after) == (15, 14, 11)
    assert _lists(log, 15) == [(8, 8), (15, 3)]
    again = root.open()
    assert again.segments() == log.segments()
    assert again.read_events().column("lsn").to_pylist() == list(range(1, 25))


def test_a_checkpoint_written_before_lists_were_shared_is_read_and_reused(
        tmp_path: Path) -> None:
    """A checkpoint of the earlier format names one ``segments_file``: opening reads it,
    the next checkpoint names that file as its first list, and vacuum keeps it while a
    checkpoint it keeps names it, after its own document is gone."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for _ in range(4):
        _commit(log)
    st = log.storage
    doc = json.loads(st.read(checkpoint_path(4)))
    [entry] = doc.pop("segment_lists")
    old = checkpoint_path(4).removesuffix(".json") + ".segments.arrow"
    st.write(old, st.read(entry["path"]))
    st.delete(entry["path"])
    doc.pop("checksum")
    doc["segments_file"] = {**entry, "path": old}
    st.delete(checkpoint_path(4))
    st.write(checkpoint_path(4), dumps(doc))
    again = pdm.open_log(str(tmp_path / "log"))
    assert again._state.checkpoint_seq == 4
    assert [s.first_lsn for s in again.segments()] == [1, 2, 3, 4]
    for _ in range(2):
        _commit(again)
    assert _lists(again, 6) == [(4, 4), (6, 2)]  # its first: the old file
    assert json.loads(st.read(checkpoint_path(6)))["segment_lists"][0]["path"] == old
    report = pdm.vacuum(again, grace=0)
    assert (report.checkpoints_removed, report.segment_lists_removed) == (1, 1)  # 2's
    for _ in range(2):
        _commit(again)
    assert _lists(again, 8) == [(8, 8)]
    report = pdm.vacuum(again, grace=0)
    assert (report.checkpoints_removed, report.segment_lists_removed) == (1, 0)  # 4's doc
    assert st.exists(old)  # 6 names it, kept: opening falls back to it
    for _ in range(2):
        _commit(again)
    assert _lists(again, 10) == [(8, 8), (10, 2)]
    report = pdm.vacuum(again, grace=0)  # 6's document and list, and 4's old file
    assert (report.checkpoints_removed, report.segment_lists_removed) == (1, 2)
    assert not st.exists(old)
    assert [s.first_lsn for s in pdm.open_log(str(tmp_path / "log")).segments()] \
        == list(range(1, 11))


def test_a_writer_behind_the_pointer_starts_from_the_pointers_lists(tmp_path: Path) -> None:
    """Several writers: one whose own last checkpoint is behind another's (the pointer)
    starts from the pointer's lists, read from its document alone (vacuum keeps those; its
    own may be gone once superseded for grace), and reads back a list it merges."""
    a = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for _ in range(8):
        _commit(a)
    assert _lists(a, 8) == [(8, 8)]
    b = pdm.open_log(str(tmp_path / "log"))
    for _ in range(2):
        _commit(b)  # checkpoint 10, by b: the pointer
    assert _lists(b, 10) == [(8, 8), (10, 2)]
    _commit(a)
    assert a.write_checkpoint() == 11  # a's own is 8: it starts from 10's
    assert _lists(a, 11) == [(8, 8), (10, 2), (11, 1)]
    _commit(b)
    assert b.write_checkpoint() == 12  # b's own (10) is behind 11: it merges a's back
    assert _lists(b, 12) == [(8, 8), (12, 4)]
    a.refresh()
    for log in (a, b, pdm.open_log(str(tmp_path / "log"))):
        assert [s.first_lsn for s in log.segments()] == list(range(1, 13))


def test_a_list_gone_before_a_checkpoint_reuses_it_is_written_again(tmp_path: Path) -> None:
    """A list the checkpoint before named, gone (vacuum, after another writer's pointer
    passed back over it): the next checkpoint looks for the lists it would reuse, and
    writes every segment again."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for _ in range(8):
        _commit(log)
    [eight] = [e["path"] for e in
               json.loads(log.storage.read(checkpoint_path(8)))["segment_lists"]]
    log.storage.delete(eight)
    for _ in range(2):
        _commit(log)
    assert _lists(log, 10) == [(10, 10)]
    assert json.loads(log.storage.read("_log/_last_checkpoint.json"))["seq"] == 10


def _removing(log: pdm.EventLog, path: str, seq: int) -> Any:
    """``log``'s put-if-absent, removing ``path`` just before it puts the checkpoint
    document at ``seq`` (as a vacuum meanwhile would)."""
    put = log.storage.put_if_absent

    def put_removing(rel: str, data: bytes) -> bool:
        if rel == checkpoint_path(seq):
            log.storage.delete(path)
        return put(rel, data)

    return put_removing


def test_a_list_gone_while_its_checkpoint_is_written_keeps_the_pointer_back(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A list removed after the checkpoint looked for it and before its document landed:
    the pointer is not moved to that checkpoint (opening goes on from the one before it),
    and the next checkpoint writes every segment again."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for _ in range(8):
        _commit(log)
    [eight] = [e["path"] for e in
               json.loads(log.storage.read(checkpoint_path(8)))["segment_lists"]]
    monkeypatch.setattr(log.storage, "put_if_absent", _removing(log, eight, 10))
    for _ in range(2):
        _commit(log)
    assert [p["path"] for p in json.loads(log.storage.read(checkpoint_path(10)))
            ["segment_lists"]][0] == eight  # named, gone
    assert json.loads(log.storage.read("_log/_last_checkpoint.json"))["seq"] == 8
    assert pdm.open_log(str(tmp_path / "log"))._state.checkpoint_seq < 10
    for _ in range(2):
        _commit(log)
    assert _lists(log, 12) == [(12, 12)]
    assert json.loads(log.storage.read("_log/_last_checkpoint.json"))["seq"] == 12
    again = pdm.open_log(str(tmp_path / "log"))
    assert again._state.checkpoint_seq == 12
    assert [s.first_lsn for s in again.segments()] == list(range(1, 13))


def test_a_checkpoint_whose_list_is_missing_is_passed_over_at_open(tmp_path: Path) -> None:
    """Opening checks every list a checkpoint names: one gone (deleted by hand) sends it
    to the checkpoint before, as a missing segments file did."""
    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for _ in range(6):
        _commit(log)
    assert _lists(log, 6) == [(4, 4), (6, 2)]
    shutil.copytree(tmp_path / "log", tmp_path / "copy")
    doc = json.loads(log.storage.read(checkpoint_path(6)))
    (tmp_path / "copy" / doc["segment_lists"][0]["path"]).unlink()  # 4's, reused by 6
    again = pdm.open_log(str(tmp_path / "copy"))
    assert again._state.checkpoint_seq == 2  # 4's list is gone too; 2's is whole
    assert [s.first_lsn for s in again.segments()] == list(range(1, 7))


# -- the plan, on its own --------------------------------------------------------------


def _seg(path: str, first: int, rows: int = 1) -> SegmentInfo:
    return SegmentInfo(path, rows, 100, "0" * 64, first, first, False)


def _manifest(seq: int, add: list[SegmentInfo], drop: list[str]) -> Manifest:
    return Manifest(seq=seq, txn=f"{seq:032x}", kind="compact" if drop else "append",
                    first_lsn=0, n_events=0, ts="2026-12-02T00:00:00+00:00",
                    segments=tuple(add), supersedes=tuple(drop))


def _written(plan: list[Any], seq: int) -> tuple[list[SegmentList], int]:
    """The lists of a plan, those to write made (named as checkpoint ``seq`` would), and
    how many segment entries were written."""
    out, rows = [], 0
    for x in plan:
        if isinstance(x, SegmentList):
            out.append(x)
            continue
        rows += len(x)
        data = list_bytes(x)
        out.append(SegmentList(list_entry(f"{seq}-{len(out)}", data, x), tuple(x)))
    return out, rows


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(0, 1000)),
                min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_a_plan_lists_every_live_segment_once_in_lsn_order(
        ops: list[tuple[int, int, int]], rnd: Any) -> None:
    """Random histories of appends, compactions of any run of consecutive segments, and
    checkpoints, each starting from the lists of the one before, held in memory or known
    from a document alone (another writer's, read back to merge): each checkpoint's lists,
    one after the other, are exactly the live segments in LSN order; there are never more
    than ``MAX_SEGMENT_LISTS``; every list no commit since took a segment out of is reused
    unless merged at the tail; and appends alone write only the binary counter's share."""
    live: dict[str, SegmentInfo] = {}
    lsn, seq, made = 1, 0, 0
    known: KnownLists | None = None
    files: dict[str, tuple[SegmentInfo, ...]] = {}
    changes: list[Manifest] = []
    checkpoints = 0

    def read(sl: SegmentList) -> tuple[SegmentInfo, ...]:
        return files[sl.entry["path"]]

    for kind, n, pick in ops:
        if kind in (0, 1):  # append n one-row segments, a commit each
            for _ in range(n):
                seq += 1
                s = _seg(f"s{made}", lsn)
                made, lsn = made + 1, lsn + 1
                live[s.path] = s
                changes.append(_manifest(seq, [s], []))
        elif kind == 2 and len(live) >= 2:  # compact a run of consecutive segments
            order = sorted(live.values(), key=lambda s: s.first_lsn)
            i = pick % (len(order) - 1)
            run = order[i:i + 2 + pick % min(n, len(order) - i - 1)]
            seq += 1
            c = _seg(f"c{made}", run[0].first_lsn, sum(s.rows for s in run))
            made += 1
            for s in run:
                del live[s.path]
            live[c.path] = c
            changes.append(_manifest(seq, [c], [s.path for s in run]))
        else:  # a checkpoint at seq
            only_appends = not any(m.supersedes for m in changes)
            plan = plan_lists(known, changes, live, read)
            lists, rows = _written(plan, seq)
            files.update((sl.entry["path"], sl.segs) for sl in lists if sl.segs is not None)
            assert [s.path for sl in lists for s in (sl.segs or read(sl))] == [
                s.path for s in sorted(live.values(), key=lambda s: s.first_lsn)]
            assert all(sl.count == len(sl.segs or read(sl)) for sl in lists)
            assert len(lists) <= MAX_SEGMENT_LISTS
            if known is not None:
                touched = {p for m in changes for p in m.supersedes}
                kept = [sl for sl in known.lists
                        if not touched & {s.path for s in (sl.segs or read(sl))}]
                reused = [sl for sl in lists if sl in known.lists]
                merged = len(kept) - len(reused)  # the tail's, into the new list
                assert reused == kept[:len(reused)] and merged >= 0
                if merged:
                    assert sum(x.count for x in kept[len(reused):]) <= lists[-1].count
                if only_appends and changes and len(lists) < MAX_SEGMENT_LISTS:
                    # the binary counter: the new segments merged with each list before
                    # them while that one holds no more, and no other list written
                    tail = sum(len(m.segments) for m in changes)
                    for x in reversed(kept[len(reused):]):
                        assert x.count <= tail
                        tail += x.count
                    assert not reused or reused[-1].count > tail
                    assert rows == tail == lists[-1].count
            checkpoints += 1
            # the next checkpoint starts from these lists, held (this process wrote
            # them), or known from the document only (another writer's)
            known = KnownLists(seq, tuple(sl if rnd.random() < 0.5 else SegmentList(sl.entry)
                                          for sl in lists))
            changes = []


def test_appends_alone_write_each_segment_about_log2_times() -> None:
    """20,000 segments, a checkpoint every 20: 1,000 checkpoints write 101,200 segment
    entries in all (each segment about 5 times), where each writing every live segment
    wrote 10 million."""
    live: dict[str, SegmentInfo] = {}
    known = None
    total = 0
    for k in range(1000):
        changes = []
        for j in range(20):
            s = _seg(f"s{k}-{j}", k * 20 + j + 1)
            live[s.path] = s
            changes.append(_manifest(k * 20 + j + 1, [s], []))
        lists, rows = _written(plan_lists(known, changes, live, _no_read), (k + 1) * 20)
        total += rows
        known = KnownLists((k + 1) * 20, tuple(lists))
    assert known is not None and len(known.lists) == bin(1000).count("1") == 6
    assert total == 20 * sum(_lowbit(n) for n in range(1, 1001)) == 101_200


def _no_read(sl: SegmentList) -> list[SegmentInfo]:
    raise AssertionError(f"read {sl.entry['path']}: its segments are held")


def test_list_names_carry_their_bytes_hash() -> None:
    """Two processes writing a checkpoint at one seq may split it differently: their lists
    never share a name unless they share their bytes."""
    from poimen_data.log._lists import list_path

    a, b = list_bytes([_seg("x", 1)]), list_bytes([_seg("x", 1), _seg("y", 2)])
    assert list_path(7, a) != list_path(7, b)
    assert list_path(7, a) == list_path(7, list_bytes([_seg("x", 1)]))
    assert list_seq(list_path(7, a).removeprefix("_log/")) == 7
    assert list_seq("00000000000000000007.checkpoint.segments.arrow") == 7
    assert [list_seq(n) for n in ("00000000000000000007.checkpoint.json",
                                  "00000000000000000007.checkpoint.segments.zz.arrow",
                                  "x7.checkpoint.segments.arrow")] == [None, None, None]


def test_threads_reading_a_fresh_logs_segments_at_once_read_the_lists_once(
        tmp_path: Path) -> None:
    """Opening leaves a checkpoint's segment lists unread; four threads asking for the
    segments at once read each list once (one reads, the others wait for it), not four
    times (at 200,000 segments, 0.65 s each)."""
    import threading

    log = pdm.open_log(str(tmp_path / "log"), checkpoint_interval=2)
    for _ in range(6):
        _commit(log)
    again = pdm.open_log(str(tmp_path / "log"))
    names = [e["path"] for e in json.loads(again.storage.read(checkpoint_path(6)))
             ["segment_lists"]]
    assert len(names) == 2
    read, reads = again.storage.read_or_none, []
    first_read, gate = threading.Event(), threading.Event()

    def held(rel: str) -> bytes | None:
        if rel in names:
            reads.append(rel)
            if len(reads) == 1:
                first_read.set()
                assert gate.wait(timeout=60)
        return read(rel)

    class Arrivals:
        """The loading lock, counting the threads that come to it."""

        def __init__(self, lock: Any) -> None:
            self.lock, self.n, self.cond = lock, 0, threading.Condition()

        def __enter__(self) -> None:
            with self.cond:
                self.n += 1
                self.cond.notify_all()
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    arrivals = Arrivals(again._loading)
    again._loading = arrivals  # type: ignore[assignment]
    again.storage.read_or_none = held  # type: ignore[method-assign]
    got: list[list[SegmentInfo]] = []
    threads = [threading.Thread(target=lambda: got.append(again.segments())) for _ in range(4)]
    threads[0].start()
    assert first_read.wait(timeout=60)  # the first thread is reading
    for t in threads[1:]:
        t.start()
    with arrivals.cond:  # the others have come to the lock
        assert arrivals.cond.wait_for(lambda: arrivals.n == 4, timeout=60)
    gate.set()
    for t in threads:
        t.join(timeout=60)
    assert sorted(reads) == sorted(names)
    assert len(got) == 4 and all(g == got[0] for g in got)
    assert [s.first_lsn for s in got[0]] == list(range(1, 7))


def test_a_writer_killed_between_its_lists_and_its_checkpoint_leaves_the_log_whole(
        proc_root: Root) -> None:
    """A child process killed once checkpoint 4's new segment list is written and its
    document is not: the log opens at checkpoint 2 and reads every event; the list left
    alone goes with vacuum; the next checkpoint is written as if nothing happened."""
    from test_log_processes import _assert_consistent, _child

    log = proc_root.open(checkpoint_interval=2)
    for _ in range(2):
        _commit(log)
    res = _child(proc_root, "record", "run-k", crash_at="checkpoint_lists_written")
    assert res.returncode == 137, res.stderr.decode()[-2000:]
    again = proc_root.open()
    assert (again._state.checkpoint_seq, again.head_seq) == (2, 4)
    assert not again.storage.exists(checkpoint_path(4))
    lone = [n for n in again.storage.list_dir("_log") if list_seq(n) == 4]
    assert len(lone) == 1
    assert again.read_events().column("run_id").to_pylist()[-2:] == ["run-k", "run-k"]
    _assert_consistent(again)
    report = pdm.vacuum(again)  # the default grace: a writer may be about to put its doc
    assert report.segment_lists_removed == 0 and again.storage.exists(f"_log/{lone[0]}")
    report = pdm.vacuum(again, grace=0, force=True)
    assert (report.checkpoints_removed, report.segment_lists_removed) == (0, 1)  # alone
    assert not any(list_seq(n) == 4 for n in again.storage.list_dir("_log"))
    for _ in range(2):
        _commit(again)
    assert _lists(again, 6) == [(6, 6)]  # 2 + 4 segments: merged
    assert [s.first_lsn for s in proc_root.open().segments()] == list(range(1, 7))


def test_a_checkpoint_never_starts_from_lists_older_than_this_processs_own(
        tmp_path: Path) -> None:
    """A thread's checkpoint read the pointer (4) before other threads of its process
    checkpointed past it (6, then 8 with a reused list removed meanwhile, so no lists are
    known after it) and another process compacted s1..s4: the commits between 4 and 8 are
    no longer among those this process keeps since its checkpoint, so 4's lists cannot be
    planned from. It writes every list again; a reader sees every event."""
    root = str(tmp_path / "log")
    a = pdm.open_log(root, checkpoint_interval=1000)
    for _ in range(4):
        _commit(a)
    assert pdm.open_log(root).write_checkpoint() == 4
    adopt, nested = a._adopt_newer_checkpoint, []

    def others_meanwhile() -> tuple[int, Any]:
        got = adopt()
        if nested:
            return got
        nested.append(True)
        _commit(a, 10)
        _commit(a, 10)
        assert a.write_checkpoint() == 6
        c = pdm.open_log(root)
        c.write_checkpoint = lambda *args, **kw: 0  # type: ignore[method-assign]
        assert pdm.compact(c, target_rows=4, min_rows=2).seq == 7
        [six] = [e["path"] for e in json.loads(a.storage.read(checkpoint_path(6)))
                 ["segment_lists"] if e["path"].startswith(f"_log/{6:020d}")]
        put = a.storage.put_if_absent
        _commit(a)
        a.storage.put_if_absent = _removing(a, six, 8)  # type: ignore[method-assign]
        assert a.write_checkpoint() == 8 and a._known_lists is None
        a.storage.put_if_absent = put  # type: ignore[method-assign]
        _commit(a)
        return got

    a._adopt_newer_checkpoint = others_meanwhile  # type: ignore[method-assign]
    assert a.write_checkpoint() == 9
    assert _lists(a, 9) == [(9, 5)]  # s1..s4 compacted into one; seqs 5, 6 (ten each), 8, 9
    fresh = pdm.open_log(root)
    assert fresh._state.checkpoint_seq == 9
    assert fresh.read_events().column("lsn").to_pylist() == list(range(1, 27))


def test_a_list_whose_name_was_taken_and_is_removed_keeps_the_pointer_back(
        tmp_path: Path, monkeypatch: Any) -> None:
    """A writer killed before its checkpoint's document left a list alone; another writing
    the same checkpoint finds its name taken (the same bytes), and a vacuum removes that
    list, old, before the document lands: the pointer stays where it was."""
    import os
    import time

    root = str(tmp_path / "log")
    log = pdm.open_log(root, checkpoint_interval=1000)
    for _ in range(2):
        _commit(log)
    assert log.write_checkpoint() == 2
    dead = pdm.open_log(root)
    for _ in range(2):
        _commit(dead)
    put = dead.storage.put_if_absent

    def killed(rel: str, data: bytes) -> bool:
        if rel == checkpoint_path(4):
            raise SystemExit("killed before its document")
        return put(rel, data)

    monkeypatch.setattr(dead.storage, "put_if_absent", killed)
    with pytest.raises(SystemExit):
        dead.write_checkpoint()
    [lone] = [n for n in os.listdir(f"{root}/_log") if list_seq(n) == 4]
    long_ago = time.time() - 3600
    os.utime(f"{root}/_log/{lone}", (long_ago, long_ago))
    w = pdm.open_log(root)
    wput, taken = w.storage.put_if_absent, []

    def vacuum_meanwhile(rel: str, data: bytes) -> bool:
        if rel == checkpoint_path(4):
            assert pdm.vacuum(root, grace=60).segment_lists_removed == 1
        ok = wput(rel, data)
        taken.append((rel, ok))
        return ok

    monkeypatch.setattr(w.storage, "put_if_absent", vacuum_meanwhile)
    assert w.write_checkpoint() == 4
    assert taken == [(f"_log/{lone}", False), (checkpoint_path(4), True)]
    assert json.loads(w.storage.read("_log/_last_checkpoint.json"))["seq"] == 2
    assert pdm.open_log(root)._state.checkpoint_seq == 2


def test_vacuum_keeps_the_lists_of_a_checkpoint_written_while_it_listed(
        tmp_path: Path, monkeypatch: Any) -> None:
    """While vacuum lists ``_log/``, a writer whose pointer was passed back over (to 6)
    writes checkpoint 7 from 6's lists; vacuum, at pointer 10, removes 6 (4 and 2 too):
    it lists ``_log/`` again, so 7's lists, which only 6 named, stay."""
    from poimen_data.log._manifest import POINTER

    root = str(tmp_path / "log")
    a = pdm.open_log(root, checkpoint_interval=2)
    for _ in range(6):
        _commit(a)
    assert _lists(a, 6) == [(4, 4), (6, 2)]
    w = pdm.open_log(root)
    w.segments()  # w's own: checkpoint 6's lists
    for _ in range(4):
        _commit(a)
    assert _lists(a, 10) == [(8, 8), (10, 2)]
    list_dir = a.storage.list_dir
    seen: list[str] = []

    def writer_meanwhile(rel: str) -> list[str]:
        names = list_dir(rel)
        if rel == "_log" and not seen:
            seen.append(rel)
            a.storage.write(POINTER, dumps({"format": "poimen-log", "version": 1, "seq": 6}))
            assert w.write_checkpoint(upto=7) == 7
            a.storage.write(POINTER, dumps({"format": "poimen-log", "version": 1, "seq": 10}))
        return names

    monkeypatch.setattr(a.storage, "list_dir", writer_meanwhile)
    report = pdm.vacuum(a, grace=0)
    assert (report.checkpoints_removed, report.segment_lists_removed) == (3, 1)  # 2's list
    assert _lists(a, 7) == [(4, 4), (6, 2), (7, 1)]  # every one there
    a.storage.write(POINTER, dumps({"format": "poimen-log", "version": 1, "seq": 7}))
    seven = pdm.open_log(root)
    assert seven._state.checkpoint_seq == 7
    assert [s.first_lsn for s in seven.segments()] == list(range(1, 11))


def test_a_checkpoint_that_finds_its_seq_taken_judges_the_document_there(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Writer a's checkpoint 10 names a list removed while it was written (its pointer
    stays at 8). Writer b, another process, writes its own checkpoint 10: its document
    loses to a's, and it looks at the lists a's names, not its own: the pointer stays."""
    root = str(tmp_path / "log")
    a = pdm.open_log(root, checkpoint_interval=2)
    for _ in range(8):
        _commit(a)
    [eight] = [e["path"] for e in json.loads(a.storage.read(checkpoint_path(8)))
               ["segment_lists"]]
    b = pdm.open_log(root)
    put = a.storage.put_if_absent
    monkeypatch.setattr(a.storage, "put_if_absent", _removing(a, eight, 10))
    for _ in range(2):
        _commit(a)
    monkeypatch.setattr(a.storage, "put_if_absent", put)
    pointer = lambda: json.loads(a.storage.read("_log/_last_checkpoint.json"))["seq"]  # noqa: E731
    assert pointer() == 8
    assert b.write_checkpoint() == 10 and b._known_lists is None
    assert pointer() == 8
    assert [s.first_lsn for s in pdm.open_log(root).segments()] == list(range(1, 11))
