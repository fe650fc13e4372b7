"""Odd input a hostile probe found on the write path: each is one ``ValidationError`` naming
what is wrong (never a raw ``ValueError``/``TypeError``), with storage exactly as it was,
the same on the event path, the bulk path and through a recorder."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta, tzinfo
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import poimen_data as pdm
from poimen_data import events as ev
from poimen_data.errors import ValidationError

HUGE = 10**5000  # past the 4,300 digits Python's repr of an int allows


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _refused(log: pdm.EventLog, root: Path, e: ev.Event, *texts: str) -> None:
    """``e`` is refused on the event path and through a recorder, naming ``texts``;
    nothing lands."""
    before = _files(root)
    with pytest.raises(ValidationError) as raised, log.transaction() as tx:
        tx.append(e)
    assert all(t in str(raised.value) for t in texts), str(raised.value)
    with log.recorder(max_delay_ms=0) as rec:
        fut = rec.record([e])  # a failed future, not a raise
        exc = fut.exception(timeout=60)
    assert isinstance(exc, ValidationError) and all(t in str(exc) for t in texts), exc
    assert _files(root) == before


@pytest.fixture
def log_root(tmp_path: Path) -> tuple[pdm.EventLog, Path]:
    root = tmp_path / "log"
    log = pdm.open_log(root, durable=False)
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "r0", "v1"))
    return log, root


@pytest.mark.parametrize("make, field", [
    (lambda: ev.AttemptDispatched("acme", "r1", 0, "plan", HUGE, 1), "'step_index'"),
    (lambda: ev.RunStarted(HUGE, "r1", "v1"), "'tenant'"),  # type: ignore[arg-type]
    (lambda: ev.RunStarted("acme", HUGE, "v1"), "'run_id'"),  # type: ignore[arg-type]
    (lambda: ev.AttemptFinished("acme", "r1", 0, "s", 1, HUGE), "'state'"),  # type: ignore
    (lambda: ev.RunFinished("acme", "r1", HUGE), "'outcome'"),  # type: ignore[arg-type]
    (lambda: ev.AttemptFinished("acme", "r1", 0, "s", 1, "failed",
                                usage=ev.Usage(input_tokens=HUGE)), "'usage.input_tokens'"),
    (lambda: ev.AttemptDispatched("acme", "r1", 0, "s", 0, 1,
                                  prompt=ev.BlobRef("acme", "ab" * 32, HUGE)), "'prompt'"),
    (lambda: ev.VerdictRecorded("acme", "r1", 0, HUGE, 1, True), "'verifier'"),  # type: ignore
])
def test_an_int_too_long_to_print_is_named_by_its_size(log_root, make, field) -> None:
    log, root = log_root
    _refused(log, root, make(), field, "an int of 16610 bits")


class _NoOffset(tzinfo):  # the base class: utcoffset raises NotImplementedError
    pass


class _IntOffset(tzinfo):
    def utcoffset(self, dt: datetime | None) -> Any:
        return 3600  # not a timedelta: datetime raises TypeError


class _DayAndMore(tzinfo):
    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=30)  # past 24 h: datetime raises ValueError


@pytest.mark.parametrize("zone, raised", [(_NoOffset(), "NotImplementedError"),
                                          (_IntOffset(), "TypeError"),
                                          (_DayAndMore(), "ValueError")])
def test_a_tzinfo_that_cannot_give_its_offset_is_refused(log_root, zone, raised) -> None:
    log, root = log_root
    _refused(log, root, ev.RunStarted("acme", "r1", "v1", ts=datetime(2024, 1, 1, tzinfo=zone)),
             "'ts'", f"({raised} from utcoffset())")


def test_nanoseconds_are_refused_on_both_paths_not_cut() -> None:
    pd = pytest.importorskip("pandas")
    stamp = pd.Timestamp("2024-01-01T00:00:00.000000999", tz="UTC")
    with pytest.raises(ValidationError, match="at most microsecond precision.*999 ns"):
        ev.validate_event(ev.RunStarted("acme", "r1", "v1", ts=stamp))
    # a whole microsecond is kept as it is
    ev.validate_event(ev.RunStarted("acme", "r1", "v1",
                                    ts=pd.Timestamp("2024-01-01T00:00:00.000001", tz="UTC")))
    table = pa.table({"ts": pa.array([stamp.value], pa.timestamp("ns", tz="UTC")),
                      "kind": ["run_started"], "tenant": ["acme"], "run_id": ["r1"],
                      "workflow_version": ["v1"]})
    with pytest.raises(ValidationError, match="'ts'.*would lose data"):
        ev.validate_table(table)


def _bulk(**cols: Any) -> pa.Table:
    base: dict[str, Any] = {"kind": ["attempt_finished"], "tenant": ["acme"], "run_id": ["r1"],
                            "branch_id": [0], "step_id": ["s"], "attempt_no": [1],
                            "state": ["succeeded"]}
    return pa.table(base | cols)


@pytest.mark.parametrize("table, column, field", [
    # money rounded by Arrow's cast (0.1234567891234 stored as 0.123456789)
    (_bulk(usage=pa.array([{"cost_usd": 0.1234567891234}],
                          pa.struct([("cost_usd", pa.float64())]))), "usage", "'cost_usd'"),
    (_bulk(usage=pa.array([{"cost_usd": 0.5}],
                          pa.struct([("cost_usd", pa.float32())]))), "usage", "'cost_usd'"),
    # an int read as a bool, or as microseconds since the epoch
    (pa.table({"kind": ["verdict_recorded"], "tenant": ["acme"], "run_id": ["r1"],
               "branch_id": [0], "verifier": ["v@1"], "snapshot_lsn": [1],
               "passed": [7]}), "passed", None),
    (_bulk(ts=pa.array([1_700_000_000_000_000], pa.int64())), "ts", None),
    (_bulk(ts=["2024-01-01T00:00:00Z"]), "ts", None),
    # numbers turned into text, text parsed into numbers
    (_bulk(step_id=pa.array([12], pa.int64())), "step_id", None),
    (_bulk(attempt_no=["1"]), "attempt_no", None),
    (_bulk(attempt_no=pa.array([1.0], pa.float64())), "attempt_no", None),
    (_bulk(usage=pa.array([{"input_tokens": 1.0}], pa.struct([("input_tokens", pa.float64())]))),
     "usage", "'input_tokens'"),
])
def test_a_bulk_cast_across_kinds_is_refused(table, column, field) -> None:
    with pytest.raises(ValidationError) as raised:
        ev.validate_table(table)
    text = str(raised.value)
    assert f"column {column!r} has type" in text and "values are not" in text, text
    assert field is None or f"field {field}" in text, text


def test_a_bulk_cast_within_a_kind_is_kept() -> None:
    """Other widths and layouts of the values the event path takes still conform: int32
    ids, a large_string, a dictionary of strings, ints where a double or money is, a
    timestamp in another unit or zone, an exact decimal of a smaller scale."""
    usage = pa.array([{"input_tokens": 3, "cost_usd": Decimal("0.25"), "latency_ms": 12}],
                     pa.struct([("input_tokens", pa.int32()),
                                ("cost_usd", pa.decimal128(10, 2)),
                                ("latency_ms", pa.int16())]))
    table = _bulk(branch_id=pa.array([0], pa.int32()),
                  step_id=pa.array(["s"], pa.large_string()),
                  state=pa.array(["succeeded"]).dictionary_encode(),
                  ts=pa.array([datetime(2024, 1, 1, 2, tzinfo=UTC)],
                              pa.timestamp("ms", tz="Europe/Paris")),
                  usage=usage)
    t = ev.validate_table(table)
    row = t.to_pylist()[0]
    assert row["usage"]["cost_usd"] == Decimal("0.250000000")
    assert row["usage"]["input_tokens"] == 3 and row["usage"]["latency_ms"] == 12.0
    assert row["ts"] == datetime(2024, 1, 1, 2, tzinfo=UTC) and row["state"] == "succeeded"


def test_a_table_duckdb_hands_over_conforms() -> None:
    """DuckDB types a literal 0.5 as DECIMAL(2,1) and sum() of ints as HUGEINT (a
    decimal128(38, 0) in Arrow): numbers where numbers are, cast with Arrow's safe cast,
    which still refuses a fraction or an overflow into an int."""
    import duckdb

    t = duckdb.sql("select 'verdict_recorded' as kind, 'acme' as tenant, 'r1' as run_id, "
                   "0 as branch_id, 'v@1' as verifier, true as passed, "
                   "sum(1) as snapshot_lsn, 0.5 as score").to_arrow_table()
    assert pa.types.is_decimal(t.schema.field("snapshot_lsn").type)
    row = ev.validate_table(t).to_pylist()[0]
    assert row["snapshot_lsn"] == 1 and row["score"] == 0.5
    for bad, text in (("1.5", "data loss"), ("170141183460469231731687303715884105727",
                                              "out of bounds")):
        t = duckdb.sql(f"select 'verdict_recorded' as kind, 'acme' as tenant, 'r1' as "
                       f"run_id, 0 as branch_id, 'v@1' as verifier, true as passed, "
                       f"{bad}::{'decimal(2,1)' if '.' in bad else 'hugeint'} as "
                       f"snapshot_lsn").to_arrow_table()
        with pytest.raises(ValidationError, match=f"column 'snapshot_lsn' has type .*{text}"):
            ev.validate_table(t)


def test_labels_with_a_key_twice_are_refused_on_the_bulk_path() -> None:
    labels = pa.array([[("a", "1")], [("env", "x"), ("env", "y")]],
                      pa.map_(pa.string(), pa.string()))
    table = pa.table({"kind": ["run_started"] * 2, "tenant": ["acme"] * 2,
                      "run_id": ["r1", "r2"], "workflow_version": ["v1"] * 2,
                      "labels": labels})
    with pytest.raises(ValidationError, match=r"row 1 \(run_started\): field 'labels'.*twice"):
        ev.validate_table(table)
    ev.validate_table(table.slice(0, 1))  # one of each key: kept
    # a big table (past _PY_REGEX_LIMIT rows) is judged by a count of (row, key) pairs
    from poimen_data.model._arrow import _PY_REGEX_LIMIT

    n = _PY_REGEX_LIMIT + 2
    big = pa.table({"kind": ["run_started"] * n, "tenant": ["acme"] * n,
                    "run_id": [f"r{i}" for i in range(n)], "workflow_version": ["v1"] * n,
                    "labels": pa.array([[("a", "1"), ("b", "2")]] * (n - 1)
                                       + [[("a", "1"), ("a", "2")]],
                                       pa.map_(pa.string(), pa.string()))})
    with pytest.raises(ValidationError, match=rf"row {n - 1} \(run_started\): field 'labels'"):
        ev.validate_table(big)
    ev.validate_table(big.slice(0, n - 1))


def test_the_body_of_a_ref_is_bytes_as_put_blob_takes_it(log_root) -> None:
    import array

    log, root = log_root
    before = _files(root)
    with log.recorder(max_delay_ms=0) as rec:
        for bad, name in (("hello", "str"), (None, "NoneType"), (array.array("i", [1]),
                                                                  "array")):
            with pytest.raises(ValidationError, match=f"'data' must be bytes, got {name}"):
                rec.ref("acme", bad)  # type: ignore[arg-type]
        # a view's bytes, as put_blob hashes them (its size in bytes, not items)
        items = memoryview(array.array("i", [1, 2]))
        assert len(items) == 2 and items.nbytes == 8
        assert rec.ref("acme", items) == rec.ref("acme", items.tobytes())
        assert rec.ref("acme", items).size == 8
        assert rec.ref("acme", bytearray(b"abcd")).size == 4
        for events in (None, 3):
            exc = rec.record(events).exception(timeout=60)  # type: ignore[arg-type]
            assert isinstance(exc, ValidationError), exc
            assert "events must be a sequence of events" in str(exc)
    tx = log.transaction()
    for events in (None, 3):
        with pytest.raises(ValidationError, match="events must be event objects or a "
                                                  "pyarrow.Table"):
            tx.extend(events)  # type: ignore[arg-type]
    tx.abort()
    assert _files(root) == before


@pytest.mark.parametrize("bad", [-1, 0, 1.5, "10", True, 2**63])
def test_a_checkpoint_interval_that_is_not_a_count_is_refused_before_any_write(
        tmp_path: Path, bad: Any) -> None:
    root = tmp_path / "log"
    with pytest.raises(ValidationError, match="checkpoint_interval must be an int >= 1"):
        pdm.open_log(root, checkpoint_interval=bad)
    assert not root.exists()
    np = pytest.importorskip("numpy")
    assert pdm.open_log(root, checkpoint_interval=np.int64(7)).checkpoint_interval == 7


def test_an_lsn_that_is_not_an_int_is_refused(log_root) -> None:
    np = pytest.importorskip("numpy")
    log, _root = log_root
    assert log.read_events(np.int64(1)).num_rows == 1  # a query's int
    for bad, name in (("1", "str"), (1.0, "float"), (True, "bool")):
        with pytest.raises(ValidationError, match=f"at_lsn must be an int, got {name}"):
            log.read_events(bad)  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match=f"at_lsn must be an int, got {name}"):
            next(log.scan(bad))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="min_lsn must be an int, got NoneType"):
        log.read_events(1, None)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="at_lsn 2 is outside 0..1"):
        log.read_events(2)


@pytest.mark.parametrize("kw", [{"grace": math.nan}, {"grace": -1}, {"grace": "x"},
                                {"grace": None}, {"grace": True},
                                {"grace": 3600, "retention": math.nan}])
def test_vacuum_refuses_an_age_that_is_not_one_before_taking_its_lease(log_root, kw) -> None:
    """NaN compares false with every age: as a grace it removed at once what a grace is
    there to keep, and passed the guard against live writers."""
    log, root = log_root
    tx = log.transaction()  # staging of a live writer's commit, young
    tx.put_blob("acme", b"a body in flight")
    tx.flush()
    before = _files(root)
    with pytest.raises(ValidationError, match="must be a number of seconds >= 0"):
        pdm.vacuum(log, **kw)
    assert _files(root) == before  # no lease taken, nothing removed
    tx.abort()
    assert pdm.vacuum(log, grace=math.inf).bodies_removed == 0
    np = pytest.importorskip("numpy")  # numpy's numbers are numbers
    assert pdm.vacuum(log, grace=np.int64(3600), retention=np.float64(60)).bodies_removed == 0
    assert pdm.compact(log, target_rows=np.int64(10), min_rows=np.int32(2)).rewritten == 0


@pytest.mark.parametrize("kw, text", [({"target_rows": "x"}, "target_rows must be an int >= 1"),
                                      ({"target_rows": 0}, "target_rows must be an int >= 1"),
                                      ({"min_rows": -1}, "min_rows must be an int >= 0"),
                                      ({"min_rows": 2.5}, "min_rows must be an int >= 0")])
def test_compact_refuses_sizes_that_are_not_counts(log_root, kw, text) -> None:
    log, root = log_root
    before = _files(root)
    with pytest.raises(ValidationError, match=text):
        pdm.compact(log, **kw)
    assert _files(root) == before


@pytest.mark.parametrize("bad", [math.nan, -1, 10**400, 1e300, 10**12 + 1, True, "5"])
def test_a_recorder_delay_out_of_range_is_refused(log_root, bad) -> None:
    log, _root = log_root
    with pytest.raises(ValidationError, match=r"max_delay_ms must be a number in \[0, "):
        log.recorder(max_delay_ms=bad)


def test_a_log_opened_read_only_never_writes(log_root) -> None:
    """``read_only=True`` never writes: not only transactions and recorders, but
    checkpoints, maintenance (its lease first) and materialize refuse, storage as it was."""
    log, root = log_root
    with log.transaction() as tx:
        tx.put_blob("acme", b"a body")
        tx.append(ev.RunStarted("acme", "r1", "v1"))
    for _ in range(3):  # segments for compact to rewrite
        with log.transaction() as tx:
            tx.append(ev.VerifyingEntered("acme", "r1"))
    log.flush()
    ro = pdm.open_log(root, create=False, read_only=True)
    before = _files(root)
    refusals = {
        "write_checkpoint": lambda: ro.write_checkpoint(),
        "the maintenance lease": lambda: pdm.compact(ro, target_rows=100),
        "materialize": lambda: pdm.materialize(ro),
        "break_lease": lambda: pdm.break_lease(ro),
        "a recorder": lambda: ro.recorder(),
    }
    refusals["vacuum"] = lambda: pdm.vacuum(ro, grace=0, force=True)
    for what, call in refusals.items():
        with pytest.raises(pdm.PoimenError, match="was opened read-only"
                           + ("" if what == "vacuum" else f": {what} refused")):
            call()
    with pytest.raises(pdm.PoimenError, match="was opened read-only"):
        ro.transaction()
    assert _files(root) == before
    assert ro.read_events().num_rows == 5  # reading is what it is for


def test_reduce_refuses_a_summary_that_is_not_text_and_refs_that_are_none(log_root) -> None:
    """(A summary that is another body reduced in the same call is kept as the maintenance
    tests decide: both reduced, as asked.)"""
    log, root = log_root
    with log.transaction() as tx:
        a = tx.put_blob("acme", b"the first body, long")
        b = tx.put_blob("acme", b"short")
        tx.append(ev.AttemptDispatched("acme", "r0", 0, "s", 0, 1, prompt=a))
        tx.append(ev.AttemptFinished("acme", "r0", 0, "s", 1, "succeeded", output=b))
    log.flush()
    before = _files(root)
    with pytest.raises(ValidationError, match="not valid UTF-8 text"):
        pdm.reduce(log, [a], lambda body: "sum \ud800")
    with pytest.raises(ValidationError, match="refs must be an iterable of BlobRef"):
        pdm.reduce(log, None, lambda body: b"x")  # type: ignore[arg-type]
    assert _files(root) == before
    assert log.blobs.get(a) == b"the first body, long" and log.blobs.get(b) == b"short"


@pytest.mark.parametrize(("kw", "text"), [
    ({"deadline_s": math.nan}, "deadline_s of ok@1 must be a number of seconds > 0, got nan"),
    ({"deadline_s": -1}, "deadline_s of ok@1 must be a number of seconds > 0"),
    ({"batch_size": "5"}, "batch_size must be an int >= 1"),
    ({"chunk_runs": 2.5}, "chunk_runs must be an int >= 1"),
    ({"threads": 2.5}, "threads must be an int >= 1"),
    ({"runs": "r0"}, "runs must be a list of run ids, not one str"),
    ({"memory_limit": "²GB"}, "memory_limit: expected a size"),
    ({"memory_limit": "9" * 400 + "GB"}, "memory_limit: expected a size"),
    ({"memory_limit": 4 << 20}, "from 16 MiB"),
])
def test_grade_refuses_options_that_are_not_what_they_say(log_root, kw, text) -> None:
    log, root = log_root

    def ok(ctx: Any) -> pdm.Verdict:
        return pdm.Verdict(passed=True)

    ok.name, ok.version = "ok", "1"  # type: ignore[attr-defined]
    before = _files(root)
    with pytest.raises(ValidationError, match=re.escape(text)):
        pdm.grade(log, [ok], **kw)
    assert _files(root) == before


@pytest.mark.parametrize("value", ["8MB", 4 << 20, "lots", "²GB", "80%", True])
def test_every_entry_point_takes_a_memory_limit_by_one_rule(log_root, tmp_path, value) -> None:
    """connect took any string DuckDB took (8MB: an OutOfMemoryException at the first
    query) and ints from 1 MiB; the jobs refused both. One rule now, one message."""
    log, root = log_root
    before = _files(root)
    calls = [lambda: pdm.connect(log, memory_limit=value),
             lambda: pdm.materialize(log, memory_limit=value),
             lambda: pdm.export_live(log, str(tmp_path / "x.jsonl"), memory_limit=value)]
    for call in calls:
        with pytest.raises(ValidationError, match=r"^memory_limit: expected a size such as "
                                                  r"'2GB' or a number of bytes, from 16 MiB"):
            call()
    assert _files(root) == before
    with pdm.connect(log, memory_limit="16MiB") as con:  # the least taken, as DuckDB reads it
        assert con.sql("select current_setting('memory_limit')").fetchall() == [("16.0 MiB",)]


@pytest.mark.parametrize(("value", "shown"), [("2147483648", "2.0 GiB"), ("4G", "3.7 GiB"),
                                              ("500 m", "476.8 MiB"), ("1GiB", "1.0 GiB")])
def test_a_memory_limit_in_digits_or_duckdb_s_short_units_is_taken(log_root, monkeypatch,
                                                                   value, shown) -> None:
    """Bytes as digits (all an environment variable or a CLI option can give) and DuckDB's
    one-letter units (1000^i, as DuckDB reads '4G') are sizes too."""
    log, _root = log_root
    monkeypatch.setenv("POIMEN_MEMORY_LIMIT", value)
    with pdm.connect(log) as con:
        assert con.sql("select current_setting('memory_limit')").fetchall() == [(shown,)]


def test_an_infinite_deadline_is_none(log_root) -> None:
    log, _root = log_root
    with log.transaction() as tx:
        tx.append(ev.VerifyingEntered("acme", "r0"))

    def ok(ctx: Any) -> pdm.Verdict:
        return pdm.Verdict(passed=True)

    ok.name, ok.version = "ok", "1"  # type: ignore[attr-defined]
    report = pdm.grade(log, [ok], deadline_s=math.inf)  # an OverflowError in the timer
    assert report.runs_graded == 1 and report.runs_passed == 1
