"""The log core, one conformance suite run on local disk, memory:// and S3 (moto)."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from conftest import Root, snapshot_files

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log._manifest import Manifest, blob_path, dumps, loads, manifest_path

TS = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _run(log: pdm.EventLog, run_id: str = "run-1", tenant: str = "acme") -> pdm.CommitInfo:
    with log.transaction() as tx:
        p = tx.put_blob(tenant, f"prompt for {run_id}".encode())
        o = tx.put_blob(tenant, "sortie: ça marche ✓".encode())
        tx.append(E.RunStarted(tenant, run_id, "wf-1", labels={"team": "x"}))
        tx.append(E.AttemptDispatched(tenant, run_id, 0, "plan", 0, 1, prompt=p))
        tx.append(E.AttemptFinished(tenant, run_id, 0, "plan", 1, "succeeded", output=o,
                                    usage=E.Usage(10, 5, cost_usd=Decimal("0.0125"))))
    assert tx.commit_info is not None
    return tx.commit_info


def test_commit_reopen_and_read_back(root: Root) -> None:
    log = root.open()
    assert log.head == 0
    info = _run(log)
    assert (info.seq, info.first_lsn, info.last_lsn) == (1, 1, 3)
    info2 = _run(log, "run-2")
    assert (info2.seq, info2.first_lsn, info2.last_lsn) == (2, 4, 6)

    again = root.open()
    assert again.head == 6
    t = again.read_events()
    assert t.schema == E.LOG_SCHEMA
    assert t.column("lsn").to_pylist() == [1, 2, 3, 4, 5, 6]
    assert t.column("seq").to_pylist() == [1, 1, 1, 2, 2, 2]
    assert t.column("kind").to_pylist() == ["run_started", "attempt_dispatched",
                                            "attempt_finished"] * 2
    usage = t.column("usage")[2].as_py()
    assert usage["cost_usd"] == Decimal("0.0125") and usage["input_tokens"] == 10
    assert t.column("labels")[0].as_py() == [("team", "x")]
    out = E.event_from_row(t.slice(5, 1).to_pylist()[0])
    assert isinstance(out, E.AttemptFinished)
    assert again.blobs.get(out.output) == "sortie: ça marche ✓".encode()
    assert again.read_events(at_lsn=4).column("lsn").to_pylist() == [1, 2, 3, 4]
    assert again.read_events(at_lsn=0).num_rows == 0
    with pytest.raises(pdm.ValidationError):
        again.read_events(at_lsn=7)


def test_reused_body_is_not_uploaded_again(root: Root) -> None:
    log = root.open()
    _run(log, "run-1")
    _run(log, "run-2")  # the output body is the same bytes as run-1's
    m2 = log.read_manifest(2)
    by_staged = {b.sha256: b.staged for b in m2.blobs}
    out_sha = hashlib.sha256("sortie: ça marche ✓".encode()).hexdigest()
    assert by_staged[out_sha] is None  # reused, not staged
    assert sum(1 for s in by_staged.values() if s is not None) == 1
    log.flush()
    bodies = [f for f in log.storage.walk_files("blobs")]
    assert len(bodies) == 3


def test_blob_only_commit_has_no_lsn(root: Root) -> None:
    log = root.open()
    ref = log.blobs.put("acme", b"a body put ahead of its event")
    assert log.head == 0
    assert log.read_manifest(1).kind == "blobs"
    with log.transaction() as tx:
        tx.append(E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=ref))
    assert tx.commit_info == pdm.CommitInfo(2, 1, 1)
    assert root.open().blobs.get(ref) == b"a body put ahead of its event"


def test_same_body_two_tenants_is_two_objects_and_refs_do_not_cross(root: Root) -> None:
    log = root.open()
    a = log.blobs.put("acme", b"same bytes")
    b = log.blobs.put("globex", b"same bytes")
    log.flush()
    assert a.sha256 == b.sha256 and a.tenant != b.tenant
    assert log.storage.exists(blob_path("acme", a.sha256))
    assert log.storage.exists(blob_path("globex", b.sha256))
    assert sorted(log.storage.walk_files("blobs")) == sorted(
        [blob_path("acme", a.sha256), blob_path("globex", a.sha256)])
    only_acme = log.blobs.put("acme", b"acme secret")
    forged = pdm.BlobRef("globex", only_acme.sha256, only_acme.size)
    with pytest.raises(pdm.NotFound):
        log.blobs.get(forged)
    with pytest.raises(pdm.NotFound):
        log.blobs.get(pdm.BlobRef("acme", "0" * 64, 3))
    with pytest.raises(pdm.ValidationError):
        log.blobs.get(pdm.BlobRef("acme", "not-hex", 3))
    # an event of one tenant cannot point at another tenant's body
    pdm.vacuum(log, grace=0)  # promote what is staged: the snapshot below is at rest
    head, files = log.head, sorted(log.storage.walk_files(""))
    with pytest.raises(pdm.TenantMismatch, match="another tenant"):
        with log.transaction() as tx:
            tx.append(E.AttemptDispatched("globex", "r", 0, "s", 0, 1, prompt=only_acme))
    # the bulk path raises the same error for the same fault
    bulk = E.events_to_table([E.AttemptFinished("globex", "r", 0, "s", 1, "succeeded",
                                                output=only_acme)],
                             [datetime(2025, 1, 1, tzinfo=UTC)])
    with pytest.raises(pdm.TenantMismatch, match="row 0 .*field 'output' belongs to another"):
        with log.transaction() as tx:
            tx.extend(bulk)
    assert issubclass(pdm.TenantMismatch, pdm.ValidationError)
    pdm.vacuum(log, grace=0)
    assert (log.head, sorted(log.storage.walk_files(""))) == (head, files)


@pytest.mark.parametrize(
    "bad, field",
    [
        (E.RunStarted("acme", "bad id!", "wf"), "run_id"),
        (E.RunStarted("-acme", "r", "wf"), "tenant"),
        (E.AttemptDispatched("acme", "r", 0, "s", 0, 0), "attempt_no"),
        (E.AttemptFinished("acme", "r", 0, "s", 1, "exploded"), "state"),
        (E.AttemptDispatched("acme", "r", -1, "s", 0, 1), "branch_id"),
        (E.BranchForked("acme", "r", 1, 1, 0), "parent_branch_id"),
        (E.VerdictRecorded("acme", "r", 0, "noversion", 3, True), "verifier"),
        (E.RunFinished("acme", "r", "maybe"), "outcome"),
        (E.AttemptFinished("acme", "r", 0, "s", 1, "failed",
                           usage=E.Usage(cost_usd=0.1)), "usage.cost_usd"),  # type: ignore[arg-type]
    ],
)
def test_bad_event_rejects_whole_transaction(root: Root, bad: E.Event, field: str) -> None:
    log = root.open()
    _run(log)
    before = snapshot_files(log)
    with pytest.raises(pdm.ValidationError) as err:
        with log.transaction() as tx:
            tx.put_blob("acme", b"a body that must not survive")
            tx.append(E.RunStarted("acme", "good-run", "wf"))
            tx.append(bad)
    assert "event 1" in str(err.value) and repr(field) in str(err.value)
    pdm.vacuum(log, grace=0)
    assert snapshot_files(log) == before
    assert root.open().head == 3


def test_caught_validation_error_still_poisons_the_transaction(root: Root) -> None:
    log = root.open()
    with pytest.raises(pdm.ValidationError, match="rejected whole"):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", "r1", "wf"))
            try:
                tx.append(E.RunStarted("acme", "r 2", "wf"))
            except pdm.ValidationError:
                pass
    assert log.head == 0


def test_bulk_table_path(root: Root) -> None:
    log = root.open()
    n = 1000
    table = pa.table({
        "ts": pa.array([TS] * n, pa.timestamp("us", tz="UTC")),
        "kind": ["attempt_dispatched"] * n,
        "tenant": ["acme"] * n,
        "run_id": [f"run-{i // 10}" for i in range(n)],
        "branch_id": [0] * n,
        "step_id": ["s"] * n,
        "step_index": [i % 10 for i in range(n)],
        "attempt_no": [1] * n,
    })
    with log.transaction() as tx:
        tx.extend(table)
    assert tx.commit_info == pdm.CommitInfo(1, 1, n)
    back = root.open().read_events()
    assert back.column("run_id").to_pylist() == table.column("run_id").to_pylist()
    bad = table.set_column(7, "attempt_no", pa.array([1] * (n - 1) + [0], pa.int64()))
    with pytest.raises(pdm.ValidationError, match=r"row 999 .*'attempt_no'"):
        with log.transaction() as tx:
            tx.extend(bad)
    extra = table.drop_columns(["step_index"])
    with pytest.raises(pdm.ValidationError, match="'step_index' is required"):
        with log.transaction() as tx:
            tx.extend(extra)
    assert log.head == n


def test_table_then_more_events_replaces_the_speculative_segment(root: Root) -> None:
    """extend(table) starts writing the table's segment at once; events added after it
    make the commit write one segment of everything instead, and leave no other file."""
    log = root.open()
    n = 50
    table = pa.table({
        "ts": pa.array([TS] * n, pa.timestamp("us", tz="UTC")),
        "kind": ["verifying_entered"] * n, "tenant": ["acme"] * n,
        "run_id": [f"run-{i}" for i in range(n)],
    })
    with log.transaction() as tx:
        tx.extend(table)
        tx.append(E.RunStarted("acme", "late", "wf-1", ts=TS))
        tx.extend(table.slice(0, 3))
    assert tx.commit_info == pdm.CommitInfo(1, 1, n + 4)
    back = root.open().read_events()
    assert back.column("run_id").to_pylist() == (
        [f"run-{i}" for i in range(n)] + ["late"] + ["run-0", "run-1", "run-2"])
    segments = [p for p in snapshot_files(log) if p.startswith("segments/")]
    assert segments == [log.read_manifest(1).segments[0].path]
    with pytest.raises(pdm.ValidationError, match="row 2 .*'run_id'"):
        with log.transaction() as tx2:  # a bad table: its speculative segment is removed
            tx2.extend(table.set_column(3, "run_id", pa.array(["a", "b", "bad id"] * 16
                                                               + ["c", "d"])))
    assert [p for p in snapshot_files(log) if p.startswith("segments/")] == segments


@pytest.mark.parametrize("kind", ["BlobRef", "subclass"])
def test_ref_to_uncommitted_body_is_rejected(root: Root, kind: str) -> None:
    """Also through a subclass of BlobRef: it is a ref like any other (it once slipped past
    the commit's ref check, which looked at exact BlobRefs only)."""
    class SubRef(pdm.BlobRef):
        pass

    log = root.open()
    make = pdm.BlobRef if kind == "BlobRef" else SubRef
    ghost = make("acme", hashlib.sha256(b"never stored").hexdigest(), 12)
    with pytest.raises(pdm.ValidationError, match="no committed body"):
        with log.transaction() as tx:
            tx.append(E.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=ghost))
    assert log.head == 0


def test_flipped_byte_in_segment_is_corruption_naming_the_file(root: Root) -> None:
    log = root.open()
    _run(log)
    seg = log.read_manifest(1).segments[0].path
    data = bytearray(log.storage.read(seg))
    data[len(data) // 2] ^= 0x01
    log.storage.write(seg, bytes(data))
    with pytest.raises(pdm.CorruptionError, match=seg.split("/")[-1]):
        root.open().read_events()


def test_damaged_manifest_and_body_are_corruption(root: Root) -> None:
    log = root.open()
    _run(log)
    _run(log, "run-2")
    name = manifest_path(2)
    log.storage.write(name, log.storage.read(name)[:-7])
    with pytest.raises(pdm.CorruptionError, match=name.split("/")[-1]):
        root.open()
    log.storage.write(name, log.storage.read(name) + b"x")  # not restored: still damaged
    with pytest.raises(pdm.CorruptionError):
        root.open()


@pytest.mark.parametrize("promoted", [[3], [0], ["1"], [1.0], 1, [True]])
def test_a_manifest_announcing_what_is_not_an_earlier_seq_is_corruption(promoted: Any) -> None:
    """``promoted`` lists seqs of earlier commits (ints from 1 to seq - 1); anything else,
    with a valid checksum, is refused as damaged, naming the file."""
    good = Manifest(seq=3, txn="0" * 32, kind="append", first_lsn=1, n_events=0,
                    ts="2026-12-01T00:00:00+00:00", promoted=(1, 2))
    assert Manifest.from_bytes(good.to_bytes(), "m3").promoted == (1, 2)
    doc = loads(good.to_bytes(), "m3")
    doc["promoted"] = promoted
    with pytest.raises(pdm.CorruptionError, match=r"^m3: (promoted must list seqs of earlier "
                                                  r"commits|missing or malformed field)"):
        Manifest.from_bytes(dumps(doc), "m3")


def test_damaged_body_is_corruption(root: Root) -> None:
    log = root.open()
    ref = log.blobs.put("acme", b"precious body")
    log.flush()
    log.storage.write(blob_path("acme", ref.sha256), b"precious bodz")
    with pytest.raises(pdm.CorruptionError, match=ref.sha256):
        root.open().blobs.get(ref)


def test_open_without_create_and_bad_url() -> None:
    with pytest.raises(pdm.NotFound):
        pdm.open_log("memory://nothing-here-ever", create=False)
    with pytest.raises(pdm.PoimenError):
        pdm.open_log("nosuchproto://x/y")


def test_checkpoints_keep_open_flat_and_damaged_one_is_skipped(tmp_path) -> None:
    log = pdm.open_log(str(tmp_path / "l"), checkpoint_interval=10)
    for i in range(25):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    st = log.storage
    assert st.exists("_log/00000000000000000020.checkpoint.json")
    again = pdm.open_log(str(tmp_path / "l"))
    assert again._state.checkpoint_seq == 20 and again.head == 25
    assert again.read_events().column("run_id").to_pylist() == [f"r{i}" for i in range(25)]
    st.write("_log/00000000000000000020.checkpoint.json", b"{garbage")
    third = pdm.open_log(str(tmp_path / "l"))
    assert third._state.checkpoint_seq == 10 and third.head == 25
    assert third.read_events().num_rows == 25


def _commit_on_another_thread(log: pdm.EventLog, run_id: str) -> None:
    """Commit one event from a thread of its own, which must be done within 60 s."""
    import threading

    def commit() -> None:
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", run_id, "wf"))

    committer = threading.Thread(target=commit)
    committer.start()
    committer.join(timeout=60)
    assert not committer.is_alive()


def test_a_checkpoint_builds_its_segment_list_while_this_process_commits_on(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's segment list (a second's work at a million segments) is built
    without the log's lock, from the segments taken under it: while the build of seq 2's
    is held, another thread commits seq 3; the list lands as of seq 2, and the commit
    after it is still read."""
    import threading

    from poimen_data.log import _log as log_module
    from poimen_data.log._manifest import POINTER, checkpoint_path

    log = pdm.open_log(str(tmp_path / "l"))
    for i in range(2):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    entered, gate = threading.Event(), threading.Event()
    build = log_module.list_bytes

    def held_build(live: Any) -> bytes:
        entered.set()
        assert gate.wait(timeout=120)
        return build(live)

    monkeypatch.setattr(log_module, "list_bytes", held_build)
    written: list[int] = []
    checkpoint = threading.Thread(target=lambda: written.append(log.write_checkpoint()))
    checkpoint.start()
    try:
        assert entered.wait(timeout=60)  # seq 2's list, being built
        _commit_on_another_thread(log, "r2")  # it never waits for the build
        assert log.head_seq == 3
    finally:
        gate.set()
        checkpoint.join(timeout=120)
    assert written == [2]
    doc = json.loads(log.storage.read(checkpoint_path(2)))
    assert doc["seq"] == 2 and doc["lsn"] == 2
    [only] = doc["segment_lists"]
    listed = pa.ipc.open_file(pa.py_buffer(log.storage.read(only["path"])))
    assert listed.read_all().column("first_lsn").to_pylist() == [1, 2]
    assert json.loads(log.storage.read(POINTER))["seq"] == 2
    assert [m.seq for m in log._state.manifests_since_checkpoint] == [3]
    again = pdm.open_log(str(tmp_path / "l"))
    assert again._state.checkpoint_seq == 2 and again.head_seq == 3
    assert again.read_events().column("run_id").to_pylist() == ["r0", "r1", "r2"]


def test_a_checkpoints_segment_list_is_read_while_this_process_commits_on(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log opened at a checkpoint reads its segment list when first needed (0.65 s at
    200,000 segments): without the log's lock, so a commit meanwhile does not wait; the
    manifests applied meanwhile are applied to it."""
    import threading

    log = pdm.open_log(str(tmp_path / "l"), checkpoint_interval=2)
    for i in range(2):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))
    again = pdm.open_log(str(tmp_path / "l"))
    st = again._state
    assert st.checkpoint_seq == 2 and st._loader is not None  # not read yet
    entered, gate = threading.Event(), threading.Event()
    load = st._loader

    def held_load() -> Any:
        entered.set()
        assert gate.wait(timeout=120)
        return load()

    st._loader = held_load
    listed: list[list[int]] = []
    reader = threading.Thread(target=lambda: listed.append(
        [s.first_lsn for s in again.segments()]))
    reader.start()
    try:
        assert entered.wait(timeout=60)
        _commit_on_another_thread(again, "r2")  # it never waits for the list
        assert again.head_seq == 3
    finally:
        gate.set()
        reader.join(timeout=120)
    assert listed == [[1, 2, 3]] and st._loader is None and st._queued == []
    assert [s.first_lsn for s in again.segments()] == [1, 2, 3]


def test_read_only_open_never_writes(tmp_path) -> None:
    url = str(tmp_path / "log")
    with pytest.raises(pdm.NotFound):
        pdm.open_log(url, read_only=True)
    log = pdm.open_log(url)
    _run(log)
    before = snapshot_files(log)
    ro = pdm.open_log(url, read_only=True)
    assert ro.head == 3 and ro.read_events().num_rows == 3
    with pytest.raises(pdm.PoimenError, match="read-only"):
        ro.transaction()
    assert snapshot_files(log) == before


def test_bulk_nulls_in_required_columns_and_malformed_json_are_validation_errors(
    tmp_path,
) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    table = pa.table({"kind": ["run_started", None], "tenant": ["acme", "acme"],
                      "run_id": ["r1", "r2"], "workflow_version": ["wf", "wf"]})
    with pytest.raises(pdm.ValidationError, match=r"row 1: field 'kind' is required"):
        with log.transaction() as tx:
            tx.extend(table)
    with pytest.raises(pdm.ValidationError, match="malformed"):
        E.event_from_json({"kind": "attempt_dispatched", "tenant": "acme", "run_id": "r",
                           "branch_id": 0, "step_id": "s", "step_index": 0, "attempt_no": 1,
                           "prompt": {"tenant": "acme"}})
    with log.transaction() as tx:  # an empty table is no commit at all
        tx.extend(table.slice(0, 0))
    assert tx.commit_info == pdm.CommitInfo(None, 1, 0) and log.head_seq == 0
