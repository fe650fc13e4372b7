"""A read-only handle that follows a live log (the viewer, a notebook) forgets the
manifests the pointer's checkpoint covers, as a writer does after its own checkpoint:
it held every manifest it read since it opened, about 1.5 KB a commit, for ever."""

from __future__ import annotations

from conftest import Root

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log import _log as _pdm_log


def test_a_read_only_handle_forgets_what_a_checkpoint_covers(root: Root) -> None:
    writer = root.open(checkpoint_interval=10)
    reader = root.open(read_only=True)
    bodies = {}
    held = []
    for i in range(95):
        with writer.transaction() as tx:
            ref = tx.put_blob("acme", f"body {i}".encode())
            tx.append(E.RunStarted("acme", f"r{i:03d}", "wf"))
            tx.append(E.AttemptDispatched("acme", f"r{i:03d}", 0, "s", 0, 1, prompt=ref))
        bodies[ref] = f"body {i}".encode()
        if i == 40:  # a body reduced, then committed again: it stays in staging
            first = next(iter(bodies))
            pdm.reduce(writer, [first], lambda body: b"summary")
            with writer.transaction() as tx:
                assert tx.put_blob("acme", bodies[first]) == first
                tx.append(E.RunStarted("acme", "again", "wf"))
        if i % 3 == 0:
            reader.refresh()  # follows the log, as a viewer does
            held.append(len(reader._state.manifests_since_checkpoint))
    writer.flush()
    reader.refresh()
    assert max(held) <= 2 * 10 + 3, held  # 97 on a handle that never forgets
    assert reader.head == writer.head
    assert reader.read_events().equals(root.open(read_only=True).read_events())
    for ref, data in bodies.items():  # every body found, the recommitted one in staging
        assert reader.blobs.get(ref) == data, ref
    assert pdm.episode(reader, "r000").branches[0].attempts[0].prompt in bodies


def _commit_runs(writer: pdm.EventLog, n: int, start: int = 0) -> dict[object, bytes]:
    bodies = {}
    for i in range(start, start + n):
        with writer.transaction() as tx:
            ref = tx.put_blob("acme", f"body {i}".encode())
            tx.append(E.RunStarted("acme", f"r{i:03d}", "wf"))
            tx.append(E.AttemptDispatched("acme", f"r{i:03d}", 0, "s", 0, 1, prompt=ref))
        bodies[ref] = f"body {i}".encode()
    return bodies


def _manifest_reads(log: pdm.EventLog) -> list[str]:
    """Every manifest ``log`` reads from now on (its storage's reads of ``_log/<seq>.json``)."""
    read, reads = log.storage.read_or_none, []

    def counted(rel: str) -> bytes | None:
        if rel.startswith("_log/") and rel[5:].split(".")[0].isdigit() \
                and rel.endswith(".json") and ".checkpoint" not in rel:
            reads.append(rel)
        return read(rel)

    log.storage.read_or_none = counted  # type: ignore[method-assign]
    return reads


def _checkpoint_reads(log: pdm.EventLog) -> list[str]:
    """Every checkpoint ``log`` reads from now on."""
    read, reads = log.storage.read_or_none, []

    def counted(rel: str) -> bytes | None:
        if rel.endswith(".checkpoint.json"):
            reads.append(rel)
        return read(rel)

    log.storage.read_or_none = counted  # type: ignore[method-assign]
    return reads


def test_a_read_only_handle_far_behind_starts_from_the_pointers_checkpoint(
        root: Root) -> None:
    """After a pause on a busy log, a read-only handle read every manifest since, one
    request each (1,000 GETs for 1,000 commits on S3): it now reads one interval's worth,
    sees it is behind, and starts again from the pointer's checkpoint."""
    writer = root.open(checkpoint_interval=10)
    bodies = _commit_runs(writer, 3)
    reader = root.open(read_only=True)
    assert reader.head == writer.head
    bodies |= _commit_runs(writer, 40, 3)
    first = next(iter(bodies))  # a body reduced, then committed again: kept in staging
    pdm.reduce(writer, [first], lambda body: b"summary")
    with writer.transaction() as tx:
        assert tx.put_blob("acme", bodies[first]) == first
        tx.append(E.RunStarted("acme", "again", "wf"))
    bodies |= _commit_runs(writer, 52, 43)
    writer.flush()
    head_seq = writer.head_seq  # 97 commits: checkpoints up to seq 90
    assert head_seq == 97
    reads = _manifest_reads(reader)
    assert reader.head == writer.head
    # seqs 4..13 (one interval), then 91..97 after the checkpoint at 90, and the miss
    assert reads == [f"_log/{s:020d}.json" for s in [*range(4, 14), *range(91, 99)]], reads
    assert reader._state.checkpoint_seq == 90
    fresh = root.open(read_only=True)
    assert reader.read_events().equals(fresh.read_events())
    for ref, data in bodies.items():  # every body found, the recommitted one in staging
        assert reader.blobs.get(ref) == data, ref
    assert pdm.episode(reader, "r000").branches[0].attempts[0].prompt == first


def test_a_handle_behind_a_damaged_checkpoint_takes_the_one_before(root: Root) -> None:
    """The pointer's checkpoint damaged: the one before it, as an open does; every
    checkpoint past the handle damaged: it reads every manifest on, and never goes back."""
    writer = root.open(checkpoint_interval=10)
    _commit_runs(writer, 2)
    behind = root.open(read_only=True)
    far_behind = root.open(read_only=True)
    _commit_runs(writer, 45, 2)
    writer.flush()
    st = writer.storage
    st.write("_log/00000000000000000040.checkpoint.json", b"{damaged")
    reads = _manifest_reads(behind)
    assert behind.head == writer.head
    assert behind._state.checkpoint_seq == 30
    assert reads == [f"_log/{s:020d}.json" for s in [*range(3, 13), *range(31, 49)]], reads
    for seq in (10, 20, 30):
        st.write(f"_log/{seq:020d}.checkpoint.json", b"{damaged")
    reads = _manifest_reads(far_behind)
    assert far_behind.head == writer.head
    assert reads == [f"_log/{s:020d}.json" for s in range(3, 49)], reads
    fresh = root.open(read_only=True)
    for log in (behind, far_behind):
        assert log.read_events().equals(fresh.read_events())
    # a pointer whose checkpoints led nowhere is not tried again until it moves
    stale = root.open(read_only=True)
    assert stale._no_catch_up == 40  # its open's refresh tried them already
    stale._state, stale._no_catch_up = _pdm_log._State(), 0  # as a handle that read nothing
    checkpoints = _checkpoint_reads(stale)
    assert stale._catch_up().seq == 0 and len(checkpoints) == 4  # 40, 30, 20, 10
    assert stale._catch_up().seq == 0 and len(checkpoints) == 4
