"""Grading at scale: 10,000 runs with the exit-code verifier, in-process, graded exactly.

Speed is measured by ``poimen bench`` (scenario ``grading``, goal >= 2,000 runs/s), not
asserted here: a timed test fails on a loaded machine without telling anything new.
The report carries ``snapshot_s`` so the cost that matters is visible.
"""

from __future__ import annotations

from typing import Any

import pytest

import poimen_data as pdm
from poimen_data.jobs._grade import VerifierCounts, grade
from poimen_data.testing import bulk_runs
from poimen_data.verifiers import exit_code

N_RUNS = 10_000


@pytest.mark.slow
def test_ten_thousand_runs_graded_exactly_in_bulk(tmp_path: Any) -> None:
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
    assert report.commits == N_RUNS // 1000  # verdicts committed in batches of 1,000
