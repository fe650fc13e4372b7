"""Grading speed: 10,000 runs with the exit-code verifier, in-process, at >= 2,000 runs/s.

Snapshot building is the cost that matters (one fold per run would take minutes); the
report carries it as ``snapshot_s`` so the number is visible, not just the total.
"""

from __future__ import annotations

from typing import Any

import pytest

import poimen_data as pdm
from poimen_data._grade import VerifierCounts, grade
from poimen_data.testing import bulk_runs
from poimen_data.verifiers import exit_code

N_RUNS = 10_000


@pytest.mark.slow
def test_ten_thousand_runs_grade_at_two_thousand_runs_per_second(tmp_path: Any) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    bulk_runs(log, N_RUNS, steps=3, fail_every=7)
    report = grade(log, [exit_code])
    n_failed = len(range(0, N_RUNS, 7))
    assert (report.runs_graded, report.runs_failed, report.runs_errored) == (
        N_RUNS, n_failed, 0)
    assert report.per_verifier == (
        VerifierCounts("exit_code@1", N_RUNS, 0, N_RUNS - n_failed, n_failed, 0),)
    assert report.verdicts_recorded == N_RUNS
    print(f"\ngraded {N_RUNS} runs in {report.wall_s:.2f}s = {report.runs_per_s:.0f} runs/s; "
          f"snapshots {report.snapshot_s:.2f}s; {report.commits} commits")
    assert report.runs_per_s >= 2_000
