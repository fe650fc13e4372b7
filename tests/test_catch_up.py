"""A writer that commits now and then to a busy log (a grader, an importer, a notebook
that labels runs) read every manifest committed since its last look before its commit
could land, one request each (2,000 commits behind on S3: tens of seconds for one
commit), and held them all until a checkpoint of its own: it now starts again from the
pointer's checkpoint once it has read an interval of them, as an open does."""

from __future__ import annotations

import hashlib
import threading

import pyarrow as pa
from conftest import Root

import poimen_data as pdm
from poimen_data import events as E


def _commit(log: pdm.EventLog, run: str) -> tuple[pdm.BlobRef, bytes]:
    body = f"prompt of {run}".encode()
    with log.transaction() as tx:
        ref = tx.put_blob("acme", body)
        tx.append(E.RunStarted("acme", run, "wf"))
        tx.append(E.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=ref))
    return ref, body


def _manifest_reads(log: pdm.EventLog) -> list[int]:
    """The seqs of the manifests ``log`` reads from now on."""
    read, seqs = log.storage.read_or_none, []

    def counted(rel: str) -> bytes | None:
        name = rel.rsplit("/", 1)[-1]
        if rel.startswith("_log/") and name.endswith(".json") and name[:-5].isdigit():
            seqs.append(int(name[:-5]))
        return read(rel)

    log.storage.read_or_none = counted  # type: ignore[method-assign]
    return seqs


def _same_log(a: pdm.EventLog, root: Root, bodies: dict[pdm.BlobRef, bytes]) -> None:
    fresh = root.open(read_only=True)
    assert a.head == fresh.head
    assert a.read_events().equals(fresh.read_events())
    for ref, data in bodies.items():
        assert a.blobs.get(ref) == data, ref
        assert fresh.blobs.get(ref) == data, ref


def test_a_writer_far_behind_commits_from_the_pointers_checkpoint(root: Root) -> None:
    busy = root.open(checkpoint_interval=10)
    rare = root.open()
    bodies = dict([_commit(rare, "rare-0")])
    for i in range(20):
        bodies.update([_commit(busy, f"busy-{i}")])
    first = next(iter(bodies))  # the rare writer's body, reduced, then committed again
    pdm.reduce(busy, [first], lambda body: b"summary")
    with busy.transaction() as tx:
        assert tx.put_blob("acme", bodies[first]) == first
        tx.append(E.RunStarted("acme", "again", "wf"))
    for i in range(20, 45):
        bodies.update([_commit(busy, f"busy-{i}")])
    busy.flush()
    head = busy.head_seq  # 48 commits: the pointer at 40
    assert head == 48
    reads = _manifest_reads(rare)
    bodies.update([_commit(rare, "rare-1")])
    assert rare.head_seq == 49  # landed at the head, right after what it missed
    # one interval (seqs 2 to 11) told it was behind: then the pointer's checkpoint at 40,
    # and only the manifests after it (a look at the seq it lost on an object store)
    missed = [s for s in reads if s <= 48]
    assert set(missed) == {*range(2, 12), *range(41, 49)}, reads  # 2 to 48 before
    assert len(missed) <= 19, reads
    assert len(rare._state.manifests_since_checkpoint) <= 10
    _same_log(rare, root, bodies)
    # it goes on committing, and writes the checkpoint its commit at seq 50 owes
    bodies.update([_commit(rare, "rare-2")])
    rare.flush()
    assert rare.head_seq == 50 and rare._state.checkpoint_seq == 50
    assert root.open(read_only=True)._state.checkpoint_seq == 50  # the pointer's
    _same_log(rare, root, bodies)
    assert pdm.episode(rare, "rare-0").branches[0].attempts[0].prompt == first


def test_a_recorder_far_behind_records_from_the_pointers_checkpoint(root: Root) -> None:
    busy = root.open(checkpoint_interval=10)
    rare = root.open()
    bodies: dict[pdm.BlobRef, bytes] = {}
    with rare.recorder(max_delay_ms=1) as rec:
        body = b"first record"
        ref = rec.ref("acme", body)
        assert rec.record([E.RunStarted("acme", "rec-0", "wf"),
                           E.AttemptDispatched("acme", "rec-0", 0, "s", 0, 1, prompt=ref)],
                          blobs={ref: body}).result().seq == 1
        bodies[ref] = body
        rare.flush()  # its promotion done: it refreshes after copying a pack's bodies out
        for i in range(44):
            bodies.update([_commit(busy, f"busy-{i}")])
        busy.flush()
        reads = _manifest_reads(rare)
        infos = []
        for k in range(1, 8):  # one window each: seqs 46 to 52, a checkpoint owed at 50
            body = f"record {k}".encode()
            ref = rec.ref("acme", body)
            infos.append(rec.record([E.RunStarted("acme", f"rec-{k}", "wf"),
                                     E.AttemptDispatched("acme", f"rec-{k}", 0, "s", 0, 1,
                                                         prompt=ref)],
                                    blobs={ref: body}).result())
            bodies[ref] = body
    assert [i.seq for i in infos] == list(range(46, 53))
    assert infos[0].first_lsn == 2 + 2 * 44 + 1
    # what it missed (seqs 2 to 45): one interval told it was behind, then only what
    # follows the pointer's checkpoint at 40 (on an object store a look at the seq it
    # lost too); each of its own windows then reads on as any recorder's does
    missed = [s for s in reads if s <= 45]
    assert set(missed) == {*range(2, 12), *range(41, 46)}, reads  # 2 to 45 before
    assert len(missed) <= 16, reads
    assert rare._state.checkpoint_seq == 50
    assert root.open(read_only=True)._state.checkpoint_seq == 50
    _same_log(rare, root, bodies)


def test_a_catch_up_while_the_writers_own_checkpoint_is_written(root: Root) -> None:
    """The writer's commit at seq 10 writes its checkpoint; while that checkpoint's
    document is being put (off the log's lock), another writer reaches seq 35 and moves
    the pointer to 30, and a read on the first writer catches up past 10. The checkpoint
    at 10 lands without moving the pointer back, the state stays the caught-up one, and
    the writer commits on at the head."""
    import threading

    busy = root.open(checkpoint_interval=10)
    rare = root.open()
    bodies: dict[pdm.BlobRef, bytes] = {}
    for i in range(9):
        bodies.update([_commit(busy, f"busy-{i}")])
    put, entered, gate = rare.storage.put_if_absent, threading.Event(), threading.Event()

    def held(rel: str, data: bytes) -> bool:
        if rel.endswith(".checkpoint.json"):
            entered.set()
            assert gate.wait(timeout=120)
        return put(rel, data)

    rare.storage.put_if_absent = held  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def commit() -> None:
        try:
            bodies.update([_commit(rare, "rare-0")])
        except BaseException as exc:  # noqa: BLE001 - asserted below
            failed.append(exc)

    t = threading.Thread(target=commit)
    t.start()
    assert entered.wait(timeout=120)  # its checkpoint at 10 is being put
    for i in range(9, 34):
        bodies.update([_commit(busy, f"busy-{i}")])
    busy.flush()
    assert busy.head_seq == 35 and root.open(read_only=True)._state.checkpoint_seq == 30
    rare.refresh()
    assert rare._state.checkpoint_seq == 30  # caught up past its own checkpoint
    gate.set()
    t.join(timeout=120)
    assert not t.is_alive() and not failed, failed
    assert root.open(read_only=True)._state.checkpoint_seq == 30  # not moved back
    assert rare.storage.exists("_log/00000000000000000010.checkpoint.json")
    assert rare._state.checkpoint_seq == 30
    assert [m.seq for m in rare._state.manifests_since_checkpoint] == list(range(31, 36))
    bodies.update([_commit(rare, "rare-1")])
    assert rare.head_seq == 36
    _same_log(rare, root, bodies)


def _blocking(log: pdm.EventLog, method: str, suffix: str
              ) -> tuple[threading.Event, threading.Event]:
    """``log.storage.<method>`` of the first file ending in ``suffix`` waits for the
    returned gate (the first event is set when it gets there)."""
    call, entered, gate = getattr(log.storage, method), threading.Event(), threading.Event()

    def held(rel: str, *args: object) -> object:
        if rel.endswith(suffix) and not entered.is_set():
            entered.set()
            assert gate.wait(timeout=120)
        return call(rel, *args)

    setattr(log.storage, method, held)
    return entered, gate


def test_a_body_repaired_before_the_checkpoint_caught_up_to_stays_repaired(
        tmp_path: object) -> None:
    """The writer's checkpoint reads the pointer's checkpoint (30), which lists a body
    lost at seq 5; while it reads it, another writer commits the body again (31) and
    moves the pointer to 40, and the checkpoint's refresh catches up there. The body was
    recorded lost again from 30's list and written into the writer's checkpoint."""
    root = Root(f"{tmp_path}/log", None, "local")
    busy = root.open(checkpoint_interval=10)
    rare = root.open()
    _commit(rare, "rare-0")
    for i in range(3):
        _commit(busy, f"busy-{i}")
    body = b"the body that gets lost"
    move = busy.storage.move

    def losing(src: str, dst: str) -> object:  # its staged file gone before promotion
        if dst.endswith(hashlib.sha256(body).hexdigest()):
            busy.storage.delete(src)
        return move(src, dst)

    busy.storage.move = losing  # type: ignore[method-assign]
    with busy.transaction() as tx:
        ref = tx.put_blob("acme", body)
        tx.append(E.RunStarted("acme", "x", "wf"))
    busy.flush()
    busy.storage.move = move  # type: ignore[method-assign]
    key = (ref.tenant, ref.sha256)
    assert busy.lost_bodies() == {key: 5}
    for i in range(3, 28):
        _commit(busy, f"busy-{i}")
    with busy.transaction() as tx:  # seq 31: committed again, repaired
        assert tx.put_blob("acme", body) == ref
        tx.append(E.RunStarted("acme", "x-again", "wf"))
    busy.flush()
    assert busy.lost_bodies() == {}
    entered, gate = _blocking(rare, "read_or_none", "00000000000000000030.checkpoint.json")
    written: list[int] = []
    t = threading.Thread(target=lambda: written.append(rare.write_checkpoint()))
    t.start()
    assert entered.wait(timeout=120)
    for i in range(28, 42):
        _commit(busy, f"busy-{i}")
    busy.flush()
    assert busy.head_seq == 45 and busy._pointer_seq() == 40
    gate.set()
    t.join(timeout=120)
    assert written == [45]
    assert rare.lost_bodies() == {}  # {key: 5} with the lost list merged after a catch-up
    assert root.open(read_only=True).lost_bodies() == {}
    assert rare.blobs.get(ref) == body


def test_a_writer_that_caught_up_writes_only_the_segments_since(tmp_path: object) -> None:
    """A writer that opened on a checkpoint (whose lists it would reuse), then caught up
    to a later one: its next checkpoint reuses that one's lists. It wrote every live
    segment again (350 rows in the lists it wrote, instead of the 10 committed since)."""
    root = Root(f"{tmp_path}/log", None, "local")
    busy = root.open(checkpoint_interval=10, durable=False)
    for i in range(300):
        _commit(busy, f"busy-{i}")
    rare = root.open()
    rare.read_events()  # its checkpoint's segment lists read: 300's
    for i in range(300, 348):
        _commit(busy, f"busy-{i}")
    put, rows = rare.storage.put_if_absent, []

    def counted(rel: str, data: bytes) -> bool:
        if ".checkpoint.segments." in rel:
            rows.append(pa.ipc.open_file(pa.py_buffer(data)).read_all().num_rows)
        return put(rel, data)

    rare.storage.put_if_absent = counted  # type: ignore[method-assign]
    _commit(rare, "rare-1")
    _commit(rare, "rare-2")  # seq 350: its checkpoint
    assert rare._state.checkpoint_seq == 350
    assert sum(rows) == 10, rows
    fresh = root.open(read_only=True)
    assert fresh._state.checkpoint_seq == 350
    assert rare.read_events().equals(fresh.read_events())
