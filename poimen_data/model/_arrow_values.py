"""Bulk checks of the values storage holds (README "Value limits"), column-wise: ``ts``
within the years 1 .. 9999 UTC, finite doubles, UTF-8 text. Numpy over Arrow's buffers,
so a clean table costs no kernel call; ``fail(mask, field, message)`` names the row."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.model._events import EVENT_SCHEMA
from poimen_data.model._limits import TS_MAX_US, TS_MIN_US, TS_RANGE


def check_values(col: Callable[[str], pa.ChunkedArray], fail: Callable[..., None]) -> None:
    """Values readers hold: ``ts`` within the years 1 .. 9999 UTC (DuckDB reads the int64
    extremes as infinity, Python not at all), ``score`` a finite double. Numpy over the
    buffers: no kernel call unless a check fails."""
    ts = col("ts").chunk(0)  # no nulls once conformed
    us = np.frombuffer(ts.buffers()[1], np.int64, count=len(ts), offset=ts.offset * 8)
    if us.min() < TS_MIN_US or us.max() > TS_MAX_US:
        fail(pa.array((us < TS_MIN_US) | (us > TS_MAX_US)), "ts", f"must be {TS_RANGE}")
    check_floats(col("score").chunk(0), "score", fail)


def check_utf8(t: pa.Table, fail: Callable[..., None]) -> None:
    """Text is valid UTF-8. Arrow's constructors and casts check it; a table read from
    an IPC file or built from raw buffers may not have been. Text that is all ASCII is
    valid (one pass over a small table's bytes, numpy over a big column's); only a column
    that is not gets Arrow's full validation (~10x dearer). Runs before any check reads
    strings into Python (which would raise UnicodeDecodeError)."""
    cols = [(nm, c, _parts(c, where)) for nm, where in _TEXT_COLUMNS
            if (c := t.column(nm).chunk(0)).null_count < len(c)]
    small = [b for _, _, parts in cols for b in parts if len(b) < 1 << 16]
    if b"".join(small).isascii() and all(_ascii(b) for _, _, parts in cols for b in parts
                                         if len(b) >= 1 << 16):
        return  # the usual case
    for nm, c, parts in cols:
        if all(_ascii(b) for b in parts):
            continue
        try:
            c.validate(full=True)
        except pa.ArrowInvalid:
            mask = pa.nulls(len(c), pa.bool_())  # the column is named, not the row
            if pa.types.is_string(c.type) and nm != "kind":  # (fail reads the row's kind)
                mask = pa.array([_not_utf8(b) for b in c.cast(pa.binary()).to_pylist()])
            fail(mask, nm, "must be valid UTF-8 text")


def _has_text(typ: pa.DataType) -> bool:
    return pa.types.is_string(typ) or any(_has_text(typ.field(i).type)
                                          for i in range(typ.num_fields))


def _string_data(typ: pa.DataType, at: int = 0) -> tuple[list[int], int]:
    """Where a type's string data buffers are in ``Array.buffers()`` (the tree's buffers,
    depth first), and how many buffers the type has."""
    if pa.types.is_string(typ):
        return [at + 2], 3
    found, n = [], 1 if pa.types.is_struct(typ) else 2  # validity (+ offsets of a list)
    for i in range(typ.num_fields):
        f, k = _string_data(typ.field(i).type, at + n)
        found += f
        n += k
    return found, n


_TEXT_COLUMNS = tuple((f.name, _string_data(f.type)[0]) for f in EVENT_SCHEMA
                      if _has_text(f.type))
_TIGHT = 1024  # bytes of text per row below which a column's whole buffers are read


def _parts(c: pa.Array, where: list[int]) -> list[memoryview]:
    """The bytes of a column's text: its whole string buffers when it is not a slice of
    something much bigger (one call), else each string array cut to the column's rows."""
    if c.offset == 0:
        tree = c.buffers()
        bufs = [b for i in where if (b := tree[i]) is not None]
        if sum(b.size for b in bufs) <= _TIGHT * len(c):
            return [memoryview(b) for b in bufs]
    return [_text_bytes(a) for a in _leaves(c)]


def _leaves(c: pa.Array) -> Iterator[pa.Array]:
    """The string arrays inside a column, each cut to the rows the column holds (a
    slice of a big table must not cost the big table)."""
    typ = c.type
    if pa.types.is_string(typ):
        yield c
    elif pa.types.is_struct(typ):  # field(i) is cut to the struct's rows, cheaply
        for i in range(typ.num_fields):
            yield from _leaves(c.field(i))
    elif pa.types.is_map(typ):  # .keys/.items ignore the slice: cut them by the offsets
        lo, hi = _span(c)
        yield from _leaves(c.keys.slice(lo, hi - lo))
        yield from _leaves(c.items.slice(lo, hi - lo))
    elif pa.types.is_list(typ):  # .values ignores the slice too
        lo, hi = _span(c)
        yield from _leaves(c.values.slice(lo, hi - lo))


def _span(c: pa.Array) -> tuple[int, int]:
    """The first and past-the-end child positions of a list-like or string array."""
    if len(c) == 0:
        return 0, 0
    o = np.frombuffer(c.buffers()[1], np.int32, count=len(c) + 1, offset=c.offset * 4)
    return int(o[0]), int(o[-1])


def _text_bytes(a: pa.Array) -> memoryview:
    data = a.buffers()[2]
    if data is None:
        return memoryview(b"")
    lo, hi = _span(a)
    return memoryview(data)[lo:hi]


_HIGH_BITS = np.uint64(0x8080808080808080)


def _ascii(b: memoryview) -> bool:
    if len(b) < 1 << 16:
        return bytes(b).isascii()
    x = np.frombuffer(b, np.uint8)
    k = len(x) // 8 * 8
    return not np.bitwise_or.reduce(x[:k].view(np.uint64)) & _HIGH_BITS \
        and not np.any(x[k:] & 0x80)


def _not_utf8(b: bytes | None) -> bool:
    if b is None:
        return False
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def check_floats(c: pa.Array, fld: str, fail: Callable[..., None],
                 minimum: int | None = None) -> None:
    """A float64 column holds finite values (at least ``minimum``). Screened over the raw
    values, null slots included (they may hold anything): only when the screen fails are
    the valid values looked at, with kernels that name the row."""
    if c.null_count == len(c):
        return
    x = np.frombuffer(c.buffers()[1], np.float64, count=len(c), offset=c.offset * 8)
    with np.errstate(invalid="ignore"):
        if np.isfinite(x).all() and (minimum is None or x.min() >= minimum):
            return
    fail(pc.fill_null(pc.invert(pc.is_finite(c)), False), fld, "must be a finite double",
         certain=False)
    if minimum is not None:
        fail(pc.fill_null(pc.less(c, minimum), False), fld, f"must be >= {minimum}",
             certain=False)
