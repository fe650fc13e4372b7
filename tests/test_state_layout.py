"""State folders any engine can glob, generations, concurrent materializers, Dask, and the
memory bound of the partitioned fold (issues 13, 15 items 2-3, 16 item H)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from test_query import harness

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data import synth
from poimen_data.fold import _check, _state

TABLES = ("runs", "branches", "attempts", "trajectories", "verdicts", "reductions",
          "anomalies")


def view_counts(log: pdm.EventLog) -> dict[str, list]:
    with pdm.connect(log) as con:
        out = {t: [con.execute(f"select count(*) from {t}").fetchone()[0]] for t in TABLES}
        out["runs"].append(str(con.execute("select sum(n_attempts), sum(cost_usd) from runs"
                                           ).fetchone()))
    return out


GLOB_CHILD = r"""
import json, sys, duckdb
root = sys.argv[1]
tables = sys.argv[2].split(",")
con = duckdb.connect()
out = {t: [con.execute(f"select count(*) from read_parquet('{root}/state/{t}/*.parquet')"
                       ).fetchone()[0]] for t in tables}
out["runs"].append(str(con.execute("select sum(n_attempts), sum(cost_usd) from "
                                   f"read_parquet('{root}/state/runs/*.parquet')").fetchone()))
assert not any(m.startswith("poimen") for m in sys.modules)
print(json.dumps(out))
"""


def test_a_plain_glob_reads_the_current_state_in_any_engine(tmp_path: Path) -> None:
    import polars as pl

    root = tmp_path / "log"
    log = pdm.open_log(root)
    synth.generate(log, runs=40, seed=1, batch=8)
    first = pdm.materialize(log)
    assert first.full and first.files_written > 0
    for seed in (2, 3, 4):  # incremental generations: old runs end, new runs start
        synth.generate(log, runs=15, seed=seed, batch=8, prefix=f"more{seed}")
        r = pdm.materialize(log)
        assert not r.full and r.lsn == log.head
    want = view_counts(log)
    assert want["reductions"] == [0]  # an empty table: still a folder with a file

    out = subprocess.run([sys.executable, "-c", GLOB_CHILD, str(root), ",".join(TABLES)],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == want

    for t in TABLES:
        assert pl.scan_parquet(f"{root}/state/{t}/*.parquet").select(pl.len()).collect(
        ).item() == want[t][0], t
        assert ds.dataset(root / "state" / t, format="parquet").count_rows() == want[t][0], t
    schema = ds.dataset(root / "state" / "reductions", format="parquet").schema
    assert schema.names == ["tenant", "original", "summary", "lsn"]
    # nothing but the current generation's files under the table folders
    ptr = _state.read_pointer(log)
    listed = {str(p.relative_to(root)) for t in _state.STATE_TABLES
              for p in (root / "state" / t).iterdir()}
    assert listed == ptr.files()


def test_a_reader_of_an_old_generation_reads_aside_then_gets_state_changed(tmp_path) -> None:
    log = pdm.open_log(tmp_path / "log")
    harness(log, "a")
    harness(log, "b")
    pdm.materialize(log)
    old = _state.read_pointer(log)
    f = old.tables["runs"][0]
    harness(log, "c")
    with log.transaction() as tx:
        tx.append(ev.RunFinished("acme", "a", "failed"))
        tx.append(ev.RunFinished("acme", "b", "failed"))
    pdm.materialize(log)
    # one generation on: the replaced file is aside, still readable through the old pointer
    assert not log.storage.exists(f.path) and f.path not in _state.read_pointer(log).files()
    assert _state.read_file(log, f, old).num_rows == f.rows
    with log.transaction() as tx:
        tx.append(ev.RunCancelled("acme", "c"))
    pdm.materialize(log)
    # two generations on: gone; the reader is told to re-read the pointer, not "corrupt"
    with pytest.raises(pdm.StateChanged):
        _state.read_file(log, f, old)
    assert not isinstance(pdm.StateChanged("x"), pdm.CorruptionError)
    assert pdm.episode(log, "a", source="state") == pdm.episode(log, "a", source="log")


def test_check_started_on_a_pointer_replaced_twice_starts_again(tmp_path, monkeypatch) -> None:
    log = pdm.open_log(tmp_path / "log")
    harness(log, "a")
    pdm.materialize(log)
    stale = _state.read_pointer(log)
    for kind in (ev.VerifyingEntered("acme", "a"), ev.RunFinished("acme", "a", "failed")):
        with log.transaction() as tx:
            tx.append(kind)
        pdm.materialize(log)
    real = _state.read_pointer
    calls = []

    def first_stale(lg):
        calls.append(1)
        return stale if len(calls) == 1 else real(lg)

    monkeypatch.setattr(_check.S, "read_pointer", first_stale)
    r = pdm.check(log)
    assert r.ok and r.lsn == log.head and len(calls) >= 2


RACER = r"""
import json, sys
import poimen_data as pdm
from poimen_data.fold import _state

def rendezvous(name):
    if name == "state_written":  # built, about to publish: wait for the other racer
        print("built", flush=True)
        assert sys.stdin.readline().strip() == "go"

_state.crash_point = rendezvous
r = pdm.materialize(sys.argv[1])
print(json.dumps({"lsn": r.lsn, "files_written": r.files_written}), flush=True)
"""


def test_two_materializers_one_publishes_the_other_takes_its_state(tmp_path) -> None:
    root = tmp_path / "log"
    log = pdm.open_log(root)
    synth.generate(log, runs=20, seed=5, batch=8)
    pdm.materialize(log)
    synth.generate(log, runs=10, seed=6, batch=8, prefix="late")
    gen = _state.read_pointer(log).gen
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:  # both built the same generation from the same pointer
            assert p.stdout.readline().strip() == "built"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    reports = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert [r["lsn"] for r in reports] == [log.head, log.head]
    assert sorted(r["files_written"] > 0 for r in reports) == [False, True]  # one won
    ptr = _state.read_pointer(log)
    assert ptr.gen == gen + 1
    assert pdm.check(log).ok
    assert not list((root / "state" / "_pending").glob("*/*/*"))  # the loser cleaned up
    listed = {str(p.relative_to(root)) for t in _state.STATE_TABLES
              for p in (root / "state" / t).iterdir()}
    assert listed == ptr.files()


@pytest.mark.slow
def test_dask_workers_materialize_the_same_bytes(tmp_path) -> None:
    distributed = pytest.importorskip("distributed")
    log = pdm.open_log(tmp_path / "log")
    synth.generate(log, runs=60, seed=7, batch=16)
    local = pdm.materialize(log, passes=3)
    want = {t: [(f.key, f.sha256) for f in e]
            for t, e in _state.read_pointer(log).tables.items()}
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        remote = pdm.materialize(log, full=True, executor=client, passes=4)
        assert (remote.full, remote.lsn, remote.runs_folded) == (True, local.lsn,
                                                                 local.runs_folded)
        got = {t: [(f.key, f.sha256) for f in e]
               for t, e in _state.read_pointer(log).tables.items()}
        assert got == want
        assert pdm.check(log, executor=client).ok


#: Peak RSS of this process image: ``VmHWM`` (``ru_maxrss`` would also count the parent's
#: resident pages at fork, which Linux carries across exec).
PEAK = ("int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
        " * 1024")
#: The jobs that write (compaction, verdicts, an export file), in one child ...
JOBS_CHILD = f"""
import json, sys
import poimen_data as pdm
from poimen_data.jobs._maint import bodies_larger_than
root, budget, out, atif = sys.argv[1:5]
k = pdm.compact(root)  # rewrites every small segment
imported = pdm.import_atif(root, [atif], tenant="acme")  # looks for its run id in the log
again = pdm.import_atif(root, [atif], tenant="acme")  # finds it there: adds nothing
big = bodies_larger_than(root, 0)  # poimen reduce --larger-than 0: every body's ref
one = pdm.episode(root, "run-000007-x3", source="log")
def looked(ctx):  # reads its snapshot, so every snapshot is built
    return pdm.Verdict(passed=len(ctx.episode.branches) > 0)
looked.name = "looked"
g = pdm.grade(root, [looked], memory_limit=budget)  # snapshots folded from the log
e = pdm.export_live(root, out, format="parquet", source="log", memory_limit=budget)
print(json.dumps({{"graded": g.runs_graded, "exported": e.records, "episode": one.run_id,
                  "compacted": [k.rewritten, k.segments_after],
                  "imported": [list(imported.runs), list(again.runs), list(again.skipped)],
                  "big": sorted(r.sha256 for r in big), "rss": {PEAK}}}))
"""
#: ... and the state and SQL over it in another (each process keeps some of what its
#: allocators got back, so one child running everything would add the jobs' peaks up).
MEMORY_CHILD = f"""
import json, sys
import poimen_data as pdm
root, budget, out = sys.argv[1:4]
r = pdm.materialize(root, full=True, memory_limit=budget)  # the parent's state is stale
c = pdm.check(root, memory_limit=budget)
e = pdm.export_live(root, out + ".state", format="parquet", memory_limit=budget)
with pdm.connect(root, source="log", memory_limit=budget) as con:  # a fold of the log
    cold = con.sql("select state, count(*) from runs group by 1 order by 1").fetchall()
with pdm.connect(root, memory_limit=budget) as con:
    served = con.sql("select state, count(*) from runs group by 1 order by 1").fetchall()
    verdicts = con.sql("select count(*) from verdicts").fetchall()[0][0]
print(json.dumps({{"ok": c.ok, "full": r.full, "runs": r.runs_folded, "same": cold == served,
                  "verdicts": verdicts, "exported_state": e.records, "rss": {PEAK}}}))
"""


@pytest.mark.slow
def test_every_read_path_stays_within_a_bound_tied_to_the_budget(tmp_path) -> None:
    """compact, import_atif (twice: the second finds its run), the refs ``poimen reduce
    --larger-than`` picks, episode (from the log), grade (its plan over a state left
    behind at the first commit: a tail of nearly all the log), export_live (a cold fold),
    materialize, check, export_live from the state, and connect + a query (a fold of the
    log, then the state), in two children, on events taking several times the budget in
    Arrow: each one's peak RSS stays bounded."""
    root = tmp_path / "log"
    log = pdm.open_log(root, durable=False)
    table = synth.events_table(2_000_000, seed=3)
    for lo in range(0, table.num_rows, 20_000):  # small segments, for compact
        with log.transaction() as tx:
            tx.extend(table.slice(lo, 20_000))
        if lo == 0:  # a state left behind: grade's plan reads a tail of 1.98 M events
            pdm.materialize(log)
    arrow_bytes = table.nbytes
    del table
    # 200 MiB: at 100 MiB DuckDB's own floor (buffers pinned per thread) made a fold group
    # run out of memory now and then on a loaded machine
    budget = 200 << 20
    assert arrow_bytes > 3 * budget  # the events are several times the budget
    # the interpreter with pyarrow, DuckDB and poimen imported, measured the same way
    base = subprocess.run([sys.executable, "-c", "import duckdb, pyarrow.parquet, "
                           f"poimen_data; print({PEAK})"],
                          capture_output=True, text=True, check=True)
    baseline = int(base.stdout)
    atif = tmp_path / "one.atif.json"  # one trajectory: one agent step, two bodies
    atif.write_text(json.dumps({
        "schema_version": "ATIF-v1.8", "session_id": "s-1",
        "agent": {"name": "outside", "version": "1"},
        "steps": [{"step_id": 1, "source": "user", "message": "add 2 and 2"},
                  {"step_id": 2, "source": "agent", "message": "4"}]}))
    got: dict[str, Any] = {}
    peaks = []
    for child in (JOBS_CHILD, MEMORY_CHILD):
        out = subprocess.run([sys.executable, "-c", child, str(root), f"{budget}B",
                              str(tmp_path / "export.parquet"), str(atif)],
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        got |= json.loads(out.stdout.strip().splitlines()[-1])
        peaks.append(got.pop("rss"))
    assert got["ok"] and got["full"] and got["runs"] > 10_000 and got["same"]
    assert got["graded"] == got["verdicts"] > 10_000  # every run in verifying, once
    assert got["exported"] == got["exported_state"] > 100_000
    export = tmp_path / "export.parquet"  # the state's export is the cold fold's, byte for byte
    assert hashlib.sha256(export.read_bytes()).hexdigest() == \
        hashlib.sha256(Path(f"{export}.state").read_bytes()).hexdigest()
    assert got["compacted"] == [100, 20] and got["episode"] == "run-000007-x3"
    (run_id,), again, skipped = got["imported"]
    assert again == [] and skipped == [run_id] and run_id.startswith("atif-")
    bodies = pdm.open_log(root).blobs  # the synthetic events have no bodies: only its two
    ep = pdm.episode(root, run_id, source="log")
    (attempt,) = [a for b in ep.branches for a in b.attempts]
    assert got["big"] == sorted([attempt.prompt.sha256, attempt.output.sha256])
    assert bodies.get(attempt.output) is not None
    # DuckDB's budget, about as much again for Arrow batches in flight and parquet encoders,
    # plus slack: below the events' Arrow size on top of the baseline (measured: 2.4x)
    bound = baseline + 5 * budget // 2 + (64 << 20)
    print(f"peak RSS {[p >> 20 for p in peaks]} MiB, baseline {baseline >> 20} MiB, "
          f"bound {bound >> 20} MiB")
    assert max(peaks) < bound, ([p >> 20 for p in peaks], baseline >> 20, arrow_bytes >> 20)
    assert bound < baseline + arrow_bytes
