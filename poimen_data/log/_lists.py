"""A checkpoint's segment lists: the live segments at its seq, split into Arrow IPC files
that later checkpoints reuse.

A checkpoint names its lists in LSN order (``segment_lists`` in its document); their rows,
one after the other, are the segments live at its seq, ordered by ``first_lsn``. A
checkpoint writes only the lists that changed since the one before it, as Iceberg's
manifest lists share manifests between snapshots: the segments committed since, and any
list a compaction took segments out of. Before, each checkpoint wrote every live segment
again: 30 MB every 100 commits for a recorder's log of 200,000 segments.

To keep the number of lists small, the newest list is merged into the one before it as
long as that one holds no more segments than it (a binary counter: at most about
log2(segments / interval) + 1 lists, each segment written again that many times over the
log's life), and past ``MAX_SEGMENT_LISTS`` the two adjacent lists with the fewest segments
between them are merged (lists a compaction wrote in the middle).

A list file is named by the checkpoint that first wrote it and the start of its sha256
(``_log/<seq>.checkpoint.segments.<16 hex>.arrow``), so two processes writing a checkpoint
at the same seq, which may split it differently, never write different bytes under one
name. A checkpoint written before lists were shared names one file,
``_log/<seq>.checkpoint.segments.arrow`` (``segments_file`` in its document); it is read,
and reused, as a single list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

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


@dataclass(frozen=True, eq=False)
class SegmentList:
    """One list file a checkpoint names: its entry in the document (path, size, sha256)
    and its segments' paths in LSN order, with the ``first_lsn`` of its first and last
    segment (what a later checkpoint places and reuses it by)."""

    entry: dict[str, Any]
    paths: tuple[str, ...]
    first: int
    last: int

    @classmethod
    def of(cls, entry: dict[str, Any], segs: Sequence[SegmentInfo]) -> SegmentList:
        return cls(entry, tuple(s.path for s in segs), segs[0].first_lsn if segs else 0,
                   segs[-1].first_lsn if segs else 0)


@dataclass(frozen=True, eq=False)
class KnownLists:
    """The lists of the checkpoint at ``seq`` that this process read or wrote, and the list
    each of its segments is in: what its next checkpoint may reuse."""

    seq: int
    lists: tuple[SegmentList, ...]
    where: dict[str, SegmentList]

    @classmethod
    def of(cls, seq: int, lists: Sequence[SegmentList]) -> KnownLists:
        return cls(seq, tuple(lists), {p: sl for sl in lists for p in sl.paths})


#: a plan's item: a list reused as it is, or the segments of a list to write
Planned = SegmentList | list[SegmentInfo]


def _count(x: Planned) -> int:
    return len(x.paths) if isinstance(x, SegmentList) else len(x)


def plan_lists(known: KnownLists | None, changes: Sequence[Manifest],
               live: Mapping[str, SegmentInfo]) -> list[Planned]:
    """The lists of a checkpoint whose live segments are ``live``, in LSN order: those of
    ``known`` that no commit of ``changes`` (every commit after ``known.seq`` up to the
    checkpoint's seq) took a segment out of, reused; the rest written again with the
    segments committed since. Without ``known``: every segment, in one list."""
    if known is None:
        fresh = sorted(live.values(), key=lambda s: s.first_lsn)
        return [fresh] if fresh else []
    dirty: set[SegmentList] = set()
    for m in changes:
        for p in m.supersedes:
            sl = known.where.get(p)
            if sl is not None:
                dirty.add(sl)
    fresh = [live[s.path] for m in changes for s in m.segments if s.path in live]
    fresh += [live[p] for sl in dirty for p in sl.paths if p in live]
    fresh.sort(key=lambda s: s.first_lsn)
    clean = [sl for sl in known.lists if sl not in dirty]
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
    if not _ordered(items):  # not expected; one list of every segment is always right
        return plan_lists(None, changes, live)
    try:
        while len(items) >= 2 and _count(items[-2]) <= _count(items[-1]):
            _merge(items, len(items) - 2, live)
        while len(items) > MAX_SEGMENT_LISTS:
            j = min(range(len(items) - 1),
                    key=lambda k: _count(items[k]) + _count(items[k + 1]))
            _merge(items, j, live)
    except KeyError:  # a merged list's segment not live: ``changes`` missed a commit (a
        # caller's bug; a list merely reused is not looked through, that would cost O(n))
        return plan_lists(None, changes, live)
    return items


def _ordered(items: Sequence[Planned]) -> bool:
    """Whether the items' segments, one list after the other, are in LSN order."""
    prev = None
    for x in items:
        lo, hi = (x.first, x.last) if isinstance(x, SegmentList) else \
            (x[0].first_lsn, x[-1].first_lsn)
        if prev is not None and lo < prev:
            return False
        prev = hi
    return True


def _merge(items: list[Planned], j: int, live: Mapping[str, SegmentInfo]) -> None:
    """Replace items ``j`` and ``j + 1`` by one list of their segments, to write."""
    def segs(x: Planned) -> list[SegmentInfo]:
        return [live[p] for p in x.paths] if isinstance(x, SegmentList) else x

    items[j:j + 2] = [segs(items[j]) + segs(items[j + 1])]
