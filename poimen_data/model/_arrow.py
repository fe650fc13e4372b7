"""The Arrow side of events: converting event objects to a segment table, and validating
a bulk table of events column-wise with the same rules as ``events.validate_event``."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from datetime import UTC, datetime
from decimal import Decimal
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import CorruptionError, TenantMismatch, ValidationError
from poimen_data.model._arrow_values import check_floats, check_utf8, check_values
from poimen_data.model._events import (
    CONTEXT_TYPE,
    COST_QUANTUM,
    COST_TYPE,
    EVENT_CLASSES,
    EVENT_SCHEMA,
    KIND_COLUMNS,
    KINDS,
    LOG_SCHEMA,
    REF_COLUMNS,
    REF_TYPE,
    RUN_ID_RE,
    RUN_OUTCOMES,
    SHA256_RE,
    STEP_ID_MAX,
    TENANT_RE,
    TERMINAL_ATTEMPT_STATES,
    TOOLS_TYPE,
    USAGE_TYPE,
    VERIFIER_RE,
    BlobRef,
    Event,
)
from poimen_data.model._events import REQUIRED_FIELDS as _REQUIRED
from poimen_data.model._events import bad_field as _bad
from poimen_data.model._limits import COST_MAX, MONEY_CONTEXT, stored_double

TableOrBatch = TypeVar("TableOrBatch", pa.Table, pa.RecordBatch)

# --- conversion ---------------------------------------------------------------------


def _struct(typ: pa.StructType, values: Sequence[Any], n: int) -> pa.Array:
    """A struct column from value objects (or None) without building one dict per row."""
    mask = [v is None for v in values]
    if all(mask):
        return pa.nulls(n, typ)
    if any(mask):
        values = [_ABSENT if v is None else v for v in values]
    children = []
    for f in typ:
        vals = list(map(attrgetter(f.name), values))
        numeric = f.type == COST_TYPE or pa.types.is_floating(f.type)
        children.append(_numbers(f.type, vals) if numeric else pa.array(vals, f.type))
    return pa.StructArray.from_arrays(children, fields=list(typ), mask=pa.array(mask))


_EXACT_NUMBER = {float, int, type(None)}  # what Arrow converts to a double as it is


def _numbers(typ: pa.DataType, vals: Sequence[Any]) -> pa.Array:
    """An amount (``COST_TYPE``) or double column from validated values, stored as the
    values validation read. An amount goes to Arrow only as a Decimal of exactly 9
    decimals; any other (an int, more or fewer decimals, a subclass) is quantized here by
    value, exactly: Arrow reads a Decimal through its str(), which a subclass may format
    its own way, and past a scale of 127 it stores 0, or crashes. Doubles of exact types go
    as they are; the rest (a subclass, an int past 2**53 that a double holds exactly, which
    Arrow refuses) as ``stored_double`` makes them, the values validation read."""
    if typ == COST_TYPE:
        return pa.array([x if type(x) is Decimal and x.as_tuple().exponent == -9
                         else None if x is None
                         else Decimal(x).quantize(COST_QUANTUM, context=MONEY_CONTEXT)
                         for x in vals], typ)
    if set(map(type, vals)) <= _EXACT_NUMBER:
        try:
            return pa.array(vals, typ)
        except pa.ArrowInvalid:
            pass
    return pa.array([None if x is None else stored_double(x) for x in vals], typ)


_STRUCT_COLUMNS = {"prompt": REF_TYPE, "output": REF_TYPE, "original": REF_TYPE,
                   "summary": REF_TYPE, "context": CONTEXT_TYPE, "usage": USAGE_TYPE,
                   "tools": TOOLS_TYPE}


class _Absent:
    """Stands in for a missing value object: every field of it is None (a class attribute
    each, which ``attrgetter`` reads in C: no Python call per row, as ``__getattr__``
    would make)."""


for _typ in _STRUCT_COLUMNS.values():
    for _f in _typ:
        setattr(_Absent, _f.name, None)
_ABSENT = _Absent()


# which of the schema's columns each class has, and one getter per column: a column is
# then one C-level map of its ``attrgetter`` over the events that have it (reading each
# event as a tuple of all its fields and transposing costs 3x more, and makes garbage)
_FIELDS = {c: frozenset(f.name for f in fields(c)) | {"kind"}  # kind: a class attribute
           for c in EVENT_CLASSES.values()}
_GET = {f.name: attrgetter(f.name) for f in EVENT_SCHEMA}
_TS = attrgetter("ts")


def _column(name: str, typ: pa.DataType, values: Sequence[Any], n: int) -> pa.Array:
    struct = _STRUCT_COLUMNS.get(name)
    if struct is not None:
        return _struct(struct, values, n)
    if name == "labels":
        return pa.array([None if v is None else sorted(v.items()) for v in values], typ)
    if pa.types.is_floating(typ):  # score
        return _numbers(typ, values)
    return pa.array(values, typ)


def events_to_table(events: Sequence[Event], stamps: Sequence[datetime]) -> pa.Table:
    """Turn validated events (with their append-time stamps) into one EVENT_SCHEMA table.

    Each column is built in append order, once: a column every class of these events has
    is one ``map`` of its getter over all of them; one that only some classes have is
    mapped over those classes' events and scattered into place (a numpy object array:
    every other row null); one none of them has is all null (free). No table is built per
    class and put back in order (a ``take`` of every column: for a recorder's window of
    64 records, half the time).
    """
    n = len(events)
    where: dict[type[Event], list[int]] = {}
    for i, e in enumerate(events):
        where.setdefault(type(e), []).append(i)
    classes = list(where)
    groups = {c: [events[i] for i in idx] for c, idx in where.items()} \
        if len(classes) > 1 else {}
    rows = {c: np.array(idx, dtype=np.intp) for c, idx in where.items()} \
        if len(classes) > 1 else {}
    arrays = []
    for f in EVENT_SCHEMA:
        name = f.name
        if name == "ts":
            values: Sequence[Any] = [s if t is None else t
                                     for t, s in zip(map(_TS, events), stamps, strict=True)]
            arrays.append(pa.array(values, f.type))
            continue
        having = [c for c in classes if name in _FIELDS[c]]
        if not having:
            arrays.append(pa.nulls(n, f.type))
            continue
        get = _GET[name]
        if len(having) == len(classes):
            values = list(map(get, events))
        else:
            scattered = np.empty(n, dtype=object)  # None everywhere
            for c in having:
                part = groups[c]
                # fromiter: each value one object, never unpacked as numpy would a tuple
                scattered[rows[c]] = np.fromiter(map(get, part), dtype=object,
                                                  count=len(part))
            values = scattered.tolist()
        arrays.append(_column(name, f.type, values, n))
    return pa.Table.from_arrays(arrays, schema=EVENT_SCHEMA)


# --- bulk validation -----------------------------------------------------------------


def validate_table(table: pa.Table, where: str = "table", now: datetime | None = None) -> pa.Table:
    """Validate a bulk table of events and return it conformed to ``EVENT_SCHEMA``.

    Missing optional columns are filled with nulls and a missing or null ``ts`` is stamped
    with ``now``. The checks are the ones ``validate_event`` makes, vectorized; the first
    fault names its row and field.
    """
    t = conform_table(table, where, now)
    check_conformed(t, where)
    return t


def conform_table(table: pa.Table, where: str = "table", now: datetime | None = None) -> pa.Table:
    """The first half of ``validate_table``: the table in ``EVENT_SCHEMA`` as one chunk,
    ``ts`` stamped, required columns without nulls; ``check_conformed`` does the rest."""
    if table.schema.equals(EVENT_SCHEMA):  # the usual bulk writer's table: nothing to conform
        t = table.replace_schema_metadata(None) if table.schema.metadata else table
        ts = t.column("ts")
        if ts.null_count:
            t = t.set_column(0, EVENT_SCHEMA.field("ts"),
                             pc.fill_null(ts, pa.scalar(now or datetime.now(UTC), ts.type)))
        for i, f in enumerate(EVENT_SCHEMA):
            if not f.nullable and f.name != "ts" and t.column(i).null_count:
                row = _first_row(pc.is_null(t.column(i)))
                raise ValidationError(f"{where} row {row}: field {f.name!r} is required")
    else:
        t = _conform(table, where, now)
    return t.combine_chunks()


def _conform(table: pa.Table, where: str, now: datetime | None) -> pa.Table:
    """A table with other column order, types or missing optional columns, cast to
    ``EVENT_SCHEMA`` column by column (a cast that fails names its column)."""
    extra = set(table.column_names) - set(EVENT_SCHEMA.names)
    if extra:
        raise ValidationError(f"{where}: unknown columns {sorted(extra)}")
    n = table.num_rows
    now = now or datetime.now(UTC)
    cols = []
    for f in EVENT_SCHEMA:
        if f.name in table.column_names:
            col = table.column(f.name)
            if f.name == "ts" and pa.types.is_timestamp(col.type) and col.type.tz is None:
                raise ValidationError(f"{where}: column 'ts' has type {col.type}, naive: "
                                      "timestamps must be timezone-aware (e.g. tz='UTC')")
            if col.type != f.type:
                problem = _cast_problem(col.type, f.type)
                if problem:
                    raise ValidationError(f"{where}: column {f.name!r} has type {col.type}, "
                                          f"expected {f.type}: {problem}")
                try:
                    col = col.cast(f.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                    raise ValidationError(
                        f"{where}: column {f.name!r} has type {col.type}, "
                        f"expected {f.type}: {exc}"
                    ) from None
        else:
            col = pa.nulls(n, f.type)
        if f.name == "ts":
            col = pc.fill_null(col, pa.scalar(now, f.type))
        elif not f.nullable and col.null_count:
            i = _first_row(pc.is_null(col))
            raise ValidationError(f"{where} row {i}: field {f.name!r} is required")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=EVENT_SCHEMA.remove_metadata()).cast(EVENT_SCHEMA)


def _family(t: pa.DataType) -> str:
    """The kind of Python value the event path takes for a field of Arrow type ``t``."""
    for name, test in (("bool", pa.types.is_boolean), ("int", pa.types.is_integer),
                       ("float", pa.types.is_floating), ("decimal", pa.types.is_decimal),
                       ("timestamp", pa.types.is_timestamp)):
        if test(t):
            return name
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "str"
    return str(t)


#: the families a column may be cast from, by the family of its field: numbers between
#: numbers where Arrow's safe cast refuses a loss (an int too big for a double, a decimal
#: with a fraction or out of an int64's range, more decimal places than money keeps), and
#: a decimal where a double is (DuckDB types a literal 0.5 as DECIMAL(2,1), sum() of ints
#: as HUGEINT, handed over as decimal128(38, 0)); never a double into money
_CASTS_FROM = {"bool": {"bool"}, "int": {"int", "decimal"},
               "float": {"int", "float", "decimal"}, "decimal": {"int", "decimal"},
               "str": {"str"}, "timestamp": {"timestamp"}}


def _cast_problem(src: pa.DataType, dst: pa.DataType) -> str | None:
    """Why a column of type ``src`` may not be cast to its field's type ``dst`` (None when
    it may, or when Arrow's cast is left to refuse it): only values the event path takes
    for the field, in another width or layout. A cast across kinds would convert without
    a check the event path makes: a double rounded into money, an int read as a bool or
    as microseconds, a number turned into text. Nested types are judged child by child."""
    if pa.types.is_dictionary(src):
        src = src.value_type
    if src == dst or pa.types.is_null(src):
        return None
    if pa.types.is_struct(dst):
        if not pa.types.is_struct(src):
            return None
        for f in src:
            i = dst.get_field_index(f.name)
            problem = None if i < 0 else _cast_problem(f.type, dst.field(i).type)
            if problem:
                return f"field {f.name!r}: {problem}"
        return None
    if pa.types.is_map(dst):
        if not pa.types.is_map(src):
            return None
        return _cast_problem(src.key_type, dst.key_type) \
            or _cast_problem(src.item_type, dst.item_type)
    if pa.types.is_list(dst) or pa.types.is_large_list(dst):
        if not (pa.types.is_list(src) or pa.types.is_large_list(src)
                or pa.types.is_fixed_size_list(src) or pa.types.is_list_view(src)
                or pa.types.is_large_list_view(src)):
            return None
        return _cast_problem(src.value_type, dst.value_type)
    allowed = _CASTS_FROM.get(_family(dst))
    if allowed is None or _family(src) in allowed:
        return None
    return (f"{src} values are not {dst} values (a cast would convert them unchecked; "
            "the event path refuses them too)")


def _first_row(mask: pa.ChunkedArray | pa.Array) -> int | None:
    mask = pc.fill_null(mask, True)
    if not pc.any(mask).as_py():
        return None
    return int(pc.index(mask, True).as_py())


def _fail_where(t: pa.Table, where: str, mask: Any, fld: str, msg: str, *, base: int = 0,
                certain: bool = True, error: type[ValidationError] = ValidationError) -> None:
    """Raise naming the first row ``mask`` selects. ``certain``: a check already found a
    fault, so raise (without a row) even if the mask selects none: never accept."""
    i = _first_row(mask)
    if i is not None:
        kind = t.column("kind")[i].as_py()
        raise _bad(f"{where} row {base + i} ({kind})", fld, msg, error)
    if certain:
        raise _bad(where, fld, msg, error)


_REQUIRED_BY: dict[str, frozenset[str]] = {
    name: frozenset(k for k, req in _REQUIRED.items() if name in req) for name in EVENT_SCHEMA.names
}
_MINIMUM = {"branch_id": 0, "step_index": 0, "attempt_no": 1, "parent_branch_id": 0,
            "fork_step_index": 0, "snapshot_lsn": 1}


_PY_REGEX_LIMIT = 4096  # up to this many distinct values, Python's re checks them


# Patterns of ASCII classes only: Arrow's RE2 and Python's re agree on them (not on \s).
_RE2_AGREES = (TENANT_RE, RUN_ID_RE, SHA256_RE)


def _distinct(col: pa.Array) -> list[Any]:
    """The distinct non-null values of a column. A small table is read in one go (a kernel
    call costs more than its 100 rows); a big one is reduced by ``unique`` first."""
    if len(col) <= _PY_REGEX_LIMIT:  # first-occurrence order, like unique: the row named
        return [v for v in dict.fromkeys(col.to_pylist()) if v is not None]  # is stable
    return pc.unique(col.drop_null()).to_pylist()


def _first_bad(col: pa.Array, pattern: re.Pattern[str]) -> str | None:
    """A non-null value that does not match (None when all do), judged by Python's ``re``
    as ``validate_event`` does, on the distinct values only (a log repeats its tenants,
    run ids and bodies). Many distinct values are first screened by Arrow's regex kernel,
    where it agrees with ``re``; compiling a pattern there costs more than a small table."""
    if len(col) > _PY_REGEX_LIMIT:
        values = pc.unique(col.drop_null())
        if len(values) > _PY_REGEX_LIMIT and pattern in _RE2_AGREES:
            ok = pc.match_substring_regex(values, f"^{pattern.pattern}$")
            if pc.all(ok).as_py() in (True, None):
                return None
            values = pc.filter(values, pc.invert(ok))
        distinct = values.to_pylist()
    else:
        distinct = _distinct(col)
    match = pattern.fullmatch
    return next((v for v in distinct if not match(v)), None)


def _fits(v: str, *, longest: int) -> bool:
    return 0 < len(v) <= longest


def _first_outside(col: pa.Array, ok: Callable[[Any], bool]) -> Any:
    """A distinct non-null value for which ``ok`` is false (None when there is none)."""
    return next((v for v in _distinct(col) if not ok(v)), None)


def _bad_item_row(lists: pa.Array) -> int | None:
    """The first row of a list column holding a null item (``list_flatten`` skips null
    rows; the row is then found row by row, on this fault path only)."""
    if not pc.list_flatten(lists).null_count:
        return None
    return next(i for i, v in enumerate(lists.to_pylist()) if v is not None and None in v)


class _Kinds:
    """Which rows hold which kind, as one bitmap per kind present (bit i = row i, the
    layout of Arrow's validity bitmaps), so "a row of these kinds with this column null"
    is an AND of bitmaps and an ``any``, whatever the number of rows."""

    def __init__(self, kind: pa.Array) -> None:
        enc = pc.dictionary_encode(kind)
        self.present: list[str] = enc.dictionary.to_pylist()
        self.n = len(kind)
        codes = enc.indices.to_numpy()
        self._bits = {k: np.packbits(codes == j, bitorder="little")
                      for j, k in enumerate(self.present)}

    def rows_of(self, kinds: tuple[str, ...]) -> np.ndarray:
        """The bitmap of rows whose kind is in ``kinds`` (all present)."""
        out = self._bits.get(kinds)
        if out is None:
            out = np.bitwise_or.reduce([self._bits[k] for k in kinds])
            self._bits[kinds] = out
        return out

    def bits(self, mask: pa.Array) -> np.ndarray:
        """The bitmap of rows where a boolean array is true (null counts as false)."""
        if mask.null_count:
            mask = pc.fill_null(mask, False)
        return _bitmap(mask.buffers()[1], mask.offset, self.n)

    def any(self, kinds: Iterable[str], mask: pa.Array) -> bool:
        """Whether a row of one of ``kinds`` has ``mask`` true."""
        have = tuple(k for k in kinds if k in self._bits)
        return bool(have) and bool(np.any(self.rows_of(have) & self.bits(mask)))


def _validity(c: pa.Array, n: int) -> np.ndarray:
    """A column's validity bitmap: the first of its buffers (a nested column lists its
    children's after it; still cheaper than a kernel call)."""
    return _bitmap(c.buffers()[0], c.offset, n)


def _bitmap(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """Bits ``offset .. offset + n`` of an Arrow bitmap as packed bytes starting at bit 0
    (zero-copy when aligned; bits past ``n`` in the last byte are left as they are)."""
    if offset % 8 == 0:
        return np.frombuffer(buf, np.uint8, count=(n + 7) // 8, offset=offset // 8)
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), count=offset + n, bitorder="little")
    return np.packbits(bits[offset:], bitorder="little")


_FIELD_COLUMNS = [nm for nm in EVENT_SCHEMA.names if nm not in ("ts", "kind", "tenant")]
_NOT_FIELD_OF: dict[str, frozenset[str]] = {
    nm: frozenset(k for k in KINDS if nm not in KIND_COLUMNS[k]) for nm in _FIELD_COLUMNS
}


@functools.lru_cache(maxsize=256)
def _field_plan(present: frozenset[str]) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """For the kinds present, each column with the kinds that require it and the kinds
    it is not a field of (a table repeats the same few kind mixes)."""
    return [(nm, tuple(sorted(_REQUIRED_BY[nm] & present)),
             tuple(sorted(_NOT_FIELD_OF[nm] & present))) for nm in _FIELD_COLUMNS]


def check_conformed(t: pa.Table, where: str, base: int = 0) -> None:
    """The checks of ``validate_event``, a few vectorized passes per column over a table
    of one chunk; a row is looked for (``_fail_where``) only once a check failed."""
    n = t.num_rows
    if n == 0:
        return
    if any(c.num_chunks != 1 for c in t.columns):  # strings over 2 GiB stay in pieces
        for b in t.to_batches():
            check_conformed(pa.Table.from_batches([b]), where, base)
            base += b.num_rows
        return

    def fail(mask: Any, fld: str, msg: str, certain: bool = True,
             error: type[ValidationError] = ValidationError) -> None:
        _fail_where(t, where, mask, fld, msg, base=base, certain=certain, error=error)

    check_utf8(t, fail)  # first: the checks below read strings into Python
    col = t.column
    kind = col("kind").chunk(0)
    kinds = _Kinds(kind)
    present = set(kinds.present)
    if not present <= set(KINDS):
        fail(pc.invert(pc.is_in(kind, pa.array(KINDS))), "kind", f"must be one of {KINDS}")
    tenant = col("tenant").chunk(0)
    for name, pattern in (("tenant", TENANT_RE), ("run_id", RUN_ID_RE)):
        values = col(name).chunk(0)
        bad = _first_bad(values, pattern)
        if bad is not None:
            fail(pc.fill_null(pc.equal(values, bad), False), name,
                 f"must match {pattern.pattern}, got {bad!r}")
    # Required and foreign columns: every (kind rows, validity) pair ANDed in one numpy
    # operation over stacked bitmaps; the column at fault is looked for only on a hit.
    pending: list[tuple[str, tuple[str, ...], pa.Array, bool]] = []
    lhs: list[np.ndarray] = []
    rhs: list[np.ndarray] = []
    for nm, required, foreign in _field_plan(frozenset(present)):
        c = col(nm).chunk(0)
        nulls = c.null_count
        if required and nulls:
            pending.append((nm, required, c, True))
            lhs.append(kinds.rows_of(required))
            rhs.append(~_validity(c, n) if nulls < n else np.full((n + 7) // 8, 255, np.uint8))
        if foreign and nulls < n:
            pending.append((nm, foreign, c, False))
            lhs.append(kinds.rows_of(foreign))
            rhs.append(_validity(c, n) if nulls else np.full((n + 7) // 8, 255, np.uint8))
    hits = np.any(np.stack(lhs) & np.stack(rhs), axis=1) if lhs else ()
    for (nm, of, c, is_required), hit in zip(pending, hits, strict=True):
        if not hit:
            continue
        if is_required:
            fail(pc.and_(pc.is_in(kind, pa.array(of)), pc.is_null(c)), nm, "is required")
        first = _first_row(pc.and_(pc.is_in(kind, pa.array(of)), pc.is_valid(c)))
        fail(pc.and_(pc.equal(kind, kind[first]), pc.is_valid(c)), nm,
             f"is not a field of {kind[first].as_py()}")
    _check_minimums(t, fail)
    check_values(col, fail)
    if "branch_forked" in present:  # branch_id first, as validate_event checks it
        pb, b = col("parent_branch_id").chunk(0), col("branch_id").chunk(0)
        if kinds.any(["branch_forked"], pc.less(b, 1)):
            fail(pc.and_(pc.equal(kind, "branch_forked"), pc.fill_null(pc.less(b, 1), False)),
                 "branch_id", "must be >= 1")
        if kinds.any(["branch_forked"], pc.greater_equal(pb, b)):
            fail(pc.and_(pc.equal(kind, "branch_forked"), pc.fill_null(
                pc.greater_equal(pb, b), False)), "parent_branch_id",
                "must be lower than branch_id")
    # State and outcome are foreign to every other kind (checked above), so any value of
    # the column belongs to a kind that needs it to be one of these.
    for name, allowed in (("state", TERMINAL_ATTEMPT_STATES), ("outcome", RUN_OUTCOMES)):
        values = col(name).chunk(0)
        bad = _first_outside(values, allowed.__contains__)
        if bad is not None:
            fail(pc.fill_null(pc.equal(values, bad), False), name,
                 f"must be one of {allowed}, got {bad!r}")
    if "verdict_recorded" in present:
        verifier = col("verifier").chunk(0)
        bad = _first_bad(verifier, VERIFIER_RE)
        if bad is not None:
            fail(pc.fill_null(pc.equal(verifier, bad), False), "verifier",
                 f"must be 'name@version', got {bad!r}")
        # an attempt verdict names both step_id and attempt_no, a run verdict neither
        half = pc.not_equal(pc.is_null(col("step_id").chunk(0)),
                            pc.is_null(col("attempt_no").chunk(0)))
        if kinds.any(["verdict_recorded"], half):
            fail(pc.and_(pc.equal(kind, "verdict_recorded"), half), "attempt_no",
                 "must be given with step_id (an attempt verdict) or neither (a run verdict)")
    for name, longest in (("step_id", STEP_ID_MAX), ("workflow_version", 256)):
        values = col(name).chunk(0)
        if len(values) > _PY_REGEX_LIMIT and values.null_count < len(values):
            size = pc.min_max(pc.binary_length(values))  # bytes >= characters
            if size["min"].as_py() > 0 and size["max"].as_py() <= longest:
                continue
        bad = _first_outside(values, functools.partial(_fits, longest=longest))
        if bad is not None:
            fail(pc.fill_null(pc.equal(values, bad), False), name,
                 f"must be a non-empty str of at most {longest} chars")
    _check_nested(col, fail)
    for name in REF_COLUMNS:
        _check_refs(col(name).chunk(0), tenant, name, fail)


def _check_minimums(t: pa.Table, fail: Callable[..., None]) -> None:
    """Ids and counts at least their minimum: one ``min`` over the columns sharing one."""
    for minimum in sorted(set(_MINIMUM.values())):
        cols = [(nm, t.column(nm).chunk(0)) for nm, m in _MINIMUM.items() if m == minimum]
        cols = [(nm, c) for nm, c in cols if c.null_count < len(c)]
        if not cols or pc.min(pa.concat_arrays([c for _, c in cols])).as_py() >= minimum:
            continue
        for nm, c in cols:
            fail(pc.fill_null(pc.less(c, minimum), False), nm, f"must be >= {minimum}",
                 certain=False)


def _check_nested(col: Callable[[str], pa.ChunkedArray], fail: Callable[..., None]) -> None:
    """Inside the nested columns: counts >= 0, cost >= 0, no null list items or labels."""
    # One kernel call per check over the children concatenated (a small table pays per
    # call, not per row); the child at fault is looked for only when the check fails.
    usage = col("usage").chunk(0)
    if usage.null_count < len(usage):
        kids = usage.flatten()  # children with the struct's nulls merged in
        names = [f.name for f in usage.type][:5]
        tokens, cost = pa.concat_arrays(kids[:4]), kids[4]
        money = pc.min_max(cost)
        if (pc.min(tokens).as_py() or 0) < 0 or (money["min"].as_py() or 0) < 0:
            for f, v in zip(names, kids[:5], strict=True):
                fail(pc.fill_null(pc.less(v, pa.scalar(0, v.type)), False), f"usage.{f}",
                     "must be >= 0", certain=False)
        if (money["max"].as_py() or 0) > COST_MAX:  # only a column built unchecked
            fail(pc.fill_null(pc.greater(cost, pa.scalar(COST_MAX, cost.type)), False),
                 "usage.cost_usd", f"must be at most {COST_MAX} (decimal(18, 9))")
        check_floats(kids[5], "usage.latency_ms", fail, minimum=0)
    lists = []
    for name in ("context", "tools"):
        outer = col(name).chunk(0)
        if outer.null_count < len(outer):
            lists += [(f"{name}.{f.name}", v) for f, v in zip(outer.type, outer.flatten(),
                                                                strict=True)]
    if lists and pc.list_flatten(pa.concat_arrays([v for _, v in lists])).null_count:
        for fld, v in lists:
            row = _bad_item_row(v)
            if row is not None:
                fail(_row_mask(len(v), row), fld, "must be a tuple of str")
    labels = col("labels").chunk(0)
    if labels.null_count < len(labels):
        entries = labels.cast(pa.list_(pa.struct([labels.type.key_field,
                                                  labels.type.item_field])))
        flat = pc.list_flatten(entries)
        values = pc.struct_field(flat, "value")
        if values.null_count:
            row = next(i for i, v in enumerate(labels.to_pylist())
                       if v is not None and any(val is None for _k, val in v))
            fail(_row_mask(len(labels), row), "labels", "must be a mapping of str to str")
        # a key twice in one row: a mapping (the event path's labels) cannot hold it. A
        # small table is read in one go (a group_by costs more than its rows); a big one
        # counts the distinct (row, key) pairs
        if len(labels) <= _PY_REGEX_LIMIT:
            twice = any(v is not None and len({k for k, _v in v}) < len(v)
                        for v in labels.to_pylist())
        else:
            pairs = pa.table({"row": pc.list_parent_indices(entries),
                              "key": pc.struct_field(flat, "key")})
            twice = pairs.group_by(["row", "key"]).aggregate([]).num_rows < pairs.num_rows
        if twice:
            row = next(i for i, v in enumerate(labels.to_pylist())
                       if v is not None and len({k for k, _v in v}) < len(v))
            fail(_row_mask(len(labels), row), "labels",
                 "must be a mapping of str to str (a key is there twice)")


def _row_mask(n: int, row: int) -> pa.Array:
    return pa.array(np.arange(n) == row)


def _check_refs(ref: pa.Array, tenant: pa.Array, name: str, fail: Callable[..., None]) -> None:
    """A ref's children are all there, its sha256 is hex, its tenant the event's, size >= 0."""
    if ref.null_count == len(ref):
        return
    valid = pc.is_valid(ref)
    sha = pc.struct_field(ref, "sha256")
    ok = pc.and_(pc.and_(pc.equal(pc.struct_field(ref, "tenant"), tenant),
                         pc.greater_equal(pc.struct_field(ref, "size"), 0)),
                 pc.is_valid(sha))
    bad = pc.and_(valid, pc.invert(pc.fill_null(ok, False)))
    bad_sha = _first_bad(sha, SHA256_RE)
    if not pc.any(bad).as_py() and bad_sha is None:
        return
    if bad_sha is not None:
        fail(pc.fill_null(pc.equal(sha, bad_sha), False), name,
             "sha256 must be 64 lowercase hex digits")
    fail(pc.and_(valid, pc.is_null(sha)), name, "sha256 must be 64 lowercase hex digits",
         certain=False)
    fail(pc.and_(valid, pc.invert(pc.fill_null(
        pc.equal(pc.struct_field(ref, "tenant"), tenant), False))), name,
        "belongs to another tenant than the event", certain=False, error=TenantMismatch)
    fail(bad, name, "size must be an int >= 0")


def table_refs(t: pa.Table) -> set[BlobRef]:
    """Every distinct ref a validated event table points at."""
    out: set[BlobRef] = set()
    for name in REF_COLUMNS:
        col = t.column(name)
        if col.null_count == len(col):
            continue
        col = col.drop_null()
        flat = pa.table({f: pc.struct_field(col, f) for f in ("tenant", "sha256", "size")})
        uniq = flat.group_by(["tenant", "sha256", "size"]).aggregate([])
        out.update(BlobRef(*row) for row in zip(*(uniq.column(c).to_pylist()
                                                  for c in ("tenant", "sha256", "size")),
                                                strict=True))
    return out


# --- reading segments written under an older schema ------------------------------------


def conform_segment(t: TableOrBatch, name: str) -> TableOrBatch:
    """A segment (a table, or one batch of it) read from storage, as ``LOG_SCHEMA``: a
    column the segment lacks (it was written before the column existed) reads as all
    null; a column it has keeps its values (cast when the writer's type differs, e.g. a
    string type of another width). A segment missing a required column, or holding one
    that cannot be cast, is corrupt.
    """
    if t.schema == LOG_SCHEMA:
        return t
    n, have = t.num_rows, set(t.column_names)
    cols = []
    for f in LOG_SCHEMA:
        if f.name not in have:
            if not f.nullable:
                raise CorruptionError(f"{name}: unexpected schema: no column {f.name!r}")
            cols.append(pa.nulls(n, f.type))
            continue
        col = t.column(f.name)
        if col.type != f.type:
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise CorruptionError(f"{name}: unexpected schema: column {f.name!r}: "
                                      f"{exc}") from None
        cols.append(col)
    try:
        return type(t).from_arrays(cols, schema=LOG_SCHEMA)
    except (pa.ArrowInvalid, ValueError) as exc:
        raise CorruptionError(f"{name}: unexpected schema: {exc}") from None
