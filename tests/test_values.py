"""Values outside what storage holds (issue 16, A and B): a ``ValidationError`` naming the
event, the field and the limit, on the event and the bulk paths alike, storage untouched;
values inside the limits commit and read back exactly."""

from __future__ import annotations

import hashlib
import math
import os
import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from enum import IntEnum
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import poimen_data as pdm
from poimen_data import cli
from poimen_data.errors import ValidationError
from poimen_data.events import (
    EVENT_SCHEMA,
    AttemptDispatched,
    AttemptFinished,
    BlobRef,
    BranchForked,
    RunCancelled,
    RunStarted,
    ToolInfo,
    Usage,
    VerdictRecorded,
)

T = "acme"
MAX = 2**63 - 1
TS_MIN = datetime(1, 1, 1, tzinfo=UTC)
TS_MAX = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
COST_MAX = Decimal("999999999.999999999")


def _new_log() -> pdm.EventLog:
    return pdm.open_log(f"memory://values-{uuid.uuid4().hex}")


def _files(log: pdm.EventLog) -> dict[str, bytes]:
    fs = fsspec.filesystem("memory")
    root = log.root.removeprefix("memory://")
    return {p: fs.cat_file(p) for p in fs.find(root)}


def _finished(**kw: Any) -> AttemptFinished:
    return AttemptFinished(T, "r", 0, "s", 1, "failed", **kw)


def _verdict(**kw: Any) -> VerdictRecorded:
    return VerdictRecorded(T, "r", 0, "v@1", 1, True, **kw)


PLUS1 = timezone(timedelta(hours=1))
EVENT_CASES = [  # (event, field, words of the message naming the limit)
    (AttemptDispatched(T, "r", 0, "s", 0, 2**63), "attempt_no", "[1, 2**63 - 1]"),
    (AttemptDispatched(T, "r", 2**63, "s", 0, 1), "branch_id", "[0, 2**63 - 1]"),
    (AttemptDispatched(T, "r", 0, "s", 2**64, 1), "step_index", "[0, 2**63 - 1]"),
    (BranchForked(T, "r", 1, 0, 2**63), "fork_step_index", "[0, 2**63 - 1]"),
    # what reads like an int and is not one says what it is
    (AttemptDispatched(T, "r", 0, "s", True, 1), "step_index", "got True (bool, not int)"),
    (AttemptDispatched(T, "r", 0, "s", 0, IntEnum("N", "ONE").ONE), "attempt_no",
     "got <N.ONE: 1> (N, not int)"),
    (VerdictRecorded(T, "r", 0, "v@1", 2**63, True), "snapshot_lsn", "[1, 2**63 - 1]"),
    (_finished(usage=Usage(input_tokens=2**63)), "usage.input_tokens", "[0, 2**63 - 1]"),
    (_finished(usage=Usage(reasoning_tokens=2**70)), "usage.reasoning_tokens", "2**63 - 1"),
    (_finished(usage=Usage(latency_ms=10**400)), "usage.latency_ms", "finite double"),
    (_finished(usage=Usage(latency_ms=-1.0)), "usage.latency_ms", ">= 0"),
    (_finished(usage=Usage(latency_ms=math.nan)), "usage.latency_ms", "finite double"),
    (_finished(usage=Usage(latency_ms=math.inf)), "usage.latency_ms", "finite double"),
    (_finished(usage=Usage(cost_usd=Decimal("1e9"))), "usage.cost_usd", "at most"),
    (_finished(usage=Usage(cost_usd=Decimal("1e30"))), "usage.cost_usd", "at most"),
    (_finished(usage=Usage(cost_usd=Decimal("sNaN"))), "usage.cost_usd", "finite amount"),
    (_finished(usage=Usage(cost_usd=Decimal("NaN"))), "usage.cost_usd", "finite amount"),
    (_finished(usage=Usage(cost_usd=Decimal("-Infinity"))), "usage.cost_usd", "finite"),
    (_finished(usage=Usage(cost_usd=Decimal("1e-20"))), "usage.cost_usd", "9 decimals"),
    (_finished(usage=Usage(cost_usd=Decimal("0.1234567891"))), "usage.cost_usd", "9 decimals"),
    (_verdict(score=10**400), "score", "finite double"),
    (_verdict(score=math.nan), "score", "finite double"),
    (_verdict(score=2**53 + 1), "score", "exactly representable"),
    (_finished(error="a\ud800b"), "error", "UTF-8"),
    (AttemptFinished(T, "r", 0, "s\udfff", 1, "failed"), "step_id", "UTF-8"),
    (RunStarted(T, "r", "wf\ud800"), "workflow_version", "UTF-8"),
    (RunStarted(T, "r", "wf", labels={"k": "\ud800"}), "labels", "UTF-8"),
    (_verdict(detail="\udc00"), "detail", "UTF-8"),
    (RunCancelled(T, "r", reason="\ud800"), "reason", "UTF-8"),
    (_finished(tools=ToolInfo(("ok", "\ud800"))), "tools.calls", "UTF-8"),
    (VerdictRecorded(T, "r", 0, "v\ud800@1", 1, True), "verifier", "name@version"),
    (RunStarted(T, "r", "wf", ts=datetime(1, 1, 1, 0, 30, tzinfo=PLUS1)), "ts",
     "0001-01-01 .. 9999-12-31 UTC"),
    (RunStarted(T, "r", "wf", ts=datetime(9999, 12, 31, 23, 30,
                                           tzinfo=timezone(-timedelta(hours=1)))), "ts",
     "0001-01-01 .. 9999-12-31 UTC"),
    (RunStarted(T, "r", "wf", ts=datetime(2024, 1, 1)), "ts", "timezone-aware"),
]


@pytest.mark.parametrize(("event", "field", "limit"), EVENT_CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(EVENT_CASES)])
def test_a_value_storage_cannot_hold_is_a_validation_error(event: Any, field: str,
                                                           limit: str) -> None:
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "first", "wf"))
    before = _files(log)
    with pytest.raises(ValidationError) as info, log.transaction() as tx:
        tx.append(RunStarted(T, "other", "wf"))
        tx.append(event)
    msg = str(info.value)
    assert msg.startswith(f"event 1 ({event.kind}): field '{field}' "), msg
    assert limit in msg, msg
    assert _files(log) == before and log.head == 1


def _bulk(ts: pa.Array | None = None, **cols: pa.Array) -> pa.Table:
    n = len(next(iter(cols.values()))) if cols else len(ts)  # type: ignore[arg-type]
    base = {"kind": pa.array(["verdict_recorded"] * n), "tenant": pa.array([T] * n),
            "run_id": pa.array(["r"] * n), "branch_id": pa.array([0] * n),
            "verifier": pa.array(["v@1"] * n), "snapshot_lsn": pa.array([1] * n),
            "passed": pa.array([True] * n)}
    if ts is not None:
        base["ts"] = ts
    base.update(cols)
    return pa.table(base)


def _usage(**kw: Any) -> pa.Array:
    return pa.array([None, kw], EVENT_SCHEMA.field("usage").type)


def _bad_utf8() -> pa.Array:
    offsets = pa.py_buffer(np.array([0, 2, 5], np.int32).tobytes())
    return pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xed\xa0\x80")])


TS_UTC = pa.timestamp("us", tz="UTC")
FINISHED = {"kind": pa.array(["attempt_finished"] * 2), "step_id": pa.array(["s", "s"]),
            "attempt_no": pa.array([1, 1]), "state": pa.array(["failed", "failed"]),
            "verifier": pa.nulls(2, pa.string()), "snapshot_lsn": pa.nulls(2, pa.int64()),
            "passed": pa.nulls(2, pa.bool_())}
BULK_CASES = [  # (table, message fragment)
    (_bulk(pa.array([datetime(2024, 1, 1)], pa.timestamp("us"))), "column 'ts' has type "
     "timestamp[us], naive"),
    (_bulk(pa.array([0, MAX], TS_UTC)), "row 1 (verdict_recorded): field 'ts' must be within "
     "0001-01-01 .. 9999-12-31 UTC"),
    (_bulk(pa.array([-(2**63) + 1], TS_UTC)), "row 0 (verdict_recorded): field 'ts' must be "
     "within 0001-01-01"),
    (_bulk(pa.array([0, 253_402_300_800_000_000], TS_UTC)), "row 1 (verdict_recorded): field "
     "'ts' must be within"),
    (_bulk(score=pa.array([1.0, math.nan])), "row 1 (verdict_recorded): field 'score' must be "
     "a finite double"),
    (_bulk(score=pa.array([-math.inf, 1.0])), "row 0 (verdict_recorded): field 'score' must be "
     "a finite double"),
    (_bulk(detail=_bad_utf8()), "row 1 (verdict_recorded): field 'detail' must be valid UTF-8"),
    (_bulk(run_id=_bad_utf8()), "row 1 (verdict_recorded): field 'run_id' must be valid UTF-8"),
    (pa.concat_tables([_bulk(detail=pa.array(["ok"] * 9000)),  # bad text past a slice's
                       _bulk(detail=_bad_utf8())]).combine_chunks().slice(9001),  # start
     "row 0 (verdict_recorded): field 'detail' must be valid UTF-8"),
    (_bulk(kind=pa.array(["run_started"] * 2), verifier=pa.nulls(2, pa.string()),
           snapshot_lsn=pa.nulls(2, pa.int64()), passed=pa.nulls(2, pa.bool_()),
           branch_id=pa.nulls(2, pa.int64()), workflow_version=pa.array(["w", "w"]),
           labels=pa.MapArray.from_arrays(pa.array([0, 1, 2], pa.int32()), pa.array(["a", "b"]),
                                          _bad_utf8())),
     "field 'labels' must be valid UTF-8"),
    (_bulk(usage=_usage(latency_ms=-0.5), **FINISHED), "row 1 (attempt_finished): field "
     "'usage.latency_ms' must be >= 0"),
    (_bulk(usage=_usage(latency_ms=math.nan), **FINISHED), "row 1 (attempt_finished): field "
     "'usage.latency_ms' must be a finite double"),
    (_bulk(branch_id=pa.array([0, 2**64 - 1], pa.uint64())), "column 'branch_id' has type "
     "uint64"),
]


@pytest.mark.parametrize(("table", "message"), BULK_CASES,
                         ids=[f"bulk-{i}" for i in range(len(BULK_CASES))])
def test_the_bulk_path_refuses_the_same_values(table: pa.Table, message: str) -> None:
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "r", "wf"))
    before = _files(log)
    with pytest.raises(ValidationError) as info, log.transaction() as tx:
        tx.extend(table)
    assert message in str(info.value), str(info.value)
    assert _files(log) == before and log.head == 1


def test_the_limits_themselves_commit_and_read_back(tmp_path: Any) -> None:
    """The extreme values each limit admits, on both paths, through the views and the
    CLI (which printed an OverflowError traceback for a year-0 start before)."""
    log = pdm.open_log(str(tmp_path / "log"))
    usage = Usage(MAX, 0, MAX, 1, COST_MAX, 1.7976931348623157e308)
    with log.transaction() as tx:
        tx.append(RunStarted(T, "lo", "wf", labels={"ключ": "値"}, ts=TS_MIN))
        tx.append(AttemptFinished(T, "lo", MAX, "s", MAX, "failed", usage=usage,
                                  error="ошибка ✓", ts=TS_MAX))
        tx.append(_verdict(score=-1.7976931348623157e308, detail="détail"))
    with log.transaction() as tx:
        tx.extend(_bulk(pa.array([TS_MIN, TS_MAX], TS_UTC), run_id=pa.array(["hi", "hi"]),
                        score=pa.array([2.0**53, -0.0])))
    con = pdm.connect(log)
    got = con.execute("select ts, usage, error from events where kind = 'attempt_finished'"
                      ).fetchall()
    assert got == [(TS_MAX, {"input_tokens": MAX, "output_tokens": 0,
                             "cache_read_input_tokens": MAX, "reasoning_tokens": 1,
                             "cost_usd": COST_MAX, "latency_ms": 1.7976931348623157e308},
                    "ошибка ✓")]
    assert con.execute("select run_id, started_at from runs where run_id = 'lo'").fetchall() \
        == [("lo", TS_MIN)]
    assert con.execute("select ts, score from events where run_id = 'hi' order by lsn"
                       ).fetchall() == [(TS_MIN, 2.0**53), (TS_MAX, 0.0)]
    con.close()
    from typer.testing import CliRunner

    r = CliRunner().invoke(cli.app, ["sql", "--root", str(tmp_path / "log"), "--json",
                                     "select run_id, started_at from runs"])
    assert r.exit_code == 0, r.output
    assert '"started_at": "0001-01-01T00:00:00+00:00"' in r.output


# --- the property ------------------------------------------------------------------------

ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
INTS = st.one_of(st.integers(-3, 5), st.sampled_from([MAX - 1, MAX, MAX + 1, 2**64, -(2**63)]),
                 st.integers())
FLOATS = st.one_of(st.floats(), st.sampled_from([10**400, 2**53 + 1, 2**53, -1, 0, 7]))
DECIMALS = st.one_of(
    st.decimals(allow_nan=True, allow_infinity=True),
    st.decimals(min_value=0, max_value=COST_MAX, places=9),
    st.sampled_from([Decimal("sNaN"), Decimal("1e9"), COST_MAX, Decimal("1e-20"),
                     Decimal("1.0000000000"), Decimal("1E+30"), Decimal("-0"), 5, 2**70]))
OFFSETS = st.timedeltas(min_value=-timedelta(hours=23, minutes=59),
                        max_value=timedelta(hours=23, minutes=59)
                        ).map(lambda d: timezone(timedelta(minutes=d // timedelta(minutes=1))))
STAMPS = st.one_of(st.datetimes(timezones=st.one_of(st.none(), OFFSETS)),
                   st.sampled_from([TS_MIN, TS_MAX, datetime(1, 1, 1, tzinfo=PLUS1)]))


def _int_ok(v: Any, minimum: int) -> bool:
    return type(v) is int and minimum <= v <= MAX


def _float_ok(v: Any, minimum: float | None = None) -> bool:
    if isinstance(v, float):
        ok = math.isfinite(v)
    else:
        try:
            ok = float(v) == v
        except OverflowError:
            ok = False
    return ok and (minimum is None or v >= minimum)


def _cost_ok(v: Any) -> bool:
    d = Decimal(v)
    return d.is_finite() and 0 <= d <= COST_MAX and d == round(d, 9)


def _text_ok(v: str, longest: int | None = None) -> bool:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return longest is None or 0 < len(v) <= longest


def _ts_ok(v: datetime) -> bool:
    if v.utcoffset() is None:
        return False
    try:
        v.astimezone(UTC)
    except OverflowError:
        return False
    return True


WILD = {"ts": STAMPS, "workflow_version": ANY_TEXT, "step_id": ANY_TEXT, "attempt_no": INTS,
        "tokens": INTS, "cost": DECIMALS, "latency": FLOATS, "error": ANY_TEXT,
        "snapshot_lsn": INTS, "score": FLOATS, "detail": ANY_TEXT, "label": ANY_TEXT}
GOOD_TEXT = st.text(min_size=1, max_size=8)  # hypothesis leaves surrogates out by default
TAME = {"ts": st.one_of(st.datetimes(timezones=OFFSETS, min_value=datetime(2, 1, 1),
                                     max_value=datetime(9998, 12, 31)),
                        st.sampled_from([TS_MIN, TS_MAX])),
        "workflow_version": GOOD_TEXT, "step_id": GOOD_TEXT,
        "attempt_no": st.integers(1, MAX), "tokens": st.integers(0, MAX),
        "cost": st.decimals(min_value=0, max_value=COST_MAX, places=9),
        "latency": st.floats(min_value=0, allow_infinity=False),
        "error": GOOD_TEXT, "snapshot_lsn": st.integers(1, MAX),
        "score": st.floats(allow_nan=False, allow_infinity=False),
        "detail": GOOD_TEXT, "label": GOOD_TEXT}


@st.composite
def _values(draw: st.DrawFn) -> dict[str, Any]:
    """Every field within its limits but for up to two, drawn from anything (at, past
    and far past the limits), so both commits and refusals are common."""
    wild = draw(st.sets(st.sampled_from(sorted(WILD)), max_size=2))
    return {k: draw(WILD[k] if k in wild else TAME[k]) for k in sorted(WILD)}


VALUES = _values()


def _ok(v: dict[str, Any]) -> bool:
    return (_ts_ok(v["ts"]) and _text_ok(v["workflow_version"], 256)
            and _text_ok(v["step_id"], 256) and _int_ok(v["attempt_no"], 1)
            and _int_ok(v["tokens"], 0) and _cost_ok(v["cost"]) and _float_ok(v["latency"], 0)
            and _text_ok(v["error"]) and _int_ok(v["snapshot_lsn"], 1)
            and _float_ok(v["score"]) and _text_ok(v["detail"]) and _text_ok(v["label"]))


def _events(v: dict[str, Any]) -> list[Any]:
    return [RunStarted(T, "r", v["workflow_version"], labels={"k": v["label"]}, ts=v["ts"]),
            AttemptFinished(T, "r", 0, v["step_id"], v["attempt_no"], "failed",
                            usage=Usage(input_tokens=v["tokens"], cost_usd=v["cost"],
                                        latency_ms=v["latency"]), error=v["error"]),
            VerdictRecorded(T, "r", 0, "v@1", v["snapshot_lsn"], True, score=v["score"],
                            detail=v["detail"])]


def _table(v: dict[str, Any]) -> pa.Table:
    """The same three events as a bulk table; raises when Arrow itself cannot hold a value
    (then there is nothing to hand to ``extend``)."""
    ts_type = TS_UTC if v["ts"].utcoffset() is not None else pa.timestamp("us")
    rows = [
        {"ts": v["ts"], "kind": "run_started", "tenant": T, "run_id": "r",
         "workflow_version": v["workflow_version"], "labels": [("k", v["label"])]},
        {"ts": v["ts"], "kind": "attempt_finished", "tenant": T, "run_id": "r",
         "branch_id": 0, "step_id": v["step_id"], "attempt_no": v["attempt_no"],
         "state": "failed", "error": v["error"],
         "usage": {"input_tokens": v["tokens"], "cost_usd": Decimal(v["cost"]),
                   "latency_ms": v["latency"]}},
        {"ts": v["ts"], "kind": "verdict_recorded", "tenant": T, "run_id": "r",
         "branch_id": 0, "verifier": "v@1", "snapshot_lsn": v["snapshot_lsn"],
         "passed": True, "score": v["score"], "detail": v["detail"]}]
    schema = pa.schema([pa.field("ts", ts_type)] + list(EVENT_SCHEMA)[1:])
    return pa.Table.from_pylist(rows, schema=schema)


def _read_back(log: pdm.EventLog) -> list[Any]:
    con = pdm.connect(log)
    try:
        return con.execute(
            "select e.ts, e.workflow_version, e.labels, a.step_id, a.attempt_no, a.usage, "
            "a.error, v.snapshot_lsn, v.score, v.detail from events e, attempts a, verdicts v "
            "where e.kind = 'run_started' and e.run_id = 'r'").fetchall()
    finally:
        con.close()


def _expected(v: dict[str, Any]) -> list[Any]:
    usage = {"input_tokens": v["tokens"], "output_tokens": None,
             "cache_read_input_tokens": None, "reasoning_tokens": None,
             "cost_usd": Decimal(v["cost"]), "latency_ms": float(v["latency"])}
    return [(v["ts"], v["workflow_version"], {"k": v["label"]}, v["step_id"],
             v["attempt_no"], usage, v["error"], v["snapshot_lsn"], float(v["score"]),
             v["detail"])]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(VALUES, st.booleans())
def test_values_commit_and_read_back_exactly_or_are_refused(v: dict[str, Any],
                                                            bulk: bool) -> None:
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "before", "wf"))
    before = _files(log)
    if bulk:
        try:
            table = _table(v)
        except (pa.ArrowException, OverflowError, UnicodeError, TypeError, ValueError,
                ArithmeticError):
            event("bulk: not expressible in Arrow")
            return  # not expressible as an Arrow table: nothing reaches extend
    try:
        with log.transaction() as tx:
            if bulk:
                tx.extend(table)
            else:
                tx.extend(_events(v))
    except ValidationError:
        event(f"{'bulk' if bulk else 'objects'}: refused")
        assert not _ok(v), v
        assert _files(log) == before and log.head == 1
        return
    event(f"{'bulk' if bulk else 'objects'}: committed")
    assert _ok(v), v
    rows = _read_back(log)
    assert rows == _expected(v)
    assert rows[0][0].utcoffset() is not None


def test_the_limits_export_exactly(tmp_path: Any) -> None:
    import json

    import pyarrow.parquet as pq

    log = pdm.open_log(str(tmp_path / "log"))
    usage = Usage(MAX, 0, MAX, 1, COST_MAX, 1.7976931348623157e308)
    with log.transaction() as tx:
        tx.append(RunStarted(T, "lo", "wf ✓", ts=TS_MIN))
        prompt, output = tx.put_blob(T, b"prompt"), tx.put_blob(T, b"output")
        tx.append(AttemptDispatched(T, "lo", 0, "шаг", MAX, MAX, prompt=prompt, ts=TS_MAX))
        tx.append(AttemptFinished(T, "lo", 0, "шаг", MAX, "failed", output=output,
                                  usage=usage))
    want = {"input_tokens": MAX, "output_tokens": 0, "cache_read_input_tokens": MAX,
            "reasoning_tokens": 1, "cost_usd": COST_MAX, "latency_ms": 1.7976931348623157e308}
    pdm.export_live(log, str(tmp_path / "x.jsonl"))
    (line,) = (tmp_path / "x.jsonl").read_text(encoding="utf-8").splitlines()
    meta = json.loads(line)["metadata"]
    assert (meta["step_id"], meta["step_index"], meta["attempt_no"], meta["workflow_version"]
            ) == ("шаг", MAX, MAX, "wf ✓")
    assert {**meta["usage"], "cost_usd": Decimal(meta["usage"]["cost_usd"])} == want
    pdm.export_live(log, str(tmp_path / "x.parquet"), format="parquet")
    (row,) = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert {k: row[k] for k in want} == want
    assert (row["step_index"], row["attempt_no"]) == (MAX, MAX)


def test_a_null_score_whose_slot_holds_nan_commits() -> None:
    """Null slots may hold anything (pandas puts NaN there): only valid values count."""
    log = _new_log()
    score = pa.array(np.array([math.nan, 0.5]), from_pandas=True)  # row 0 null, slot NaN
    assert score.null_count == 1
    with log.transaction() as tx:
        tx.extend(_bulk(score=score))
    con = pdm.connect(log)
    assert con.execute("select score from events order by lsn").fetchall() == [(None,), (0.5,)]
    con.close()


class _Sly(str):
    """A str whose equality lies: equal to anything, hashed as a bad tenant."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("bad tenant")


def _refused_whole(events: list[Any]) -> str:
    """Append ``events`` in one transaction and in one recorder record: both refuse with
    a ValidationError (its message returned) and storage is as it was."""
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "before", "wf"))
    before = _files(log)
    with pytest.raises(ValidationError) as txn_error:
        with log.transaction() as tx:
            for e in events:
                tx.append(e)
    with log.recorder(max_delay_ms=0) as rec:
        fut = rec.record(events)
        with pytest.raises(ValidationError) as rec_error:
            fut.result(timeout=120)
    assert _files(log) == before and log.head == 1
    assert str(rec_error.value).split(": ", 1)[1] == str(txn_error.value).split(": ", 1)[1]
    return str(txn_error.value)


def test_an_id_checked_once_passes_only_where_it_is_valid() -> None:
    """Validation remembers the strs that matched the run_id pattern (within a transaction
    or a record) instead of matching them again. A tenant is the same pattern, shorter: a
    run_id of 65 to 128 chars seen before is still refused as a tenant, and a str subclass
    (whose own ``__eq__`` could answer for other strs) is never remembered."""
    long = "r" * 100
    assert "field 'tenant' must match" in _refused_whole(
        [RunStarted(T, long, "wf"), RunStarted(long, "r", "wf")])
    assert "event 1 (run_started): field 'tenant'" in _refused_whole(
        [RunStarted(_Sly(T), "r", "wf"), RunStarted("bad tenant", "r", "wf")])
    assert "event 1 (run_started): field 'run_id'" in _refused_whole(
        [RunStarted(T, _Sly("r"), "wf"), RunStarted(T, "bad tenant", "wf")])
    # the same ids again are fine: a tenant seen first as a run_id, and the reverse
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "acme", "wf"))
        tx.append(RunStarted("acme", T, "wf"))
        tx.append(RunStarted("a" * 64, "a" * 64, "wf"))
    assert log.head == 3  # the last LSN


def test_utc_stamps_of_either_kind_and_numbers_arrow_will_not_take_commit_exactly() -> None:
    """A stamp in ``datetime.UTC`` or in ``ZoneInfo("UTC")`` (what Arrow's rows carry) is
    checked without asking for its offset, and any other zone still is; a usage whose
    numbers Arrow converts as they are (an int cost, a Decimal of 10 places ending in 0)
    and one it refuses (an int latency past 2**53, exact as a double) read back exactly."""
    from zoneinfo import ZoneInfo

    zoned = datetime(2026, 5, 1, 12, tzinfo=ZoneInfo("UTC"))
    paris = datetime(2026, 5, 1, 14, tzinfo=ZoneInfo("Europe/Paris"))
    fixed = datetime(2026, 5, 1, 12, tzinfo=UTC)
    log = _new_log()
    with log.transaction() as tx:
        for i, ts in enumerate((zoned, paris, fixed)):
            tx.append(RunStarted(T, f"z{i}", "wf", ts=ts))
        tx.append(_finished(usage=Usage(cost_usd=5, latency_ms=2**60)))  # type: ignore[arg-type]
        tx.append(_finished(usage=Usage(cost_usd=Decimal("1.0000000000"), latency_ms=3)))
    con = pdm.connect(log)
    assert con.execute("select ts from events where kind = 'run_started' order by lsn"
                       ).fetchall() == [(fixed,), (fixed,), (fixed,)]
    got = con.execute("select usage.cost_usd, usage.latency_ms from events "
                      "where kind = 'attempt_finished' order by lsn").fetchall()
    con.close()
    assert got == [(Decimal("5.000000000"), float(2**60)), (Decimal("1.000000000"), 3.0)]
    assert [type(v) for row in got for v in row] == [Decimal, float, Decimal, float]
    with pytest.raises(ValidationError, match="field 'ts' must be a timezone-aware"):
        with log.transaction() as tx:
            tx.append(RunStarted(T, "n", "wf", ts=datetime(2026, 5, 1)))


class _SlyRef(BlobRef):
    """A ref whose equality lies: equal to anything, hashed as a bad tenant."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("bad tenant")


def test_a_value_equal_to_one_checked_before_is_still_checked() -> None:
    """Validation caches what it checked (refs, ids) per transaction or record;
    a value of another type that equals a cached one is checked all the same: a str as
    ``usage`` equal to the event's run_id, a ref as ``usage`` equal to its ``output``, and
    a lying ref subclass (remembered for the commit's body check) beside a bad tenant."""
    assert "field 'usage' must be a Usage" in _refused_whole(
        [_finished(usage="r")])  # type: ignore[arg-type]
    ref = BlobRef(T, "ab" * 32, 3)
    assert "field 'usage' must be a Usage" in _refused_whole(
        [_finished(output=ref, usage=ref)])  # type: ignore[arg-type]
    sly = _SlyRef(T, "cd" * 32, 4)
    assert "event 1 (run_started): field 'tenant'" in _refused_whole(
        [AttemptDispatched(T, "r", 0, "s", 0, 1, prompt=sly),
         RunStarted("bad tenant", "r", "wf")])


class _Money(Decimal):
    """An amount that prints itself for people, with two decimals."""

    def __str__(self) -> str:
        return f"{self:.2f}"


class _Shown(int):
    def __str__(self) -> str:
        return "7"


class _Ms(float):
    """A latency whose float() answers something else than its value."""

    def __float__(self) -> float:
        return math.nan


def test_subclassed_numbers_are_stored_as_the_values_validation_read() -> None:
    """Arrow reads a Decimal through its str(), which a subclass may format its own way:
    subclasses are converted by value, as validation reads them (0.004 stays 0.004, not
    0.00; 3 stays 3, not 7); a float subclass is stored as its own value, not as what its
    ``float()`` answers (which validation never saw)."""
    log = _new_log()
    with log.transaction() as tx:
        tx.append(_finished(usage=Usage(cost_usd=_Money("0.004"), latency_ms=_Ms(1.5))))
        tx.append(_finished(usage=Usage(cost_usd=_Shown(3))))  # type: ignore[arg-type]
    con = pdm.connect(log)
    got = con.execute("select usage.cost_usd, usage.latency_ms from events order by lsn"
                      ).fetchall()
    con.close()
    assert got == [(Decimal("0.004"), 1.5), (Decimal(3), None)]


_NO_ZONES_CHILD = """
import sys
from datetime import UTC, datetime
sys.modules["tzdata"] = None  # no time-zone package either
import poimen_data as pdm
from poimen_data import events as E
from poimen_data.model import _events
log = pdm.open_log("memory://no-zones")
with log.transaction() as tx:
    tx.append(E.RunStarted("acme", "r", "wf", ts=datetime(2026, 1, 1, tzinfo=UTC)))
print(_events._ZONE_UTC is UTC, log.head)
"""


def test_the_package_imports_and_commits_without_a_time_zone_database(tmp_path: Any) -> None:
    """Validation knows Arrow's ``ZoneInfo("UTC")`` by identity; where there is no
    time-zone database (a slim container) that zone cannot exist, and the package still
    imports and commits."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _NO_ZONES_CHILD], capture_output=True,
                         env={**os.environ, "PYTHONTZPATH": str(tmp_path)}, timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert res.stdout.decode().split() == ["True", "1"]


def test_a_score_past_2_53_that_a_double_holds_commits() -> None:
    """An int score past 2**53 that a double holds exactly (2**60) passes validation; Arrow
    refuses to convert such an int, which failed the commit with a raw ArrowInvalid."""
    log = _new_log()
    with log.transaction() as tx:
        tx.append(_verdict(score=2**60))
        tx.append(_verdict(score=0.25))
    con = pdm.connect(log)
    assert con.execute("select score from events order by lsn").fetchall() \
        == [(float(2**60),), (0.25,)]
    con.close()


def test_amounts_of_any_scale_are_stored_exactly() -> None:
    """Validation accepts an amount with any number of trailing zeros; Arrow, handed such a
    Decimal, stores 0 past a scale of 127 (and crashes the process further on), so every
    amount not already of 9 decimals is quantized before it gets there."""
    wide = Decimal("7.25" + "0" * 128)
    log = _new_log()
    with log.transaction() as tx:
        tx.append(_finished(usage=Usage(cost_usd=wide)))
    with log.recorder(max_delay_ms=0) as rec:
        rec.record([_finished(usage=Usage(cost_usd=COST_MAX + Decimal("0E-200")))]
                   ).result(timeout=120)
    con = pdm.connect(log)
    assert con.execute("select usage.cost_usd from events order by lsn").fetchall() \
        == [(Decimal("7.25"),), (COST_MAX,)]
    con.close()


_ZERO_OF_HUGE_SCALE_CHILD = """
from decimal import Decimal
import poimen_data as pdm
from poimen_data.events import AttemptFinished, Usage
log = pdm.open_log("memory://huge-scale")
with log.transaction() as tx:
    tx.append(AttemptFinished("acme", "r", 0, "s", 1, "failed",
                              usage=Usage(cost_usd=Decimal("0E-5000000"))))
print(log.read_events().column("usage").to_pylist()[0]["cost_usd"])
"""


def test_a_zero_of_huge_scale_commits_in_a_process_that_survives() -> None:
    """``Decimal('0E-5000000')`` is a valid zero; converted by Arrow it crashed the process
    (a child here, so a crash fails this test instead of the run)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _ZERO_OF_HUGE_SCALE_CHILD],
                         capture_output=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr.decode()[-2000:])
    assert res.stdout.decode().strip() == "0E-9"


class _Liar:
    """Not a Usage, but equal to anything, and hashed as ``like``."""

    def __init__(self, like: object) -> None:
        self._hash = hash(like)

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return self._hash


def test_a_checked_value_is_reused_only_for_the_same_types_all_through() -> None:
    """What validation caches is compared by value; a bool equals 1 and 5.0 equals 5, and
    a liar equals anything: each of these, after an equal value was checked, is checked
    itself (it passed and failed the commit with a raw Arrow error, or stored a ref to a
    body that does not exist)."""
    ok = Usage(input_tokens=1)
    for bad, field in ((Usage(input_tokens=True), "usage.input_tokens"),  # type: ignore[arg-type]
                       (Usage(input_tokens=1.0), "usage.input_tokens"),  # type: ignore[arg-type]
                       (_Liar(ok), "usage")):
        assert f"event 1 (attempt_finished): field {field!r}" in _refused_whole(
            [_finished(usage=ok), _finished(usage=bad)])  # type: ignore[arg-type]
    ref = BlobRef(T, "ab" * 32, 1)
    assert "event 1 (attempt_dispatched): field 'prompt' size must be an int" in \
        _refused_whole([AttemptDispatched(T, "r", 0, "s", 0, 1, prompt=ref),
                        AttemptDispatched(T, "r", 0, "s", 1, 1,
                                          prompt=BlobRef(T, "ab" * 32, True))])


_ABC = BlobRef(T, hashlib.sha256(b"abc").hexdigest(), 3)  # the ref tx.put_blob(T, b"abc") gives


class _SlyLike(BlobRef):
    """A ref to a body nobody put, equal to anything, hashed as ``_ABC``."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash(_ABC)


def test_every_ref_is_checked_for_its_body_whatever_it_equals() -> None:
    """A transaction checks at commit that every ref points at a body of its size: one
    put in it, or one committed. A ref subclass that equals a ref put in the transaction
    is checked all the same (a set of refs dropped it as a duplicate), and so is a ref
    whose size is not its body's, when that body is put in the same transaction."""
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "before", "wf"))
    before = _files(log)
    with pytest.raises(ValidationError, match="no committed body"):
        with log.transaction() as tx:
            good = tx.put_blob(T, b"abc")
            tx.append(AttemptDispatched(T, "r", 0, "s", 0, 1, prompt=good))
            tx.append(AttemptDispatched(T, "r", 0, "s", 1, 1,
                                        prompt=_SlyLike(T, "ee" * 32, 3)))
    with pytest.raises(ValidationError, match="size 999 does not match the body"):
        with log.transaction() as tx:
            ref = tx.put_blob(T, b"xyz")
            tx.append(AttemptDispatched(T, "r", 0, "s", 0, 1,
                                        prompt=BlobRef(T, ref.sha256, 999)))
    assert _files(log) == before and log.head == 1
    with log.transaction() as tx:  # a body committed: put again, it is reused, not staged
        kept = tx.put_blob(T, b"kept")
    before = _files(log)
    with pytest.raises(ValidationError, match="size 999 does not match the body"):
        with log.transaction() as tx:
            assert tx.put_blob(T, b"kept") == kept
            tx.append(AttemptDispatched(T, "r", 0, "s", 0, 1,
                                        prompt=BlobRef(T, kept.sha256, 999)))
    assert _files(log) == before


class _NegD(Decimal):
    def __lt__(self, other: object) -> bool:
        return False


class _NegF(float):
    def __lt__(self, other: object) -> bool:
        return False


def test_a_negative_number_is_refused_whatever_it_says_of_itself() -> None:
    """Limits are checked on the value stored, not through a subclass's comparisons."""
    assert "usage.cost_usd' must be >= 0" in _refused_whole(
        [_finished(usage=Usage(cost_usd=_NegD("-5")))])
    assert "usage.latency_ms' must be >= 0" in _refused_whole(
        [_finished(usage=Usage(latency_ms=_NegF(-5.0)))])


class _NanInt(int):
    """An int whose float() answers NaN."""

    def __float__(self) -> float:
        return math.nan


class _LyingFloat(float):
    def __float__(self) -> float:
        return math.inf


def test_numbers_are_stored_as_the_values_validation_read() -> None:
    """An int or float subclass is checked and stored by its own value; what its
    ``float()`` answers is never asked, on the event path and in a grader's verdict
    (which stored a lying float's answer, inf)."""
    from poimen_data.jobs._grade import Verdict
    from poimen_data.jobs._grade_exec import safe_verdict

    log = _new_log()
    with log.transaction() as tx:
        tx.append(_verdict(score=_NanInt(5)))
        tx.append(_finished(usage=Usage(latency_ms=_NanInt(7))))
    with log.recorder(max_delay_ms=0) as rec:
        rec.record([_verdict(score=_LyingFloat(-1.0))]).result(timeout=120)
    con = pdm.connect(log)
    assert con.execute("select score, usage.latency_ms from events order by lsn").fetchall() \
        == [(5.0, None), (None, 7.0), (-1.0, None)]
    con.close()
    assert safe_verdict(Verdict(True, score=_NanInt(5)))[:2] == (True, 5.0)
    assert safe_verdict(Verdict(True, score=_LyingFloat(-1.0)))[:2] == (True, -1.0)


def test_a_bulk_tables_refs_point_at_bodies_of_their_size() -> None:
    """A table's refs are checked at commit like event objects': a body put in the same
    transaction must have the ref's size, and a body nobody put is refused."""
    log = _new_log()
    with log.transaction() as tx:
        tx.append(RunStarted(T, "before", "wf"))
    before = _files(log)

    def dispatched(ref: BlobRef) -> pa.Table:
        return pa.Table.from_pylist([{
            "ts": datetime(2026, 1, 1, tzinfo=UTC), "kind": "attempt_dispatched",
            "tenant": T, "run_id": "r", "branch_id": 0, "step_id": "s", "step_index": 0,
            "attempt_no": 1, "prompt": {"tenant": ref.tenant, "sha256": ref.sha256,
                                        "size": ref.size}}], schema=EVENT_SCHEMA)

    with pytest.raises(ValidationError, match="size 999 does not match the body"):
        with log.transaction() as tx:
            ref = tx.put_blob(T, b"xyz")
            tx.extend(dispatched(BlobRef(T, ref.sha256, 999)))
    with pytest.raises(ValidationError, match="no committed body"):
        with log.transaction() as tx:
            tx.extend(dispatched(BlobRef(T, "ee" * 32, 3)))
    assert _files(log) == before and log.head == 1
    with log.transaction() as tx:
        ref = tx.put_blob(T, b"xyz")
        tx.extend(dispatched(ref))
    assert log.head == 2
