"""The fold's rules (docs/DESIGN.md, "Domain") and the views' shape ("SQL views"), on real
DuckDB over real logs; and the golden log, whose fold digest is pinned.

Re-pin the golden digest only on purpose: ``.venv/bin/python tests/test_fold.py --pin``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import orjson
import pyarrow as pa
import pytest

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.fold import _fold
from poimen_data.testing import CountingBlobStore as CountingBlobs

GOLDEN = Path(__file__).parent / "data" / "golden"
T = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
T2 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
REF = "STRUCT(tenant VARCHAR, sha256 VARCHAR, size BIGINT)"
USAGE = ("STRUCT(input_tokens BIGINT, output_tokens BIGINT, cache_read_input_tokens BIGINT, "
         "reasoning_tokens BIGINT, cost_usd DECIMAL(18,9), latency_ms DOUBLE)")
CONTEXT = "STRUCT(packed VARCHAR[], available VARCHAR[], dropped VARCHAR[])"
ATTEMPT_COLUMNS = [
    ("run_id", "VARCHAR"), ("tenant", "VARCHAR"), ("branch_id", "BIGINT"),
    ("step_id", "VARCHAR"), ("step_index", "BIGINT"), ("attempt_no", "BIGINT"),
    ("state", "VARCHAR"), ("workflow_version", "VARCHAR"), ("context", CONTEXT),
    ("prompt", REF), ("output", REF), ("tools", "STRUCT(calls VARCHAR[])"), ("usage", USAGE),
    ("error", "VARCHAR"), ("recovered", "BOOLEAN"), ("first_lsn", "BIGINT"),
    ("last_lsn", "BIGINT")]
VIEW_COLUMNS = {
    "runs": [("run_id", "VARCHAR"), ("tenant", "VARCHAR"), ("workflow_version", "VARCHAR"),
             ("state", "VARCHAR"), ("live_branch", "BIGINT"), ("n_branches", "BIGINT"),
             ("n_attempts", "BIGINT"), ("n_failed_attempts", "BIGINT"),
             ("cost_usd", "DECIMAL(38,9)"), ("started_at", "TIMESTAMP WITH TIME ZONE"),
             ("ended_at", "TIMESTAMP WITH TIME ZONE"), ("verifying_lsn", "BIGINT"),
             ("last_lsn", "BIGINT")],
    "branches": [("run_id", "VARCHAR"), ("branch_id", "BIGINT"),
                 ("parent_branch_id", "BIGINT"), ("fork_step_index", "BIGINT"),
                 ("fork_lsn", "BIGINT"), ("is_live", "BOOLEAN")],
    "attempts": ATTEMPT_COLUMNS,
    "trajectories": [*ATTEMPT_COLUMNS, ("trajectory_branch_id", "BIGINT"),
                     ("is_live", "BOOLEAN")],
    "verdicts": [("run_id", "VARCHAR"), ("tenant", "VARCHAR"), ("branch_id", "BIGINT"),
                 ("verifier", "VARCHAR"), ("snapshot_lsn", "BIGINT"), ("passed", "BOOLEAN"),
                 ("score", "DOUBLE"), ("detail", "VARCHAR"), ("lsn", "BIGINT"),
                 ("step_id", "VARCHAR"), ("attempt_no", "BIGINT")],
    "reductions": [("tenant", "VARCHAR"), ("original", REF), ("summary", REF),
                   ("lsn", "BIGINT")],
    "anomalies": [("lsn", "BIGINT"), ("kind", "VARCHAR"), ("run_id", "VARCHAR"),
                  ("reason", "VARCHAR")],
}


def commit(log: pdm.EventLog, *events: ev.Event) -> pdm.CommitInfo:
    with log.transaction() as tx:
        tx.extend(events)
    return tx.commit_info


def rows(con, sql: str, params=None) -> list[tuple]:
    return con.execute(sql, params or []).fetchall()


@pytest.fixture
def log(tmp_path: Path) -> pdm.EventLog:
    return pdm.open_log(tmp_path / "log")




# --- shape -----------------------------------------------------------------------------


def test_every_view_has_exactly_the_contract_columns_as_typed_values(log) -> None:
    with pdm.connect(log) as con:  # an empty log folds too
        for view, cols in VIEW_COLUMNS.items():
            assert rows(con, f"describe {view}") and \
                [(r[0], r[1]) for r in rows(con, f"describe {view}")] == cols, view
        events = [(r[0], r[1]) for r in rows(con, "describe events")]
    assert events[:4] == [("lsn", "BIGINT"), ("seq", "BIGINT"),
                          ("ts", "TIMESTAMP WITH TIME ZONE"), ("kind", "VARCHAR")]
    assert ("usage", USAGE) in events and ("prompt", REF) in events


def test_view_sql_is_printable_data_and_is_what_connect_runs(log) -> None:
    assert tuple(_fold.VIEW_SQL) == ("attempts", "branches", "runs", "trajectories",
                                     "verdicts", "reductions", "anomalies")
    for name in _fold.VIEWS:
        text = _fold.view_sql(name)
        assert text.lstrip().startswith(("SELECT", "WITH", "--")) and "ORDER BY" in text
    with pytest.raises(KeyError):
        _fold.view_sql("nope")
    with pdm.connect(log) as con:
        got = dict(rows(con, "select view_name, sql from duckdb_views() where not internal"))
    assert set(got) == {"events", *_fold.VIEWS}  # events: the registered Arrow table
    assert _fold.FOLD_VERSION.startswith("1-")


def test_timestamps_are_utc_and_money_is_exact(log) -> None:
    commit(log, ev.RunStarted("acme", "r", "wf",
                              ts=datetime.fromisoformat("2026-03-01T14:00:00+02:00")))
    with log.transaction() as tx:
        for n, cost in enumerate(("0.1", "0.2", "0.000000001"), start=1):
            tx.append(ev.AttemptDispatched("acme", "r", 0, "s", 0, n, ts=T))
            tx.append(ev.AttemptFinished("acme", "r", 0, "s", n, "failed",
                                         usage=ev.Usage(cost_usd=Decimal(cost)), ts=T))
    commit(log, ev.RunFinished("acme", "r", "failed",
                               ts=datetime.fromisoformat("2026-03-01T09:30:00-05:00")))
    with pdm.connect(log) as con:
        got = con.sql("select cost_usd, started_at, ended_at from runs").to_arrow_table()
    assert got.schema.field("started_at").type == pa.timestamp("us", tz="UTC")
    assert got.schema.field("cost_usd").type == pa.decimal128(38, 9)
    assert got.to_pylist() == [{"cost_usd": Decimal("0.300000001"),
                                "started_at": datetime(2026, 3, 1, 12, 0, tzinfo=UTC),
                                "ended_at": datetime(2026, 3, 1, 14, 30, tzinfo=UTC)}]


# --- fold rules ------------------------------------------------------------------------


def test_last_event_wins_and_each_field_keeps_its_last_non_null(log) -> None:
    with log.transaction() as tx:
        p, o = tx.put_blob("acme", b"the prompt"), tx.put_blob("acme", b"the output")
        tx.extend([
            ev.RunStarted("acme", "r", "wf-run", ts=T),
            ev.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=p,
                                 context=ev.ContextPartition(("a",), ("b",), ("c",)),
                                 workflow_version="wf-dispatch", ts=T),
            ev.AttemptFinished("acme", "r", 0, "s", 1, "failed", output=o,
                               usage=ev.Usage(10, 2, cost_usd=Decimal("0.5")),
                               error="boom", ts=T),
            ev.AttemptRecovered("acme", "r", 0, "s", 1, "timed_out",
                                tools=ev.ToolInfo(("grep",)), ts=T),
            ev.AttemptDispatched("acme", "r", 0, "t", 1, 1, ts=T),
        ])
    with pdm.connect(log) as con:
        got = con.sql("select * from attempts").to_arrow_table().to_pylist()
    assert got == [
        {"run_id": "r", "tenant": "acme", "branch_id": 0, "step_id": "s", "step_index": 0,
         "attempt_no": 1, "state": "timed_out", "workflow_version": "wf-dispatch",
         "context": {"packed": ["a"], "available": ["b"], "dropped": ["c"]},
         "prompt": p.as_dict(), "output": o.as_dict(), "tools": {"calls": ["grep"]},
         "usage": {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": None,
                   "reasoning_tokens": None, "cost_usd": Decimal("0.500000000"),
                   "latency_ms": None},
         "error": "boom", "recovered": True, "first_lsn": 2, "last_lsn": 4},
        {"run_id": "r", "tenant": "acme", "branch_id": 0, "step_id": "t", "step_index": 1,
         "attempt_no": 1, "state": "dispatched", "workflow_version": "wf-run",
         "context": None, "prompt": None, "output": None, "tools": None, "usage": None,
         "error": None, "recovered": False, "first_lsn": 5, "last_lsn": 5},
    ]
    commit(log, ev.AttemptFinished("acme", "r", 0, "s", 1, "succeeded", ts=T))
    with pdm.connect(log) as con:
        assert rows(con, "select state, recovered, error, last_lsn from attempts "
                         "where step_id = 's'") == [("succeeded", False, "boom", 6)]


def test_run_state_is_the_last_run_level_event(log) -> None:
    commit(log, ev.RunStarted("acme", "r", "wf", ts=T))
    expect = [(ev.VerifyingEntered("acme", "r", ts=T), "verifying"),
              (ev.BranchForked("acme", "r", 1, 0, 0, ts=T), "running"),
              (ev.VerifyingEntered("acme", "r", ts=T), "verifying"),
              (ev.RunCancelled("acme", "r", "stop", ts=T), "cancelled"),
              (ev.RunFinished("acme", "r", "succeeded", ts=T), "succeeded")]  # anomaly
    for e, state in expect:
        commit(log, e)
        with pdm.connect(log) as con:
            assert rows(con, "select state from runs") == [(state,)]
    with pdm.connect(log) as con:
        assert rows(con, "select verifying_lsn, live_branch, n_branches from runs") == \
            [(4, 1, 2)]
        assert rows(con, "select lsn, kind, reason from anomalies") == \
            [(6, "run_finished", "run event after cancel")]


def test_an_event_of_another_tenant_than_its_run_s_is_listed(log) -> None:
    """A run belongs to the tenant that started it (tenant is the isolation boundary): an
    event of another tenant on its run_id is kept and folded like any other, and listed,
    by the cold fold and the materialized state alike."""
    commit(log, ev.RunStarted("acme", "r", "wf", ts=T),                     # 1
           ev.AttemptDispatched("acme", "r", 0, "s", 0, 1, ts=T))           # 2
    commit(log, ev.AttemptDispatched("globex", "r", 0, "s", 0, 2, ts=T),    # 3
           ev.AttemptFinished("globex", "r", 0, "s", 2, "failed", ts=T),    # 4
           ev.RunStarted("globex", "g", "wf", ts=T),                        # 5 its own run
           ev.AttemptDispatched("globex", "g", 0, "s", 0, 1, ts=T))         # 6
    commit(log, ev.RunStarted("globex", "r", "wf-other", ts=T2))            # 7 not a takeover
    want = [(3, "attempt_dispatched", "r", "event of another tenant than the run's"),
            (4, "attempt_finished", "r", "event of another tenant than the run's"),
            (7, "run_started", "r", "event of another tenant than the run's"),
            (7, "run_started", "r", "run started twice")]
    query = "select lsn, kind, run_id, reason from anomalies order by lsn, reason"
    runs = "select run_id, tenant, workflow_version, started_at, n_attempts from runs order by 1"
    with pdm.connect(log, source="log") as con:
        assert rows(con, query) == want
        # the run stays the tenant's that started it: a later run_started takes nothing over
        assert rows(con, runs) == [("g", "globex", "wf", T, 1), ("r", "acme", "wf", T, 2)]
        assert rows(con, "select distinct workflow_version from attempts") == [("wf",)]
    assert pdm.episode(log, "r", source="log").tenant == "acme"
    pdm.materialize(log)
    with pdm.connect(log) as con:
        assert con.execute("select getvariable('poimen_source')").fetchall() == [("state",)]
        assert rows(con, query) == want
        assert rows(con, runs) == [("g", "globex", "wf", T, 1), ("r", "acme", "wf", T, 2)]


def test_transitions_the_state_machine_forbids_are_listed(log) -> None:
    """running -> verifying -> succeeded | failed; cancelled from running or verifying; a
    rewind from running or verifying; an attempt ends once. Every other transition is kept,
    folded (a run's state is its last run-level event's, an attempt's its last event's)
    and listed, each event under one reason; the state serves the same rows."""
    commit(log,
           ev.RunStarted("acme", "a", "wf", ts=T),                          # 1
           ev.RunFinished("acme", "a", "succeeded", ts=T),                  # 2 not verifying
           ev.RunCancelled("acme", "a", ts=T),                              # 3 after finishing
           ev.RunStarted("acme", "b", "wf", ts=T),                          # 4
           ev.VerifyingEntered("acme", "b", ts=T),                          # 5
           ev.VerifyingEntered("acme", "b", ts=T),                          # 6 while verifying
           ev.RunFinished("acme", "b", "failed", ts=T),                     # 7
           ev.BranchForked("acme", "b", 1, 0, 0, ts=T),                     # 8 after finishing
           ev.RunFinished("acme", "b", "failed", ts=T),                     # 9 so is this
           ev.AttemptDispatched("acme", "b", 1, "s", 0, 1, ts=T),           # 10
           ev.AttemptFinished("acme", "b", 1, "s", 1, "failed", ts=T),      # 11
           ev.AttemptFinished("acme", "b", 1, "s", 1, "succeeded", ts=T),   # 12 ended
           ev.AttemptRecovered("acme", "b", 1, "s", 1, "timed_out", ts=T),  # 13 ended
           ev.RunStarted("acme", "c", "wf", ts=T),                          # 14 well formed:
           ev.VerifyingEntered("acme", "c", ts=T),                          # 15 nothing listed
           ev.BranchForked("acme", "c", 1, 0, 0, ts=T),                     # 16
           ev.AttemptDispatched("acme", "c", 1, "s", 0, 1, ts=T),           # 17
           ev.AttemptRecovered("acme", "c", 1, "s", 1, "failed", ts=T),     # 18
           ev.VerifyingEntered("acme", "c", ts=T),                          # 19
           ev.RunFinished("acme", "c", "succeeded", ts=T),                  # 20
           ev.RunStarted("acme", "d", "wf", ts=T),                          # 21
           ev.VerifyingEntered("acme", "d", ts=T),                          # 22
           ev.RunFinished("acme", "d", "succeeded", ts=T),                  # 23
           ev.BranchForked("acme", "d", 1, 0, 0, ts=T),                     # 24 each one after
           ev.VerifyingEntered("acme", "d", ts=T),                          # 25 the finish,
           ev.RunFinished("acme", "d", "failed", ts=T),                     # 26 not only the
           ev.RunCancelled("acme", "d", ts=T),                              # 27 first
           ev.RunStarted("acme", "e", "wf", ts=T),                          # 28
           ev.RunCancelled("acme", "e", ts=T),                              # 29
           ev.RunFinished("acme", "e", "failed", ts=T),                     # 30 after cancel
           ev.RunCancelled("acme", "e", ts=T),                              # 31 (that alone)
           ev.AttemptFinished("acme", "e", 0, "s", 1, "failed", ts=T),      # 32 no dispatch
           ev.AttemptFinished("acme", "e", 0, "s", 1, "failed", ts=T))      # 33 (that alone)
    want = [(2, "run_finished", "a", "run finished without verifying"),
            (3, "run_cancelled", "a", "run event after the run finished"),
            (6, "verifying_entered", "b", "verifying entered while verifying"),
            (8, "branch_forked", "b", "run event after the run finished"),
            (9, "run_finished", "b", "run event after the run finished"),
            (12, "attempt_finished", "b", "attempt event after the attempt ended"),
            (13, "attempt_recovered", "b", "attempt event after the attempt ended"),
            (24, "branch_forked", "d", "run event after the run finished"),
            (25, "verifying_entered", "d", "run event after the run finished"),
            (26, "run_finished", "d", "run event after the run finished"),
            (27, "run_cancelled", "d", "run event after the run finished"),
            (30, "run_finished", "e", "run event after cancel"),
            (31, "run_cancelled", "e", "run event after cancel"),
            (32, "attempt_finished", "e", "finished without a dispatch"),
            (33, "attempt_finished", "e", "finished without a dispatch")]
    query = "select lsn, kind, run_id, reason from anomalies order by lsn, reason"
    folded = [("a", "cancelled"), ("b", "failed"), ("c", "succeeded"), ("d", "cancelled"),
              ("e", "cancelled")]
    with pdm.connect(log, source="log") as con:
        assert rows(con, query) == want
        assert rows(con, "select run_id, state from runs order by 1") == folded
        assert rows(con, "select state, recovered from attempts where run_id = 'b'") == [
            ("timed_out", True)]
    pdm.materialize(log)
    assert pdm.check(log).ok
    with pdm.connect(log) as con:
        assert con.execute("select getvariable('poimen_source')").fetchall() == [("state",)]
        assert rows(con, query) == want
        assert rows(con, "select run_id, state from runs order by 1") == folded


def test_every_forbidden_event_is_kept_folded_and_listed(log) -> None:
    commit(log,
           ev.VerifyingEntered("acme", "ghost", ts=T),                      # 1 unknown run
           ev.RunStarted("acme", "r", "wf", ts=T),                          # 2
           ev.RunStarted("acme", "r", "wf-again", ts=T),                    # 3 twice
           ev.AttemptFinished("acme", "r", 0, "s", 1, "failed", ts=T),      # 4 no dispatch
           ev.AttemptDispatched("acme", "r", 0, "s", 0, 1, ts=T),           # 5
           ev.AttemptDispatched("acme", "r", 0, "s", 0, 1, ts=T),           # 6 twice
           ev.AttemptRecovered("acme", "r", 0, "u", 1, "failed", ts=T),     # 7 no dispatch
           ev.AttemptDispatched("acme", "r", 3, "s", 0, 1, ts=T),           # 8 no branch 3
           ev.BranchForked("acme", "r", 2, 1, 0, ts=T),                     # 9 parent, id
           ev.AttemptDispatched("acme", "ghost", 0, "s", 0, 1, ts=T))       # 10 unknown run
    with pdm.connect(log) as con:
        assert rows(con, "select lsn, kind, run_id, reason from anomalies order by lsn, "
                         "reason") == [
            (1, "verifying_entered", "ghost", "event of an unknown run"),
            (3, "run_started", "r", "run started twice"),
            (4, "attempt_finished", "r", "finished without a dispatch"),
            (6, "attempt_dispatched", "r", "attempt number dispatched twice"),
            (7, "attempt_recovered", "r", "recovered without a dispatch"),
            (8, "attempt_dispatched", "r", "attempt on an unknown branch"),
            (9, "branch_forked", "r", "fork does not take the run's max branch + 1"),
            (9, "branch_forked", "r", "fork of an unknown branch"),
            (10, "attempt_dispatched", "ghost", "event of an unknown run"),
        ]
        # kept and folded by the same rules (the run's version is its first run_started's)
        assert rows(con, "select run_id, workflow_version, state, live_branch, n_attempts "
                         "from runs") == [("ghost", None, "verifying", 0, 1),
                                          ("r", "wf", "running", 2, 3)]
        assert rows(con, "select branch_id, step_id, state, first_lsn, last_lsn "
                         "from attempts where run_id = 'r'") == [
            (0, "s", "dispatched", 4, 6), (0, "u", "failed", 7, 7),
            (3, "s", "dispatched", 8, 8)]
        # branch 2's parent does not exist: its trajectory is its own attempts only
        assert rows(con, "select trajectory_branch_id, branch_id, step_id "
                         "from trajectories where run_id = 'r'") == [
            (0, 0, "s"), (0, 0, "u")]


def test_trajectory_of_a_fork_below_an_earlier_fork_point(log) -> None:
    """trajectory(b) restricts the parent's *trajectory*: a fork of a fork at a later step
    than the first fork still drops the grandparent's attempts past the first fork."""
    commit(log, ev.RunStarted("acme", "r", "wf", ts=T))
    for step, i in (("a", 0), ("b", 1), ("c", 2), ("d", 3)):
        commit(log, ev.AttemptDispatched("acme", "r", 0, step, i, 1, ts=T),
               ev.AttemptFinished("acme", "r", 0, step, 1, "succeeded", ts=T))
    commit(log, ev.BranchForked("acme", "r", 1, 0, 1, ts=T))
    commit(log, ev.AttemptDispatched("acme", "r", 1, "b", 1, 1, ts=T))
    commit(log, ev.BranchForked("acme", "r", 2, 1, 3, ts=T))
    commit(log, ev.AttemptDispatched("acme", "r", 2, "d", 3, 1, ts=T))
    with pdm.connect(log) as con:
        assert rows(con, "select branch_id, step_id, is_live from trajectories "
                         "where trajectory_branch_id = 2") == [
            (0, "a", True), (1, "b", True), (2, "d", True)]


def test_blob_text_reads_only_when_called_and_is_null_after_reduction(log) -> None:
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "r", "wf", ts=T))
        for n in (1, 2, 3):
            p = tx.put_blob("acme", f"prompt {n}".encode())
            tx.append(ev.AttemptDispatched("acme", "r", 0, "s", 0, n, prompt=p, ts=T))
            tx.append(ev.AttemptFinished("acme", "r", 0, "s", n,
                                         "succeeded" if n == 3 else "failed", ts=T))
    counting = CountingBlobs(log.blobs)
    log.blobs = counting
    with pdm.connect(log) as con:
        assert rows(con, "select count(*), count(prompt) from attempts") == [(3, 3)]
        assert counting.gets == 0
        assert rows(con, "select blob_text(prompt) from attempts where state = 'failed' "
                         "limit 5") == [("prompt 1",), ("prompt 2",)]
        assert counting.gets == 2
        first = rows(con, "select prompt from attempts where attempt_no = 1")[0][0]
    pdm.reduce(log, [pdm.BlobRef(**first)], lambda body: b"short")
    with pdm.connect(log) as con:
        assert rows(con, "select attempt_no, blob_text(prompt) from attempts") == [
            (1, None), (2, "prompt 2"), (3, "prompt 3")]
        assert rows(con, "select blob_text(summary), (original).sha256 from reductions") == \
            [("short", first["sha256"])]
        assert rows(con, "select blob_text(output) from attempts limit 1") == [(None,)]


def test_connect_by_root_url_and_missing_root(tmp_path: Path) -> None:
    log = pdm.open_log(tmp_path / "log")
    commit(log, ev.RunStarted("acme", "r", "wf", ts=T))
    with pdm.connect(str(tmp_path / "log")) as con:
        assert rows(con, "select run_id, state from runs") == [("r", "running")]
    with pdm.connect(f"file://{tmp_path / 'log'}", at_lsn=0) as con:
        assert rows(con, "select count(*) from runs") == [(0,)]
    with pytest.raises(pdm.NotFound):
        pdm.connect(tmp_path / "nothing-here")


# --- the golden log ----------------------------------------------------------------------


def _default(v: object) -> str:
    if isinstance(v, Decimal):
        return str(v)
    raise TypeError(type(v).__name__)


#: Columns a view gained after the golden digest was pinned: the digest covers the
#: columns it was pinned with (which must fold byte-equal), and the golden test checks
#: that the added ones are null on the golden log (written before they existed).
ADDED_COLUMNS = {"verdicts": ("step_id", "attempt_no")}


def fold_digest(root: Path | str) -> dict:
    """Digest of every view (schema and rows, canonical JSON) and of every episode."""
    log = pdm.open_log(root, create=False)
    out: dict = {"head": log.head, "tables": {}, "episodes": {}}
    with pdm.connect(log) as con:
        for view in _fold.VIEWS:
            t = con.sql(f"select * from {view}").to_arrow_table()
            t = t.drop_columns(list(ADDED_COLUMNS.get(view, ())))
            body = orjson.dumps({"schema": str(t.schema), "rows": t.to_pylist()},
                                default=_default, option=orjson.OPT_SORT_KEYS)
            out["tables"][view] = hashlib.sha256(body).hexdigest()
        run_ids = [r[0] for r in rows(con, "select run_id from runs")]
    for run in run_ids:
        view = pdm.episode(log, run, all_branches=True, source="log")
        out["episodes"][run] = hashlib.sha256(view.serialize()).hexdigest()
    return out


def test_golden_log_folds_to_its_pinned_digest(tmp_path: Path) -> None:
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN / "log", root)
    pinned = json.loads((GOLDEN / "digest.json").read_text())
    assert fold_digest(root) == pinned
    with pdm.connect(root) as con:  # what the pinned digest leaves out: null on an old log
        for view, added in ADDED_COLUMNS.items():
            assert con.execute(f"select count(*), {', '.join(f'count({c})' for c in added)} "
                               f"from {view}").fetchone() == (2, *(0 for _ in added))
    log = pdm.open_log(root, create=False)
    pdm.materialize(log)  # the state serves the very same episodes
    for run, digest in pinned["episodes"].items():
        view = pdm.episode(log, run, all_branches=True, source="state")
        assert hashlib.sha256(view.serialize()).hexdigest() == digest
    assert pdm.check(log).ok


if __name__ == "__main__" and sys.argv[1:] == ["--pin"]:
    digest = fold_digest(GOLDEN / "log")
    (GOLDEN / "digest.json").write_text(json.dumps(digest, indent=1, sort_keys=True) + "\n")
    print(json.dumps(digest, indent=1))
