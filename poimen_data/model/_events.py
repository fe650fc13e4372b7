"""Event classes, value types, the Arrow event schema and validation (docs/DESIGN.md, "Domain").

Every change to a run is one of the frozen event dataclasses below. A transaction
validates each event on append (``validate_event``) and turns the batch into one Arrow
table with ``EVENT_SCHEMA`` (``events_to_table``); bulk writers hand a table of the same
schema to ``validate_table`` instead.
"""

from __future__ import annotations

import re
import zoneinfo
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa

from poimen_data.errors import TenantMismatch, ValidationError
from poimen_data.model._limits import (
    COST_QUANTUM,
    INT64_MAX,
    cost_problem,
    int_problem,
    number_problem,
    short_repr,
    strs_problem,
    text_problem,
    ts_problem,
    utf8_ok,
)

try:  # one object per key: what Arrow's rows carry
    _ZONE_UTC: Any = zoneinfo.ZoneInfo("UTC")
except zoneinfo.ZoneInfoNotFoundError:  # no time-zone database here: nothing carries it
    _ZONE_UTC = UTC

# one pattern, two bounds: validation caches the strs that matched the longer one
_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,%d}"
_TENANT_MAX = 64
TENANT_RE = re.compile(_ID % (_TENANT_MAX - 1))
RUN_ID_RE = re.compile(_ID % 127)
SHA256_RE = re.compile(r"[0-9a-f]{64}")
VERIFIER_RE = re.compile(r"[^@\s]+@[^@\s]+")
STEP_ID_MAX = 256

RUN_STATES = ("running", "verifying", "succeeded", "failed", "cancelled")
ATTEMPT_STATES = ("dispatched", "succeeded", "failed", "cancelled", "timed_out")
TERMINAL_ATTEMPT_STATES = ("succeeded", "failed", "cancelled", "timed_out")
RUN_OUTCOMES = ("succeeded", "failed")

# cost_usd is money: stored exactly, so sums are deterministic (docs/DESIGN.md, "Storage format").
COST_TYPE = pa.decimal128(18, 9)


# --- value types -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlobRef:
    """A body by reference: content-addressed by sha256 within one tenant."""

    tenant: str
    sha256: str
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True, slots=True)
class ContextPartition:
    """Context identifiers packed into the prompt, available but not packed, dropped."""

    packed: tuple[str, ...] = ()
    available: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "packed": list(self.packed),
            "available": list(self.available),
            "dropped": list(self.dropped),
        }


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage, cost and latency of one attempt (OpenTelemetry GenAI names)."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    reasoning_tokens: int | None = None
    cost_usd: Decimal | None = None
    latency_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        cost = self.cost_usd
        if cost is not None:
            cost = Decimal(cost).quantize(COST_QUANTUM)
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "cost_usd": cost,
            "latency_ms": None if self.latency_ms is None else float(self.latency_ms),
        }


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """Names of the tools an attempt called, in call order."""

    calls: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"calls": list(self.calls)}


# --- events -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    kind: ClassVar[str] = ""
    tenant: str
    if TYPE_CHECKING:  # every event class ends with a keyword-only ``ts`` of its own
        ts: datetime | None


@dataclass(frozen=True, slots=True)
class RunStarted(Event):
    kind: ClassVar[str] = "run_started"
    run_id: str
    workflow_version: str
    labels: Mapping[str, str] | None = None
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class AttemptDispatched(Event):
    kind: ClassVar[str] = "attempt_dispatched"
    run_id: str
    branch_id: int
    step_id: str
    step_index: int
    attempt_no: int
    prompt: BlobRef | None = None
    context: ContextPartition | None = None
    workflow_version: str | None = None
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class AttemptFinished(Event):
    kind: ClassVar[str] = "attempt_finished"
    run_id: str
    branch_id: int
    step_id: str
    attempt_no: int
    state: str
    output: BlobRef | None = None
    usage: Usage | None = None
    tools: ToolInfo | None = None
    error: str | None = None
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class AttemptRecovered(Event):
    kind: ClassVar[str] = "attempt_recovered"
    run_id: str
    branch_id: int
    step_id: str
    attempt_no: int
    state: str
    output: BlobRef | None = None
    usage: Usage | None = None
    tools: ToolInfo | None = None
    error: str | None = None
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class BranchForked(Event):
    kind: ClassVar[str] = "branch_forked"
    run_id: str
    branch_id: int
    parent_branch_id: int
    fork_step_index: int
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class VerifyingEntered(Event):
    kind: ClassVar[str] = "verifying_entered"
    run_id: str
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class VerdictRecorded(Event):
    kind: ClassVar[str] = "verdict_recorded"
    run_id: str
    branch_id: int
    verifier: str
    snapshot_lsn: int
    passed: bool
    score: float | None = None
    detail: str | None = None
    ts: datetime | None = field(default=None, kw_only=True)
    # The attempt an attempt-scoped verifier judged (``branch_id`` is then its branch);
    # both None for a run verdict. Stored in the same columns as the attempt events'.
    step_id: str | None = field(default=None, kw_only=True)
    attempt_no: int | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class RunFinished(Event):
    kind: ClassVar[str] = "run_finished"
    run_id: str
    outcome: str
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class RunCancelled(Event):
    kind: ClassVar[str] = "run_cancelled"
    run_id: str
    reason: str | None = None
    ts: datetime | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class BlobReduced(Event):
    kind: ClassVar[str] = "blob_reduced"
    original: BlobRef
    summary: BlobRef
    ts: datetime | None = field(default=None, kw_only=True)


EVENT_CLASSES: dict[str, type[Event]] = {
    c.kind: c
    for c in (
        RunStarted,
        AttemptDispatched,
        AttemptFinished,
        AttemptRecovered,
        BranchForked,
        VerifyingEntered,
        VerdictRecorded,
        RunFinished,
        RunCancelled,
        BlobReduced,
    )
}
KINDS = tuple(EVENT_CLASSES)

# --- the Arrow schema of a segment -------------------------------------------------

REF_TYPE = pa.struct(
    [("tenant", pa.string()), ("sha256", pa.string()), ("size", pa.int64())]
)
CONTEXT_TYPE = pa.struct(
    [
        ("packed", pa.list_(pa.string())),
        ("available", pa.list_(pa.string())),
        ("dropped", pa.list_(pa.string())),
    ]
)
USAGE_TYPE = pa.struct(
    [
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("cache_read_input_tokens", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("cost_usd", COST_TYPE),
        ("latency_ms", pa.float64()),
    ]
)
TOOLS_TYPE = pa.struct([("calls", pa.list_(pa.string()))])
LABELS_TYPE = pa.map_(pa.string(), pa.string())

#: One row per event, in commit order. A fresh segment holds exactly these columns; its
#: LSNs are the manifest's ``first_lsn`` plus the row number. Compacted segments add
#: ``lsn`` and ``seq`` in front (``LOG_SCHEMA``), which is also what readers see.
EVENT_SCHEMA = pa.schema(
    [
        pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("tenant", pa.string(), nullable=False),
        ("run_id", pa.string()),
        ("branch_id", pa.int64()),
        ("step_id", pa.string()),
        ("step_index", pa.int64()),
        ("attempt_no", pa.int64()),
        ("state", pa.string()),
        ("workflow_version", pa.string()),
        ("labels", LABELS_TYPE),
        ("prompt", REF_TYPE),
        ("output", REF_TYPE),
        ("context", CONTEXT_TYPE),
        ("usage", USAGE_TYPE),
        ("tools", TOOLS_TYPE),
        ("error", pa.string()),
        ("parent_branch_id", pa.int64()),
        ("fork_step_index", pa.int64()),
        ("verifier", pa.string()),
        ("snapshot_lsn", pa.int64()),
        ("passed", pa.bool_()),
        ("score", pa.float64()),
        ("detail", pa.string()),
        ("outcome", pa.string()),
        ("reason", pa.string()),
        ("original", REF_TYPE),
        ("summary", REF_TYPE),
    ]
)
LOG_SCHEMA = pa.schema(
    [pa.field("lsn", pa.int64(), nullable=False), pa.field("seq", pa.int64(), nullable=False)]
    + list(EVENT_SCHEMA)
)
REF_COLUMNS = ("prompt", "output", "original", "summary")


# --- validation ---------------------------------------------------------------------

_REQUIRED: dict[str, tuple[str, ...]] = {
    "run_started": ("run_id", "workflow_version"),
    "attempt_dispatched": ("run_id", "branch_id", "step_id", "step_index", "attempt_no"),
    "attempt_finished": ("run_id", "branch_id", "step_id", "attempt_no", "state"),
    "attempt_recovered": ("run_id", "branch_id", "step_id", "attempt_no", "state"),
    "branch_forked": ("run_id", "branch_id", "parent_branch_id", "fork_step_index"),
    "verifying_entered": ("run_id",),
    "verdict_recorded": ("run_id", "branch_id", "verifier", "snapshot_lsn", "passed"),
    "run_finished": ("run_id", "outcome"),
    "run_cancelled": ("run_id",),
    "blob_reduced": ("original", "summary"),
}
REQUIRED_FIELDS = _REQUIRED  # required fields by kind, shared with the bulk path
#: Which columns each kind may carry; anything else must be null in a bulk table.
KIND_COLUMNS: dict[str, frozenset[str]] = {
    k: frozenset(f.name for f in fields(c)) - {"ts"} for k, c in EVENT_CLASSES.items()
}


def _bad(where: str, fld: str, msg: str,
         error: type[ValidationError] = ValidationError) -> ValidationError:
    if not where:
        return error(f"field {fld!r} {msg}")
    return error(f"{where}: field {fld!r} {msg}")


#: The public names of what the bulk path (``_arrow``) shares with the event path.
bad_field = _bad


class Checked:
    """What ``validate_event`` checked already, kept by its caller across calls (a
    transaction, a recorder's record): ids and refs, each of exact types all through, in a
    set of its own, so a lookup compares two values of those very types and never asks an
    object of another type or a subclass (whose ``__eq__`` could answer yes to anything,
    or a bool that equals 1); and every other ref, never looked up, kept for the commit's
    check that every body pointed at exists. Usages are not kept: they differ from one
    attempt to the next, and a lookup cost more than the check it saved."""

    __slots__ = ("ids", "refs", "other_refs")

    def __init__(self) -> None:
        self.ids: set[str] = set()  # strs that matched RUN_ID_RE
        self.refs: set[BlobRef] = set()  # of exact types all through (_plain_ref)
        # by identity: no equality of theirs is asked, and one object used by many
        # events is checked once
        self.other_refs: dict[int, BlobRef] = {}

    def all_refs(self) -> Iterator[BlobRef]:
        """Every ref checked: each plain one once, every other object once."""
        yield from self.refs
        yield from self.other_refs.values()

    def add_refs(self, refs: Iterable[BlobRef]) -> None:
        """Refs checked elsewhere (a recorder's records)."""
        for r in refs:
            if _plain_ref(r):
                self.refs.add(r)
            else:
                self.other_refs[id(r)] = r


def _plain_ref(ref: Any) -> bool:
    """A ref of exact types all through, whose equality is its fields' own (a subclass, a
    bool size equal to 1 or a str subclass would compare equal to a ref checked before)."""
    return type(ref) is BlobRef and type(ref.tenant) is str and type(ref.sha256) is str \
        and type(ref.size) is int


def _check_ref_cached(ref: Any, name: str, seen: Checked | None) -> None:
    plain = _plain_ref(ref)
    if plain and seen is not None and ref in seen.refs:
        return
    check_ref(ref, "", name)
    if seen is not None:  # any other too: the commit checks that its body exists
        if plain:
            seen.refs.add(ref)
        else:
            seen.other_refs[id(ref)] = ref


def _check_int(where: str, name: str, v: Any, minimum: int) -> None:
    if type(v) is not int or v < minimum or v > INT64_MAX:
        raise _bad(where, name, int_problem(v, minimum) or "")


def _check_str(where: str, name: str, v: Any, max_len: int = 4096) -> None:
    if not isinstance(v, str) or not v or len(v) > max_len:
        raise _bad(where, name, f"must be a non-empty str of at most {max_len} chars")
    if not v.isascii() and not utf8_ok(v):
        raise _bad(where, name, "must be valid UTF-8 text (it holds a lone surrogate)")


def _check_text(where: str, name: str, v: Any) -> None:
    """An optional free-text field (error, detail, reason): a storable str or None."""
    if v is not None and (type(v) is not str or not v.isascii()):
        problem = text_problem(v)
        if problem:
            raise _bad(where, name, problem)


def check_tenant(v: Any, where: str = "argument") -> str:
    if not isinstance(v, str) or not TENANT_RE.fullmatch(v):
        raise _bad(where, "tenant", f"must match {TENANT_RE.pattern}, got {short_repr(v)}")
    return v


def check_run_id(v: Any, where: str = "argument") -> str:
    if not isinstance(v, str) or not RUN_ID_RE.fullmatch(v):
        raise _bad(where, "run_id", f"must match {RUN_ID_RE.pattern}, got {short_repr(v)}")
    return v


def check_ref(ref: Any, where: str = "argument", name: str = "ref") -> BlobRef:
    if not isinstance(ref, BlobRef):
        raise _bad(where, name, f"must be a BlobRef, got {type(ref).__name__}")
    if not isinstance(ref.tenant, str) or not TENANT_RE.fullmatch(ref.tenant):
        raise _bad(where, name, f"has an invalid tenant {short_repr(ref.tenant)}")
    if not isinstance(ref.sha256, str) or not SHA256_RE.fullmatch(ref.sha256):
        raise _bad(where, name, "sha256 must be 64 lowercase hex digits")
    if type(ref.size) is not int or ref.size < 0 or ref.size > INT64_MAX:
        raise _bad(where, name, "size must be an int in [0, 2**63 - 1], got "
                   f"{short_repr(ref.size)}")
    return ref


def _check_str_tuple(where: str, name: str, v: Any) -> None:
    problem = strs_problem(v)
    if problem:
        raise _bad(where, name, problem)


def validate_event(e: Any, where: str | int = "event",
                   seen_refs: Checked | None = None) -> None:
    """Check one event's structure; raise ``ValidationError`` naming ``where`` and the field.

    ``where`` may be the event's position (an int): the message is only formatted on a
    fault. ``seen_refs`` (a ``Checked``) is what the caller's earlier calls checked: refs,
    usages and ids a transaction reuses many times are checked once, which keeps
    validation cheap on the hot append path.
    """
    kind = getattr(type(e), "kind", None)
    if kind not in EVENT_CLASSES or type(e) is not EVENT_CLASSES[kind]:
        label = f"event {where}" if isinstance(where, int) else where
        raise ValidationError(f"{label}: not a poimen_data.events event: {type(e).__name__}")
    try:
        _validate(e, kind, seen_refs)
    except ValidationError as exc:
        label = f"event {where}" if isinstance(where, int) else where
        raise type(exc)(f"{label} ({kind}): {exc}") from None


def _validate(e: Any, kind: str, seen: Checked | None) -> None:
    where = ""
    # ``seen.ids``: the strs that matched RUN_ID_RE; TENANT_RE is that pattern, at most
    # _TENANT_MAX chars: one lookup instead of a regex each
    ids = None if seen is None else seen.ids
    tenant = e.tenant
    if type(tenant) is not str or ids is None or tenant not in ids \
            or len(tenant) > _TENANT_MAX:
        check_tenant(tenant, where)
        if ids is not None and type(tenant) is str:
            ids.add(tenant)
    if kind != "blob_reduced":
        run_id = e.run_id
        if type(run_id) is not str or ids is None or run_id not in ids:
            check_run_id(run_id, where)
            if ids is not None and type(run_id) is str:
                ids.add(run_id)
    ts = e.ts
    # the common case costs no call: an aware stamp in either UTC, within the years (any
    # other zone is asked for its offset inside ts_problem, which names what it gets)
    if ts is not None and (type(ts) is not datetime or not 1 < ts.year < 9999
                           or (ts.tzinfo is not UTC and ts.tzinfo is not _ZONE_UTC)):
        problem = ts_problem(ts)
        if problem:
            raise _bad(where, "ts", problem)
    if kind in ("attempt_dispatched", "attempt_finished", "attempt_recovered"):
        _check_int(where, "branch_id", e.branch_id, 0)
        _check_str(where, "step_id", e.step_id, STEP_ID_MAX)
        _check_int(where, "attempt_no", e.attempt_no, 1)
        if kind == "attempt_dispatched":
            _check_int(where, "step_index", e.step_index, 0)
            if e.prompt is not None:
                _check_ref_cached(e.prompt, "prompt", seen)
                if e.prompt.tenant != tenant:
                    raise _bad(where, "prompt", "belongs to another tenant than the event",
                           TenantMismatch)
            ctx = e.context
            if ctx is not None:  # checked each time: hashing it for a cache costs more
                if not isinstance(ctx, ContextPartition):
                    raise _bad(where, "context", "must be a ContextPartition")
                _check_str_tuple(where, "context.packed", ctx.packed)
                _check_str_tuple(where, "context.available", ctx.available)
                _check_str_tuple(where, "context.dropped", ctx.dropped)
            if e.workflow_version is not None:
                _check_str(where, "workflow_version", e.workflow_version, 256)
        else:
            if e.state not in TERMINAL_ATTEMPT_STATES:
                raise _bad(where, "state", f"must be one of {TERMINAL_ATTEMPT_STATES}, "
                           f"got {short_repr(e.state)}")
            if e.output is not None:
                _check_ref_cached(e.output, "output", seen)
                if e.output.tenant != tenant:
                    raise _bad(where, "output", "belongs to another tenant than the event",
                           TenantMismatch)
            if e.usage is not None:  # checked each time, as a context is
                _check_usage(where, e.usage)
            if e.tools is not None:
                if not isinstance(e.tools, ToolInfo):
                    raise _bad(where, "tools", "must be a ToolInfo")
                _check_str_tuple(where, "tools.calls", e.tools.calls)
            _check_text(where, "error", e.error)
    elif kind == "run_started":
        _check_str(where, "workflow_version", e.workflow_version, 256)
        labels = e.labels
        if labels is not None and (
            not isinstance(labels, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        ):
            raise _bad(where, "labels", "must be a mapping of str to str")
        if labels and not all(utf8_ok(k) and utf8_ok(v) for k, v in labels.items()):
            raise _bad(where, "labels", "must be valid UTF-8 text (a lone surrogate)")
    elif kind == "branch_forked":
        _check_int(where, "branch_id", e.branch_id, 1)
        _check_int(where, "parent_branch_id", e.parent_branch_id, 0)
        _check_int(where, "fork_step_index", e.fork_step_index, 0)
        if e.parent_branch_id >= e.branch_id:
            raise _bad(where, "parent_branch_id", "must be lower than branch_id")
    elif kind == "verdict_recorded":
        _check_int(where, "branch_id", e.branch_id, 0)
        if not isinstance(e.verifier, str) or not VERIFIER_RE.fullmatch(e.verifier) \
                or not utf8_ok(e.verifier):
            raise _bad(where, "verifier",
                       f"must be 'name@version', got {short_repr(e.verifier)}")
        _check_int(where, "snapshot_lsn", e.snapshot_lsn, 1)
        if type(e.passed) is not bool:
            raise _bad(where, "passed", "must be a bool")
        if e.score is not None:
            problem = number_problem(e.score)
            if problem:
                raise _bad(where, "score", problem)
        _check_text(where, "detail", e.detail)
        if (e.step_id is None) != (e.attempt_no is None):
            raise _bad(where, "attempt_no", "must be given with step_id (an attempt "
                       "verdict) or neither (a run verdict)")
        if e.step_id is not None:
            _check_str(where, "step_id", e.step_id, STEP_ID_MAX)
            _check_int(where, "attempt_no", e.attempt_no, 1)
    elif kind == "run_finished":
        if e.outcome not in RUN_OUTCOMES:
            raise _bad(where, "outcome",
                       f"must be one of {RUN_OUTCOMES}, got {short_repr(e.outcome)}")
    elif kind == "run_cancelled":
        _check_text(where, "reason", e.reason)
    elif kind == "blob_reduced":
        for name in ("original", "summary"):
            ref = getattr(e, name)
            _check_ref_cached(ref, name, seen)
            if ref.tenant != tenant:
                raise _bad(where, name, "belongs to another tenant than the event",
                           TenantMismatch)


_USAGE_INTS = tuple((name, f"usage.{name}") for name in (
    "input_tokens", "output_tokens", "cache_read_input_tokens", "reasoning_tokens"))


def _check_usage(where: str, u: Any) -> None:
    if not isinstance(u, Usage):
        raise _bad(where, "usage", "must be a Usage")
    for name, label in _USAGE_INTS:
        v = getattr(u, name)
        if v is not None:
            _check_int(where, label, v, 0)
    if u.cost_usd is not None:
        problem = cost_problem(u.cost_usd)
        if problem:
            raise _bad(where, "usage.cost_usd", problem)
    if u.latency_ms is not None:
        problem = number_problem(u.latency_ms, minimum=0)
        if problem:
            raise _bad(where, "usage.latency_ms", problem)


def event_refs(e: Event) -> Iterable[tuple[str, BlobRef]]:
    """The (field, ref) pairs an event points at."""
    for name in REF_COLUMNS:
        ref = getattr(e, name, None)
        if ref is not None:
            yield name, ref


def _ref_from(d: Mapping[str, Any] | None) -> BlobRef | None:
    return None if d is None else BlobRef(d["tenant"], d["sha256"], d["size"])


def event_from_row(row: Mapping[str, Any]) -> Event:
    """Rebuild an event object from one row (a dict) of an EVENT_SCHEMA/LOG_SCHEMA table."""
    kind = row["kind"]
    cls = EVENT_CLASSES[kind]
    kw: dict[str, Any] = {}
    for f in fields(cls):
        v = row.get(f.name)
        if v is None:
            kw[f.name] = None
            continue
        if f.name in REF_COLUMNS:
            v = _ref_from(v)
        elif f.name == "context":
            v = ContextPartition(tuple(v["packed"] or ()), tuple(v["available"] or ()),
                                 tuple(v["dropped"] or ()))
        elif f.name == "usage":
            v = Usage(**v)
        elif f.name == "tools":
            v = ToolInfo(tuple(v["calls"] or ()))
        elif f.name == "labels":
            v = dict(v)
        kw[f.name] = v
    return cls(**kw)


def event_from_json(obj: Mapping[str, Any]) -> Event:
    """Build an event from its JSON form: ``kind`` plus the class's fields (test vectors).
    Any malformed part is a ``ValidationError``."""
    try:
        return _event_from_json(obj)
    except ValidationError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as exc:
        kind = short_repr(dict(obj).get("kind"))
        raise ValidationError(f"event {kind}: malformed: {exc!r}") from None


def _event_from_json(obj: Mapping[str, Any]) -> Event:
    obj = dict(obj)
    kind = obj.pop("kind", None)
    if kind not in EVENT_CLASSES:
        raise ValidationError(f"unknown event kind {short_repr(kind)}")
    for name in REF_COLUMNS:
        if obj.get(name) is not None:
            obj[name] = BlobRef(**obj[name])
    if obj.get("context") is not None:
        obj["context"] = ContextPartition(**{k: tuple(v) for k, v in obj["context"].items()})
    if obj.get("usage") is not None:
        u = dict(obj["usage"])
        if u.get("cost_usd") is not None:
            u["cost_usd"] = Decimal(str(u["cost_usd"]))
        obj["usage"] = Usage(**u)
    if obj.get("tools") is not None:
        obj["tools"] = ToolInfo(tuple(obj["tools"]["calls"]))
    if isinstance(obj.get("ts"), str):
        obj["ts"] = datetime.fromisoformat(obj["ts"])
    try:
        return EVENT_CLASSES[kind](**obj)
    except TypeError as exc:
        raise ValidationError(f"event of kind {short_repr(kind)}: {exc}") from None


__all__ = [
    "ATTEMPT_STATES",
    "AttemptDispatched",
    "AttemptFinished",
    "AttemptRecovered",
    "BlobReduced",
    "BlobRef",
    "BranchForked",
    "ContextPartition",
    "EVENT_SCHEMA",
    "Event",
    "LOG_SCHEMA",
    "RUN_STATES",
    "RunCancelled",
    "RunFinished",
    "RunStarted",
    "ToolInfo",
    "Usage",
    "VerdictRecorded",
    "VerifyingEntered",
    "event_from_json",
    "event_from_row",
    "validate_event",
]
