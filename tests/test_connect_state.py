"""connect() over the materialized state plus the tail: the rows of a cold fold, opened
at the cost of the tail, with DuckDB's memory capped; the events stream by segment."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_materialize import OPS, history
from test_query import attempt, commit, harness

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.fold import _build, _connect, _fold, _state

T = datetime(2026, 3, 1, tzinfo=UTC)
ALL = ("events", *_fold.VIEWS)


def tables(con: duckdb.DuckDBPyConnection,
           names: tuple[str, ...] = ALL) -> dict[str, pa.Table]:
    """Every view's rows in its key order (a view promises rows, not an order)."""
    keys = {"events": ("lsn",), **_fold.TABLE_KEYS}
    return {t: con.sql(f"select * from {t} order by {', '.join(keys[t])}").to_arrow_table()
            for t in names}


def source_of(con: duckdb.DuckDBPyConnection) -> str:
    return con.execute("select getvariable('poimen_source')").fetchall()[0][0]


def assert_same_views(log: pdm.EventLog, at_lsn: int | None = None) -> str:
    """Every view of ``connect(source="auto")`` equals the cold fold's (``source="log"``),
    schema and rows in order; returns what served the auto connection."""
    with pdm.connect(log, at_lsn=at_lsn, source="log") as con:
        assert source_of(con) == "log"
        want = tables(con)
    with pdm.connect(log, at_lsn=at_lsn) as con:
        got = tables(con)
        used = source_of(con)
    for t in ALL:
        assert got[t].schema == want[t].schema, t
        assert got[t].to_pylist() == want[t].to_pylist(), (t, used)
    return used


# --- property: state + tail == cold fold ---------------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, compact_at=st.integers(0, 30), picks=st.lists(st.integers(0, 10**6),
                                                              max_size=3),
       streamed=st.booleans())
def test_views_from_state_and_tail_equal_the_cold_fold(ops, compact_at, picks,
                                                       streamed) -> None:
    """Random histories (retries, rewinds, cancels, recoveries, verdicts, anomalies) cut
    into random commits, materialized at random points, sometimes compacted: at the head,
    at the state's LSN and at random LSNs, every view equals a cold fold row for row;
    ``streamed``: every tail taken as a big one (its events streamed into DuckDB)."""
    events = history(ops)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setattr(_build, "RUNS_PER_CHUNK", 3)
        if streamed:
            mp.setattr(_connect, "ARROW_TAIL_BYTES", 0)
        log = pdm.open_log(Path(tmp) / "log", durable=False)
        batch: list[ev.Event] = []
        n_commits = 0
        for i, (e, cut, mat) in enumerate(events):
            batch.append(e)
            if cut or i == len(events) - 1:
                commit(log, *batch)
                batch = []
                n_commits += 1
                if n_commits == compact_at:
                    pdm.compact(log)
                if mat:
                    pdm.materialize(log)
        ptr = _state.usable_pointer(log)
        used = assert_same_views(log)
        if ptr is None:
            assert used == "log"
            return
        assert used == ("state" if ptr.lsn == log.head else "state+log")
        assert assert_same_views(log, ptr.lsn) == "state"
        for p in picks:
            lsn = p % (log.head + 1)
            want = "log" if lsn < ptr.lsn else "state" if lsn == ptr.lsn else "state+log"
            assert assert_same_views(log, lsn) == want


def test_state_and_tail_on_s3(s3) -> None:
    """On S3 (moto on loopback): DuckDB reads the state's files through the log's
    filesystem, and the tail re-folds an old run (rewound, cancelled), a new run, and a
    reduction; the rows equal the cold fold's."""
    root = f"s3://poimen-test/{uuid.uuid4().hex}"
    log = pdm.open_log(root, storage_options=s3.storage_options)
    harness(log, "a")
    harness(log, "b")
    pdm.materialize(log)
    commit(log, ev.BranchForked("acme", "a", 2, 1, 1, ts=T))
    attempt(log, "a", 2, "code", 1, 1, "failed")
    commit(log, ev.RunCancelled("acme", "a", "operator", ts=T))
    harness(log, "c")
    ref = pdm.episode(log, "b", all_branches=True).branches[0].attempts[0].prompt
    pdm.reduce(log, [ref], lambda body: b"summary")
    fresh = pdm.open_log(root, storage_options=s3.storage_options, create=False)
    assert assert_same_views(fresh) == "state+log"
    with pdm.connect(root, storage_options=s3.storage_options) as con:
        assert con.execute("select run_id, state, n_branches from runs "
                           "order by run_id").fetchall() == [
            ("a", "cancelled", 3), ("b", "verifying", 2), ("c", "verifying", 2)]
        assert con.execute("select blob_text(summary) from reductions").fetchall() == [
            ("summary",)]


# --- opening costs the tail, not the log -----------------------------------------------------


def _segments_before(log: pdm.EventLog, lsn: int) -> list[str]:
    return [s.path for s in log.segments() if s.first_lsn <= lsn]


def test_connect_after_materialize_reads_no_segment_the_state_covers(tmp_path) -> None:
    """Damage every segment older than what the tail needs: ``connect`` still serves
    every view (it read none of them), while a cold fold trips over the damage."""
    root = tmp_path / "log"
    log = pdm.open_log(root)
    harness(log, "old")   # segments that only the state needs
    first_kept = log.head + 1
    harness(log, "kept")  # its run is touched again after the state
    lsn = pdm.materialize(log).lsn
    commit(log, ev.RunFinished("acme", "kept", "succeeded", ts=T))
    harness(log, "new")
    with pdm.connect(log, source="log") as con:
        want = tables(con, _fold.VIEWS)
    damaged = _segments_before(log, first_kept - 1)
    assert damaged and lsn > first_kept
    for path in damaged:
        full = log.storage.full(path)
        Path(full).write_bytes(b"\0" * os.path.getsize(full))
    fresh = pdm.open_log(root, create=False)
    with pdm.connect(fresh) as con:
        assert source_of(con) == "state+log"
        got = tables(con, _fold.VIEWS)
        for t in _fold.VIEWS:
            assert got[t].equals(want[t]), t
        with pytest.raises(duckdb.Error, match="sha256 differs"):
            con.sql("select count(*) from events").fetchall()  # events stream every segment
    with pytest.raises(duckdb.Error, match="sha256 differs"), \
            pdm.connect(pdm.open_log(root, create=False), source="log") as con:
        con.sql("select count(*) from runs").fetchall()


def test_at_head_of_the_state_no_segment_is_read(tmp_path) -> None:
    log = pdm.open_log(tmp_path / "log")
    for r in ("a", "b"):
        harness(log, r)
    pdm.materialize(log)
    fresh = pdm.open_log(tmp_path / "log", create=False)
    before = fresh.storage.calls["read"]
    with pdm.connect(fresh, source="state") as con:
        assert con.execute("select count(*) from attempts").fetchall() == [(12,)]
    # the pointer and the log's head probe: no segment (there are 24)
    assert fresh.storage.calls["read"] - before <= 3


# --- sources ----------------------------------------------------------------------------------


def test_sources_and_their_errors(tmp_path) -> None:
    log = pdm.open_log(tmp_path / "log")
    harness(log, "a")
    with pytest.raises(pdm.NotFound, match="no usable materialized state"):
        pdm.connect(log, source="state")
    with pdm.connect(log) as con:
        assert source_of(con) == "log"
    lsn = pdm.materialize(log).lsn
    commit(log, ev.RunFinished("acme", "a", "failed", ts=T))
    with pytest.raises(pdm.NotFound, match=f"covers lsn {lsn}, not lsn {lsn + 1}"):
        pdm.connect(log, source="state")
    for at, used in ((lsn, "state"), (lsn + 1, "state+log"), (lsn - 1, "log")):
        with pdm.connect(log, at_lsn=at) as con:
            assert source_of(con) == used
            assert con.execute("select getvariable('poimen_lsn')").fetchall() == [(at,)]
            assert con.execute("select max(lsn) from events").fetchall() == [(at,)]
    with pdm.connect(log, at_lsn=lsn, source="state") as con:
        assert con.execute("select state from runs").fetchall() == [("verifying",)]
    with pytest.raises(pdm.ValidationError, match="source must be one of"):
        pdm.connect(log, source="cache")
    with pytest.raises(pdm.ValidationError, match="outside 0.."):
        pdm.connect(log, at_lsn=lsn + 5)


def test_a_state_file_gone_falls_back_to_the_log(tmp_path) -> None:
    """A state file removed under us (by a vacuum, or a damaged state): ``auto`` folds
    the log instead, ``state`` says which state is unreadable."""
    log = pdm.open_log(tmp_path / "log")
    harness(log, "a")
    pdm.materialize(log)
    ptr = _state.read_pointer(log)
    log.storage.delete(ptr.tables["runs"][0].path)
    with pdm.connect(log) as con:
        assert source_of(con) == "log"
        assert con.execute("select state from runs").fetchall() == [("verifying",)]
    with pytest.raises(pdm.CorruptionError, match="unreadable"):
        pdm.connect(log, source="state")


def test_events_stream_equals_read_events_across_compaction_and_cuts(tmp_path) -> None:
    log = pdm.open_log(tmp_path / "log")
    for r in ("a", "b"):
        harness(log, r)
    pdm.compact(log)  # these segments now carry lsn and seq columns
    harness(log, "c")  # these do not
    head = log.head
    for at in (head, head - 3, 7):
        with pdm.connect(log, at_lsn=at, source="log") as con:
            got = con.sql("select * from events").to_arrow_table()
        want = log.read_events(at)
        assert got.schema.types == want.schema.types  # DuckDB drops "not null" only
        assert got.to_pylist() == want.to_pylist(), at
    some = pa.Table.from_batches(list(log.scan(head - 2, 5, columns=("lsn", "kind"),
                                               run_ids=["a", "c"])))
    want = log.read_events(head - 2, 5)
    want = want.filter(pc.is_in(want.column("run_id"), pa.array(["a", "c"])))
    assert some.equals(want.select(["lsn", "kind"]).combine_chunks())


# --- memory ------------------------------------------------------------------------------------


def _setting(con: duckdb.DuckDBPyConnection, name: str) -> Any:
    return con.execute(f"select current_setting('{name}')").fetchall()[0][0]


def test_memory_limit_from_argument_environment_or_default(tmp_path, monkeypatch) -> None:
    log = pdm.open_log(tmp_path / "log")
    harness(log, "a")
    monkeypatch.delenv(_fold.MEMORY_ENV, raising=False)
    with pdm.connect(log) as con:
        assert _setting(con, "memory_limit") != ""
        assert _fold.memory_limit() == _fold.default_memory_limit()
    monkeypatch.setenv(_fold.MEMORY_ENV, "300MB")
    with pdm.connect(log) as con:
        assert _setting(con, "memory_limit") == "286.1 MiB"
    with pdm.connect(log, memory_limit=64 << 20) as con:
        assert _setting(con, "memory_limit") == "64.0 MiB"
    monkeypatch.setenv(_fold.MEMORY_ENV, "lots")
    with pytest.raises(pdm.ValidationError, match="POIMEN_MEMORY_LIMIT: expected a size"):
        pdm.connect(log)
    with pytest.raises(pdm.ValidationError, match="memory_limit"):
        pdm.connect(log, memory_limit=100)


def test_each_connection_spills_to_its_own_temp_directory_removed_at_close(tmp_path) -> None:
    con = _fold.new_connection(memory="32MB")
    spill = _setting(con, "temp_directory")
    other = _fold.new_connection()
    try:
        assert spill != _setting(other, "temp_directory")
        assert os.path.dirname(spill) == tempfile.gettempdir()
        assert not os.path.exists(spill)  # made on first spill only
        con.execute("create table t as select range i, md5(range::varchar) s "
                    "from range(1500000)")
        assert con.execute("select count(distinct s) from t").fetchall() == [(1500000,)]
        assert os.listdir(spill)  # it spilled there, not into the working directory
    finally:
        con.close()
        other.close()
    assert not os.path.exists(spill)


_CHILD = r"""
import sys
import pandas, pyarrow.dataset, pyarrow.parquet  # fixed costs, before the baseline
import poimen_data as pdm
from poimen_data.fold import _state

def peak_kib():  # this process's own peak: ru_maxrss would start at the parent's
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

_state.table_schemas()
root, budget = sys.argv[1], sys.argv[2]
log = pdm.open_log(root, create=False)
base = peak_kib()
with pdm.connect(log, memory_limit=budget) as con:
    used = con.execute("select getvariable('poimen_source')").fetchall()[0][0]
    runs = con.sql("select state, count(*) from runs group by 1 order by 1").fetchall()
    kinds = con.sql("select kind, count(*) from events group by 1 order by 1").fetchall()
one = pdm.episode(log, sys.argv[3], source="log")
peak = peak_kib()
print(used, sum(n for _s, n in runs), sum(n for _k, n in kinds), len(one.branches),
      (peak - base) >> 10)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM (Linux)")
def test_connect_query_and_episode_stay_within_a_budget(tmp_path) -> None:
    """A log whose events take ~200 MB in Arrow, three times a 64 MB budget (about the
    least DuckDB folds in): in a child, ``connect`` (state + 1% tail), a group-by over
    ``runs``, one over ``events`` (every segment streamed) and ``episode(source="log")``
    add less than 1.5 budgets to the peak RSS (about 40 MB here; reading the log into
    memory, as ``connect`` did before, adds about 180 MB)."""
    from poimen_data.synth import events_table

    root = tmp_path / "log"
    log = pdm.open_log(root, durable=False)

    def extend(n: int, seed: int, tag: str) -> None:
        t = events_table(n, seed=seed)
        i = t.schema.get_field_index("run_id")
        t = t.set_column(i, "run_id", pc.binary_join_element_wise(t.column("run_id"),
                                                                   tag, ""))
        with log.transaction() as tx:
            tx.extend(t)

    for c in range(5):
        extend(80_000, c, f"-c{c}")
    pdm.materialize(log)
    extend(4_000, 99, "-tail")
    n_runs = len(pc.unique(log.read_events(log.head, 400_001).column("run_id"))) + \
        pa.concat_tables(_state.read_file(log, f) for f in
                         _state.read_pointer(log).tables["runs"]).num_rows
    child = subprocess.run([sys.executable, "-c", _CHILD, str(root), "64MB", "run-000007-c3"],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    used, runs, events, branches, grown_mb = out = child.stdout.split()
    assert (used, int(runs), int(events)) == ("state+log", n_runs, 404_000)
    assert int(branches) == len(pdm.episode(log, "run-000007-c3", source="log").branches)
    assert int(grown_mb) < 96, out


def test_poimen_sql_source_and_memory_options(tmp_path) -> None:
    from typer.testing import CliRunner

    from poimen_data import cli

    root = str(tmp_path / "log")
    log = pdm.open_log(root)
    harness(log, "a")
    lsn = pdm.materialize(log).lsn
    commit(log, ev.RunFinished("acme", "a", "failed", ts=T))

    def sql(*args: str) -> Any:
        return CliRunner().invoke(cli.app, ["sql", "--root", root, "--json", *args],
                                  catch_exceptions=False)

    q = "select getvariable('poimen_source') as s, state from runs"
    for args, want in (((), "state+log"), (("--source", "log"), "log"),
                       (("--at-lsn", str(lsn), "--source", "state"), "state")):
        r = sql(*args, "--memory-limit", "100MB", q)
        assert r.exit_code == 0, r.output
        assert want in r.stdout and ("verifying" if "--at-lsn" in args else "failed") \
            in r.stdout
    r = sql("--source", "state", q)
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert f"covers lsn {lsn}, not lsn {lsn + 1}" in r.stderr
    r = sql("--memory-limit", "lots", q)
    assert r.exit_code != 0 and "--memory-limit: expected a size such as '2GB'" in r.stderr
