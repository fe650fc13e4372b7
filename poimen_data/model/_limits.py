"""What storage holds, as value rules shared by the event path (``validate_event``) and
the bulk path (``check_conformed``): int64 ints, finite float64s, ``decimal(18, 9)`` money,
UTF-8 text and UTC timestamps within 0001-01-01 .. 9999-12-31 (README "Value limits")."""

from __future__ import annotations

import math
import numbers
from datetime import UTC, datetime
from decimal import Context, Decimal
from typing import Any

INT64_MAX = 2**63 - 1
COST_MAX = Decimal("999999999.999999999")  # decimal(18, 9): 18 digits, 9 of them decimals
COST_QUANTUM = Decimal("0.000000001")
TS_MIN = datetime(1, 1, 1, tzinfo=UTC)
TS_MAX = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
TS_MIN_US = -62_135_596_800_000_000  # TS_MIN and TS_MAX in microseconds since the epoch
TS_MAX_US = 253_402_300_799_999_999
TS_RANGE = "within 0001-01-01 .. 9999-12-31 UTC"
# Money arithmetic in our own context: a caller's thread context (say prec=5) must not
# round or trap inside validation. 40 digits hold any decimal(18, 9) exactly.
MONEY_CONTEXT = Context(prec=40)


def utf8_ok(s: str) -> bool:
    """Whether a str can be stored as UTF-8 (no lone surrogates)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_problem(v: Any) -> str | None:
    """Why ``v`` cannot be stored as a string (None when it can)."""
    if not isinstance(v, str):
        return f"must be a str, got {type(v).__name__}"
    if not utf8_ok(v):
        return "must be valid UTF-8 text (it holds a lone surrogate)"
    return None


def strs_problem(v: Any) -> str | None:
    """Why ``v`` is not a tuple of storable strings (None when it is)."""
    if not isinstance(v, tuple):
        return "must be a tuple of str"
    try:
        joined = "".join(v)  # one pass: every item a str, then one UTF-8 check
    except TypeError:
        return "must be a tuple of str"
    if not utf8_ok(joined):
        return "must be valid UTF-8 text (an item holds a lone surrogate)"
    return None


def int_problem(v: Any, minimum: int) -> str | None:
    """Why ``v`` is not an int in ``[minimum, 2**63 - 1]`` (None when it is)."""
    if type(v) is not int or v < minimum or v > INT64_MAX:
        # a bool, an int subclass or numpy's int64 reads like an int: say what it is
        kind = (f" ({type(v).__name__}, not int)"
                if type(v) is not int and hasattr(type(v), "__index__") else "")
        return f"must be an int in [{minimum}, 2**63 - 1], got {_short(v)}{kind}"
    return None


def _own_value(v: int | float) -> int | float:
    """A number's own value: a subclass's ``__float__`` or ``__int__`` is never asked
    (validation would not see what it answers)."""
    return float.__float__(v) if isinstance(v, float) else int.__int__(v)


def stored_double(v: int | float) -> float:
    """The double a number ``number_problem`` passed is stored as: a float's own value, an
    int's own value as a double."""
    return float(_own_value(v))


def number_problem(v: Any, *, minimum: float | None = None) -> str | None:
    """Why ``v`` cannot be stored exactly as a finite double (None when it can)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return f"must be a number, got {type(v).__name__}"
    v = _own_value(v)  # as ``stored_double`` stores it, not what a subclass answers
    if isinstance(v, float):
        if not math.isfinite(v):
            return f"must be a finite double, got {v!r}"
    else:
        try:
            f = float(v)
        except OverflowError:
            return f"must be a finite double, got an int of {v.bit_length()} bits"
        if f != v:
            return f"must be exactly representable as a double, got {_short(v)}"
    if minimum is not None and v < minimum:
        return f"must be >= {minimum}, got {v!r}"
    return None


def cost_problem(v: Any) -> str | None:
    """Why ``v`` is not an amount ``decimal(18, 9)`` holds exactly (None when it is): a
    finite Decimal (or int) in ``[0, 999999999.999999999]`` with at most 9 decimals.
    More decimals are refused rather than rounded: money is stored exactly."""
    if isinstance(v, bool) or not isinstance(v, Decimal | int):
        return "must be a Decimal (money is stored exactly)"
    d = v if type(v) is Decimal else Decimal(v)  # a subclass's value, not its methods
    if not d.is_finite():
        return f"must be a finite amount, got {d}"
    if d < 0:
        return f"must be >= 0, got {_short(d)}"
    if d > COST_MAX:
        return f"must be at most {COST_MAX} (stored as decimal(18, 9)), got {_short(d)}"
    exp = d.as_tuple().exponent
    if isinstance(exp, int) and exp < -9 and d != d.quantize(COST_QUANTUM, context=MONEY_CONTEXT):
        return f"must have at most 9 decimals (stored exactly), got {_short(d)}"
    return None


def ts_problem(ts: Any) -> str | None:
    """Why ``ts`` is not an aware datetime within 0001-01-01 .. 9999-12-31 UTC."""
    if not isinstance(ts, datetime):
        return "must be a timezone-aware datetime"
    try:
        off = ts.utcoffset()
    except Exception as exc:  # noqa: BLE001 - a tzinfo of the caller's, failing any way
        return (f"must be a timezone-aware datetime whose tzinfo gives its UTC offset "
                f"({type(exc).__name__} from utcoffset())")
    if off is None:
        return "must be a timezone-aware datetime"
    try:
        if ts.year in (1, 9999):  # elsewhere an offset (< 24 h) cannot cross the limits
            ts.astimezone(UTC)
    except (OverflowError, ValueError, TypeError):
        return f"must be {TS_RANGE}, got {ts.isoformat()}"
    # a subclass with more precision (pandas' Timestamp) would lose it: refused, as a
    # nanosecond column is on the bulk path, instead of cut to the microsecond
    nanos = getattr(ts, "nanosecond", 0)
    if nanos:
        return (f"must have at most microsecond precision (stored as timestamp[us]), got "
                f"{nanos} ns past {ts.isoformat()}")
    return None


def is_count(v: Any) -> bool:
    """An int, numpy's too (what a query hands over), never a bool: what an argument that
    counts something (rows, threads, commits) must be."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def short_repr(v: Any) -> str:
    """``repr(v)`` for an error message, cut to about 60 characters. Never raises: an int
    too long for ``repr`` (over 4,300 digits, Python's limit) is described by its size,
    and a value whose ``repr`` fails by its type."""
    try:
        s = repr(v)
    except Exception:  # noqa: BLE001 - a message must not fail on the value it names
        if isinstance(v, int):
            return f"an int of {int.bit_length(v)} bits"
        return f"a {type(v).__name__}"
    return s if len(s) <= 60 else f"{s[:40]}...({len(s)} chars)"


_short = short_repr
