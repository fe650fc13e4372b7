"""episode(): frozen views from the log, from materialized state, and from both (auto)."""

from __future__ import annotations

import dataclasses
import uuid
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

import poimen_data as pdm
from poimen_data import _state
from poimen_data import events as ev
from poimen_data._manifest import dumps

TS = "2026-03-01T12:00:00+00:00"


class CountingBlobs:
    """Counts ``get`` calls on its way to the real store (this test's own wrapper)."""

    def __init__(self, inner: pdm.BlobStore) -> None:
        self.inner, self.gets = inner, 0

    def get(self, ref: pdm.BlobRef) -> bytes | None:
        self.gets += 1
        return self.inner.get(ref)

    def put(self, tenant: str, data: bytes) -> pdm.BlobRef:
        return self.inner.put(tenant, data)


def commit(log: pdm.EventLog, *events: ev.Event) -> pdm.CommitInfo:
    with log.transaction() as tx:
        tx.extend(events)
    return tx.commit_info


def attempt(log: pdm.EventLog, run: str, branch: int, step: str, index: int, n: int,
            state: str, *, tenant: str = "acme", cost: str = "0.0015") -> pdm.CommitInfo:
    """One attempt as an engine records it: prompt and output captured with it."""
    with log.transaction() as tx:
        prompt = tx.put_blob(tenant, f"prompt {run}/{branch}/{step}/{n}".encode())
        tx.append(ev.AttemptDispatched(
            tenant, run, branch, step, index, n, prompt=prompt,
            context=ev.ContextPartition(("spec",), ("notes",), ()), ts=_ts()))
        output = tx.put_blob(tenant, f"output {run}/{branch}/{step}/{n}".encode())
        tx.append(ev.AttemptFinished(
            tenant, run, branch, step, n, state, output=output,
            usage=ev.Usage(input_tokens=100, output_tokens=20, cost_usd=Decimal(cost),
                           latency_ms=12.5),
            tools=ev.ToolInfo(("search",)), error="tests failed" if state == "failed" else None,
            ts=_ts()))
    return tx.commit_info


def _ts():
    from datetime import datetime

    return datetime.fromisoformat(TS)


def harness(log: pdm.EventLog, run: str = "h-1") -> dict[str, int]:
    """3 steps; 'code' fails twice before it succeeds; then a rewind at step 2 (a second
    branch re-runs 'test'). Returns the LSNs that matter."""
    commit(log, ev.RunStarted("acme", run, "wf-1", ts=_ts()))
    attempt(log, run, 0, "plan", 0, 1, "succeeded")
    attempt(log, run, 0, "code", 1, 1, "failed")
    attempt(log, run, 0, "code", 1, 2, "failed")
    attempt(log, run, 0, "code", 1, 3, "succeeded")
    attempt(log, run, 0, "test", 2, 1, "succeeded")
    verifying = commit(log, ev.VerifyingEntered("acme", run, ts=_ts())).last_lsn
    fork = commit(log, ev.BranchForked("acme", run, 1, 0, 2, ts=_ts())).last_lsn
    attempt(log, run, 1, "test", 2, 1, "succeeded")
    commit(log, ev.VerifyingEntered("acme", run, ts=_ts()))
    return {"verifying": verifying, "fork": fork}


@pytest.fixture
def log(tmp_path: Path) -> pdm.EventLog:
    return pdm.open_log(tmp_path / "log")


def test_harness_from_state_then_cold_refold_gives_the_same_bytes(log: pdm.EventLog) -> None:
    harness(log)
    assert pdm.materialize(log) == log.head
    counting = CountingBlobs(log.blobs)
    log.blobs = counting
    from_state = pdm.episode(log, "h-1", source="state")
    from_state_all = pdm.episode(log, "h-1", all_branches=True, source="state")

    log.storage.delete_tree("state")
    with pytest.raises(pdm.NotFound):
        pdm.episode(log, "h-1", source="state")
    cold = pdm.episode(log, "h-1")  # auto, no state: folds the log
    cold_all = pdm.episode(log, "h-1", all_branches=True, source="log")
    assert counting.gets == 0
    assert from_state.serialize() == cold.serialize()
    assert from_state_all.serialize() == cold_all.serialize()
    assert from_state == cold and from_state_all == cold_all

    # live branch only by default: branch 1 and its one attempt
    assert [b.branch_id for b in cold.branches] == [1]
    assert cold.live_branch == 1 and cold.branches[0].is_live
    assert [(a.step, a.attempt, a.state) for a in cold.branches[0].attempts] == \
        [("test", 1, "succeeded")]
    # both branches on request, with every attempt and failure of branch 0
    b0, b1 = cold_all.branches
    assert (b0.branch_id, b0.parent_branch_id, b0.is_live) == (0, None, False)
    assert (b1.branch_id, b1.parent_branch_id, b1.fork_step_index, b1.is_live) == \
        (1, 0, 2, True)
    assert [(a.step, a.attempt, a.state) for a in b0.attempts] == [
        ("plan", 1, "succeeded"), ("code", 1, "failed"), ("code", 2, "failed"),
        ("code", 3, "succeeded"), ("test", 1, "succeeded")]
    n_attempts = sum(len(b.attempts) for b in cold_all.branches)
    n_failed = sum(a.state == "failed" for b in cold_all.branches for a in b.attempts)
    assert (n_attempts, n_failed) == (6, 2)
    with pdm.connect(log) as con:
        assert con.execute("select n_attempts, n_failed_attempts, n_branches, live_branch, "
                           "state from runs").fetchall() == [(6, 2, 2, 1, "verifying")]
    assert counting.gets == 0


def test_views_hold_refs_and_exact_values(log: pdm.EventLog) -> None:
    harness(log)
    view = pdm.episode(log, "h-1", all_branches=True)
    a = view.branches[0].attempts[1]
    assert a.prompt == pdm.BlobRef("acme", a.prompt.sha256, len(b"prompt h-1/0/code/1"))
    assert a.output.size == len(b"output h-1/0/code/1")
    assert a.usage == ev.Usage(100, 20, None, None, Decimal("0.001500000"), 12.5)
    assert a.context == ev.ContextPartition(("spec",), ("notes",), ())
    assert a.tools == ev.ToolInfo(("search",))
    assert (a.error, a.workflow_version, a.step_index) == ("tests failed", "wf-1", 1)
    assert a.last_lsn == a.first_lsn + 1
    assert (view.run_id, view.tenant, view.workflow_version, view.state, view.at_lsn) == \
        ("h-1", "acme", "wf-1", "verifying", log.head)


def test_field_order_is_the_contract() -> None:
    names = [[f.name for f in dataclasses.fields(c)]
             for c in (pdm.EpisodeView, pdm.BranchView, pdm.AttemptView)]
    assert names == [
        ["run_id", "tenant", "workflow_version", "state", "live_branch", "at_lsn", "branches"],
        ["branch_id", "parent_branch_id", "fork_step_index", "fork_lsn", "is_live",
         "attempts"],
        ["step", "step_index", "attempt", "state", "workflow_version", "context", "prompt",
         "output", "tools", "usage", "error", "first_lsn", "last_lsn"],
    ]


def test_views_are_frozen_values(log: pdm.EventLog) -> None:
    harness(log)
    view = pdm.episode(log, "h-1", all_branches=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.state = "failed"  # type: ignore[misc]
    assert isinstance(view.branches, tuple) and isinstance(view.branches[0].attempts, tuple)
    before = view.serialize()
    attempt(log, "h-1", 1, "test", 2, 2, "failed")
    assert view.serialize() == before  # a held view never re-reads storage


def test_serialize_is_canonical_and_covers_every_field(log: pdm.EventLog) -> None:
    harness(log)
    view = pdm.episode(log, "h-1", all_branches=True)
    plain = orjson.loads(view.serialize())
    assert list(plain) == sorted(plain)
    assert set(plain) == {f.name for f in dataclasses.fields(pdm.EpisodeView)}
    assert set(plain["branches"][0]) == {f.name for f in dataclasses.fields(pdm.BranchView)}
    att = plain["branches"][0]["attempts"][0]
    assert set(att) == {f.name for f in dataclasses.fields(pdm.AttemptView)}
    assert att["usage"]["cost_usd"] == "0.001500000"
    assert att["prompt"] == view.branches[0].attempts[0].prompt.as_dict()
    # the same value spelled differently serializes the same
    a = view.branches[0].attempts[0]
    respelled = dataclasses.replace(a, usage=dataclasses.replace(a.usage,
                                                                 cost_usd=Decimal("0.0015")))
    b0 = dataclasses.replace(view.branches[0], attempts=(respelled,
                                                          *view.branches[0].attempts[1:]))
    other = dataclasses.replace(view, branches=(b0, *view.branches[1:]))
    assert other == view and other.serialize() == view.serialize()


def test_at_lsn_before_the_rewind(log: pdm.EventLog) -> None:
    lsns = harness(log)
    before = pdm.episode(log, "h-1", all_branches=True, at_lsn=lsns["fork"] - 1)
    assert (before.state, before.live_branch, before.at_lsn) == ("verifying", 0,
                                                                 lsns["fork"] - 1)
    assert [b.branch_id for b in before.branches] == [0]
    at_fork = pdm.episode(log, "h-1", all_branches=True, at_lsn=lsns["fork"])
    assert (at_fork.state, at_fork.live_branch) == ("running", 1)
    assert [(b.branch_id, len(b.attempts)) for b in at_fork.branches] == [(0, 5), (1, 0)]


def test_unknown_run_and_bad_lsn(log: pdm.EventLog) -> None:
    harness(log)
    for source in ("log", "auto"):
        with pytest.raises(pdm.NotFound, match="nope"):
            pdm.episode(log, "nope", source=source)
    pdm.materialize(log)
    for source in ("state", "auto"):
        with pytest.raises(pdm.NotFound, match="nope"):
            pdm.episode(log, "nope", source=source)
    with pytest.raises(pdm.NotFound):
        pdm.episode(log, "h-1", at_lsn=0)
    for bad in (-1, log.head + 1, "3", 2.0, True):
        with pytest.raises(pdm.ValidationError):
            pdm.episode(log, "h-1", at_lsn=bad)
    with pytest.raises(pdm.ValidationError):
        pdm.episode(log, "h-1", source="cache")
    for bad_id in ("", "has space", 7):
        with pytest.raises(pdm.ValidationError, match="run_id"):
            pdm.episode(log, bad_id)
    with pytest.raises(pdm.ValidationError):
        pdm.connect(log, at_lsn="3")


def test_state_serves_only_its_own_lsn_and_auto_tops_up(log: pdm.EventLog) -> None:
    harness(log, "h-1")
    harness(log, "h-2")
    covered = pdm.materialize(log)
    attempt(log, "h-1", 1, "test", 2, 2, "failed")  # touches h-1 only
    assert log.head > covered
    with pytest.raises(pdm.NotFound, match="covers lsn"):
        pdm.episode(log, "h-1", source="state")
    assert pdm.episode(log, "h-1", source="state", at_lsn=covered) == \
        pdm.episode(log, "h-1", source="log", at_lsn=covered)
    for run in ("h-1", "h-2"):  # touched since the state, and not
        for all_branches in (False, True):
            auto = pdm.episode(log, run, all_branches=all_branches)
            assert auto.serialize() == pdm.episode(log, run, all_branches=all_branches,
                                                   source="log").serialize()
            assert auto.at_lsn == log.head
    assert len(pdm.episode(log, "h-1").branches[0].attempts) == 2
    # a state newer than at_lsn is not used for it; auto folds the log instead
    early = pdm.episode(log, "h-1", at_lsn=5)
    assert early == pdm.episode(log, "h-1", at_lsn=5, source="log")
    assert [a.attempt for a in early.branches[0].attempts] == [1, 1]  # plan/1, code/1


def test_a_state_of_another_fold_version_is_never_served(log: pdm.EventLog) -> None:
    harness(log)
    pdm.materialize(log)
    doc = _state.read_pointer(log).to_doc()
    doc["fold_version"] = "0-older"
    log.storage.write(_state.POINTER, dumps(doc))
    with pytest.raises(pdm.NotFound, match="fold version"):
        pdm.episode(log, "h-1", source="state")
    assert pdm.episode(log, "h-1") == pdm.episode(log, "h-1", source="log")
    assert pdm.materialize(log) == log.head  # rebuilt, not served
    assert _state.read_pointer(log).fold_version == pdm._fold.FOLD_VERSION
    assert pdm.episode(log, "h-1", source="state") == pdm.episode(log, "h-1", source="log")


def test_on_memory_storage() -> None:
    root = f"memory://poimen-query-{uuid.uuid4().hex}"
    log = pdm.open_log(root)
    try:
        harness(log)
        pdm.materialize(root)
        a = pdm.episode(root, "h-1", all_branches=True, source="state")
        assert a.serialize() == pdm.episode(log, "h-1", all_branches=True,
                                            source="log").serialize()
        with pdm.connect(root) as con:
            assert con.execute("select count(*) from attempts").fetchall() == [(6,)]
            assert con.execute("select blob_text(prompt) from attempts where state = 'failed' "
                               "order by attempt_no").fetchall() == \
                [("prompt h-1/0/code/1",), ("prompt h-1/0/code/2",)]
    finally:
        log.storage.delete_tree("")
