"""Write the golden log (run once; the result is checked in beside this script).

    .venv/bin/python tests/data/golden/make_golden.py   # writes tests/data/golden/log/

Every event has a fixed ``ts`` and every body fixed bytes, so the fold of this log is a
fixed value; tests/test_fold.py pins its digest (tests/data/golden/digest.json), and a
change of the storage format or of the fold fails that test. Regenerate only on purpose
(segment names are random, so a regenerated log is new files), then re-pin with
``.venv/bin/python tests/test_fold.py --pin`` and say in the commit why the digest moved.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import poimen_data as pdm
from poimen_data import events as ev

HERE = Path(__file__).parent
T0 = datetime(2026, 2, 1, 9, 0, tzinfo=UTC)


def main(root: Path = HERE / "log") -> None:
    if root.exists():
        shutil.rmtree(root)
    log = pdm.open_log(root)
    clock = iter(T0 + timedelta(seconds=i) for i in range(10_000))

    def commit(*events: ev.Event) -> None:
        with log.transaction() as tx:
            tx.extend(events)

    def attempt(tenant: str, run: str, branch: int, step: str, index: int, n: int,
                state: str | None, cost: str = "0.0125") -> None:
        with log.transaction() as tx:
            p = tx.put_blob(tenant, f"[{tenant}] prompt for {run} b{branch} {step}#{n}".encode())
            tx.append(ev.AttemptDispatched(
                tenant, run, branch, step, index, n, prompt=p,
                context=ev.ContextPartition((f"ctx-{step}",), ("ctx-extra",), ("ctx-old",)),
                workflow_version="wf-2" if step == "deploy" else None, ts=next(clock)))
            if state is not None:
                o = tx.put_blob(tenant, f"[{tenant}] output of {run} b{branch} {step}#{n}".encode())
                tx.append(ev.AttemptFinished(
                    tenant, run, branch, step, n, state, output=o,
                    usage=ev.Usage(1000 + n, 200 + index, 50, 7, Decimal(cost), 1234.5),
                    tools=ev.ToolInfo(("grep", "pytest")[: index % 3]),
                    error="assertion failed" if state == "failed" else None, ts=next(clock)))

    # run-1: retries, a rewind from verifying, a fork of the fork, verdicts, finished
    commit(ev.RunStarted("acme", "run-1", "wf-1", {"team": "core"}, ts=next(clock)))
    attempt("acme", "run-1", 0, "plan", 0, 1, "succeeded")
    attempt("acme", "run-1", 0, "code", 1, 1, "failed")
    attempt("acme", "run-1", 0, "code", 1, 2, "failed", cost="0.000000001")
    attempt("acme", "run-1", 0, "code", 1, 3, "succeeded")
    attempt("acme", "run-1", 0, "test", 2, 1, "succeeded")
    commit(ev.VerifyingEntered("acme", "run-1", ts=next(clock)))
    commit(ev.VerdictRecorded("acme", "run-1", 0, "tests@1", 17, False, 0.25, "2 failing",
                              ts=next(clock)))
    commit(ev.BranchForked("acme", "run-1", 1, 0, 1, ts=next(clock)))
    attempt("acme", "run-1", 1, "code", 1, 1, "succeeded")
    attempt("acme", "run-1", 1, "test", 2, 1, "timed_out")
    commit(ev.BranchForked("acme", "run-1", 2, 1, 2, ts=next(clock)))
    attempt("acme", "run-1", 2, "test", 2, 1, "succeeded")
    attempt("acme", "run-1", 2, "deploy", 3, 1, "succeeded")
    commit(ev.VerifyingEntered("acme", "run-1", ts=next(clock)))
    commit(ev.VerdictRecorded("acme", "run-1", 2, "tests@1", 40, True, 1.0, None,
                              ts=next(clock)))
    commit(ev.RunFinished("acme", "run-1", "succeeded", ts=next(clock)))

    # run-2 (another tenant): a dispatch left by a crash, recovered; then cancelled
    commit(ev.RunStarted("globex", "run-2", "wf-1", ts=next(clock)))
    attempt("globex", "run-2", 0, "plan", 0, 1, None)
    commit(ev.AttemptRecovered("globex", "run-2", 0, "plan", 1, "failed",
                               error="worker lost", ts=next(clock)))
    attempt("globex", "run-2", 0, "plan", 0, 2, "succeeded")
    commit(ev.RunCancelled("globex", "run-2", "operator", ts=next(clock)))
    # anomalies: a finish racing the cancel, a finish with no dispatch, a run event
    # after the cancel, an event of a run never started
    commit(ev.AttemptFinished("globex", "run-2", 0, "code", 1, "succeeded", ts=next(clock)),
           ev.RunFinished("globex", "run-2", "failed", ts=next(clock)),
           ev.VerifyingEntered("globex", "ghost", ts=next(clock)))

    # run-3: still running, one attempt in flight
    commit(ev.RunStarted("acme", "run-3", "wf-3", ts=next(clock)))
    attempt("acme", "run-3", 0, "plan", 0, 1, "succeeded")
    attempt("acme", "run-3", 0, "code", 1, 1, None)

    # a reduction of one failed attempt's prompt
    with pdm.connect(log) as con:
        (sha, size), = con.execute(
            "select prompt.sha256, prompt.size from attempts where run_id = 'run-1' "
            "and branch_id = 0 and step_id = 'code' and attempt_no = 1").fetchall()
    ref = ev.BlobRef("acme", sha, size)
    pdm.reduce(log, [ref], lambda body: b"summary: " + body[:24])
    print(f"golden log at {root}: head {log.head}")


if __name__ == "__main__":
    main()
