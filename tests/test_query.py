"""episode(): frozen views from the log, from materialized state, and from both (auto)."""

from __future__ import annotations

import dataclasses
import uuid
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.fold import _fold, _state
from poimen_data.log._manifest import dumps
from poimen_data.testing import CountingBlobStore as CountingBlobs

TS = "2026-03-01T12:00:00+00:00"




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
    assert pdm.materialize(log).lsn == log.head
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
    covered = pdm.materialize(log).lsn
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
    assert pdm.materialize(log).lsn == log.head  # rebuilt, not served
    assert _state.read_pointer(log).fold_version == _fold.FOLD_VERSION
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


def test_repr_names_each_branch_its_attempts_and_failures_without_reading_a_blob(
        log: pdm.EventLog) -> None:
    harness(log)
    counting = CountingBlobs(log.blobs)
    log.blobs = counting
    view = pdm.episode(log, "h-1", all_branches=True)
    assert repr(view) == (
        "EpisodeView(run 'h-1', tenant 'acme', workflow 'wf-1', state 'verifying', "
        "live branch 1, at lsn 16, 2 branches)\n"
        "  branch 0: 5 attempts, 2 failed (code#1=failed, code#2=failed)\n"
        "  branch 1 (live, from branch 0 at step 2): 1 attempt, 0 failed")
    assert repr(pdm.episode(log, "h-1")) == (
        "EpisodeView(run 'h-1', tenant 'acme', workflow 'wf-1', state 'verifying', "
        "live branch 1, at lsn 16, 1 branch)\n"
        "  branch 1 (live, from branch 0 at step 2): 1 attempt, 0 failed")
    for n in range(2, 9):  # more failures than a line names
        attempt(log, "h-1", 1, "test", 2, n, "timed_out" if n % 2 else "failed")
    assert repr(pdm.episode(log, "h-1")).splitlines()[1] == (
        "  branch 1 (live, from branch 0 at step 2): 8 attempts, 7 failed (test#2=failed, "
        "test#3=timed_out, test#4=failed, test#5=timed_out, test#6=failed, +2 more)")
    assert counting.gets == 0


def test_repr_html_is_a_table_of_attempts_by_branch_failed_ones_marked(
        log: pdm.EventLog) -> None:
    harness(log)
    counting = CountingBlobs(log.blobs)
    log.blobs = counting
    html = pdm.episode(log, "h-1", all_branches=True)._repr_html_()
    ok = ("<tr><td>{b}</td><td>{s}</td><td>{i}</td><td>{n}</td><td>succeeded</td><td></td>"
          "<td>19 B</td><td>19 B</td><td>{lo}&ndash;{hi}</td></tr>")
    bad = ('<tr class="failed" style="background-color: #fdd"><td>0</td><td>code</td>'
           "<td>1</td><td>{n}</td><td>&#10007; failed</td><td>tests failed</td><td>19 B</td>"
           "<td>19 B</td><td>{lo}&ndash;{hi}</td></tr>")
    assert html == (
        "<p><b>run h-1</b> &middot; tenant acme &middot; workflow wf-1 &middot; state "
        "verifying &middot; live branch 1 &middot; at lsn 16</p><table><thead><tr>"
        "<th>branch</th><th>step</th><th>index</th><th>attempt</th><th>state</th>"
        "<th>error</th><th>prompt</th><th>output</th><th>lsn</th></tr></thead><tbody>"
        + ok.format(b=0, s="plan", i=0, n=1, lo=2, hi=3)
        + bad.format(n=1, lo=4, hi=5) + bad.format(n=2, lo=6, hi=7)
        + ok.format(b=0, s="code", i=1, n=3, lo=8, hi=9)
        + ok.format(b=0, s="test", i=2, n=1, lo=10, hi=11)
        + ok.format(b="1 (live) &larr; 0@2", s="test", i=2, n=1, lo=14, hi=15)
        + "</tbody></table>")
    assert counting.gets == 0


def _row_wise(r: dict) -> pdm.AttemptView:
    """The per-row conversion the column-wise builder replaced: the reference it must
    equal, value for value and spelling for spelling."""
    ctx, tools, usage = r["context"], r["tools"], r["usage"]

    def ref(d: dict | None) -> pdm.BlobRef | None:
        return None if d is None else pdm.BlobRef(d["tenant"], d["sha256"], d["size"])

    return pdm.AttemptView(
        r["step_id"], r["step_index"], r["attempt_no"], r["state"], r["workflow_version"],
        None if ctx is None else ev.ContextPartition(
            tuple(ctx["packed"] or ()), tuple(ctx["available"] or ()),
            tuple(ctx["dropped"] or ())),
        ref(r["prompt"]), ref(r["output"]),
        None if tools is None else ev.ToolInfo(tuple(tools["calls"] or ())),
        None if usage is None else ev.Usage(**usage), r["error"], r["first_lsn"],
        r["last_lsn"])


def test_views_built_column_wise_equal_the_row_wise_conversion() -> None:
    """Nulls at every level, -0.0 next to 0.0, equal values shared, sliced and chunked
    tables: each attempt equals (``==`` and ``repr``) the per-row conversion."""
    import pyarrow as pa

    from poimen_data.fold._query import episodes_from_tables

    usage = {"input_tokens": 5, "output_tokens": None, "cache_read_input_tokens": 0,
             "reasoning_tokens": None, "cost_usd": Decimal("0.1"), "latency_ms": 0.0}
    values = {
        "context": [None, {"packed": None, "available": ["a"], "dropped": []},
                    {"packed": ["a", "b"], "available": [], "dropped": ["x"]},
                    {"packed": ["a,b"], "available": None, "dropped": [""]}],
        "prompt": [None, {"tenant": "t", "sha256": "a" * 64, "size": 3},
                   {"tenant": "t", "sha256": "b" * 64, "size": 3},
                   {"tenant": None, "sha256": None, "size": None}],
        "tools": [None, {"calls": None}, {"calls": []}, {"calls": ["s", "s"]}],
        "usage": [None, usage, {**usage, "latency_ms": -0.0},
                  {**usage, "cost_usd": None, "input_tokens": None}],
    }
    rows = [{"run_id": f"r{k // 30}", "tenant": "t", "branch_id": k // 10 % 3,
             "step_id": f"s{k % 3}", "step_index": None if k % 7 == 0 else k % 10,
             "attempt_no": k, "state": ("failed", "succeeded")[k % 2],
             "workflow_version": None if k % 5 else "w",
             "context": values["context"][k % 4], "prompt": values["prompt"][k * 3 % 4],
             "output": values["prompt"][k % 4], "tools": values["tools"][k * 5 % 4],
             "usage": values["usage"][k * 7 % 4], "error": None if k % 2 else "boom",
             "recovered": False, "first_lsn": k, "last_lsn": k + 1} for k in range(90)]
    schemas = _state.table_schemas()
    attempts = pa.Table.from_pylist(rows, schema=schemas["attempts"])
    branches = pa.Table.from_pylist(
        [{"run_id": f"r{r}", "branch_id": b, "parent_branch_id": b - 1 if b else None,
          "fork_step_index": 3 if b else None, "fork_lsn": 9 if b else None,
          "is_live": b == 1} for r in range(3) for b in (0, 1) if (r, b) != (1, 0)],
        schema=schemas["branches"])
    runs = pa.Table.from_pylist(
        [{"run_id": f"r{r}", "tenant": "t", "workflow_version": "w", "state": "verifying",
          "live_branch": 1} for r in range(4)], schema=schemas["runs"])
    chunked = pa.concat_tables([attempts.slice(0, 17), attempts.slice(17, 40),
                                attempts.slice(57)])
    built = {}
    for name, att in (("whole", attempts), ("chunked", chunked), ("sliced", attempts.slice(31))):
        views = built[name] = list(episodes_from_tables(
            {"runs": runs, "branches": branches, "attempts": att}, at_lsn=5))
        want: dict[tuple[str, int], list[pdm.AttemptView]] = {}
        for r in att.to_pylist():
            want.setdefault((r["run_id"], r["branch_id"]), []).append(_row_wise(r))
        got = {(v.run_id, b.branch_id): list(b.attempts) for v in views for b in v.branches}
        for key, held in got.items():
            expected = want.get(key, [])
            assert held == expected and repr(held) == repr(expected), (name, key)
        assert [v.run_id for v in views] == ["r0", "r1", "r2", "r3"]
        assert ("r1", 0) not in got  # attempts on a branch no fork created: left out
        assert views[3].branches == ()  # a run without branch rows
    every = [a for v in built["whole"] for b in v.branches for a in b.attempts]
    shared = [a.usage for a in every
              if a.usage == ev.Usage(**usage) and str(a.usage.latency_ms) == "0.0"]
    assert len(shared) > 1 and len({id(u) for u in shared}) == 1  # built once, shared
    assert {repr(a.usage.latency_ms) for a in every
            if a.usage is not None and a.usage.latency_ms == 0.0} == {"0.0", "-0.0"}
