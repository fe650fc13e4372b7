"""The snapshot barrier (docs/DESIGN.md, "Grading"): a rewind, a cancel and a recovery
committed from outside the run while a verifier is parked mid-verify must not reach the
view it holds.

Each test parks the verifier on a rendezvous (threading.Event, never a sleep), lets a
mutator thread (or a child process it starts) commit through its own handle on the log,
then releases the verifier and checks the held view byte for byte.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.fold._query import episode
from poimen_data.jobs._grade import Verdict, VerifierCtx, grade
from poimen_data.testing import record_run

WAIT_S = 60  # a bound for a broken rendezvous, never a delay on the happy path

# plan ok; code failed, failed, ok; test timed_out, ok -> 3 failed attempts (failed or
# timed_out), 6 attempts in all, on branch 0.
STEPS = [("plan", ["succeeded"]), ("code", ["failed", "failed", "succeeded"]),
         ("test", ["timed_out", "succeeded"])]


class Parked:
    """A verifier that records the view on entry, parks until released, and records it
    again: what it saw must not change while it held it."""

    name = "parked"
    version = "1"

    def __init__(self, look: Callable[[VerifierCtx], Any] = lambda ctx: None) -> None:
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.look = look
        self.ctx: VerifierCtx | None = None

    def __call__(self, ctx: VerifierCtx) -> Verdict:
        self.ctx = ctx
        self.on_entry = ctx.episode.serialize()
        self.seen_on_entry = self.look(ctx)
        self.entered.set()
        if not self.proceed.wait(WAIT_S):
            raise AssertionError("the mutator never released the verifier")
        self.on_exit = ctx.episode.serialize()
        self.seen_on_exit = self.look(ctx)
        return Verdict(True, 1.0, "held")


def grade_while(log: pdm.EventLog, parked: Any, mutate: Callable[[], None]) -> Any:
    """Grade ``log`` with ``parked`` (a verifier with ``entered`` and ``proceed`` events)
    while ``mutate`` runs on its own thread once the verifier is parked; returns the
    grade report, once the mutator's errors (if any) are raised here."""
    errors: list[BaseException] = []

    def mutator() -> None:
        try:
            if not parked.entered.wait(WAIT_S):
                raise AssertionError("the verifier never started")
            mutate()
        except BaseException as exc:  # reported in the test thread
            errors.append(exc)
        finally:
            parked.proceed.set()

    t = threading.Thread(target=mutator)
    t.start()
    report = grade(log, [parked], deadline_s=WAIT_S)
    t.join(WAIT_S)
    assert not errors, errors
    return report


def graded_with_mutator(log: pdm.EventLog, parked: Parked,
                        mutate: Callable[[], None]) -> pdm.EventLog:
    """``grade_while`` of one run that passes; a fresh handle on the log for the
    assertions."""
    report = grade_while(log, parked, mutate)
    assert (report.runs_graded, report.runs_passed, report.verdicts_recorded) == (1, 1, 1)
    return pdm.open_log(log.root)


def failed_attempts(view: Any) -> int:
    return sum(a.state in ("failed", "timed_out") for b in view.branches for a in b.attempts)


def check_held(parked: Parked, log: pdm.EventLog, run: str, lsn: int) -> None:
    """The assertions every mutator shares."""
    ctx = parked.ctx
    assert ctx is not None
    assert ctx.snapshot_lsn == lsn
    assert ctx.run == run
    assert parked.on_exit == parked.on_entry
    assert ctx.episode.serialize() == parked.on_entry
    assert ctx.episode.at_lsn == lsn
    assert ctx.episode.live_branch == 0
    assert [b.branch_id for b in ctx.episode.branches] == [0]
    assert ctx.episode.state == "verifying"
    cold = episode(log, run, all_branches=True, at_lsn=lsn, source="log")
    assert cold.serialize() == parked.on_entry
    con = pdm.connect(log)
    rows = con.execute("select run_id, branch_id, verifier, snapshot_lsn, passed, score, "
                       "detail from verdicts").fetchall()
    con.close()
    assert rows == [(run, 0, "parked@1", lsn, True, 1.0, "held")]


def test_rewind_forking_a_new_branch_does_not_reach_the_held_view(tmp_path: Any) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    lsn = record_run(log, "r1", STEPS)
    parked = Parked()

    def rewind() -> None:
        other = pdm.open_log(log.root)
        with other.transaction() as tx:
            tx.append(E.BranchForked("acme", "r1", 1, 0, 1))
            tx.append(E.AttemptDispatched("acme", "r1", 1, "code", 1, 1))
            tx.append(E.AttemptFinished("acme", "r1", 1, "code", 1, "failed", error="again"))

    fresh_log = graded_with_mutator(log, parked, rewind)
    check_held(parked, fresh_log, "r1", lsn)
    assert failed_attempts(parked.ctx.episode) == 3
    assert sum(len(b.attempts) for b in parked.ctx.episode.branches) == 6
    fresh = episode(fresh_log, "r1", all_branches=True)
    assert (fresh.live_branch, fresh.state) == (1, "running")
    assert [b.branch_id for b in fresh.branches] == [0, 1]
    assert failed_attempts(fresh) == 4


def test_cancel_arriving_during_verifying_does_not_reach_the_held_view(tmp_path: Any) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    lsn = record_run(log, "r1", STEPS)
    parked = Parked()
    child = textwrap.dedent(f"""
        import poimen_data as pdm
        from poimen_data import events as E
        log = pdm.open_log({log.root!r}, create=False)
        with log.transaction() as tx:
            tx.append(E.RunCancelled("acme", "r1", "operator"))
        print(tx.commit_info.last_lsn)
    """)

    def cancel_from_child_process() -> None:
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             timeout=WAIT_S, check=True)
        assert int(out.stdout) == lsn + 1

    fresh_log = graded_with_mutator(log, parked, cancel_from_child_process)
    check_held(parked, fresh_log, "r1", lsn)
    assert failed_attempts(parked.ctx.episode) == 3
    fresh = episode(fresh_log, "r1", all_branches=True)
    assert (fresh.state, fresh.live_branch) == ("cancelled", 0)
    assert fresh.serialize() != parked.on_entry


def test_recovery_resolving_a_dispatched_attempt_does_not_reach_the_held_view(
        tmp_path: Any) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    # code #2 was dispatched, then the engine crashed; the retry #3 succeeded.
    lsn = record_run(log, "r1", [("plan", ["succeeded"]),
                                 ("code", ["failed", "dispatched", "succeeded"]),
                                 ("test", ["timed_out", "succeeded"])])

    def code_2(ctx: VerifierCtx) -> tuple[str, str | None]:
        (b,) = ctx.episode.branches
        (a,) = [a for a in b.attempts if (a.step, a.attempt) == ("code", 2)]
        return a.state, a.error

    parked = Parked(code_2)

    def recover() -> None:
        other = pdm.open_log(log.root)
        with other.transaction() as tx:
            tx.append(E.AttemptRecovered("acme", "r1", 0, "code", 2, "failed",
                                         error="lost in a crash"))

    fresh_log = graded_with_mutator(log, parked, recover)
    check_held(parked, fresh_log, "r1", lsn)
    assert parked.seen_on_entry == parked.seen_on_exit == ("dispatched", None)
    assert failed_attempts(parked.ctx.episode) == 2
    fresh = episode(fresh_log, "r1", all_branches=True)
    (b,) = fresh.branches
    (a,) = [a for a in b.attempts if (a.step, a.attempt) == ("code", 2)]
    assert (a.state, a.error) == ("failed", "lost in a crash")
    assert failed_attempts(fresh) == 3


@pytest.mark.parametrize("mutation", ["rewind", "cancel"])
def test_verdict_is_recorded_on_the_snapshot_branch_after_the_run_moved_on(
        tmp_path: Any, mutation: str) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    lsn = record_run(log, "r1", STEPS)
    parked = Parked()

    def mutate() -> None:
        event = (E.BranchForked("acme", "r1", 1, 0, 2) if mutation == "rewind"
                 else E.RunCancelled("acme", "r1"))
        with pdm.open_log(log.root).transaction() as tx:
            tx.append(event)

    fresh_log = graded_with_mutator(log, parked, mutate)
    con = pdm.connect(fresh_log)
    assert con.execute("select state, live_branch from runs").fetchall() == [
        ("running", 1) if mutation == "rewind" else ("cancelled", 0)]
    assert con.execute("select branch_id, snapshot_lsn, lsn from verdicts").fetchall() == [
        (0, lsn, lsn + 2)]
    con.close()
