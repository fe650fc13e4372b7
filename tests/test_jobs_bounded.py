"""Grade and export split by run bucket (issue 13, "Bounded memory everywhere"): when the
log is larger than the budget, both work one group of buckets at a time; the verdicts'
snapshots are those of a cold fold and the export's bytes those of one query.

``_state.PASS_FACTOR`` is raised to force several groups on a small log (how many groups
a budget gets is the only thing it decides); the memory bound itself is checked at size
in ``test_state_layout.py``.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

import poimen_data as pdm
from poimen_data import Verdict, export_live, grade, materialize, reduce, synth
from poimen_data.fold import _build, _state
from poimen_data.jobs import VerifierCtx

FORMATS = ("jsonl", "parquet", "pairs", "atif")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def split(monkeypatch: pytest.MonkeyPatch, log: pdm.EventLog, n: int = 4, *,
          groups: int | None = None) -> None:
    """Make the budget look ``n`` times too small for the log: the jobs then work in
    ``n`` groups of run buckets (at most 16, ``groups``)."""
    size = sum(s.size for s in log.segments(log.head))
    monkeypatch.setattr(_state, "PASS_FACTOR", n * _build.budget_of(None).memory_limit // size)
    planned = _state.plan_groups(log, log.head, _build.budget_of(None), None)
    assert len(planned) == (n if groups is None else groups)


def on_run(ctx: VerifierCtx) -> Verdict:
    return Verdict(len(ctx.episode.branches) % 2 == 0, score=float(ctx.snapshot_lsn % 7))


on_run.name, on_run.version = "on_run", "1"  # type: ignore[attr-defined]


def on_attempt(ctx: VerifierCtx) -> Verdict:
    return Verdict((ctx.attempt or 0) % 2 == 1, detail=f"{ctx.step}#{ctx.attempt}")


on_attempt.name, on_attempt.scope = "on_attempt", "attempt"  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic log (forks of forks, cancels, retries) with run and attempt verdicts
    and some prompts reduced: every part of the export's query has rows."""
    root = tmp_path_factory.mktemp("graded") / "log"
    log = pdm.open_log(root)
    synth.generate(log, runs=90, seed=21, batch=8)
    report = grade(log, [on_run, on_attempt])
    assert report.runs_graded > 10
    con = pdm.connect(log)
    refs = [pdm.BlobRef(*r) for r in con.execute(
        "select distinct prompt.tenant, prompt.sha256, prompt.size from attempts "
        "where prompt is not null order by 2 limit 12").fetchall()]
    con.close()
    reduce(log, refs, lambda body: b"summary: " + body[:20])
    return root


@pytest.fixture(scope="module")
def states(graded: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Copies of ``graded``: one materialized at its head; one materialized, then more
    runs recorded (its exports serve the state plus the re-fold of the runs touched)."""
    import shutil

    at_head, older = (tmp_path_factory.mktemp("states") / n for n in ("head", "older"))
    for root in (at_head, older):
        shutil.copytree(graded, root)
        materialize(root)
    synth.generate(older, runs=6, seed=22, batch=4, prefix="late")
    return at_head, older


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_in_bucket_groups_writes_the_bytes_of_one_query(
        graded: Path, states: tuple[Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """From the log, from a state at the LSN and from an older state plus the runs
    touched since: the same file as one query over a cold fold, runs in run_id order."""
    at_head, older = states
    one = export_live(graded, tmp_path / "one.out", format=fmt, source="log")
    later = export_live(older, tmp_path / "later.out", format=fmt, source="log")
    assert one.records > 20 and later.records > one.records
    split(monkeypatch, pdm.open_log(graded))
    cold = export_live(graded, tmp_path / "cold.out", format=fmt, source="log")
    state = export_live(at_head, tmp_path / "state.out", format=fmt, source="state")
    tail = export_live(older, tmp_path / "tail.out", format=fmt)
    assert (cold.source, state.source, tail.source) == ("log", "state", "state+log")
    for r in (cold, state):
        assert (r.sha256, r.records, r.runs, r.reduced, r.skipped_no_output,
                r.skipped_no_prompt) == (one.sha256, one.records, one.runs, one.reduced,
                                         one.skipped_no_output, one.skipped_no_prompt)
    assert (tail.sha256, tail.records, tail.runs) == (later.sha256, later.records, later.runs)
    assert sha(tmp_path / "cold.out") == sha(tmp_path / "state.out") == one.sha256
    assert sha(tmp_path / "tail.out") == later.sha256 != one.sha256


def test_export_in_slices_of_bucket_groups_writes_the_same_bytes(
        graded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget smaller than a 16th of the log: each bucket group is folded in slices."""
    one = export_live(graded, tmp_path / "one.out", format="pairs", source="log")
    split(monkeypatch, pdm.open_log(graded), 32, groups=16)  # 16 groups of 2 slices
    got = export_live(graded, tmp_path / "split.out", format="pairs", source="log")
    assert (got.sha256, got.records, got.runs) == (one.sha256, one.records, one.runs)
    assert sha(tmp_path / "split.out") == one.sha256


def test_export_of_some_runs_in_bucket_groups(graded: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    log = pdm.open_log(graded)
    con = pdm.connect(log)
    runs = [r for (r,) in con.execute("select run_id from runs order by run_id desc "
                                      "limit 9").fetchall()]
    con.close()
    one = export_live(log, tmp_path / "one.out", format="parquet", runs=runs,
                      only_succeeded=True, source="log")
    split(monkeypatch, log)
    got = export_live(log, tmp_path / "split.out", format="parquet", runs=runs,
                      only_succeeded=True, source="log")
    assert (got.sha256, got.runs) == (one.sha256, 9)
    with pytest.raises(pdm.NotFound, match="no run nope"):
        export_live(log, tmp_path / "x.out", runs=[*runs, "nope"], source="log")
    assert not (tmp_path / "x.out").exists()


def test_grade_in_bucket_groups_holds_cold_snapshots(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each snapshot, built from its bucket group's fold, equals a cold fold of its run at
    its verifying LSN; every run in verifying gets its verdicts, once."""
    log = pdm.open_log(tmp_path / "log")
    synth.generate(log, runs=60, seed=5, batch=8)
    split(monkeypatch, log)
    seen: dict[str, tuple[int, bytes]] = {}
    lock = threading.Lock()

    def keep(ctx: VerifierCtx) -> Verdict:
        with lock:
            assert ctx.run not in seen
            seen[ctx.run] = (ctx.snapshot_lsn, ctx.episode.serialize())
        return Verdict(True)

    report = grade(log, [keep, on_attempt], chunk_runs=7)
    con = pdm.connect(log)
    expected = dict(con.execute("select run_id, verifying_lsn from runs "
                                "where state = 'verifying'").fetchall())
    con.close()
    assert report.runs_graded == len(expected) == len(seen) > 10
    assert len({_build.bucket_of(r) % 4 for r in seen}) == 4  # every group had runs
    for run, (lsn, held) in seen.items():
        assert lsn == expected[run]
        cold = pdm.episode(log, run, all_branches=True, at_lsn=lsn, source="log")
        assert held == cold.serialize(), run
    again = grade(log, [keep, on_attempt])
    assert again.verdicts_recorded == 0


def test_a_bad_memory_limit_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = pdm.open_log(tmp_path / "log")
    synth.generate(log, runs=3, seed=1)
    with pytest.raises(pdm.ValidationError, match="memory_limit"):
        grade(log, [on_run], memory_limit="lots")
    with pytest.raises(pdm.ValidationError, match="memory_limit"):
        export_live(log, tmp_path / "x.jsonl", memory_limit=12)
    monkeypatch.setenv("POIMEN_MEMORY_LIMIT", "2 parsecs")
    with pytest.raises(pdm.ValidationError, match="POIMEN_MEMORY_LIMIT"):
        export_live(log, tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()
