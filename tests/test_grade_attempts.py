"""Attempt-scoped verifiers (issue 18): one call per attempt with ctx.branch/step/attempt
set, one verdict per attempt on the attempt it judged, idempotent per attempt; the
snapshot barrier holds for them; a log written before attempt verdicts (the golden log)
reads as before and takes them; laziness is one ``get`` per attempt read."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_grade_barrier import grade_while

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.fold import _fold, _state
from poimen_data.fold._query import episode
from poimen_data.jobs._grade import Verdict, VerifierCtx, grade
from poimen_data.log._manifest import dumps
from poimen_data.testing import CountingBlobStore, record_run
from poimen_data.verifiers import (
    OutputIsJson,
    exit_code,
    judged_attempt,
    output_is_json,
)

WAIT_S = 60  # a bound for a broken rendezvous, never a delay on the happy path
GOLDEN = Path(__file__).parent / "data" / "golden"
#: The fold version of every release before attempt verdicts (commit 1bcc09a): a state
#: it made must be rebuilt, never served.
OLD_FOLD_VERSION = "1-04532ab194479d29"

# Branch 0: plan ok; code failed, dispatched (a crash), ok; test timed_out, ok.
STEPS = [("plan", ["succeeded"]), ("code", ["failed", "dispatched", "succeeded"]),
         ("test", ["timed_out", "succeeded"])]


class Seen:
    """An attempt-scoped verifier recording what it was called with; its verdict says
    which attempt its ctx named, so the recorded row can be checked against it."""

    name = "seen"
    version = "1"

    def __init__(self, **attrs: Any) -> None:
        attrs.setdefault("scope", "attempt")
        if attrs["scope"] is None:  # no scope attribute at all
            del attrs["scope"]
        self.__dict__.update(attrs)
        self.calls: list[tuple[int | None, str | None, int | None, int]] = []
        self.lock = threading.Lock()

    def __call__(self, ctx: VerifierCtx) -> Verdict:
        a = judged_attempt(ctx)
        with self.lock:
            self.calls.append((ctx.branch, ctx.step, ctx.attempt, ctx.snapshot_lsn))
        return Verdict(a.state == "succeeded", None, f"{ctx.branch}/{ctx.step}#{ctx.attempt} "
                                                     f"{a.state}")


def rewound(log: pdm.EventLog) -> tuple[int, int]:
    """r1 as in STEPS, verified (snapshot 1), rewound to step 1 with a retry on branch 1,
    verified again (snapshot 2). Returns both snapshot LSNs."""
    first = record_run(log, "r1", STEPS)
    with log.transaction() as tx:
        tx.append(E.BranchForked("acme", "r1", 1, 0, 1))
        for step, index, n, state in (("code", 1, 1, "failed"), ("code", 1, 2, "succeeded"),
                                      ("test", 2, 1, "succeeded")):
            tx.append(E.AttemptDispatched("acme", "r1", 1, step, index, n))
            out = tx.put_blob("acme", f"r1 b1 {step} #{n}: {state}".encode())
            tx.append(E.AttemptFinished("acme", "r1", 1, step, n, state, output=out))
        tx.append(E.VerifyingEntered("acme", "r1"))
    return first, log.head


def verdict_rows(log: pdm.EventLog, verifier: str) -> list[tuple[Any, ...]]:
    with pdm.connect(log) as con:
        return con.execute(
            "select branch_id, step_id, attempt_no, snapshot_lsn, passed, detail "
            "from verdicts where verifier = ? order by branch_id, step_id, attempt_no, lsn",
            [verifier]).fetchall()


@pytest.fixture
def log() -> pdm.EventLog:
    return pdm.open_log(f"memory://grade-attempts-{uuid.uuid4().hex}")


# --- one call and one verdict per attempt ----------------------------------------------


ALL = [(0, "code", 1, "failed"), (0, "code", 3, "succeeded"), (0, "plan", 1, "succeeded"),
       (0, "test", 1, "timed_out"), (0, "test", 2, "succeeded"), (1, "code", 1, "failed"),
       (1, "code", 2, "succeeded"), (1, "test", 1, "succeeded")]


def test_every_terminal_attempt_of_the_snapshot_is_graded_once(log: pdm.EventLog) -> None:
    _first, snap = rewound(log)
    seen = Seen()
    report = grade(log, [seen, exit_code])
    # every branch, retries included; the still-dispatched code#2 is not judged
    assert sorted(seen.calls) == sorted((b, s, n, snap) for b, s, n, _ in ALL)
    assert verdict_rows(log, "seen@1") == [
        (b, s, n, snap, state == "succeeded", f"{b}/{s}#{n} {state}") for b, s, n, state in ALL]
    # the run verdict beside it: on the live branch, no attempt
    assert verdict_rows(log, "exit_code@1") == [
        (1, None, None, snap, True, "3 steps succeeded; 1 failed attempts")]
    assert report.verdicts_recorded == 9
    assert (report.runs_graded, report.runs_failed) == (1, 1)  # 3 attempts did not succeed
    per = {c.verifier: c for c in report.per_verifier}
    assert (per["seen@1"].graded, per["seen@1"].passed, per["seen@1"].failed) == (8, 5, 3)
    assert (per["exit_code@1"].graded, per["exit_code@1"].skipped) == (1, 0)
    failures = sorted((f.branch, f.step, f.attempt) for f in report.failures)
    assert failures == [(0, "code", 1), (0, "test", 1), (1, "code", 1)]

    again = grade(log, [seen, exit_code])  # idempotent per (run, verifier, snapshot, attempt)
    assert (again.verdicts_recorded, again.runs_graded, again.runs_skipped) == (0, 0, 1)
    assert again.snapshot_s == 0.0  # the plan saw every attempt graded: no snapshot built
    assert len(seen.calls) == 8
    forced = grade(log, [seen], force=True)
    assert forced.verdicts_recorded == 8
    assert len(verdict_rows(log, "seen@1")) == 16


def test_last_attempt_per_step_of_the_live_trajectory(log: pdm.EventLog) -> None:
    _first, snap = rewound(log)
    seen = Seen(attempts="last_per_step")
    grade(log, [seen])
    # plan is inherited from branch 0 (below the fork at step 1); code and test are 1's own
    assert sorted(seen.calls) == [(0, "plan", 1, snap), (1, "code", 2, snap),
                                  (1, "test", 1, snap)]
    assert [r[:3] for r in verdict_rows(log, "seen@1")] == [
        (0, "plan", 1), (1, "code", 2), (1, "test", 1)]
    again = grade(log, [seen])  # owed by the plan (a superset), nothing left to grade
    assert (again.verdicts_recorded, len(seen.calls)) == (0, 3)


def test_a_step_filter_grades_only_those_steps(log: pdm.EventLog) -> None:
    _first, snap = rewound(log)
    seen = Seen(steps=("code",), scope=None)  # steps= alone makes it attempt-scoped
    grade(log, [seen])
    assert sorted(seen.calls) == [(0, "code", 1, snap), (0, "code", 3, snap),
                                  (1, "code", 1, snap), (1, "code", 2, snap)]
    assert grade(log, [seen]).snapshot_s == 0.0  # the other steps are not owed
    everything = Seen(name="seen")  # same identity, every step: plan and test are owed
    assert grade(log, [everything]).verdicts_recorded == 4
    assert sorted(everything.calls) == [(0, "plan", 1, snap), (0, "test", 1, snap),
                                        (0, "test", 2, snap), (1, "test", 1, snap)]


def test_an_attempt_graded_by_an_interrupted_job_is_not_graded_again(
        log: pdm.EventLog) -> None:
    _first, snap = rewound(log)
    with log.transaction() as tx:  # what a job that died after its first batch left
        tx.append(E.VerdictRecorded("acme", "r1", 1, "seen@1", snap, True, None, "earlier",
                                    step_id="code", attempt_no=2))
        tx.append(E.VerdictRecorded("acme", "r1", 0, "seen@1", snap - 1, True, None,
                                    "another snapshot", step_id="plan", attempt_no=1))
    seen = Seen()
    report = grade(log, [seen])
    assert (1, "code", 2, snap) not in seen.calls
    assert (0, "plan", 1, snap) in seen.calls  # graded at an older snapshot only
    assert report.verdicts_recorded == len(seen.calls) == 7


def test_scope_attributes_are_checked_before_anything_is_written(log: pdm.EventLog) -> None:
    rewound(log)
    head = log.head
    for attrs, match in (({"scope": "step"}, "scope must be one of"),
                         ({"attempts": "first"}, "attempts must be one of"),
                         ({"steps": "code"}, "steps must be a non-empty tuple"),
                         ({"scope": "run", "steps": ("code",)}, "needs scope 'attempt'")):
        with pytest.raises(pdm.ValidationError, match=match):
            grade(log, [Seen(**attrs)])
    assert log.head == head


def test_a_verdict_names_both_step_and_attempt_or_neither(log: pdm.EventLog) -> None:
    rewound(log)
    head = log.head
    half = E.VerdictRecorded("acme", "r1", 0, "v@1", 3, True, step_id="code")
    with pytest.raises(pdm.ValidationError, match="attempt_no"):
        with log.transaction() as tx:
            tx.append(half)
    table = pa.table({"kind": ["verdict_recorded"], "tenant": ["acme"], "run_id": ["r1"],
                      "branch_id": [0], "verifier": ["v@1"], "snapshot_lsn": [3],
                      "passed": [True], "attempt_no": [2]})
    with pytest.raises(pdm.ValidationError, match="row 0 .*attempt_no"):
        with log.transaction() as tx:
            tx.extend(table)
    with pytest.raises(pdm.ValidationError, match="attempt_no"):
        with log.transaction() as tx:
            tx.append(E.VerdictRecorded("acme", "r1", 0, "v@1", 3, True, step_id="code",
                                        attempt_no=0))
    assert log.head == head


# --- the snapshot barrier, attempt by attempt ------------------------------------------


class Parked(Seen):
    """Parks every call until the mutator is done; records each call's view on entry
    and on exit, and the judged attempt's state and error."""

    name = "parked"

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.entered = threading.Event()
        self.proceed = threading.Event()
        self.views: list[tuple[bytes, bytes, Any, Any]] = []

    def __call__(self, ctx: VerifierCtx) -> Verdict:
        a = judged_attempt(ctx)
        on_entry = ctx.episode.serialize()
        self.entered.set()
        if not self.proceed.wait(WAIT_S):
            raise AssertionError("the mutator never released the verifier")
        after = judged_attempt(ctx)
        with self.lock:
            self.views.append((on_entry, ctx.episode.serialize(), (a.state, a.error),
                               (after.state, after.error)))
        return super().__call__(ctx)


def _rewind(root: str) -> None:
    with pdm.open_log(root).transaction() as tx:
        tx.append(E.BranchForked("acme", "r1", 1, 0, 1))
        tx.append(E.AttemptDispatched("acme", "r1", 1, "code", 1, 1))
        tx.append(E.AttemptFinished("acme", "r1", 1, "code", 1, "succeeded"))


def _cancel_from_a_child_process(root: str) -> None:
    child = textwrap.dedent(f"""
        import poimen_data as pdm
        from poimen_data import events as E
        log = pdm.open_log({root!r}, create=False)
        with log.transaction() as tx:
            tx.append(E.RunCancelled("acme", "r1", "operator"))
    """)
    subprocess.run([sys.executable, "-c", child], timeout=WAIT_S, check=True)


def _recover(root: str) -> None:
    with pdm.open_log(root).transaction() as tx:
        tx.append(E.AttemptRecovered("acme", "r1", 0, "code", 2, "failed",
                                     error="lost in a crash"))


MUTATORS: dict[str, Callable[[str], None]] = {
    "rewind": _rewind, "cancel": _cancel_from_a_child_process, "recovery": _recover}


@pytest.mark.parametrize("mutation", list(MUTATORS))
def test_a_mutation_while_attempts_are_graded_does_not_reach_the_held_view(
        tmp_path: Path, mutation: str) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    snap = record_run(log, "r1", STEPS)
    parked = Parked(steps=("code",))
    report = grade_while(log, parked, lambda: MUTATORS[mutation](log.root))
    fresh = pdm.open_log(log.root)
    assert fresh.head == snap + {"rewind": 3, "cancel": 1, "recovery": 1}[mutation] + 2
    # code#1 and code#3 are graded; code#2 was dispatched at the snapshot (a recovery
    # that resolves it later does not make it gradable at this snapshot)
    assert sorted(parked.calls) == [(0, "code", 1, snap), (0, "code", 3, snap)]
    assert report.verdicts_recorded == 2
    cold = episode(fresh, "r1", all_branches=True, at_lsn=snap, source="log").serialize()
    assert [v[:2] for v in parked.views] == [(cold, cold)] * 2
    assert sorted(v[2] for v in parked.views) == sorted(v[3] for v in parked.views) == [
        ("failed", "code failed"), ("succeeded", None)]
    assert verdict_rows(fresh, "parked@1") == [
        (0, "code", 1, snap, False, "0/code#1 failed"),
        (0, "code", 3, snap, True, "0/code#3 succeeded")]
    now = episode(fresh, "r1", all_branches=True)
    assert now.serialize() != cold
    if mutation == "recovery":
        (a,) = [a for a in now.branches[0].attempts if (a.step, a.attempt) == ("code", 2)]
        assert (a.state, a.error) == ("failed", "lost in a crash")


# --- laziness ----------------------------------------------------------------------------


def record_json_run(log: pdm.EventLog, run: str, outputs: list[tuple[str, bytes | None]]) -> int:
    """One run whose step i has one succeeded attempt with output ``outputs[i]``."""
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", run, "wf-1"))
        for i, (step, body) in enumerate(outputs):
            tx.append(E.AttemptDispatched("acme", run, 0, step, i, 1))
            ref = None if body is None else tx.put_blob("acme", body)
            tx.append(E.AttemptFinished("acme", run, 0, step, 1, "succeeded", output=ref))
        tx.append(E.VerifyingEntered("acme", run))
    return log.head


def test_an_attempt_verifier_reading_one_output_makes_one_get_per_attempt(
        log: pdm.EventLog) -> None:
    rewound(log)  # 8 terminal attempts, each with an output body
    record_json_run(log, "r2", [("plan", b'{"plan": [1, 2]}'), ("answer", b'{"answer": 4'),
                                ("note", None)])
    blobs = CountingBlobStore(log.blobs)
    report = grade(log, [output_is_json, exit_code], blobs=blobs)
    # r1: 8 attempts; r2: 3 attempts, one of them without an output ref (nothing to read)
    assert report.verdicts_recorded == 8 + 3 + 2
    assert blobs.gets == 8 + 2
    with pdm.connect(log) as con:
        rows = con.execute("select step_id, attempt_no, passed, score from verdicts "
                           "where run_id = 'r2' and step_id is not null "
                           "order by step_id").fetchall()
    assert rows == [("answer", 1, False, 0.0), ("note", 1, False, None),
                    ("plan", 1, True, 1.0)]

    keyed = OutputIsJson(keys=("plan", "budget"), steps=("plan",), name="plan_json")
    counting = CountingBlobStore(log.blobs)
    grade(log, [keyed], blobs=counting)  # r1 has plan#1 once (branch 0), r2 once
    assert counting.gets == 2
    with pdm.connect(log) as con:
        assert con.execute("select run_id, passed, score, detail from verdicts "
                           "where verifier = 'plan_json@1' order by run_id").fetchall() == [
            ("r1", False, 0.0, "plan#1: not JSON: Expecting value: line 1 column 1 (char 0)"),
            ("r2", False, 0.5, "plan#1: missing keys budget")]


# --- a log written before attempt verdicts ---------------------------------------------


def test_the_golden_log_reads_as_before_and_takes_attempt_verdicts(tmp_path: Path) -> None:
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN / "log", root)
    log = pdm.open_log(root, create=False)
    old_head = log.head
    before = log.read_events()
    # the events are the segments' own columns, byte for byte (no column conformed away)
    for s in log.segments():
        raw = pa.ipc.open_file(pa.memory_map(str(root / s.path))).read_all()
        read = before.slice(s.first_lsn - 1, s.rows)
        assert raw.schema.names == before.schema.names[2:]
        for name in raw.schema.names:
            assert read.column(name).combine_chunks().equals(raw.column(name).combine_chunks())
    with pdm.connect(log) as con:
        old_verdicts = con.execute("select * from verdicts order by lsn").fetchall()
    assert [r[-2:] for r in old_verdicts] == [(None, None), (None, None)]

    # a state made by the previous fold version is rebuilt, never served
    pdm.materialize(log)
    doc = _state.read_pointer(log).to_doc()
    doc["fold_version"] = OLD_FOLD_VERSION
    log.storage.write(_state.POINTER, dumps(doc))
    assert _fold.FOLD_VERSION != OLD_FOLD_VERSION
    with pytest.raises(pdm.NotFound, match="fold version"):
        pdm.episode(log, "run-1", source="state")

    seen = Seen()
    report = grade(log, [seen, output_is_json], runs=["run-1"])
    snap = 24  # run-1's latest verifying_entered
    with pdm.connect(log) as con:
        assert con.execute("select verifying_lsn from runs where run_id = 'run-1'"
                           ).fetchall() == [(snap,)]
    assert {c[3] for c in seen.calls} == {snap}
    assert sorted(c[:3] for c in seen.calls) == [
        (0, "code", 1), (0, "code", 2), (0, "code", 3), (0, "plan", 1), (0, "test", 1),
        (1, "code", 1), (1, "test", 1), (2, "deploy", 1), (2, "test", 1)]
    assert report.verdicts_recorded == 18
    fresh = pdm.open_log(root, create=False)
    after = fresh.read_events(at_lsn=old_head)
    assert after.equals(before)
    with pdm.connect(fresh) as con:
        assert con.execute("select * from verdicts where lsn <= ? order by lsn",
                           [old_head]).fetchall() == old_verdicts
        assert con.execute("select count(*), count(step_id), count(attempt_no) from verdicts "
                           "where lsn > ?", [old_head]).fetchone() == (18, 18, 18)
    assert pdm.materialize(fresh).lsn == fresh.head
    assert _state.read_pointer(fresh).fold_version == _fold.FOLD_VERSION
    assert pdm.check(fresh).ok


def test_a_segment_lacking_a_column_reads_it_as_null(tmp_path: Path) -> None:
    """How the next schema change will read old segments: a committed segment written
    without a column (here: as if ``detail`` did not exist yet, manifest and all) reads
    with that column null, and the verdict in it folds with a null detail."""
    import hashlib
    import json

    from poimen_data.log._manifest import loads, manifest_path
    from poimen_data.model import conform_segment

    root = tmp_path / "log"
    log = pdm.open_log(str(root))
    record_run(log, "r1", [("plan", ["succeeded"])])
    with log.transaction() as tx:
        tx.append(E.VerdictRecorded("acme", "r1", 0, "v@1", 4, True, 1.0, "fine"))
    seq = tx.commit_info.seq
    doc = loads((root / manifest_path(seq)).read_bytes(), "m")
    (seg,) = doc["segments"]
    full = pa.ipc.open_file(pa.memory_map(str(root / seg["path"]))).read_all()
    older = full.drop_columns(["detail"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, older.schema) as w:
        w.write_table(older)
    data = sink.getvalue().to_pybytes()
    (root / seg["path"]).write_bytes(data)
    seg.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    (root / manifest_path(seq)).write_bytes(dumps(doc))
    assert json.loads((root / manifest_path(seq)).read_bytes())["segments"][0]["size"] == len(
        data)

    fresh = pdm.open_log(str(root), create=False)
    events = fresh.read_events()
    assert events.schema == E.LOG_SCHEMA
    assert events.column("detail").to_pylist()[-1] is None
    with pdm.connect(fresh) as con:
        assert con.execute("select verifier, passed, score, detail from verdicts"
                           ).fetchall() == [("v@1", True, 1.0, None)]
    # streamed, with nothing cached: the scan behind compact, grade, export and the
    # partitioned fold reads the old segment the same way
    streamed = pdm.open_log(str(root), create=False)
    assert pa.Table.from_batches(list(streamed.scan()), E.LOG_SCHEMA).equals(events)
    assert pa.Table.from_batches(list(streamed.scan(columns=["lsn", "detail"]))).to_pydict() \
        == {"lsn": events.column("lsn").to_pylist(),
            "detail": events.column("detail").to_pylist()}
    pdm.materialize(streamed, full=True)
    assert pdm.check(streamed).ok
    with pytest.raises(pdm.CorruptionError, match="seg: .*no column 'kind'"):
        conform_segment(events.drop_columns(["kind"]), "seg")


# --- where attempt verdicts show: export, poimen show, poimen grade ---------------------


def test_the_export_lists_an_attempt_verdict_on_the_attempt_it_judged(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    log = pdm.open_log(str(tmp_path / "log"))
    _first, snap = rewound(log)
    grade(log, [Seen(), exit_code])
    out = tmp_path / "live.parquet"  # every attempt, with or without prompt and output
    pdm.export_live(log, str(out), format="parquet", source="log")
    records = pq.read_table(out).to_pylist()
    run_verdict = {"verifier": "exit_code@1", "passed": True, "score": 1.0,
                   "snapshot_lsn": snap}

    def seen(passed: bool) -> dict[str, Any]:
        return {"verifier": "seen@1", "passed": passed, "score": None, "snapshot_lsn": snap}

    # the live trajectory: plan inherited from branch 0, then branch 1's own attempts
    assert [(m["branch_id"], m["step_id"], m["attempt_no"], m["verdicts"]) for m in records] == [
        (0, "plan", 1, [run_verdict, seen(True)]),
        (1, "code", 1, [run_verdict, seen(False)]),
        (1, "code", 2, [run_verdict, seen(True)]),
        (1, "test", 1, [run_verdict, seen(True)])]
    pdm.materialize(log)
    again = tmp_path / "state.parquet"
    pdm.export_live(log, str(again), format="parquet", source="state")
    assert again.read_bytes() == out.read_bytes()


def test_poimen_show_and_grade_for_both_scopes(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from poimen_data import cli

    root = str(tmp_path / "log")
    log = pdm.open_log(root)
    _first, snap = rewound(log)
    runner = CliRunner()
    r = runner.invoke(cli.app, ["grade", "--root", root, "--json",
                                "-v", "poimen_data.verifiers:output_is_json",
                                "-v", "poimen_data.verifiers:exit_code"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["verdicts_recorded"] == 9
    assert [(v["verifier"], v["graded"], v["failed"]) for v in report["per_verifier"]] == [
        ("output_is_json@1", 8, 8), ("exit_code@1", 1, 0)]
    r = runner.invoke(cli.app, ["show", "r1", "--root", root, "--json"],
                      catch_exceptions=False)
    shown = json.loads(r.stdout)["verdicts"]
    assert len(shown) == 9 and {v["snapshot_lsn"] for v in shown} == {snap}
    assert [(v["verifier"], v["branch_id"]) for v in shown if v["step_id"] is None] == [
        ("exit_code@1", 1)]
    assert sorted((v["branch_id"], v["step_id"], v["attempt_no"]) for v in shown
                  if v["step_id"] is not None) == sorted((b, s, n) for b, s, n, _ in ALL)
    r = runner.invoke(cli.app, ["show", "r1", "--root", root], catch_exceptions=False)
    assert r.exit_code == 0
    assert "verdicts" in r.stdout and "1/code#2" in r.stdout and "run (branch 1)" in r.stdout


@pytest.mark.slow
def test_dask_grades_attempts_like_the_in_process_executor(tmp_path: Path) -> None:
    distributed = pytest.importorskip("distributed")
    log = pdm.open_log(str(tmp_path / "log"))
    _first, snap = rewound(log)
    record_json_run(log, "r2", [("plan", b'{"plan": 1}'), ("answer", b"4")])
    last = OutputIsJson(attempts="last_per_step", steps=("plan", "code"), name="last_json")
    verifiers = [output_is_json, last, exit_code]
    local = grade(log, verifiers)
    split = log.head
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        again = grade(log, verifiers, executor=client)
        remote = grade(log, verifiers, executor=client, force=True)
    assert again.verdicts_recorded == 0
    assert local.verdicts_recorded == remote.verdicts_recorded == (8 + 2) + (2 + 1) + 2
    assert remote.per_verifier == local.per_verifier
    cols = ("run_id, branch_id, step_id, attempt_no, verifier, snapshot_lsn, passed, score, "
            "detail")
    with pdm.connect(log) as con:
        before, after = (con.execute(f"select {cols} from verdicts where lsn {op} ? "
                                     f"order by {cols}", [split]).fetchall()
                         for op in ("<=", ">"))
    assert after == before and len(before) == 15
    assert [r[:4] for r in before if r[4] == "last_json@1"] == [
        ("r1", 0, "plan", 1), ("r1", 1, "code", 2), ("r2", 0, "plan", 1)]
    assert {r[5] for r in before if r[0] == "r1"} == {snap}
