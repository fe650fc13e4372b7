"""grade(): which runs, verdicts recorded back in batches, idempotence, force, and error
verdicts for a verifier that raises or passes its deadline while the batch goes on."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

import poimen_data as pdm
from poimen_data import events as E
from poimen_data import synth
from poimen_data.jobs._grade import GradeReport, Verdict, VerifierCounts, VerifierCtx, grade
from poimen_data.testing import record_run
from poimen_data.verifiers import exit_code

OK = [("plan", ["succeeded"]), ("code", ["failed", "succeeded"])]
BAD = [("plan", ["succeeded"]), ("code", ["failed", "timed_out"])]


@pytest.fixture
def log() -> pdm.EventLog:
    return pdm.open_log(f"memory://grade-{uuid.uuid4().hex}")


def verdicts(log: pdm.EventLog) -> list[tuple[Any, ...]]:
    con = pdm.connect(log)
    rows = con.execute("select run_id, branch_id, verifier, snapshot_lsn, passed, score, "
                       "detail from verdicts order by lsn").fetchall()
    con.close()
    return rows


def test_grades_the_runs_in_verifying_at_their_latest_verifying_lsn(log: pdm.EventLog) -> None:
    a = record_run(log, "a", OK)
    b = record_run(log, "b", BAD)
    record_run(log, "c", OK, verifying=False)
    d_first = record_run(log, "d", OK)
    with log.transaction() as tx:  # d is rewound to step 1, retried, and verifies again
        tx.append(E.BranchForked("acme", "d", 1, 0, 1))
        tx.append(E.AttemptDispatched("acme", "d", 1, "code", 1, 1))
        tx.append(E.AttemptFinished("acme", "d", 1, "code", 1, "failed"))
        tx.append(E.VerifyingEntered("acme", "d"))
    d = tx.commit_info.last_lsn
    assert d > d_first
    report = grade(log, exit_code)
    assert isinstance(report, GradeReport)
    assert (report.runs_graded, report.runs_skipped, report.runs_passed, report.runs_failed,
            report.runs_errored, report.verdicts_recorded, report.commits) == (3, 0, 1, 2, 0,
                                                                               3, 1)
    assert report.per_verifier == (VerifierCounts("exit_code@1", 3, 0, 1, 2, 0),)
    assert sorted(verdicts(log)) == [
        ("a", 0, "exit_code@1", a, True, 1.0, "2 steps succeeded; 1 failed attempts"),
        ("b", 0, "exit_code@1", b, False, 0.5, "not succeeded: code=timed_out"),
        ("d", 1, "exit_code@1", d, False, 0.5, "not succeeded: code=failed"),
    ]
    assert [(f.run_id, f.snapshot_lsn, f.errored) for f in report.failures] in (
        [("b", b, False), ("d", d, False)], [("d", d, False), ("b", b, False)])
    assert report.head_lsn == d
    assert report.runs_per_s > 0 and report.wall_s >= report.snapshot_s > 0


def test_grading_twice_records_nothing_new_and_force_grades_again(log: pdm.EventLog) -> None:
    for run in ("a", "b", "c"):
        record_run(log, run, OK)
    first = grade(log, [exit_code])
    assert (first.runs_graded, first.verdicts_recorded) == (3, 3)
    head = log.head
    again = grade(log, [exit_code])
    assert (again.runs_graded, again.runs_skipped, again.verdicts_recorded, again.commits) \
        == (0, 3, 0, 0)
    assert log.head == head
    assert len(verdicts(log)) == 3
    forced = grade(log, [exit_code], force=True)
    assert (forced.runs_graded, forced.verdicts_recorded) == (3, 3)
    rows = verdicts(log)
    assert len(rows) == 6
    assert sorted(rows[:3]) == sorted(rows[3:])


def test_a_new_verifier_version_grades_the_same_snapshot_again(log: pdm.EventLog) -> None:
    record_run(log, "a", OK)
    grade(log, [exit_code])

    def exit_code_v2(ctx: VerifierCtx) -> Verdict:
        return Verdict(True)

    exit_code_v2.name = "exit_code"  # type: ignore[attr-defined]
    exit_code_v2.version = 2  # type: ignore[attr-defined]
    report = grade(log, [exit_code, exit_code_v2])
    assert report.per_verifier == (VerifierCounts("exit_code@1", 0, 1, 0, 0, 0),
                                   VerifierCounts("exit_code@2", 1, 0, 1, 0, 0))
    assert [r[2] for r in verdicts(log)] == ["exit_code@1", "exit_code@2"]


def test_given_runs_are_graded_whatever_their_state_now(log: pdm.EventLog) -> None:
    a = record_run(log, "a", OK)
    record_run(log, "b", OK, verifying=False)
    record_run(log, "c", OK)
    with log.transaction() as tx:
        tx.append(E.RunFinished("acme", "a", "succeeded"))
    report = grade(log.root, [exit_code], runs=["a", "b", "a"])  # a root URL works too
    assert (report.runs_graded, report.runs_skipped) == (1, 1)
    assert [r[:4] for r in verdicts(log)] == [("a", 0, "exit_code@1", a)]
    with pytest.raises(pdm.NotFound, match="'zz'"):
        grade(log, [exit_code], runs=["a", "zz"])


def test_verdicts_are_committed_in_batches_one_transaction_each(log: pdm.EventLog) -> None:
    for i in range(5):
        record_run(log, f"r{i}", OK)
    head = log.head
    report = grade(log, [exit_code], batch_size=2, chunk_runs=2)
    assert (report.verdicts_recorded, report.commits) == (5, 3)
    assert log.head == head + 5
    con = pdm.connect(log)
    sizes = con.execute("select count(*) from events where kind = 'verdict_recorded' "
                        "group by seq order by seq").fetchall()
    con.close()
    assert sizes == [(2,), (2,), (1,)]
    assert sorted(r[0] for r in verdicts(log)) == [f"r{i}" for i in range(5)]


def test_raising_and_late_verifiers_give_error_verdicts_and_the_batch_goes_on(
        log: pdm.EventLog) -> None:
    a = record_run(log, "a", OK)
    b = record_run(log, "b", BAD)
    release = threading.Event()

    def boom(ctx: VerifierCtx) -> Verdict:
        raise ValueError(f"kaput {ctx.run}")

    def hangs(ctx: VerifierCtx) -> Verdict:
        release.wait()  # parked until the test releases it, after grade has returned
        return Verdict(True)

    hangs.deadline_s = 0.2  # type: ignore[attr-defined]  # its own deadline wins

    def late(ctx: VerifierCtx) -> Verdict:
        while time.monotonic() <= ctx.deadline:  # works past its deadline, then answers
            pass
        return Verdict(True)

    def not_a_verdict(ctx: VerifierCtx) -> Any:
        return True

    try:
        report = grade(log, [boom, hangs, late, not_a_verdict, exit_code], deadline_s=0.3,
                       threads=2)
    finally:
        release.set()
    assert (report.runs_graded, report.runs_errored, report.verdicts_recorded) == (2, 2, 10)
    assert report.per_verifier == (
        VerifierCounts("boom@0", 2, 0, 0, 0, 2), VerifierCounts("hangs@0", 2, 0, 0, 0, 2),
        VerifierCounts("late@0", 2, 0, 0, 0, 2), VerifierCounts("not_a_verdict@0", 2, 0, 0, 0, 2),
        VerifierCounts("exit_code@1", 2, 0, 1, 1, 0))
    rows = {(r[0], r[2]): r for r in verdicts(log)}
    assert rows["a", "boom@0"] == ("a", 0, "boom@0", a, False, None, "error: ValueError: kaput a")
    assert rows["b", "hangs@0"] == ("b", 0, "hangs@0", b, False, None,
                                    "error: deadline of 0.2s passed; abandoned")
    # late answers just after its deadline, when the driver gives up on it: either way
    # the verdict is a deadline error ("passed (...s late)" or "...; abandoned")
    for run in ("a", "b"):
        assert rows[run, "late@0"][4:6] == (False, None)
        assert rows[run, "late@0"][6].startswith("error: deadline ")
    assert rows["b", "not_a_verdict@0"][6] == \
        "error: returned True, not a Verdict(passed: bool)"
    assert rows["a", "exit_code@1"][4] is True
    assert rows["b", "exit_code@1"][4] is False
    assert sum(f.errored for f in report.failures) == 8


def test_verifier_identities_are_checked_before_anything_runs(log: pdm.EventLog) -> None:
    record_run(log, "a", OK)

    def v(ctx: VerifierCtx) -> Verdict:
        return Verdict(True)

    v.name = "has space"  # type: ignore[attr-defined]
    with pytest.raises(pdm.ValidationError, match="'has space@0'"):
        grade(log, [v])
    with pytest.raises(pdm.ValidationError, match="share an identity"):
        grade(log, [exit_code, exit_code])
    assert verdicts(log) == []


def test_progress_counts_run_verifier_pairs(log: pdm.EventLog) -> None:
    for i in range(3):
        record_run(log, f"r{i}", OK)
    seen: list[tuple[int, int]] = []
    grade(log, [exit_code], progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)]


def test_snapshots_built_in_bulk_equal_cold_episodes_at_each_verifying_lsn(
        log: pdm.EventLog) -> None:
    """The synthetic workload has forks of forks, cancels while verifying and recovered
    attempts: every held view must equal a cold fold of its run at its snapshot LSN."""
    synth.generate(log, runs=120, seed=5, batch=4)
    seen: dict[str, tuple[int, bytes]] = {}
    lock = threading.Lock()

    def keep(ctx: VerifierCtx) -> Verdict:
        with lock:
            seen[ctx.run] = (ctx.snapshot_lsn, ctx.episode.serialize())
        return Verdict(True)

    report = grade(log, [keep], chunk_runs=25)
    con = pdm.connect(log)
    expected = dict(con.execute("select run_id, verifying_lsn from runs "
                                "where state = 'verifying'").fetchall())
    n_forked = con.execute("select count(*) from runs where state = 'verifying' "
                           "and n_branches > 2").fetchone()[0]
    con.close()
    assert report.runs_graded == len(expected) == len(seen)
    assert n_forked > 0
    for run, (lsn, held) in seen.items():
        assert lsn == expected[run]
        cold = pdm.episode(log, run, all_branches=True, at_lsn=lsn, source="log")
        assert held == cold.serialize(), run
