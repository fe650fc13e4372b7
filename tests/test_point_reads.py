"""A read of one run at an LSN before the materialized state starts at the run's first
event (the state's run index says where), never at LSN 1: proven by damaging the log's
first segments, which such a read must not touch, and comparing with the answers given
before the damage."""

from __future__ import annotations

import contextlib
from pathlib import Path

import duckdb
import pytest

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.errors import CorruptionError
from poimen_data.fold._query import run_labels


def _runs(log: pdm.EventLog, first: int, last: int, verify: bool = False) -> dict[int, int]:
    """Runs first..last, one commit each (one segment each), in verifying when
    ``verify``; each run's commit LSN."""
    at = {}
    for i in range(first, last + 1):
        with log.transaction() as tx:
            tx.append(ev.RunStarted("acme", f"run-{i:03d}", "wf", {"i": str(i)}))
            tx.append(ev.AttemptDispatched("acme", f"run-{i:03d}", 0, "s", 0, 1))
            tx.append(ev.AttemptFinished("acme", f"run-{i:03d}", 0, "s", 1, "succeeded"))
            if verify:
                tx.append(ev.VerifyingEntered("acme", f"run-{i:03d}"))
        at[i] = log.head
    return at


def _damage_first_segments(log: pdm.EventLog, n: int, root: Path) -> None:
    for s in sorted(log.segments(), key=lambda s: s.first_lsn)[:n]:
        path = root / s.path
        path.write_bytes(b"\0" * path.stat().st_size)  # same size, other bytes


def test_one_run_before_the_state_is_read_from_its_first_event(tmp_path: Path) -> None:
    root = tmp_path / "log"
    log = pdm.open_log(root)
    at = _runs(log, 1, 40)
    pdm.materialize(log)  # the state at the head: every read below is before it
    at |= _runs(log, 41, 42)  # and a tail after it
    asks = [("run-030", at[35]), ("run-030", at[30]), ("run-012", at[20]),
            ("run-041", at[42]), ("run-030", None)]
    before = {(r, lsn): (pdm.episode(log, r, at_lsn=lsn, all_branches=True),
                         run_labels(log, r, at_lsn=lsn)) for r, lsn in asks}
    assert before[("run-030", at[35])][1] == [("i", "30")]
    assert len(before[("run-030", at[35])][0].branches[0].attempts) == 1
    _damage_first_segments(log, 10, root)  # runs 1..10 unreadable now
    fresh = pdm.open_log(root)
    for (r, lsn), (view, labels) in before.items():
        assert pdm.episode(fresh, r, at_lsn=lsn, all_branches=True) == view, (r, lsn)
        assert run_labels(fresh, r, at_lsn=lsn) == labels, (r, lsn)
    # a run that had not started by then: nothing, without reading a segment for it
    assert run_labels(fresh, "run-038", at_lsn=at[35]) == []
    with pytest.raises(pdm.NotFound):
        pdm.episode(fresh, "run-038", at_lsn=at[35])
    # the damage is real: a read of a damaged run, and one from the log, say so
    with pytest.raises(CorruptionError):
        run_labels(fresh, "run-005", at_lsn=at[35])
    with pytest.raises(CorruptionError):
        pdm.episode(fresh, "run-030", at_lsn=at[35], source="log")


class _Each:
    """An attempt-scoped verifier: passes every succeeded attempt."""

    name, version, scope = "each", "1", "attempt"

    def __call__(self, ctx: pdm.VerifierCtx) -> pdm.Verdict:
        return pdm.Verdict(passed=True, detail=f"{ctx.step}#{ctx.attempt}")


def _whole(ctx: pdm.VerifierCtx) -> pdm.Verdict:
    return pdm.Verdict(passed=len(ctx.episode.branches) == 1)


_whole.name = "whole"  # type: ignore[attr-defined]


@pytest.mark.parametrize("executor", ["here", "chunks", "dask"])
def test_grading_late_runs_reads_the_log_from_their_first_event(tmp_path: Path,
                                                                 executor: str) -> None:
    """Snapshots of the runs to grade, and what an attempt-scoped verifier already
    graded, are read from those runs' first events: grading runs 31..40 of a log whose
    first ten segments are damaged grades them, once."""
    root = tmp_path / "log"
    log = pdm.open_log(root)
    _runs(log, 1, 40, verify=True)
    first = pdm.grade(log, [_whole], runs=[f"run-{i:03d}" for i in range(1, 31)])
    assert first.runs_graded == 30
    pdm.materialize(log)
    _damage_first_segments(log, 10, root)
    fresh = pdm.open_log(root)
    late = [f"run-{i:03d}" for i in range(31, 41)]
    chunk = 1000 if executor == "here" else 3
    with contextlib.ExitStack() as stack:
        client = None
        if executor == "dask":  # chunks of 3 runs on a worker, each its own snapshots
            distributed = pytest.importorskip("distributed")
            cluster = stack.enter_context(distributed.LocalCluster(
                n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None))
            client = stack.enter_context(distributed.Client(cluster))
        got = pdm.grade(fresh, [_whole, _Each()], runs=late, chunk_runs=chunk,
                        executor=client)
        assert (got.runs_graded, got.verdicts_recorded, got.runs_passed) == (10, 20, 10)
        again = pdm.grade(fresh, [_whole, _Each()], runs=late, chunk_runs=chunk,
                          executor=client)  # all graded
    assert (again.runs_graded, again.runs_skipped, again.verdicts_recorded) == (0, 10, 0)
    with pdm.connect(fresh) as con:
        assert con.sql("select verifier, count(*), bool_and(passed) from verdicts "
                       "where run_id >= 'run-031' group by 1 order by 1").fetchall() == [
            ("each@1", 10, True), ("whole@0", 10, True)]
    # the damage is real: run-005's snapshot reads it (through a stream DuckDB reads,
    # which hands the CorruptionError back as its own error)
    with pytest.raises((CorruptionError, duckdb.Error), match="sha256 differs from its"):
        pdm.grade(fresh, [_Each()], runs=["run-005"])


def test_a_run_index_footer_that_lies_never_hides_a_run(tmp_path: Path) -> None:
    """The run index's parquet footer (its run_id statistics) is covered by no checksum:
    one byte there must not make a run read before the state look absent (its episode
    NotFound, its labels empty, a grade folding it from after the state and committing
    a wrong verdict). The index is read whole for those reads, pages checked by CRC."""
    from poimen_data.fold._state import INDEX, usable_pointer

    root = tmp_path / "log"
    log = pdm.open_log(root)
    at = _runs(log, 1, 40)
    pdm.materialize(log)
    with log.transaction() as tx:  # run-030 enters verifying after the state
        tx.append(ev.VerifyingEntered("acme", "run-030"))
    ptr = usable_pointer(log)
    assert ptr is not None
    index = root / ptr.tables[INDEX][0].path
    data = bytearray(index.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    hits = [i for i in range(footer, len(data) - 8) if data[i:i + 7] == b"run-040"]
    assert hits  # the row group's max run_id statistic
    for i in hits:
        data[i:i + 7] = b"run-020"  # says no run past run-020 is in it
    index.write_bytes(bytes(data))
    fresh = pdm.open_log(root)
    view = pdm.episode(fresh, "run-030", at_lsn=at[35], all_branches=True)
    assert [(a.step, a.state) for a in view.branches[0].attempts] == [("s", "succeeded")]
    assert run_labels(fresh, "run-030", at_lsn=at[35]) == [("i", "30")]

    def one_attempt(ctx: pdm.VerifierCtx) -> pdm.Verdict:
        return pdm.Verdict(passed=[len(b.attempts) for b in ctx.episode.branches] == [1])

    got = pdm.grade(fresh, [one_attempt], runs=["run-030"])
    assert (got.runs_graded, got.runs_passed) == (1, 1)
