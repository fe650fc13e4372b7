"""The bulk path (``validate_table``) and the event path (``validate_event``) accept and
reject the same events: one fault planted in a valid mixed table is found by both, and the
bulk error names the row and the field.

``validate_table`` checks few distinct values with Python's ``re`` and many with Arrow's
regex kernel, and counts columns per kind with numpy: both branches are exercised.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poimen_data import events as ev
from poimen_data import synth
from poimen_data.model._arrow import _PY_REGEX_LIMIT

SHA = "ab" * 32


def _base_rows() -> list[dict[str, Any]]:
    evs = [e for u in synth.units(40, seed=5, tenants=2, recovery_every=10) for e in u.events]
    tenant, run = evs[0].tenant, evs[0].run_id
    evs += [
        ev.VerdictRecorded(tenant, run, 0, "judge@1", 3, True, 0.5, "fine", ts=evs[-1].ts),
        ev.BlobReduced(tenant, ev.BlobRef(tenant, SHA, 10),
                       ev.BlobRef(tenant, "cd" * 32, 4), ts=evs[-1].ts),
    ]
    return ev.events_to_table(evs, [e.ts for e in evs]).to_pylist()


BASE = _base_rows()
Mutation = Callable[[dict[str, Any]], tuple[str, Any] | None]

# Each mutation names the field it breaks and its bad value, or None when it does not
# apply to the row's kind.
MUTATIONS: dict[str, Mutation] = {
    "tenant charset": lambda r: ("tenant", "acme corp"),
    "tenant non-ascii": lambda r: ("tenant", "ácme"),
    "tenant too long": lambda r: ("tenant", "t" * 65),
    "kind unknown": lambda r: ("kind", "run_paused"),
    "run_id empty": lambda r: ("run_id", "") if r["run_id"] is not None else None,
    "run_id too long": lambda r: ("run_id", "r" * 129) if r["run_id"] is not None else None,
    "run_id missing": lambda r: ("run_id", None) if r["run_id"] is not None else None,
    "attempt_no zero": lambda r: ("attempt_no", 0) if r["attempt_no"] is not None else None,
    "step_index negative": lambda r: (("step_index", -1) if r["step_index"] is not None
                                      else None),
    "branch_id negative": lambda r: ("branch_id", -1) if r["branch_id"] is not None else None,
    "step_id empty": lambda r: ("step_id", "") if r["step_id"] is not None else None,
    "step_id missing": lambda r: ("step_id", None) if r["step_id"] is not None else None,
    "state not terminal": lambda r: (("state", "dispatched") if r["kind"] in
                                     ("attempt_finished", "attempt_recovered") else None),
    "outcome unknown": lambda r: ("outcome", "meh") if r["kind"] == "run_finished" else None,
    "verifier malformed": lambda r: (("verifier", "judge") if r["kind"] == "verdict_recorded"
                                     else None),
    "fork branch zero": lambda r: ("branch_id", 0) if r["kind"] == "branch_forked" else None,
    "fork parent not lower": lambda r: (("parent_branch_id", r["branch_id"])
                                       if r["kind"] == "branch_forked" else None),
    "workflow_version missing": lambda r: (("workflow_version", None)
                                           if r["kind"] == "run_started" else None),
    "foreign field": lambda r: (("outcome", "succeeded") if r["kind"] != "run_finished"
                                else ("verifier", "judge@1")),
    "step_id too long": lambda r: (("step_id", "s" * 257) if r["step_id"] is not None
                                   else None),
    "workflow_version empty": lambda r: (("workflow_version", "")
                                         if r["workflow_version"] is not None else None),
    "workflow_version too long": lambda r: (("workflow_version", "w" * 257)
                                            if r["workflow_version"] is not None else None),
    "usage negative tokens": lambda r: _nested(r, "usage", "input_tokens", -1),
    "usage negative cost": lambda r: _nested(r, "usage", "cost_usd", Decimal("-0.5")),
    "context null item": lambda r: _nested(r, "context", "packed", ["kb/1", None]),
    "tools null item": lambda r: _nested(r, "tools", "calls", [None]),
    "labels null value": lambda r: (("labels", [("env", None)]) if r["labels"] is not None
                                    else None),
    "verifier unicode space": lambda r: (("verifier", "judge\u00a0x@1")
                                         if r["kind"] == "verdict_recorded" else None),
    "ref sha null": lambda r: _ref(r, sha256=None),
    "ref sha not hex": lambda r: _ref(r, sha256="XY" * 32),
    "ref other tenant": lambda r: _ref(r, tenant="other-tenant"),
    "ref negative size": lambda r: _ref(r, size=-1),
}


def _nested(row: dict[str, Any], name: str, child: str, value: Any) -> tuple[str, Any] | None:
    """Set one child of a struct column; the fault is reported as ``name.child``."""
    if row[name] is None:
        return None
    return name, {**row[name], child: value}


FIELD_NAMED = {"usage negative tokens": "usage.input_tokens",
               "usage negative cost": "usage.cost_usd", "context null item": "context.packed",
               "tools null item": "tools.calls"}


def _ref(row: dict[str, Any], **change: Any) -> tuple[str, Any] | None:
    for name in ev.REF_COLUMNS:
        if row[name] is not None:
            return name, {**row[name], **change}
    return None


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ev.EVENT_SCHEMA)


def test_base_table_is_valid_on_both_paths() -> None:
    kinds = {r["kind"] for r in BASE}
    assert kinds == set(ev.KINDS)  # every kind is in the table the mutations start from
    assert ev.validate_table(_table(BASE)).num_rows == len(BASE)
    for pad in range(1, 9):
        assert ev.validate_table(_table(BASE[:pad] + BASE).slice(pad)).num_rows == len(BASE)
    for r in BASE:
        ev.validate_event(ev.event_from_row(r))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_planted_fault_is_found_by_both_paths(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(MUTATIONS)), label="mutation")
    rows_ok = [i for i, r in enumerate(BASE) if MUTATIONS[name](r) is not None]
    i = data.draw(st.sampled_from(rows_ok), label="row")
    field, value = MUTATIONS[name](BASE[i])  # type: ignore[misc]
    rows = [dict(r) for r in BASE]
    rows[i][field] = value
    field = FIELD_NAMED.get(name, field)
    layout = data.draw(st.sampled_from(["plain", "sliced", "chunked"]), label="layout")
    if layout == "sliced":  # offsets into the buffers that are not multiples of 8
        pad = data.draw(st.integers(1, 13), label="offset")
        table = _table(rows[:pad] + rows).slice(pad)
    elif layout == "chunked":
        cut = data.draw(st.integers(1, len(rows) - 1), label="cut")
        table = pa.concat_tables([_table(rows[:cut]), _table(rows[cut:])])
    else:
        table = _table(rows)
    with pytest.raises(ev.ValidationError) as bulk:
        ev.validate_table(table)
    assert re.search(rf"row {i}\b.*field '{field}'", str(bulk.value)), str(bulk.value)
    if name == "foreign field":
        return  # an event object has no such field to set: only a table can carry it
    with pytest.raises(ev.ValidationError, match=f"'{field}'"):
        if rows[i]["kind"] not in ev.KINDS:
            raise ev.ValidationError(f"field '{field}' unknown")  # no class to build
        ev.validate_event(ev.event_from_row(rows[i]))


def test_the_first_faulty_row_is_named_whatever_the_hash_seed() -> None:
    rows = [dict(r) for r in BASE]
    rows[3]["tenant"], rows[10]["tenant"] = "bad tenant", "also bad"
    with pytest.raises(ev.ValidationError, match=r"row 3 .*field 'tenant'"):
        ev.validate_table(_table(rows))


def test_lengths_count_characters_not_bytes() -> None:
    rows = [dict(r) for r in BASE]
    i = next(j for j, r in enumerate(rows) if r["step_id"] is not None)
    rows[i]["step_id"] = "é" * 256  # 512 bytes, 256 characters: allowed
    assert ev.validate_table(_table(rows)).num_rows == len(rows)
    ev.validate_event(ev.event_from_row(rows[i]))
    rows[i]["step_id"] = "é" * 257
    with pytest.raises(ev.ValidationError, match=rf"row {i} .*field 'step_id'"):
        ev.validate_table(_table(rows))


def test_many_distinct_values_take_the_arrow_regex_branch() -> None:
    n = _PY_REGEX_LIMIT + 500
    table = pa.table({"kind": ["verifying_entered"] * n, "tenant": ["acme"] * n,
                      "run_id": [f"run-{i}" for i in range(n)]})
    assert ev.validate_table(table).num_rows == n
    bad = table.set_column(2, "run_id", pa.array([f"run-{i}" for i in range(n - 1)]
                                                 + ["bad run"]))
    with pytest.raises(ev.ValidationError, match=rf"row {n - 1} .*field 'run_id'"):
        ev.validate_table(bad)
    tenants = pa.array([f"t{i}" for i in range(n - 1)] + ["t/x"])
    with pytest.raises(ev.ValidationError, match=rf"row {n - 1} .*field 'tenant'"):
        ev.validate_table(table.set_column(1, "tenant", tenants))


def test_schema_metadata_of_the_input_is_not_written() -> None:
    t = _table(BASE).replace_schema_metadata({"pandas": "{}"})
    out = ev.validate_table(t)
    assert out.schema.metadata is None and out.schema.equals(ev.EVENT_SCHEMA)


def _files(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_big_table_is_checked_while_its_segment_is_written(tmp_path) -> None:
    """A table of BACKGROUND_CHECK_ROWS rows or more is checked on a thread during the
    segment write: its fault is raised by the commit, which leaves nothing behind; a good
    one lands with a segment whose streamed sha256 matches the file."""
    from poimen_data import open_log
    from poimen_data.log._txn import BACKGROUND_CHECK_ROWS

    n = BACKGROUND_CHECK_ROWS + 10_000
    good = synth.events_table(n, seed=2)
    attempt_no = good.column("attempt_no").to_pylist()
    row = next(i for i in range(n - 1, 0, -1) if attempt_no[i] is not None)
    attempt_no[row] = 0
    bad = good.set_column(good.schema.get_field_index("attempt_no"), "attempt_no",
                          pa.array(attempt_no, pa.int64()))
    log = open_log(str(tmp_path / "log"))
    before = _files(tmp_path / "log")
    tx = log.transaction()
    tx.extend(bad)  # not raised here: the check is still running
    with pytest.raises(ev.ValidationError, match=rf"row {row} .*field 'attempt_no'"):
        tx.commit()
    assert log.head == 0
    assert _files(tmp_path / "log") == before == {"_poimen.json"}
    with log.transaction() as tx:
        tx.extend(good)
    again = open_log(str(tmp_path / "log"))
    back = again.read_events()  # verifies the segment's size and sha256 against the manifest
    assert back.num_rows == n
    assert back.drop_columns(["lsn", "seq"]).equals(ev.validate_table(good))


# every kind, with its optional value objects set and unset (the base rows, and bare ones)
_T, _R = BASE[0]["tenant"], BASE[0]["run_id"]
KINDS_POOL = [ev.event_from_row(r) for r in BASE] + [
    ev.AttemptDispatched(_T, _R, 0, "s", 0, 1),
    ev.AttemptFinished(_T, _R, 0, "s", 1, "failed", error="boom"),
    ev.RunStarted(_T, _R, "wf", labels=None),
]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(range(len(KINDS_POOL))), st.booleans()),
                min_size=1, max_size=80))
def test_events_to_table_puts_each_event_in_its_own_row(picks: list[tuple[int, bool]]
                                                        ) -> None:
    """Any mix and order of kinds: row i is event i, every field in place. A column only
    some kinds have is built over those kinds' events and scattered into their rows; an
    event without a stamp takes the one given for its row."""
    stamps = [datetime(2030, 1, 1, tzinfo=UTC) + timedelta(seconds=i)
              for i in range(len(picks))]
    evs = [dataclasses.replace(KINDS_POOL[k], ts=None) if unstamped else KINDS_POOL[k]
           for k, unstamped in picks]
    table = ev.events_to_table(evs, stamps)
    assert table.schema == ev.EVENT_SCHEMA
    want = [e if e.ts is not None else dataclasses.replace(e, ts=s)
            for e, s in zip(evs, stamps, strict=True)]
    assert [ev.event_from_row(r) for r in table.to_pylist()] == want


def _probes_of_a_commit(tmp_path: Any, name: str, fill: Callable[[Any, ev.BlobRef], None]
                        ) -> int:
    """Storage probes (``size`` and ``exists``) one commit makes, whose events point at a
    body committed (and promoted) before, added by ``fill(tx, ref)``."""
    from poimen_data.log import open_log

    log = open_log(tmp_path / name)
    with log.transaction() as tx:
        ref = tx.put_blob("acme", b"a committed prompt")
    log.flush()
    before = log.storage.calls["size"] + log.storage.calls["exists"]
    with log.transaction() as tx:
        fill(tx, ref)
    return log.storage.calls["size"] + log.storage.calls["exists"] - before


def _dispatched(run: str, ref: ev.BlobRef) -> ev.AttemptDispatched:
    return ev.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=ref,
                                ts=datetime(2026, 1, 1, tzinfo=UTC))


def test_a_body_many_tables_point_at_is_looked_up_once(tmp_path: Any) -> None:
    """The commit checks each body its events point at once, however many bulk tables
    (or events given one by one) point at it: one lookup in storage, not one per table."""
    def tables(k: int) -> Callable[[Any, ev.BlobRef], None]:
        def fill(tx: Any, ref: ev.BlobRef) -> None:
            tx.append(_dispatched("one-by-one", ref))
            for i in range(k):
                e = _dispatched(f"bulk-{i}", ref)
                tx.extend(ev.events_to_table([e], [e.ts]))
        return fill

    one = _probes_of_a_commit(tmp_path, "one", tables(1))
    assert one >= 1  # the body was looked up
    assert _probes_of_a_commit(tmp_path, "five", tables(5)) == one


def test_one_subclass_ref_many_events_point_at_is_looked_up_once(tmp_path: Any) -> None:
    """A ref of a BlobRef subclass is never compared by its own ``__eq__``, and one such
    object that many events point at is still looked up once at commit."""
    @dataclasses.dataclass(frozen=True)
    class MyRef(ev.BlobRef):
        pass

    def events(k: int) -> Callable[[Any, ev.BlobRef], None]:
        def fill(tx: Any, ref: ev.BlobRef) -> None:
            mine = MyRef(ref.tenant, ref.sha256, ref.size)
            tx.extend([_dispatched(f"r{i}", mine) for i in range(k)])
        return fill

    one = _probes_of_a_commit(tmp_path, "one", events(1))
    assert one >= 1
    assert _probes_of_a_commit(tmp_path, "fifty", events(50)) == one
