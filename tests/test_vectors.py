"""Every expectation of tests/data/vectors/fork_of_fork.json, through the SQL views."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import poimen_data as pdm
from poimen_data import events as ev

VECTOR = json.loads((Path(__file__).parent / "data/vectors/fork_of_fork.json").read_text())
EXPECT = VECTOR["expect"]


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> pdm.EventLog:
    log = pdm.open_log(tmp_path_factory.mktemp("vector"))
    for commit in VECTOR["commits"]:
        with log.transaction() as tx:
            tx.extend([ev.event_from_json(e) for e in commit])
    return log


def _rows(con, sql: str) -> list[dict]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def test_head(log: pdm.EventLog) -> None:
    assert log.head == EXPECT["head"]


@pytest.mark.parametrize("i", range(len(EXPECT["runs"])))
def test_runs(log: pdm.EventLog, i: int) -> None:
    want = EXPECT["runs"][i]
    with pdm.connect(log) as con:
        got = _rows(con, f"select {', '.join(want)} from runs where run_id = '{want['run_id']}'")
    assert got == [want]


def test_runs_are_exactly_the_expected_ones(log: pdm.EventLog) -> None:
    with pdm.connect(log) as con:
        assert [r[0] for r in con.execute("select run_id from runs").fetchall()] == \
            [r["run_id"] for r in EXPECT["runs"]]


def test_branches(log: pdm.EventLog) -> None:
    want = EXPECT["branches"]
    with pdm.connect(log) as con:
        assert _rows(con, f"select {', '.join(want[0])} from branches") == want


@pytest.mark.parametrize("i", range(len(EXPECT["attempts"])))
def test_attempt_rows(log: pdm.EventLog, i: int) -> None:
    want = EXPECT["attempts"][i]
    with pdm.connect(log) as con:
        got = _rows(con, f"select {', '.join(want)} from attempts")
    assert got[i] == want
    assert len(got) == len(EXPECT["attempts"])


@pytest.mark.parametrize("key", [k for k in EXPECT["trajectories"] if k != "note"])
def test_trajectories(log: pdm.EventLog, key: str) -> None:
    run_id, branch = key.split("/")
    with pdm.connect(log) as con:
        got = con.execute(
            "select branch_id, step_id, attempt_no from trajectories "
            "where run_id = ? and trajectory_branch_id = ?", [run_id, int(branch)]
        ).fetchall()
    assert [list(r) for r in got] == EXPECT["trajectories"][key]


def test_trajectory_is_live_follows_the_live_branch(log: pdm.EventLog) -> None:
    with pdm.connect(log) as con:
        got = con.execute("select distinct run_id, trajectory_branch_id from trajectories "
                          "where is_live order by all").fetchall()
    assert got == [("run-a", 2), ("run-b", 0)]


def test_anomalies(log: pdm.EventLog) -> None:
    with pdm.connect(log) as con:
        got = _rows(con, "select lsn, kind, run_id, reason from anomalies")
    want = EXPECT["anomalies"]
    assert [{k: r[k] for k in ("lsn", "kind", "run_id")} for r in got] == \
        [{k: r[k] for k in ("lsn", "kind", "run_id")} for r in want]
    assert [r["reason"] for r in got] == ["finished without a dispatch"]


AT_LSN_CASES = [(int(lsn), run_id, exp) for lsn, runs in EXPECT["at_lsn"].items()
                for run_id, exp in runs.items()]


@pytest.mark.parametrize(("lsn", "run_id", "exp"), AT_LSN_CASES)
def test_at_lsn(log: pdm.EventLog, lsn: int, run_id: str, exp: dict) -> None:
    cols = [k for k in exp if " " not in k]
    with pdm.connect(log, at_lsn=lsn) as con:
        got = _rows(con, f"select {', '.join(cols)} from runs where run_id = '{run_id}'")
        assert got == [{k: exp[k] for k in cols}]
        for key, state in exp.items():
            if " " not in key:
                continue
            _attempt, ident, _state = key.split(" ")
            r, b, step, n = ident.split("/")
            assert con.execute(
                "select state from attempts where run_id = ? and branch_id = ? and "
                "step_id = ? and attempt_no = ?", [r, int(b), step, int(n)]
            ).fetchall() == [(state,)]


def test_at_lsn_sees_only_that_prefix(log: pdm.EventLog) -> None:
    with pdm.connect(log, at_lsn=11) as con:
        assert con.execute("select max(lsn), count(*) from events").fetchall() == [(11, 11)]
        assert con.execute("select count(*) from runs").fetchall() == [(1,)]
        assert con.execute("select count(*) from anomalies").fetchall() == [(0,)]


@pytest.mark.parametrize("bad", [-1, EXPECT["head"] + 1])
def test_at_lsn_out_of_range(log: pdm.EventLog, bad: int) -> None:
    with pytest.raises(pdm.ValidationError):
        pdm.connect(log, at_lsn=bad)
