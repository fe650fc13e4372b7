"""A checkpoint's segment lists: the live segments at its seq, split into Arrow IPC files
that later checkpoints reuse.

A checkpoint names its lists in LSN order (``segment_lists`` in its document, each entry
``{path, size, sha256, segments, first_lsn, last_lsn}``: the list's rows and the LSNs its
segments span); their rows, one list after the other, are the segments live at its seq,
ordered by ``first_lsn``. A checkpoint starts from the lists of the checkpoint before it
(this process's own, or the pointer's, read from its document alone) and writes only the
lists that changed since, as Iceberg's snapshots share manifests: the segments committed
since, and the lists a compaction took segments out of. A compaction's new segments span
exactly the LSNs of the segments it replaced (its groups are runs of consecutive
segments), so the lists whose span meets one of them are the ones it changed. Before, each
checkpoint wrote every live segment again: 30 MB every 100 commits for a recorder's log of
200,000 segments.

To keep the number of lists small, the newest list is merged into the one before it as
long as that one holds no more segments than it (a binary counter: at most about
log2(checkpoints) + 1 lists, each segment written that many times over the log's life),
and past ``MAX_SEGMENT_LISTS`` the two adjacent lists with the fewest segments between
them are merged (lists a compaction wrote in the middle). A list to merge whose segments
this process does not hold is read back (checked against its entry).

A list file is named by the checkpoint that first wrote it and the start of its sha256
(``_log/<seq>.checkpoint.segments.<16 hex>.arrow``), so two processes writing a checkpoint
at the same seq, which may split it differently, never write different bytes under one
name. A checkpoint written before lists were shared names one file,
``_log/<seq>.checkpoint.segments.arrow`` (``segments_file``, with no span, in its
document); it is read, and reused once read, as a single list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from poimen_data.errors import CorruptionError
from poimen_data.log._manifest import LOG_DIR, Manifest, SegmentInfo

#: a checkpoint's segment lists at most; past it adjacent lists are merged
MAX_SEGMENT_LISTS = 32

_COLUMNS = ("path", "rows", "size", "sha256", "first_lsn", "seq", "has_lsn")


def list_entries(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The segment lists a checkpoint document names, in order: ``segment_lists``, or
    the one ``segments_file`` of a checkpoint written before lists were shared.
    ``KeyError``/``TypeError`` for a document with neither."""
    if "segment_lists" in doc:
        entries = doc["segment_lists"]
    else:
        entries = [doc["segments_file"]]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise TypeError("segment_lists is not a list of objects")
    return entries


def list_path(seq: int, data: bytes) -> str:
    """Where checkpoint ``seq`` writes a list of these bytes."""
    return f"{LOG_DIR}/{seq:020d}.checkpoint.segments.{hashlib.sha256(data).hexdigest()[:16]}.arrow"


def list_seq(name: str) -> int | None:
    """The seq of the checkpoint that wrote a list file (a name in ``_log/``), or None
    when the name is not a list's."""
    head, dot, rest = name.partition(".")
    if not (dot and head.isascii() and head.isdigit()):
        return None
    if rest == "checkpoint.segments.arrow":
        return int(head)
    mid = rest.removeprefix("checkpoint.segments.").removesuffix(".arrow")
    if len(mid) == 16 and len(rest) == len(mid) + len("checkpoint.segments..arrow") \
            and all(c in "0123456789abcdef" for c in mid):
        return int(head)
    return None


def document_seq(name: str) -> int | None:
    """The seq of a checkpoint document (a name in ``_log/``), or None when the name is
    not a checkpoint document's."""
    head, dot, rest = name.partition(".")
    if dot and rest == "checkpoint.json" and head.isascii() and head.isdigit():
        return int(head)
    return None


def list_bytes(segs: Iterable[SegmentInfo]) -> bytes:
    """One segment list: the segments in LSN order, as one Arrow IPC file."""
    segs = sorted(segs, key=lambda s: s.first_lsn)
    table = pa.table({
        "path": pa.array([s.path for s in segs], pa.string()),
        "rows": pa.array([s.rows for s in segs], pa.int64()),
        "size": pa.array([s.size for s in segs], pa.int64()),
        "sha256": pa.array([s.sha256 for s in segs], pa.string()),
        "first_lsn": pa.array([s.first_lsn for s in segs], pa.int64()),
        "seq": pa.array([s.seq for s in segs], pa.int64()),
        "has_lsn": pa.array([s.has_lsn for s in segs], pa.bool_()),
    })
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def list_segments(data: bytes) -> list[SegmentInfo]:
    """The segments of a list file's bytes, in its order."""
    t = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    cols = [t.column(c).to_pylist() for c in _COLUMNS]
    return [SegmentInfo(*row) for row in zip(*cols, strict=True)]


def list_entry(path: str, data: bytes, segs: Sequence[SegmentInfo]) -> dict[str, Any]:
    """A list's entry in a checkpoint document."""
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            **_span(segs)}


def _span(segs: Sequence[SegmentInfo]) -> dict[str, int]:
    return {"segments": len(segs), "first_lsn": segs[0].first_lsn if segs else 0,
            "last_lsn": max((s.last_lsn for s in segs), default=0)}


@dataclass(frozen=True, eq=False)
class SegmentList:
    """One list file a checkpoint names: its entry in the document (with its span), and
    its segments when this process holds them (it wrote or read the list)."""

    entry: dict[str, Any]
    segs: tuple[SegmentInfo, ...] | None = None

    @classmethod
    def read(cls, entry: dict[str, Any], segs: Sequence[SegmentInfo]) -> SegmentList:
        """A list read from its file: its entry given a span if it had none (a
        ``segments_file``)."""
        return cls({**entry, **_span(segs)}, tuple(segs))

    @property
    def count(self) -> int:
        return int(self.entry["segments"])

    @property
    def first(self) -> int:
        return int(self.entry["first_lsn"])

    @property
    def last(self) -> int:
        return int(self.entry["last_lsn"])

    @staticmethod
    def spanned(entry: Mapping[str, Any]) -> bool:
        """Whether a document's entry carries the span a checkpoint reuses it by."""
        return all(type(entry.get(k)) is int for k in ("segments", "first_lsn", "last_lsn"))


@dataclass(frozen=True, eq=False)
class KnownLists:
    """The lists of the checkpoint at ``seq``: what a later checkpoint may reuse."""

    seq: int
    lists: tuple[SegmentList, ...]


#: a plan's item: a list reused as it is, or the segments of a list to write
Planned = SegmentList | list[SegmentInfo]


def _count(x: Planned) -> int:
    return x.count if isinstance(x, SegmentList) else len(x)


class Replan(Exception):
    """The known lists do not add up to the live segments: plan from the live ones."""


def plan_lists(known: KnownLists | None, changes: Sequence[Manifest],
               live: Mapping[str, SegmentInfo],
               read: Callable[[SegmentList], Sequence[SegmentInfo]]) -> list[Planned]:
    """The lists of a checkpoint whose live segments are ``live``, in LSN order: those of
    ``known`` that no commit of ``changes`` (every commit after ``known.seq`` up to the
    checkpoint's seq) took a segment out of, reused; the rest written again with the
    segments committed since. Without ``known``, or when its lists do not add up to
    ``live``: every segment, in one list. ``read`` gives the segments of a list this
    process does not hold (to merge it, or to keep what a compaction left of it)."""
    if known is None:
        fresh = sorted(live.values(), key=lambda s: s.first_lsn)
        return [fresh] if fresh else []
    try:
        return _plan(known, changes, live, read)
    except Replan:
        return plan_lists(None, changes, live, read)


def _plan(known: KnownLists, changes: Sequence[Manifest], live: Mapping[str, SegmentInfo],
          read: Callable[[SegmentList], Sequence[SegmentInfo]]) -> list[Planned]:
    def segs(x: Planned) -> list[SegmentInfo]:
        if not isinstance(x, SegmentList):
            return x
        got = list(x.segs if x.segs is not None else read(x))
        if any(s.path not in live for s in got):
            raise Replan  # a compaction this plan did not see took one out
        return got

    if [m.seq for m in changes] != list(range(known.seq + 1, known.seq + 1 + len(changes))):
        raise Replan  # not every commit since: what this plan did not see could be anything
    spans = []  # the LSNs each compaction since rewrote: the spans of its new segments
    for m in changes:
        if m.supersedes:
            if not m.segments:
                raise Replan  # segments taken out with nothing in their place
            spans += [(s.first_lsn, s.last_lsn) for s in m.segments]
    dirty = {sl for sl in known.lists for lo, hi in spans if sl.first <= hi and lo <= sl.last}
    fresh = [live[s.path] for m in changes for s in m.segments if s.path in live]
    for sl in dirty:
        fresh += [s for s in (sl.segs if sl.segs is not None else read(sl)) if s.path in live]
    fresh.sort(key=lambda s: s.first_lsn)
    clean = [sl for sl in known.lists if sl not in dirty]
    if sum(sl.count for sl in clean) + len(fresh) != len(live):
        raise Replan  # the spans missed a compaction's change (not expected)
    # clean lists and runs of fresh segments, by LSN
    items: list[Planned] = []
    i = 0
    for sl in clean:
        run = []
        while i < len(fresh) and fresh[i].first_lsn < sl.first:
            run.append(fresh[i])
            i += 1
        if run:
            items.append(run)
        items.append(sl)
    if i < len(fresh):
        items.append(fresh[i:])
    if not _ordered(items):
        raise Replan
    while len(items) >= 2 and _count(items[-2]) <= _count(items[-1]):
        items[-2:] = [segs(items[-2]) + segs(items[-1])]
    while len(items) > MAX_SEGMENT_LISTS:
        j = min(range(len(items) - 1), key=lambda k: _count(items[k]) + _count(items[k + 1]))
        items[j:j + 2] = [segs(items[j]) + segs(items[j + 1])]
    return items


def _ordered(items: Sequence[Planned]) -> bool:
    """Whether the items' segments, one list after the other, span increasing LSNs."""
    prev = 0
    for x in items:
        lo, hi = (x.first, x.last) if isinstance(x, SegmentList) else \
            (x[0].first_lsn, max(s.last_lsn for s in x))
        if lo <= prev:
            return False
        prev = hi
    return True


def checked_segments(sl: SegmentList, data: bytes | None, where: str) -> list[SegmentInfo]:
    """The segments of a list file's bytes, checked against its entry (size, sha256 and
    span); ``CorruptionError`` otherwise."""
    e = sl.entry
    if data is None or len(data) != e["size"] or hashlib.sha256(data).hexdigest() != e["sha256"]:
        raise CorruptionError(f"{where}: segment list {e['path']} missing or damaged")
    segs = list_segments(data)
    if SegmentList.spanned(e) and _span(segs) != {k: e[k] for k in
                                                  ("segments", "first_lsn", "last_lsn")}:
        raise CorruptionError(f"{where}: segment list {e['path']} is not what its entry says")
    return segs
