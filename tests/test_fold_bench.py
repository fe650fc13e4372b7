"""Speed figures of the read side (run as a script; a small smoke run is a test).

    .venv/bin/python tests/test_fold_bench.py [--events 1000000]

Prints: cold re-fold from segments vs the same SQL over one in-memory Arrow table,
incremental materialize after +1% events vs a full one, and episode() from state.
Events are built as an Arrow table and committed with ``tx.extend(table)`` (the bulk
path). Runs overlap in time (about 50 in flight), so later commits finish runs that
earlier commits started, as a live engine's would.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pyarrow as pa

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.fold._fold import VIEWS, fold_tables
from poimen_data.fold._state import read_pointer

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TENANTS = ("acme", "globex", "initech")
STEPS = ("plan", "code", "test")


def blob_pool(log: pdm.EventLog, per_tenant: int = 8) -> dict[str, list[dict]]:
    """Commit a few bodies per tenant; events point at these (refs must be committed)."""
    pool: dict[str, list[dict]] = {}
    with log.transaction() as tx:
        for t in TENANTS:
            pool[t] = [tx.put_blob(t, f"{t} body {i}".encode() * 20).as_dict()
                       for i in range(per_tenant)]
    return pool


def synthetic(pool: dict[str, list[dict]], first_run: int, n_runs: int,
              seed: int = 7) -> list[pa.Table]:
    """Events of runs ``first_run ..`` ordered by a simulated clock, as one table per
    tenth of the runs started; a run may finish in the next table."""
    rng = random.Random(seed + first_run)
    rows: list[tuple[float, int, dict]] = []
    for i in range(first_run, first_run + n_runs):
        tenant = TENANTS[i % len(TENANTS)]
        run = f"run-{i:07d}"
        refs = pool[tenant]
        evs: list[dict] = [{"kind": "run_started", "run_id": run, "workflow_version": "wf-1"}]

        def attempt(branch: int, step: int, n: int, state: str, run=run, refs=refs,
                    evs=evs) -> None:
            evs.append({"kind": "attempt_dispatched", "run_id": run, "branch_id": branch,
                        "step_id": STEPS[step], "step_index": step, "attempt_no": n,
                        "prompt": rng.choice(refs),
                        "context": {"packed": ["doc-1", "doc-2"], "available": ["doc-3"],
                                    "dropped": []}})
            evs.append({"kind": "attempt_finished", "run_id": run, "branch_id": branch,
                        "step_id": STEPS[step], "attempt_no": n, "state": state,
                        "output": rng.choice(refs),
                        "usage": {"input_tokens": rng.randrange(100, 5000),
                                  "output_tokens": rng.randrange(10, 900),
                                  "cost_usd": Decimal(rng.randrange(1, 10**6)) / 10**7,
                                  "latency_ms": float(rng.randrange(50, 9000))},
                        "tools": {"calls": ["search", "read"][: rng.randrange(3)]},
                        "error": "tests failed" if state == "failed" else None})

        for step in range(3):
            n = 1
            while step == 1 and rng.random() < 0.2 and n < 3:
                attempt(0, step, n, "failed")
                n += 1
            attempt(0, step, n, "succeeded")
        evs.append({"kind": "verifying_entered", "run_id": run})
        if rng.random() < 0.1:
            evs.append({"kind": "branch_forked", "run_id": run, "branch_id": 1,
                        "parent_branch_id": 0, "fork_step_index": 2})
            attempt(1, 2, 1, "succeeded")
            evs.append({"kind": "verifying_entered", "run_id": run})
        evs.append({"kind": "verdict_recorded", "run_id": run, "branch_id": 0,
                    "verifier": "tests@1", "snapshot_lsn": 1, "passed": True, "score": 1.0})
        evs.append({"kind": "run_finished", "run_id": run, "outcome": "succeeded"})
        for k, e in enumerate(evs):
            e["tenant"] = tenant
            rows.append((i + 5.0 * k, len(rows), e))
    rows.sort(key=lambda r: (r[0], r[1]))
    out = []
    per = max(1, len(rows) // 10)
    for lo in range(0, len(rows), per):
        part = [e for _t, _i, e in rows[lo: lo + per]]
        for j, e in enumerate(part):
            e["ts"] = T0 + timedelta(microseconds=lo + j)
        out.append(pa.Table.from_pylist(part, schema=ev.EVENT_SCHEMA))
    return out


def commit_tables(log: pdm.EventLog, tables: list[pa.Table]) -> None:
    for t in tables:
        with log.transaction() as tx:
            tx.extend(t)


def _timed(fn, *args, **kw) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t, out


def bench(n_events: int, root: str, *, lookups: int = 200) -> dict[str, float]:
    log = pdm.open_log(root)
    pool = blob_pool(log)
    n_runs = max(10, n_events * 100 // 1075)
    commit_tables(log, synthetic(pool, 0, n_runs))
    head = log.head
    out: dict[str, float] = {"events": head, "runs": n_runs}

    in_memory = log.read_events().combine_chunks()

    def cold() -> None:
        fold_tables(pdm.open_log(root, create=False).read_events(), VIEWS)

    mem, seg, read = [], [], []
    for _ in range(3):  # interleaved, best of 3: the machine is shared
        mem.append(_timed(fold_tables, in_memory, VIEWS)[0])
        seg.append(_timed(cold)[0])
        read.append(_timed(lambda: pdm.open_log(root, create=False).read_events())[0])
    out["fold_in_memory_s"], out["fold_from_segments_s"] = min(mem), min(seg)
    out["read_events_cold_s"] = min(read)
    out["fold_ratio"] = out["fold_from_segments_s"] / out["fold_in_memory_s"]

    out["materialize_full_s"], _ = _timed(pdm.materialize, pdm.open_log(root), full=True)
    extra = synthetic(pool, n_runs, max(1, n_runs // 100), seed=11)
    commit_tables(log, extra)
    out["added_events"] = log.head - head
    out["materialize_incremental_s"], _ = _timed(pdm.materialize, pdm.open_log(root))
    out["incremental_ratio"] = out["materialize_incremental_s"] / out["materialize_full_s"]
    out["state_files"] = sum(len(v) for v in read_pointer(log).tables.values())

    rng = random.Random(3)
    fresh = pdm.open_log(root)
    times = []
    for _ in range(lookups):
        run = f"run-{rng.randrange(n_runs):07d}"
        times.append(_timed(pdm.episode, fresh, run, source="state")[0])
    out["episode_state_median_ms"] = statistics.median(times) * 1000
    out["episode_state_p95_ms"] = sorted(times)[int(len(times) * 0.95)] * 1000
    return out


def test_bench_smoke(tmp_path: Path) -> None:
    """The bench's own plumbing at a small scale; both folds must agree."""
    log = pdm.open_log(tmp_path / "log")
    commit_tables(log, synthetic(blob_pool(log), 0, 40))
    events = log.read_events()
    a = fold_tables(events.combine_chunks(), VIEWS)
    b = fold_tables(pdm.open_log(tmp_path / "log", create=False).read_events(), VIEWS)
    assert all(a[v].equals(b[v]) for v in VIEWS)
    assert a["runs"].num_rows == 40
    assert pdm.materialize(log).lsn == log.head


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for k, v in bench(args.events, d).items():
            print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
