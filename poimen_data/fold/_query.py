"""Episode views: frozen values built from the fold's rows (docs/DESIGN.md, "Python API").

An ``EpisodeView`` is an owned, immutable value that holds refs, never bodies, and never
re-reads storage; time travel gives a new value. ``serialize()`` is canonical JSON
(sorted keys, no spaces, money as a fixed-point string), so a view served from the
materialized state and one from a cold re-fold can be compared byte for byte, which is
what ``check()`` does for every episode (and for every state file, by sha256).
"""

from __future__ import annotations

import html
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import CorruptionError, NotFound, StateChanged, ValidationError
from poimen_data.fold._fold import SOURCES, Source, fold_tables, run_events
from poimen_data.fold._state import (
    INDEX,
    Pointer,
    read_run,
    read_runs,
    table_schemas,
    usable_pointer,
)
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.model._events import (
    COST_QUANTUM,
    BlobRef,
    ContextPartition,
    ToolInfo,
    Usage,
    check_run_id,
)

#: Attempt states that count as failures (as ``runs.n_failed_attempts`` counts them).
FAILED_STATES = ("failed", "timed_out")
#: Failed attempts a repr names per branch before it says how many more.
REPR_FAILED = 5
#: The tables an episode is built from.
EPISODE_TABLES = ("runs", "branches", "attempts")


@dataclass(frozen=True, slots=True)
class AttemptView:
    """One attempt, whatever its outcome (failed ones are the learning signal)."""

    step: str
    step_index: int | None
    attempt: int
    state: str
    workflow_version: str | None
    context: ContextPartition | None
    prompt: BlobRef | None
    output: BlobRef | None
    tools: ToolInfo | None
    usage: Usage | None
    error: str | None
    first_lsn: int
    last_lsn: int


@dataclass(frozen=True, slots=True)
class BranchView:
    """One branch and the attempts recorded on it (its own; not the inherited ones)."""

    branch_id: int
    parent_branch_id: int | None
    fork_step_index: int | None
    fork_lsn: int | None
    is_live: bool
    attempts: tuple[AttemptView, ...]


@dataclass(frozen=True, slots=True)
class EpisodeView:
    """One run as it stood at ``at_lsn``; ``branches`` sorted by branch_id."""

    run_id: str
    tenant: str
    workflow_version: str | None
    state: str | None
    live_branch: int
    at_lsn: int
    branches: tuple[BranchView, ...]

    def to_plain(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, int, float, bool, None) covering every field."""
        return _plain(self)

    def serialize(self) -> bytes:
        """Canonical bytes: equal views give equal bytes, whatever built them."""
        return orjson.dumps(self.to_plain(), option=orjson.OPT_SORT_KEYS)

    @property
    def live(self) -> BranchView | None:
        """The live branch, when this view holds it."""
        for b in self.branches:
            if b.is_live:
                return b
        return None

    def __repr__(self) -> str:
        """A header line, then one line per branch: its attempts, how many failed and
        which (step#attempt=state). Reads fields only, never a blob."""
        lines = [f"EpisodeView(run {self.run_id!r}, tenant {self.tenant!r}, workflow "
                 f"{self.workflow_version!r}, state {self.state!r}, live branch "
                 f"{self.live_branch}, at lsn {self.at_lsn}, {len(self.branches)} "
                 f"branch{'' if len(self.branches) == 1 else 'es'})"]
        for b in self.branches:
            failed = [a for a in b.attempts if a.state in FAILED_STATES]
            where = [] if b.parent_branch_id is None else [
                f"from branch {b.parent_branch_id} at step {b.fork_step_index}"]
            head = ", ".join((["live"] if b.is_live else []) + where)
            line = (f"  branch {b.branch_id}{f' ({head})' if head else ''}: "
                    f"{len(b.attempts)} attempt{'' if len(b.attempts) == 1 else 's'}, "
                    f"{len(failed)} failed")
            if failed:
                shown = ", ".join(f"{a.step}#{a.attempt}={a.state}"
                                  for a in failed[:REPR_FAILED])
                more = len(failed) - REPR_FAILED
                line += f" ({shown}{f', +{more} more' if more > 0 else ''})"
            lines.append(line)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """For notebooks: a table of attempts by branch, failed ones marked. Reads
        fields only, never a blob (a ref shows as its size)."""
        e = html.escape
        head = (f"<p><b>run {e(self.run_id)}</b> &middot; tenant {e(str(self.tenant))} "
                f"&middot; workflow {e(str(self.workflow_version))} &middot; state "
                f"{e(str(self.state))} &middot; live branch {self.live_branch} &middot; "
                f"at lsn {self.at_lsn}</p>")
        cols = ("branch", "step", "index", "attempt", "state", "error", "prompt", "output",
                "lsn")
        rows = []
        for b in self.branches:
            label = f"{b.branch_id}{' (live)' if b.is_live else ''}"
            if b.parent_branch_id is not None:
                label += f" &larr; {b.parent_branch_id}@{b.fork_step_index}"
            if not b.attempts:
                rows.append(f'<tr><td>{label}</td><td colspan="{len(cols) - 1}">'
                            "<i>no attempts</i></td></tr>")
            for a in b.attempts:
                bad = a.state in FAILED_STATES
                cells = (label, e(a.step), "" if a.step_index is None else a.step_index,
                         a.attempt, ("&#10007; " if bad else "") + e(a.state),
                         e(a.error or ""), _size(a.prompt), _size(a.output),
                         f"{a.first_lsn}&ndash;{a.last_lsn}")
                style = ' class="failed" style="background-color: #fdd"' if bad else ""
                rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells)
                            + "</tr>")
        return (head + "<table><thead><tr>" + "".join(f"<th>{c}</th>" for c in cols)
                + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _size(ref: BlobRef | None) -> str:
    return "" if ref is None else f"{ref.size:,} B"


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, str | bool | int | float):
        return v
    if isinstance(v, Decimal):
        # money: one spelling per amount (0.0015 and 0.001500000 are the same value)
        return str(v.quantize(COST_QUANTUM))
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    slots = getattr(type(v), "__slots__", None)
    if slots is not None and hasattr(v, "__dataclass_fields__"):
        return {name: _plain(getattr(v, name)) for name in v.__dataclass_fields__}
    raise TypeError(f"cannot serialize {type(v).__name__}")


# --- rows -> views ------------------------------------------------------------------
#
# Views are built column by column (one ``to_pylist`` per leaf column, never a dict per
# row), and equal nested values (refs, contexts, tools, usages) are built once per table
# and shared: they are frozen values, so sharing one object changes nothing a caller can
# observe (``==``, ``repr`` and ``serialize()`` are those of a value built per row).


def _arr(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _children(col: pa.ChunkedArray | pa.Array) -> tuple[list[bool], list[pa.Array]]:
    """(valid per row, each child with the struct's nulls applied) of a struct column."""
    arr = _arr(col)
    return arr.is_valid().to_pylist(), arr.flatten()


def _keys(arr: pa.Array) -> tuple[list[Any], list[Any]]:
    """(key per row, value per key) of a primitive column: the keys are the indices of a
    dictionary encoding (None for null), so equal keys mean values Arrow finds identical
    (floats by bit pattern: 0.0 and -0.0 stay apart)."""
    enc = pc.dictionary_encode(arr)
    return enc.indices.to_pylist(), enc.dictionary.to_pylist()


def _lists(arr: pa.Array) -> list[tuple[Any, ...]]:
    """A list<...> column as one tuple per row (a null list gives ())."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not len(arr):
        return []
    offsets = arr.offsets.to_pylist()
    lo, hi = offsets[0], offsets[-1]
    values = arr.values.slice(lo, hi - lo).to_pylist()
    valid = arr.is_valid().to_pylist()
    return [tuple(values[a - lo:b - lo]) if v else ()
            for v, a, b in zip(valid, offsets, offsets[1:], strict=False)]


def _interned(valid: list[bool], keys: Any, make: Any) -> list[Any]:
    """``make(*key)`` per valid row, None per null one, one object per distinct key."""
    cache: dict[Any, Any] = {}
    out: list[Any] = []
    append = out.append
    for v, k in zip(valid, keys, strict=True):
        if not v:
            append(None)
            continue
        obj = cache.get(k)
        if obj is None:
            obj = cache[k] = make(*k)
        append(obj)
    return out


def _refs(col: pa.ChunkedArray) -> list[BlobRef | None]:
    valid, (tenant, sha, size) = _children(col)
    return _interned(valid, zip(tenant.to_pylist(), sha.to_pylist(), size.to_pylist(),
                                strict=True), BlobRef)


def _contexts(col: pa.ChunkedArray) -> list[ContextPartition | None]:
    valid, (packed, available, dropped) = _children(col)
    return _interned(valid, zip(_lists(packed), _lists(available), _lists(dropped),
                                strict=True), ContextPartition)


def _tools(col: pa.ChunkedArray) -> list[ToolInfo | None]:
    valid, (calls,) = _children(col)
    return _interned(valid, ((c,) for c in _lists(calls)), ToolInfo)


def _usages(col: pa.ChunkedArray) -> list[Usage | None]:
    valid, children = _children(col)
    encoded = [_keys(c) for c in children]
    names = [f.name for f in _arr(col).type]
    values = [vals for _k, vals in encoded]

    def make(*key: int | None) -> Usage:
        return Usage(**{n: None if k is None else vals[k]
                        for n, k, vals in zip(names, key, values, strict=True)})

    return _interned(valid, zip(*(k for k, _v in encoded), strict=True), make)


def _attempt_views(attempts: pa.Table) -> list[AttemptView]:
    """One ``AttemptView`` per row of an ``attempts`` table, in row order."""
    c = attempts.column
    return list(map(
        AttemptView, c("step_id").to_pylist(), c("step_index").to_pylist(),
        c("attempt_no").to_pylist(), c("state").to_pylist(),
        c("workflow_version").to_pylist(), _contexts(c("context")), _refs(c("prompt")),
        _refs(c("output")), _tools(c("tools")), _usages(c("usage")),
        c("error").to_pylist(), c("first_lsn").to_pylist(), c("last_lsn").to_pylist()))


def _groups(*cols: list[Any]) -> dict[Any, tuple[int, int]]:
    """key -> (first row, end row) of each run of equal keys in rows sorted by key (the
    first run of a key wins, as the sorted merge this replaces would)."""
    out: dict[Any, tuple[int, int]] = {}
    keys = list(zip(*cols, strict=True)) if len(cols) > 1 else cols[0]
    n = len(keys)
    lo = 0
    for i in range(1, n + 1):
        if i == n or keys[i] != keys[lo]:
            out.setdefault(keys[lo], (lo, i))
            lo = i
    return out


def episodes_from_tables(tables: Mapping[str, pa.Table], *, at_lsn: int,
                         all_branches: bool = True,
                         lsn_of: Mapping[str, int] | None = None) -> Iterator[EpisodeView]:
    """Build one view per row of ``runs`` from fold tables sorted as ``TABLE_KEYS`` says
    (the views' order and the state's order), in run_id order. ``lsn_of`` gives a run
    its own ``at_lsn`` (runs it does not name get ``at_lsn``)."""
    att, br, runs = tables["attempts"], tables["branches"], tables["runs"]
    views = _attempt_views(att)
    own = _groups(att.column("run_id").to_pylist(), att.column("branch_id").to_pylist())
    b_run = br.column("run_id").to_pylist()
    b_id = br.column("branch_id").to_pylist()
    b_rows = zip(b_run, b_id, br.column("parent_branch_id").to_pylist(),
                 br.column("fork_step_index").to_pylist(), br.column("fork_lsn").to_pylist(),
                 br.column("is_live").to_pylist(), strict=True)
    by_run: dict[str, list[BranchView]] = {}
    for run_id, branch_id, parent, fork_step, fork_lsn, is_live in b_rows:
        got = by_run.setdefault(run_id, [])
        if all_branches or is_live:
            span = own.get((run_id, branch_id))
            got.append(BranchView(branch_id, parent, fork_step, fork_lsn, is_live,
                                  tuple(views[span[0]:span[1]]) if span else ()))
    r = runs.column
    for run_id, tenant, version, state, live in zip(
            r("run_id").to_pylist(), r("tenant").to_pylist(),
            r("workflow_version").to_pylist(), r("state").to_pylist(),
            r("live_branch").to_pylist(), strict=True):
        lsn = at_lsn if lsn_of is None else lsn_of.get(run_id, at_lsn)
        yield EpisodeView(run_id, tenant, version, state, live, lsn,
                          tuple(by_run.get(run_id, ())))


def one_episode(tables: Mapping[str, pa.Table], run_id: str, *, at_lsn: int,
                all_branches: bool) -> EpisodeView:
    """The view of ``run_id`` from tables that hold (at least) that run's rows."""
    only = {name: tables[name].filter(pc.equal(tables[name].column("run_id"), run_id))
            for name in EPISODE_TABLES}
    for view in episodes_from_tables(only, at_lsn=at_lsn, all_branches=all_branches):
        return view
    raise NotFound(f"no run {run_id!r} in the log at lsn {at_lsn}")


def _fold_run(log: EventLog, run_id: str, *, at_lsn: int, names: tuple[str, ...],
              min_lsn: int = 1) -> dict[str, pa.Table]:
    """Fold one run from the log (its events only: every fold rule is per run)."""
    return fold_tables(run_events(log, [run_id], at_lsn=at_lsn, min_lsn=min_lsn), names)


def fold_episode(log: EventLog, run_id: str, *, at_lsn: int, all_branches: bool,
                 min_lsn: int = 1) -> EpisodeView:
    """Fold one run from the log (its events only: every fold rule is per run)."""
    tables = _fold_run(log, run_id, at_lsn=at_lsn, names=EPISODE_TABLES, min_lsn=min_lsn)
    return one_episode(tables, run_id, at_lsn=at_lsn, all_branches=all_branches)


# --- serving from the materialized state -------------------------------------------


def _locate(log: EventLog, ptr: Pointer, run_id: str) -> tuple[tuple[int, int], int] | None:
    """((bucket, chunk), first_lsn) of a run in the state, found through the run index."""
    for f in ptr.tables.get(INDEX, ()):
        rows = read_run(log, f, run_id, ptr)
        if rows.num_rows:
            return ((rows.column("bucket")[0].as_py(), rows.column("chunk")[0].as_py()),
                    rows.column("first_lsn")[0].as_py())
    return None


def _state_run(log: EventLog, ptr: Pointer, run_id: str,
               names: tuple[str, ...]) -> dict[str, pa.Table]:
    """The run's rows of each table from its (bucket, chunk) file (empty: no such run)."""
    where = _locate(log, ptr, run_id)
    tables = {}
    for t in names:
        f = None if where is None else next(
            (f for f in ptr.tables.get(t, ()) if f.key == where[0]), None)
        tables[t] = read_run(log, f, run_id, ptr) if f else table_schemas()[t].empty_table()
    return tables


def _serve(log: EventLog, ptr: Pointer, run_id: str, *, at_lsn: int,
           all_branches: bool) -> EpisodeView:
    tables = _state_run(log, ptr, run_id, EPISODE_TABLES)
    return one_episode(tables, run_id, at_lsn=at_lsn, all_branches=all_branches)


def episode_from_state(log: EventLog, run_id: str, *, at_lsn: int,
                       all_branches: bool) -> EpisodeView:
    for attempt in range(3):  # a state replaced while read: read the new pointer
        ptr = usable_pointer(log)
        if ptr is None:
            raise NotFound(f"no materialized state of this fold version in {log.root}")
        if ptr.lsn != at_lsn:
            raise NotFound(f"the materialized state covers lsn {ptr.lsn}, not {at_lsn}")
        try:
            return _serve(log, ptr, run_id, at_lsn=at_lsn, all_branches=all_branches)
        except StateChanged:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def run_tables(log: EventLog, run_id: str, *, at_lsn: int,
               names: tuple[str, ...] = EPISODE_TABLES) -> dict[str, pa.Table]:
    """One run's rows of each named per-run table at ``at_lsn`` (empty tables when there
    is no such run), served as ``episode(source="auto")`` serves: from the run's state
    file when no later commit touched it, else by folding its events from its first
    (through the run index), else by folding it from the log. A point read: never a
    scan of a whole table."""
    ptr = usable_pointer(log)
    if ptr is None or ptr.lsn > at_lsn:  # before the state: its run index still bounds
        return _fold_run(log, run_id, at_lsn=at_lsn, names=names,  # where the run starts
                         min_lsn=first_lsn_bound(log, ptr, run_id, at_lsn=at_lsn))
    try:
        if ptr.lsn < at_lsn:
            newer = log.scan(at_lsn, ptr.lsn + 1, columns=("run_id",), run_ids=[run_id])
            if any(b.num_rows for b in newer):
                where = _locate(log, ptr, run_id)
                lo = where[1] if where is not None else ptr.lsn + 1
                return _fold_run(log, run_id, at_lsn=at_lsn, names=names, min_lsn=lo)
        return _state_run(log, ptr, run_id, names)
    except (CorruptionError, StateChanged):  # damaged, or replaced while read: the log
        return _fold_run(log, run_id, at_lsn=at_lsn, names=names)


def first_lsn_bound(log: EventLog, ptr: Pointer | None, run_id: str, *, at_lsn: int) -> int:
    """An LSN at or below the run's first event (``first_lsns``): what a read of this run
    at ``at_lsn`` need not scan below; ``at_lsn + 1`` when the state shows it has no event
    by then (a scan from there reads nothing); 1 without a usable state (``ptr``)."""
    if ptr is None:
        return 1
    return min(first_lsns(log, [run_id], ptr)[run_id], at_lsn + 1)


def first_lsns(log: EventLog, run_ids: Sequence[str], ptr: Pointer | None = None
               ) -> dict[str, int]:
    """For each run, an LSN at or below its first event, from the state's run index (one
    read of it: it has every run with an event by the state's LSN, with its first LSN);
    ``ptr.lsn + 1`` for a run it lacks; 1 for all without a usable state with a run index
    (``ptr``, else the pointer's), or with a damaged one. Every row group of the index is
    read, pages checked by CRC: a run's absence is taken as a fact here, so the footer's
    statistics, which no checksum covers, may not prune it away."""
    out = dict.fromkeys(run_ids, 1)
    if ptr is None:
        ptr = usable_pointer(log)
    if ptr is None or not out or not ptr.tables.get(INDEX):
        return out
    want = pa.array(sorted(out), pa.string())
    found: dict[str, int] = {}
    try:
        for f in ptr.tables[INDEX]:
            t = read_runs(log, f, want, ptr)
            found.update(zip(t.column("run_id").to_pylist(),
                             t.column("first_lsn").to_pylist(), strict=True))
    except (CorruptionError, StateChanged):  # damaged, or moved on: it bounds nothing
        return out
    return {r: found.get(r, ptr.lsn + 1) for r in out}


def run_labels(log: LogLike, run_id: str, *, at_lsn: int | None = None
               ) -> list[tuple[str, str]]:
    """The labels of the run's last ``run_started`` at ``at_lsn`` (the head), sorted: a
    scan of the run's events from its first (through the state's run index), two
    columns kept. (The viewer asked the ``events`` view: a scan of the whole log.)"""
    log = as_log(log)
    check_run_id(run_id, "run_labels")
    at = resolve_lsn(log, at_lsn)
    lo = first_lsn_bound(log, usable_pointer(log), run_id, at_lsn=at)
    last: Any = None
    for b in log.scan(at, lo, columns=("kind", "labels"), run_ids=[run_id]):
        started = b.filter(pc.equal(b.column("kind"), "run_started"))
        if started.num_rows:
            last = started.column("labels")[started.num_rows - 1].as_py()
    return sorted(last or ())


def episode_auto(log: EventLog, run_id: str, *, at_lsn: int,
                 all_branches: bool) -> EpisodeView:
    """Serve from the state; fold the run again when later commits touched it."""
    tables = run_tables(log, run_id, at_lsn=at_lsn)
    return one_episode(tables, run_id, at_lsn=at_lsn, all_branches=all_branches)


def resolve_lsn(log: EventLog, at_lsn: int | None) -> int:
    """``at_lsn`` checked against the head (``ValidationError`` outside 0..head)."""
    head = log.head
    if at_lsn is None:
        return head
    if isinstance(at_lsn, bool) or not isinstance(at_lsn, int) or not 0 <= at_lsn <= head:
        raise ValidationError(f"at_lsn {at_lsn!r} is outside 0..{head}")
    return at_lsn


def episode(
    log: LogLike,
    run_id: str,
    *,
    storage_options: dict[str, Any] | None = None,
    all_branches: bool = False,
    at_lsn: int | None = None,
    source: Source = "auto",
) -> EpisodeView:
    """The episode of ``run_id`` as the log stood at ``at_lsn`` (default: the head).

    ``source="log"`` folds the log; ``"state"`` serves only from a materialized state made
    at exactly that LSN by this fold version (else ``NotFound``); ``"auto"`` serves from
    the state, folding the run again only when commits after the state touched it, and
    folds the log when no usable state exists. Never reads a blob body.
    """
    if source not in SOURCES:
        raise ValidationError(f"source must be one of {SOURCES}, got {source!r}")
    check_run_id(run_id, "episode")
    log = as_log(log, storage_options=storage_options, read_only=True)
    lsn = resolve_lsn(log, at_lsn)
    if source == "log":
        return fold_episode(log, run_id, at_lsn=lsn, all_branches=all_branches)
    if source == "state":
        return episode_from_state(log, run_id, at_lsn=lsn, all_branches=all_branches)
    return episode_auto(log, run_id, at_lsn=lsn, all_branches=all_branches)


__all__ = ["AttemptView", "BranchView", "EpisodeView", "episode", "episodes_from_tables",
           "one_episode", "run_tables"]
