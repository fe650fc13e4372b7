"""Materialized state: incremental == cold re-fold, byte for byte; atomic publish; check."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_query import attempt, commit, harness

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.fold import _build, _fold, _state
from poimen_data.log._manifest import dumps

T = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two buckets of two runs per chunk, so a handful of runs spans several files per
    table."""
    monkeypatch.setattr(_build, "N_BUCKETS", 2)
    monkeypatch.setattr(_build, "RUNS_PER_CHUNK", 2)
    monkeypatch.setattr(_build, "REDUCTIONS_PER_CHUNK", 2)


@pytest.fixture
def log(tmp_path: Path) -> pdm.EventLog:
    return pdm.open_log(tmp_path / "log")


def entries(log: pdm.EventLog) -> dict[str, list[tuple[tuple[int, int], str, int]]]:
    ptr = _state.read_pointer(log)
    return {t: [(f.key, f.sha256, f.rows) for f in e] for t, e in ptr.tables.items()}


def cold_entries(log: pdm.EventLog, lsn: int,
                 passes: int | None = None) -> dict[str, list[tuple[tuple[int, int], str, int]]]:
    return {t: [(f.key, f.sha256, f.rows) for f in e]
            for t, e in _state.cold_files(log, lsn, passes=passes).items()}


def expected_keys(runs_in_start_order: list[str]) -> dict[str, tuple[int, int]]:
    """(bucket, chunk) of each run: md5 bucket, then start order within the bucket."""
    seen: dict[int, int] = {}
    out = {}
    for r in runs_in_start_order:
        b = _build.bucket_of(r)
        out[r] = (b, seen.get(b, 0) // _build.RUNS_PER_CHUNK)
        seen[b] = seen.get(b, 0) + 1
    return out


def state_equals_views(log: pdm.EventLog) -> None:
    """Every state table, read back whole, equals the view of a fresh connect()."""
    ptr = _state.read_pointer(log)
    with pdm.connect(log, at_lsn=ptr.lsn) as con:
        for t in _fold.VIEWS:
            parts = [_state.read_file(log, f) for f in ptr.tables[t]]
            whole = pa.concat_tables(parts) if parts else _state.table_schemas()[t].empty_table()
            mem = duckdb.connect()
            mem.register("s", whole)
            keys = ", ".join(_fold.TABLE_KEYS[t])
            got = mem.sql(f"select * from s order by {keys}")
            want = con.sql(f"select * from {t} order by {keys}").to_arrow_table()
            assert got.to_arrow_table().to_pylist() == want.to_pylist(), t


def all_episodes(log: pdm.EventLog, source: str) -> dict[str, bytes]:
    with pdm.connect(log) as con:
        runs = [r[0] for r in con.execute("select run_id from runs").fetchall()]
    return {r: pdm.episode(log, r, all_branches=True, source=source).serialize()
            for r in runs}


# --- incremental == cold -----------------------------------------------------------------


def test_incremental_equals_cold_refold_for_every_table_and_episode(log, small_chunks) -> None:
    for i in range(5):
        harness(log, f"run-{i}")
    first = pdm.materialize(log).lsn
    keys = expected_keys([f"run-{i}" for i in range(5)])
    before = entries(log)
    assert [k for k, _s, _n in before["runs"]] == sorted(set(keys.values()))
    # new runs, a cancel, a finish, a rewind of an old run, a verdict, a reduction
    harness(log, "run-5")
    harness(log, "run-6")
    commit(log, ev.RunCancelled("acme", "run-3", "operator", ts=T))
    commit(log, ev.RunFinished("acme", "run-4", "succeeded", ts=T))
    commit(log, ev.BranchForked("acme", "run-0", 2, 1, 1, ts=T))
    attempt(log, "run-0", 2, "code", 1, 1, "failed")
    commit(log, ev.VerdictRecorded("acme", "run-2", 1, "tests@1", first, True, 0.5, "ok",
                                   ts=T))
    ref = pdm.episode(log, "run-1", all_branches=True).branches[0].attempts[1].prompt
    pdm.reduce(log, [ref], lambda body: b"summary")
    r = pdm.materialize(log)
    assert (r.lsn, r.head, r.full, r.runs_folded) == (log.head, log.head, False, 6)

    after = entries(log)
    assert after == cold_entries(log, log.head)
    assert after == cold_entries(log, log.head, passes=1) == cold_entries(log, log.head, passes=2)
    assert pdm.check(log).ok
    state_equals_views(log)
    assert all_episodes(log, "state") == all_episodes(log, "log")
    # runs keep their (bucket, chunk): start order within the md5 bucket
    keys = expected_keys([f"run-{i}" for i in range(7)])
    want: dict[tuple[int, int], int] = {}
    for k in keys.values():
        want[k] = want.get(k, 0) + 1
    assert [(k, n) for k, _s, n in after["runs"]] == sorted(want.items())
    assert [n for _k, _s, n in after["reductions"]] == [1]
    assert [n for _k, _s, n in after["anomalies"]] == [0]  # present although empty


def test_incremental_and_full_give_the_same_bytes_and_a_repeat_is_a_no_op(log,
                                                                          small_chunks) -> None:
    for i in range(3):
        harness(log, f"r{i}")
        pdm.materialize(log)
    raw = log.storage.read(_state.POINTER)
    again = pdm.materialize(log)
    assert (again.lsn, again.files_written, again.runs_folded) == (log.head, 0, 0)
    assert log.storage.read(_state.POINTER) == raw  # nothing to do, nothing written
    incremental = entries(log)
    r = pdm.materialize(log, full=True)
    assert r.full and r.runs_folded == 3 and r.buckets == 2
    assert entries(log) == incremental


def test_only_touched_chunks_are_written(log, small_chunks) -> None:
    for i in range(6):
        harness(log, f"r{i}")
    pdm.materialize(log)
    old = _state.read_pointer(log)
    commit(log, ev.RunFinished("acme", "r5", "succeeded", ts=T))
    r = pdm.materialize(log)
    new = _state.read_pointer(log)
    changed = new.files() - old.files()
    b, c = expected_keys([f"r{i}" for i in range(6)])["r5"]
    assert changed and all(f"/{b:02d}-{c:06d}-" in p for p in changed)
    assert {p.split("/")[1] for p in changed} == {"runs"}  # only the run row changed
    assert (r.files_written, r.runs_folded, r.buckets) == (1, 1, 1)


def test_old_files_move_aside_and_go_one_generation_late(log) -> None:
    harness(log, "a")
    pdm.materialize(log)
    gen1 = _state.read_pointer(log).files()
    commit(log, ev.RunFinished("acme", "a", "failed", ts=T))
    pdm.materialize(log)
    gen2 = _state.read_pointer(log).files()
    # only the current generation under state/<table>/; gen1 readers find theirs aside
    assert all(log.storage.exists(p) for p in gen2)
    assert not any(log.storage.exists(p) for p in gen1 - gen2)
    assert all(log.storage.exists(_state.prev_path(p)) for p in gen1 - gen2)
    commit(log, ev.RunCancelled("acme", "a", ts=T))
    pdm.materialize(log)
    gen3 = _state.read_pointer(log).files()
    gone = gen1 - gen2 - gen3
    assert gone and not any(log.storage.exists(_state.prev_path(p)) for p in gone)
    assert all(log.storage.exists(_state.prev_path(p)) for p in gen2 - gen3)
    assert all(log.storage.exists(p) for p in gen3)


def test_state_survives_compaction(log, small_chunks) -> None:
    for i in range(3):
        harness(log, f"r{i}")
    pdm.materialize(log)
    harness(log, "r3")
    pdm.compact(log)
    pdm.materialize(log)
    assert pdm.check(log).ok
    assert entries(log) == cold_entries(log, log.head)
    assert all_episodes(log, "state") == all_episodes(log, "log")


def test_a_state_of_other_settings_is_rebuilt(log, monkeypatch) -> None:
    harness(log, "a")
    pdm.materialize(log)
    monkeypatch.setattr(_build, "ROW_GROUP_SIZE", 7)
    assert _state.usable_pointer(log) is None
    with pytest.raises(pdm.NotFound):
        pdm.episode(log, "a", source="state")
    pdm.materialize(log)
    assert _state.read_pointer(log).settings["row_group_size"] == 7
    assert pdm.episode(log, "a", source="state") == pdm.episode(log, "a", source="log")


# --- crashes and the atomic publish --------------------------------------------------------


def _materialize_in_child(root: Path, crash_at: str) -> int:
    env = dict(os.environ, POIMEN_CRASH_AT=crash_at)
    code = "import sys, poimen_data as p; p.materialize(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(root)], env=env,
                          timeout=120).returncode


def test_crash_after_the_tables_leaves_the_old_state_served(tmp_path, log) -> None:
    harness(log, "a")
    old_lsn = pdm.materialize(log).lsn
    harness(log, "b")
    assert _materialize_in_child(tmp_path / "log", "state_written") == 137
    log = pdm.open_log(tmp_path / "log")
    assert _state.read_pointer(log).lsn == old_lsn
    assert pdm.episode(log, "a", source="state", at_lsn=old_lsn) == \
        pdm.episode(log, "a", source="log", at_lsn=old_lsn)
    with pytest.raises(pdm.NotFound):
        pdm.episode(log, "b", source="state")
    assert pdm.episode(log, "b") == pdm.episode(log, "b", source="log")  # auto tops up
    assert pdm.check(log).ok
    assert pdm.materialize(log).lsn == log.head and pdm.check(log).ok


def test_crash_after_the_publish_leaves_the_new_state_whole(tmp_path, log) -> None:
    harness(log, "a")
    pdm.materialize(log)
    harness(log, "b")
    assert _materialize_in_child(tmp_path / "log", "state_published") == 137
    log = pdm.open_log(tmp_path / "log")
    assert _state.read_pointer(log).lsn == log.head
    report = pdm.check(log)
    assert report.ok and (report.lsn, report.episodes) == (log.head, 2)
    assert all_episodes(log, "state") == all_episodes(log, "log")


# --- check ---------------------------------------------------------------------------------


def test_check_names_the_first_difference(log) -> None:
    assert pdm.check(log).first_difference.startswith("no materialized state")
    harness(log, "a")
    harness(log, "b")
    pdm.materialize(log)
    ok = pdm.check(log)
    # 2 runs: runs, branches, attempts, trajectories at most 2 files each (buckets), plus a
    # zero-row file for verdicts, anomalies and reductions, plus the run index
    n_files = sum(len(e) for e in _state.read_pointer(log).tables.values())
    assert (ok.ok, ok.episodes, ok.files) == (True, 2, n_files)
    assert "equals a cold re-fold" in str(ok)

    # a self-consistent state (sha256 listed right) whose runs table says something else
    ptr = _state.read_pointer(log)
    f = ptr.tables["runs"][-1]
    runs = _state.read_file(log, f).to_pylist()
    runs[-1]["state"] = "succeeded"
    data = _state.parquet_bytes(pa.Table.from_pylist(runs, schema=_state.table_schemas()["runs"]))
    name = f"state/runs/{f.bucket:02d}-{f.chunk:06d}-forged.parquet"
    forged = _state.FileEntry(f.chunk, name, len(runs), len(data),
                              __import__("hashlib").sha256(data).hexdigest(), f.bucket)
    log.storage.write(forged.path, data)
    doc = ptr.to_doc()
    doc["tables"]["runs"] = [*[e.to_json() for e in ptr.tables["runs"][:-1]], forged.to_json()]
    log.storage.write(_state.gen_path(ptr.gen + 1), dumps({**doc, "gen": ptr.gen + 1}))
    bad = pdm.check(log)
    assert not bad.ok
    assert bad.first_difference.startswith(
        f"table runs bucket {f.bucket} chunk {f.chunk} ({name})")
    assert f"row {len(runs) - 1} differs in ['state']" in bad.first_difference

    # a damaged file is named as such
    log.storage.write(forged.path, data[:-3] + b"xyz")
    assert "size or sha256 differs" in pdm.check(log).first_difference
    pdm.materialize(log, full=True)
    assert pdm.check(log).ok


# --- property: any history, any split, any materialize points == one cold re-fold ------------

STEPS = ("plan", "code", "test")
OPS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3), st.integers(0, 2),
                         st.integers(1, 3), st.booleans(), st.booleans()),
               min_size=1, max_size=24)


def history(ops: list[tuple]) -> list[tuple[ev.Event, bool, bool]]:
    """Valid events (anomalies included) from op codes, each with (end commit here,
    materialize after that commit)."""
    out = []
    branches: dict[str, int] = {}
    for code, r, s, n, cut, mat in ops:
        run = f"r{r}"
        b = branches.get(run, 0)
        if code == 0 or run not in branches:
            e: ev.Event = ev.RunStarted("acme", run, f"wf-{r}", ts=T)
            branches[run] = 0
        elif code in (1, 2):
            e = ev.AttemptDispatched("acme", run, b, STEPS[s], s, n, ts=T,
                                     workflow_version="wf-x" if n == 3 else None)
        elif code in (3, 4):
            state = ("succeeded", "failed", "timed_out", "cancelled")[(n + s) % 4]
            e = ev.AttemptFinished("acme", run, b if code == 3 else 0, STEPS[s], n, state,
                                   usage=ev.Usage(cost_usd=Decimal(n) / 1000), ts=T)
        elif code == 5:
            e = ev.AttemptRecovered("acme", run, b, STEPS[s], n, "failed", ts=T)
        elif code == 6:
            branches[run] = b + 1
            e = ev.BranchForked("acme", run, b + 1, max(0, b - s % 2), s, ts=T)
        elif code == 7:
            e = ev.VerifyingEntered("acme", run, ts=T)
        elif code == 8:
            e = ev.VerdictRecorded("acme", run, b, "v@1", 1, n > 1, float(n), ts=T)
        else:
            e = (ev.RunFinished("acme", run, "succeeded", ts=T) if n < 3
                 else ev.RunCancelled("acme", run, ts=T))
        out.append((e, cut, mat))
    return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_any_split_and_materialize_points_give_the_bytes_of_one_cold_refold(ops) -> None:
    events = history(ops)
    roots = [f"memory://poimen-prop-{uuid.uuid4().hex}" for _ in range(2)]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_build, "RUNS_PER_CHUNK", 3)
            mp.setattr(_build, "N_BUCKETS", 3)
            split = pdm.open_log(roots[0])
            batch: list[ev.Event] = []
            for i, (e, cut, mat) in enumerate(events):
                batch.append(e)
                if cut or i == len(events) - 1:
                    commit(split, *batch)
                    batch = []
                    if mat:
                        pdm.materialize(split)
            pdm.materialize(split)
            whole = pdm.open_log(roots[1])
            commit(whole, *[e for e, _c, _m in events])
            pdm.materialize(whole, passes=3)
            assert entries(split) == entries(whole) == cold_entries(whole, whole.head, 1)
            assert pdm.check(split).ok
    finally:
        for r in roots:
            pdm.open_log(r).storage.delete_tree("")


def test_on_memory_storage(small_chunks) -> None:
    root = f"memory://poimen-state-{uuid.uuid4().hex}"
    log = pdm.open_log(root)
    try:
        for i in range(3):
            harness(log, f"r{i}")
            pdm.materialize(log)
        assert pdm.check(root).ok
        assert entries(log) == cold_entries(log, log.head)
        assert all_episodes(log, "state") == all_episodes(log, "log")
        assert sum(pq.ParquetFile(log.storage.fs.open(log.storage.full(f.path))
                       ).metadata.num_rows
                   for f in _state.read_pointer(log).tables["attempts"]) == 18  # 3 runs x 6
    finally:
        log.storage.delete_tree("")


def test_every_backend_serves_the_same_state(root, small_chunks) -> None:
    """local, memory:// and S3 (moto on loopback): same files, same episodes, check ok."""
    log = root.open()
    for i in range(3):
        harness(log, f"r{i}")
    pdm.materialize(log)
    commit(log, ev.RunFinished("acme", "r0", "succeeded", ts=T))
    pdm.materialize(log)
    assert pdm.check(log).ok
    assert entries(log) == cold_entries(log, log.head)
    fresh = root.open(create=False)
    assert all_episodes(fresh, "state") == all_episodes(fresh, "log")
    with pdm.connect(root.url, storage_options=root.storage_options) as con:
        assert con.execute("select run_id, state from runs order by run_id").fetchall() == [
            ("r0", "succeeded"), ("r1", "verifying"), ("r2", "verifying")]
        assert con.execute("select blob_text(output) from attempts where run_id = 'r2' "
                           "and branch_id = 1").fetchall() == [("output r2/1/test/1",)]
