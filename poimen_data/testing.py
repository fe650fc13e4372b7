"""Test helpers that ship with the package: a counting blob store and workload builders.

``CountingBlobStore`` lets a test prove that grading is lazy (a verifier reads only the
bodies it asks for). ``record_run`` and ``bulk_runs`` write realistic runs through the
public log API, so the tests of every module can share one vocabulary of workloads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from poimen_data.model import _events as ev

if TYPE_CHECKING:
    from poimen_data.log._blobs import BlobStore
    from poimen_data.log._log import EventLog


class CountingBlobStore:
    """Wraps any ``BlobStore`` and counts its own ``get`` calls in ``gets``.

    The count belongs to this instance (never a global), so two stores in one test cannot
    see each other's calls; it is exact under threads because verifiers run on a pool.
    """

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._gets = 0

    def __repr__(self) -> str:
        return f"CountingBlobStore({self.inner!r}, gets={self.gets})"

    @property
    def gets(self) -> int:
        with self._lock:
            return self._gets

    def get(self, ref: ev.BlobRef) -> bytes | None:
        with self._lock:
            self._gets += 1
        return self.inner.get(ref)

    def put(self, tenant: str, data: bytes) -> ev.BlobRef:
        return self.inner.put(tenant, data)


def record_run(
    log: EventLog,
    run_id: str,
    steps: Sequence[tuple[str, Sequence[str]]],
    *,
    tenant: str = "acme",
    workflow_version: str = "wf-1",
    outputs: bool = True,
    prompt: bytes | None = None,
    verifying: bool = True,
) -> int:
    """Record one run in a single commit: ``steps`` lists (step_id, attempt states), in
    workflow order; a state of "dispatched" leaves that attempt unresolved (a crash).

    Each attempt gets a prompt body (``prompt`` or a small text) and, when finished and
    ``outputs`` is set, an output body ``"<run> <step> #<n>: <state>"``. Returns the LSN of
    ``verifying_entered`` (or of the last event when ``verifying`` is false).
    """
    with log.transaction() as tx:
        tx.append(ev.RunStarted(tenant, run_id, workflow_version))
        for index, (step, states) in enumerate(steps):
            for n, state in enumerate(states, start=1):
                body = prompt if prompt is not None else f"{run_id} {step} prompt {n}".encode()
                p = tx.put_blob(tenant, body)
                tx.append(ev.AttemptDispatched(tenant, run_id, 0, step, index, n, prompt=p))
                if state == "dispatched":
                    continue
                out = None
                if outputs:
                    out = tx.put_blob(tenant, f"{run_id} {step} #{n}: {state}".encode())
                error = None if state == "succeeded" else f"{step} {state}"
                tx.append(ev.AttemptFinished(tenant, run_id, 0, step, n, state, output=out,
                                             error=error))
        if verifying:
            tx.append(ev.VerifyingEntered(tenant, run_id))
    assert tx.commit_info is not None
    return tx.commit_info.last_lsn


def bulk_runs(
    log: EventLog,
    n_runs: int,
    *,
    steps: int = 3,
    tenant: str = "acme",
    fail_every: int = 7,
    commit_runs: int = 2_000,
    prefix: str = "run",
) -> list[str]:
    """Record ``n_runs`` runs that reached ``verifying`` through the bulk (Arrow) path:
    ``steps`` steps each, every ``fail_every``-th run with one failed, unretried last
    step. No bodies: the fast way to build a grading benchmark. Returns the run ids."""
    run_ids = [f"{prefix}-{i:06d}" for i in range(n_runs)]
    now = datetime.now(UTC)
    for lo in range(0, n_runs, commit_runs):
        cols: dict[str, list[Any]] = {k: [] for k in (
            "kind", "run_id", "branch_id", "step_id", "step_index", "attempt_no", "state",
            "workflow_version")}

        def row(kind: str, run: str, cols: dict[str, list[Any]] = cols, **kw: Any) -> None:
            kw.update(kind=kind, run_id=run)
            for k, values in cols.items():
                values.append(kw.get(k))

        for i in range(lo, min(n_runs, lo + commit_runs)):
            run = run_ids[i]
            row("run_started", run, workflow_version="wf-1")
            for s in range(steps):
                state = "failed" if (i % fail_every == 0 and s == steps - 1) else "succeeded"
                row("attempt_dispatched", run, branch_id=0, step_id=f"step{s}", step_index=s,
                    attempt_no=1)
                row("attempt_finished", run, branch_id=0, step_id=f"step{s}", attempt_no=1,
                    state=state)
            row("verifying_entered", run)
        n = len(cols["kind"])
        table = pa.table({"ts": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
                          "tenant": pa.array([tenant] * n, pa.string()), **cols},
                         schema=None)
        with log.transaction() as tx:
            tx.extend(table)
    return run_ids


__all__ = ["CountingBlobStore", "bulk_runs", "record_run"]
