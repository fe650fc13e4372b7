"""Bulk checks of the values storage holds (README "Value limits"), column-wise: ``ts``
within the years 1 .. 9999 UTC, finite doubles, UTF-8 text. Numpy over Arrow's buffers,
so a clean table costs no kernel call; ``fail(mask, field, message)`` names the row."""

from __future__ import annotations

from collections.abc import Callable

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
    an IPC file or built from raw buffers may not have been. A column whose string data
    is all ASCII is valid; only the others get Arrow's full validation (~10x dearer)."""
    cols = []
    for nm, where in _TEXT_BUFFERS:
        c = t.column(nm).chunk(0)
        if c.null_count < len(c):
            tree = c.buffers()  # the whole tree's: a slice's bytes are within them
            cols.append((nm, c, [b for i in where if (b := tree[i]) is not None]))
    small = [b for _, _, bufs in cols for b in bufs if b.size < 1 << 16]
    if b"".join(small).isascii() and all(_ascii(b) for _, _, bufs in cols for b in bufs
                                         if b.size >= 1 << 16):
        return  # the usual case: one pass over the text of a small table
    for nm, c, bufs in cols:
        if all(_ascii(b) for b in bufs):
            continue
        try:
            c.validate(full=True)
        except pa.ArrowInvalid:
            mask = pa.nulls(len(c), pa.bool_())  # nested: the column is named, not the row
            if pa.types.is_string(c.type):
                mask = pa.array([_not_utf8(b) for b in c.cast(pa.binary()).to_pylist()])
            fail(mask, nm, "must be valid UTF-8 text")


def _string_data(typ: pa.DataType, at: int = 0) -> tuple[list[int], int]:
    """Where the string data buffers are in ``Array.buffers()`` of a type (the tree's
    buffers depth first), and how many buffers the type has."""
    if pa.types.is_string(typ):
        return [at + 2], 3
    own = 1 if pa.types.is_struct(typ) else 2  # validity (+ offsets of a list or map)
    found, n = [], own
    for i in range(typ.num_fields):
        f, k = _string_data(typ.field(i).type, at + n)
        found += f
        n += k
    return found, n


_TEXT_BUFFERS = tuple((f.name, _string_data(f.type)[0]) for f in EVENT_SCHEMA
                      if _string_data(f.type)[0])
_HIGH_BITS = np.uint64(0x8080808080808080)


def _ascii(buf: pa.Buffer) -> bool:
    if buf.size < 1 << 16:
        return buf.to_pybytes().isascii()
    b = np.frombuffer(buf, np.uint8)
    k = len(b) // 8 * 8
    return not np.bitwise_or.reduce(b[:k].view(np.uint64)) & _HIGH_BITS \
        and not np.any(b[k:] & 0x80)


def _not_utf8(b: bytes | None) -> bool:
    if b is None:
        return False
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _valid_floats(c: pa.Array) -> np.ndarray:
    """The non-null values of a float64 column (a null slot may hold anything)."""
    x = np.frombuffer(c.buffers()[1], np.float64, count=len(c), offset=c.offset * 8)
    if c.null_count:
        bits = np.unpackbits(np.frombuffer(c.buffers()[0], np.uint8),
                             count=c.offset + len(c), bitorder="little")
        x = x[bits[c.offset:].view(bool)]
    return x


def check_floats(c: pa.Array, fld: str, fail: Callable[..., None],
                  minimum: int | None = None) -> None:
    """A float64 column holds finite values (at least ``minimum``)."""
    if c.null_count == len(c):
        return
    x = _valid_floats(c)
    if not np.isfinite(x).all():
        fail(pc.fill_null(pc.invert(pc.is_finite(c)), False), fld, "must be a finite double")
    if minimum is not None and x.min() < minimum:
        fail(pc.fill_null(pc.less(c, minimum), False), fld, f"must be >= {minimum}")
