"""Logs whose roots share a prefix (``log``, ``log2``, ``log-old``) or a bucket stay apart:
every job on one reads, lists and removes only its own files."""

from __future__ import annotations

import dataclasses

from conftest import Root, snapshot_files

import poimen_data as pdm
from poimen_data import events as E


def _fill(log: pdm.EventLog, tag: str) -> E.BlobRef:
    """Two runs in three commits, a body each, one body kept for a reduction."""
    with log.transaction() as tx:
        big = tx.put_blob("acme", f"{tag} long output ".encode() * 200)
        tx.append(E.RunStarted("acme", f"{tag}-1", "wf"))
        tx.append(E.AttemptDispatched("acme", f"{tag}-1", 0, "s", 0, 1))
        tx.append(E.AttemptFinished("acme", f"{tag}-1", 0, "s", 1, "succeeded", output=big))
    for i in (2, 3):
        with log.transaction() as tx:
            prompt = tx.put_blob("acme", f"{tag} prompt {i}".encode())
            tx.append(E.RunStarted("acme", f"{tag}-{i}", "wf"))
            tx.append(E.AttemptDispatched("acme", f"{tag}-{i}", 0, "s", 0, 1, prompt=prompt))
    return big


def test_jobs_on_one_root_leave_a_root_that_shares_its_prefix_alone(root: Root,
                                                                    tmp_path) -> None:
    siblings = [dataclasses.replace(root, url=root.url + suffix) for suffix in ("2", "-old")]
    others = [s.open() for s in siblings]
    for i, other in enumerate(others):
        _fill(other, f"o{i}")
    before = [snapshot_files(o) for o in others]
    log = root.open()
    big = _fill(log, "me")
    # every job of the maintenance chain, the state, a read and an export, on `log` alone
    assert (pdm.compact(log).segments_before, log.head) == (3, 7)
    assert len(pdm.reduce(log, [big], lambda b: b"summary").reduced) == 1
    pdm.vacuum(log, grace=0)
    assert pdm.materialize(log, full=True).lsn == log.head == 8
    assert pdm.check(log).ok
    con = pdm.connect(log)
    assert con.sql("select run_id from runs order by run_id").fetchall() == \
        [("me-1",), ("me-2",), ("me-3",)]
    assert pdm.export_live(log, str(tmp_path / "out.parquet"), format="parquet").records == 3
    for sibling, snap in zip(siblings, before, strict=True):
        again = sibling.open()
        assert snapshot_files(again) == snap, sibling.url  # not a byte changed, none gone
        assert again.head == 7
        pdm.materialize(again)
        assert pdm.check(again).ok
    # and the other way round: a sibling's vacuum leaves this log's files alone
    mine = snapshot_files(log)
    pdm.vacuum(others[0], grace=0)
    assert snapshot_files(root.open()) == mine
