"""The Dask executor: two worker processes open the log read-only, build their snapshots at
the snapshot LSNs themselves, and give the verdicts the in-process executor gives."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.jobs._grade import grade
from poimen_data.testing import record_run
from poimen_data.verifiers import exit_code, output_mentions

distributed = pytest.importorskip("distributed")

VERDICT_COLUMNS = "run_id, tenant, branch_id, verifier, snapshot_lsn, passed, score, detail"


def verdict_rows(log: pdm.EventLog, where: str) -> list[tuple[Any, ...]]:
    con = pdm.connect(log)
    rows = con.execute(f"select {VERDICT_COLUMNS} from verdicts where {where} "
                       "order by run_id, verifier").fetchall()
    con.close()
    return rows


@pytest.mark.slow
def test_dask_executor_gives_the_same_verdicts_as_in_process(tmp_path: Any) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    shapes = [[("plan", ["succeeded"]), ("code", ["failed", "succeeded"])],
              [("plan", ["succeeded"]), ("code", ["failed", "timed_out"])],
              [("plan", ["succeeded"]), ("code", ["dispatched", "succeeded"])]]
    for i in range(12):
        record_run(log, f"r{i:02d}", shapes[i % 3], tenant=("acme", "globex")[i % 2])
    with log.transaction() as tx:  # r00 rewound and back in verifying: graded on branch 1
        tx.append(E.BranchForked("acme", "r00", 1, 0, 1))
        tx.append(E.AttemptDispatched("acme", "r00", 1, "code", 1, 1))
        tx.append(E.AttemptFinished("acme", "r00", 1, "code", 1, "failed"))
        tx.append(E.VerifyingEntered("acme", "r00"))
    with log.transaction() as tx:  # r01 cancelled while verifying: not graded by default
        tx.append(E.RunCancelled("globex", "r01"))
    verifiers = [exit_code, output_mentions("succeeded")]

    local = grade(log, verifiers)
    split = log.head
    assert (local.runs_graded, local.verdicts_recorded) == (11, 22)

    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        again = grade(log, verifiers, executor=client)
        assert (again.runs_graded, again.runs_skipped, again.verdicts_recorded) == (0, 11, 0)
        remote = grade(log, verifiers, executor=client, force=True)
        with pytest.raises(pdm.ValidationError, match="blobs="):
            grade(log, verifiers, executor=client, blobs=log.blobs)
        with pytest.raises(pdm.ValidationError, match="memory://"):
            grade(pdm.open_log(f"memory://dask-{uuid.uuid4().hex}"), verifiers,
                  executor=client)

    assert remote.executor == "dask" and local.executor == "threads"
    assert (remote.runs_graded, remote.runs_passed, remote.runs_failed, remote.runs_errored,
            remote.verdicts_recorded) == (local.runs_graded, local.runs_passed,
                                          local.runs_failed, local.runs_errored, 22)
    assert remote.per_verifier == local.per_verifier
    before = verdict_rows(log, f"lsn <= {split}")
    after = verdict_rows(log, f"lsn > {split}")
    assert len(before) == 22
    assert after == before
    assert [r[2] for r in before if r[0] == "r00"] == [1, 1]
