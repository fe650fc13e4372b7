"""Maintenance of a log: reduction, vacuum and compaction, under one lease.

All three delete or supersede files, so they run one at a time per log: each takes the
maintenance lease ``_lease.json`` (put-if-absent, with an expiry) and raises
``LeaseHeld`` when another process has it (``log._lease``; a commit in doubt is settled
under it too, ``EventLog.settle``). Writers never take the lease; the commit protocol in
``_log`` keeps them safe from what maintenance removes:

- a writer reuses a body only while it is committed and not reduced; if a reduction
  lands before its publish it stages the body itself (``Transaction._manifest``);
- a body committed again after a reduction stays in its staging area (``_promote``), so
  a reducer deleting ``blobs/<t>/<aa>/<sha>`` can never delete a newer commit's body;
- vacuum removes staging areas and segments by reachability from every manifest and
  only when older than the grace period, so a writer between staging and publishing
  keeps its files.
"""

from __future__ import annotations

import bisect
import logging
import numbers
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from poimen_data.errors import (
    CorruptionError,
    NotFound,
    ValidationError,
    WritersActive,
)
from poimen_data.fold._state import files_in_use
from poimen_data.log import LEASE, lease, lease_holder
from poimen_data.log._lists import document_seq, list_entries, list_seq
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.log._manifest import (
    LOG_DIR,
    Manifest,
    SegmentInfo,
    blob_path,
    checkpoint_path,
    loads,
)
from poimen_data.log._staged import Packs, piece_of
from poimen_data.log._txn import now_iso
from poimen_data.model import _events as ev
from poimen_data.model._limits import is_count, short_repr
from poimen_data.storage import Storage

_logger = logging.getLogger("poimen_data")
DEFAULT_GRACE_S = 3600.0
COMPACT_TARGET_ROWS = 100_000
# A writer's uncommitted file younger than this means it may be alive (between staging and
# publishing): vacuum with a shorter grace refuses to run (see ``vacuum``'s ``force``).
WRITER_ACTIVE_S = 10.0


def break_lease(log: LogLike, *,
                storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Remove the maintenance lease whoever holds it; returns what it said (None when
    there was none). Only for a holder known dead (a killed job keeps it for its TTL): a
    live holder rereads the lease at most every TTL/10 (60 s by default) and stops at the
    first ``check()`` after it sees the lease gone; until then it goes on, and a step
    already under way finishes. A second job that takes the lease meanwhile runs beside
    it for that while."""
    log = as_log(log, storage_options=storage_options)
    log.check_writable("break_lease")
    held = lease_holder(log)
    if held is not None:
        log.storage.delete(LEASE)
    return held


# --- reduce ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ReduceReport:
    reduced: tuple[tuple[ev.BlobRef, ev.BlobRef], ...]  # (original, summary)
    skipped: tuple[ev.BlobRef, ...]  # already reduced
    bytes_freed: int
    lsn: int | None


def reduce(
    log: LogLike,
    refs: Iterable[ev.BlobRef],
    summarize: Callable[[bytes], bytes | str],
    *,
    storage_options: dict[str, Any] | None = None,
) -> ReduceReport:
    """Replace bodies by summaries: one commit of ``blob_reduced`` events (with the
    summaries as blobs), then delete the originals (an original that is a piece of a
    recorder window's pack goes with the pack, once the pack's other bodies are promoted;
    a pack that also holds a recommitted body waits for vacuum). ``get`` of an original
    returns None from then on."""
    log = as_log(log, storage_options=storage_options)
    try:
        refs = list(dict.fromkeys(refs))
    except TypeError:
        raise ValidationError(f"reduce: refs must be an iterable of BlobRef, got "
                              f"{type(refs).__name__}") from None
    for r in refs:
        ev.check_ref(r, "reduce")
    with lease(log) as held:
        log.refresh()
        done: list[tuple[ev.BlobRef, ev.BlobRef]] = []
        skipped: list[ev.BlobRef] = []
        copies: dict[tuple[str, str], set[str]] = {}
        packs: dict[str, tuple[Manifest, list[int]]] = {}  # pack -> (its commit, sizes)
        with log.transaction() as tx:
            for r in refs:
                held.check()
                body = log.blobs.get(r)
                if body is None:
                    skipped.append(r)
                    continue
                key = (r.tenant, r.sha256)
                # every stored copy, before the reduction forgets them
                copies[key] = log.stored_copies(key)
                _note_pack(log, key, packs)
                out = summarize(body)
                if not isinstance(out, bytes | str):
                    raise ValidationError(f"reduce: summarize must return bytes or str, got "
                                          f"{type(out).__name__}")
                try:
                    data = out.encode() if isinstance(out, str) else out
                except UnicodeEncodeError:
                    raise ValidationError(f"reduce: the summary of {r.sha256[:12]}… is not "
                                          "valid UTF-8 text (a lone surrogate)") from None
                s = tx.put_blob(r.tenant, data)
                if s.sha256 == r.sha256:
                    raise ValidationError(f"reduce: the summary of {r.sha256[:12]}… is the "
                                          "body itself; nothing would be reduced")
                tx.append(ev.BlobReduced(r.tenant, r, s))
                done.append((r, s))
            held.check()  # before the commit that makes the originals deletable
        freed = 0
        held.check()
        for r, _s in done:
            for p in sorted(copies[(r.tenant, r.sha256)]):
                size = log.storage.size(p)
                if size is not None and log.storage.delete(p, check=False):
                    freed += size
        for pack, (m, sizes) in sorted(packs.items()):
            held.check()
            # an original that is a piece of a pack goes with the pack: its other bodies
            # are promoted first (a body recommitted there keeps the pack for vacuum)
            if log.storage.exists(pack):
                log.promote(m)
                if not log.storage.exists(pack):
                    freed += sum(sizes)
    info = tx.commit_info
    return ReduceReport(tuple(done), tuple(skipped), freed,
                        info.last_lsn if info and info.seq and done else None)


def bodies_larger_than(log: LogLike, size: int, *,
                       storage_options: dict[str, Any] | None = None) -> list[ev.BlobRef]:
    """Every distinct body ref (prompt or output) of the log larger than ``size`` bytes,
    sorted by (tenant, sha256): what ``poimen reduce --larger-than`` reduces. Reads the
    log one segment at a time, the two ref columns only (memory: the refs found, not the
    log)."""
    import pyarrow.compute as pc

    if not is_count(size):
        raise ValidationError(f"bodies_larger_than: size must be a count of bytes, got "
                              f"{short_repr(size)}")
    log = as_log(log, storage_options=storage_options)
    size = min(int(size), (1 << 63) - 1)  # sizes are int64: nothing is larger than that
    found: dict[tuple[str, str], ev.BlobRef] = {}
    for batch in log.scan(columns=["prompt", "output"]):
        for col in batch.columns:
            big = pc.fill_null(pc.greater(pc.struct_field(col, "size"), size), False)
            for d in col.filter(big).to_pylist():
                found[(d["tenant"], d["sha256"])] = ev.BlobRef(**d)
    return [found[k] for k in sorted(found)]


# --- vacuum ----------------------------------------------------------------------------


@dataclass(frozen=True)
class VacuumReport:
    staging_removed: int = 0  # files of uncommitted staging areas
    staging_promoted: int = 0  # bodies of committed staging areas rolled forward
    segments_removed: int = 0
    bodies_removed: int = 0
    bytes_removed: int = 0
    kept_young: int = 0  # files left because they are younger than the grace period
    state_files_removed: int = 0  # materialized-state files no pointer names
    temp_files_removed: int = 0  # temp files a writer died with under _log/
    checkpoints_removed: int = 0  # checkpoint documents no reader falls back to (see vacuum)
    segment_lists_removed: int = 0  # checkpoints' segment lists no document left names


def _check_seconds(name: str, v: Any) -> None:
    """``vacuum``'s ages: a number of seconds >= 0 (infinity keeps everything; NaN, which
    compares false with every age, would remove at once what a grace is there to keep)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not float(v) >= 0:
        raise ValidationError(f"vacuum: {name} must be a number of seconds >= 0, got "
                              f"{short_repr(v)}")


def vacuum(log: LogLike, *, storage_options: dict[str, Any] | None = None,
           grace: float = DEFAULT_GRACE_S, retention: float | None = None,
           force: bool = False) -> VacuumReport:
    """Remove what no retained manifest reaches, once older than ``grace`` seconds.

    - staging of commits that never published (a crash, an abort) is removed; staging of
      published commits is promoted first;
    - segment files no manifest lists (a crash before publish) are removed, and segments
      superseded by compaction once the compaction is older than ``retention`` (default:
      ``grace``). Manifests are never removed, and compacted segments keep every LSN, so
      ``at_lsn`` time travel reaches back to LSN 1 whatever vacuum removed;
    - bodies in ``blobs/`` that no manifest covers, or whose last mention is a reduction;
    - temp files under ``_log/`` that a writer died with (before its link or rename);
    - checkpoints (``_log/<seq>.checkpoint.json``) superseded for ``grace`` seconds,
      except the newest at or below the pointer's seq and the one opening falls back to
      when that one is damaged (the newest below it at a multiple of
      ``checkpoint_interval``); those past the pointer are kept (their pointer may be on
      its way). Then the segment lists no remaining checkpoint names (a list is named by
      every later checkpoint that reuses it), and one whose document never landed once
      older than ``grace``. No reader needs another checkpoint: one that opened at a
      checkpoint removed since rebuilds its segment list from the manifests, which are
      never removed.
    ``grace=0`` removes all of that at once: safe only when no other writer is active.
    With a grace under ``WRITER_ACTIVE_S`` (10 s), vacuum refuses (``WritersActive``,
    nothing removed) while an uncommitted file younger than that exists: a writer may be
    between staging and publishing (a commit's staging or segment, a materialize's pending
    state files). ``force=True`` removes them anyway: a body lost so is an error for its
    readers only, the log stays openable; a materialize so robbed fails before it
    publishes, unless the removal falls in the instant of its publish (README, "vacuum").
    """
    _check_seconds("grace", grace)
    if retention is not None:
        _check_seconds("retention", retention)
    log = as_log(log, storage_options=storage_options)
    retention = grace if retention is None else retention
    st = log.storage
    now = time.time()
    with lease(log) as held:
        # List first, then read the manifests: a file listed here whose commit published
        # before the read below is seen as committed.
        staging = st.list_dir("_staging")
        staged_files = {txn: list(st.walk_files(f"_staging/{txn}")) for txn in staging}
        # temp files of a dead writer: a manifest's before its link, a pointer's or the
        # lease's before its rename (local disk only: S3 and memory write in one request)
        pointer = log._pointer_seq()  # before the listing: what it names is listed
        log_names = st.list_dir("_log")
        temps = [] if not st.leaves_temp_files else (
            [n for n in st.list_dir("") if ".tmp-" in n]
            + [f"_log/{n}" for n in log_names if ".tmp-" in n])
        checkpoint_files = _superseded_checkpoints(log, log_names, pointer)
        # files right under segments/ (a directory there, made by hand, is no segment: its
        # removal failed every vacuum)
        seg_files = [f for f in st.walk_files("segments") if f.count("/") == 1]
        body_files, odd_bodies = _list_bodies(st)
        state_files = [f for f in st.walk_files("state")]
        state_keep = files_in_use(log)  # after the listing: what it names is listed
        log.refresh()
        # one manifest at a time, kept only when its staging area is still there (to
        # promote): a log's manifests held at once cost about 0.7 KB per body they name
        staged = set(staging)
        committed: dict[str, Manifest] = {}
        live_segments = {s.path for s in log.segments()}
        # what the manifests say of the segment files listed (only those: every segment
        # path ever committed would be held otherwise, about 160 bytes a commit)
        on_disk = set(seg_files)
        listed: set[str] = set()
        superseded_at: dict[str, str] = {}
        # the last mention ("commit" | "reduce") of each body a kept manifest names (for
        # its promotion); a listed body's is kept in ``body_files``
        latest: dict[tuple[str, str], str] = {}
        for m in log.manifests():
            if m.txn in staged:
                committed[m.txn] = m
                latest.update(((b.tenant, b.sha256), "commit") for b in m.blobs)
            listed.update(s.path for s in m.segments if s.path in on_disk)
            for p in m.supersedes:
                if p in on_disk:
                    superseded_at[p] = m.ts
            for b in m.blobs:
                body_files.mention(b.tenant, b.sha256, _COMMITTED)
                if latest and (b.tenant, b.sha256) in latest:
                    latest[(b.tenant, b.sha256)] = "commit"
            for key in m.reduces:
                body_files.mention(*key, _REDUCED)
                if key in latest:
                    latest[key] = "reduce"

        def old(rel: str, limit: float) -> bool:
            t = st.mtime(rel)
            return t is None or now - t >= limit

        if grace < WRITER_ACTIVE_S and not force:
            uncommitted = [f for txn, fs in staged_files.items() if txn not in committed
                           for f in fs]
            uncommitted += [p for p in seg_files if p not in listed] + temps
            # a live materialize's pending files
            uncommitted += [f for f in state_files if state_keep is not None
                            and f not in state_keep]
            young_ones = [f for f in uncommitted if not old(f, WRITER_ACTIVE_S)]
            if young_ones:
                raise WritersActive(
                    f"{log.root}: vacuum(grace={grace:g}) refused: {len(young_ones)} "
                    f"uncommitted file(s) younger than {WRITER_ACTIVE_S:g} s (e.g. "
                    f"{young_ones[0]}) may belong to a live writer; retry later, use a "
                    "longer grace, or force=True if every writer is known dead")

        removed = promoted = segs = bodies = nbytes = young = 0
        for txn in staging:
            held.check()  # cheap: reads the lease at most every TTL/10
            files = staged_files[txn]
            if txn in committed:
                n, size = _promote_kept(st, committed[txn], latest)
                promoted, nbytes = promoted + n, nbytes + size
                st.delete_tree(f"_staging/{txn}")
                continue
            if files and not all(old(f, grace) for f in files):
                young += len(files)
                continue
            for f in files:
                nbytes += st.size(f) or 0
                removed += st.delete(f)
            st.delete_tree(f"_staging/{txn}")
        for p in seg_files:
            held.check()
            if p in live_segments:
                continue
            if p in listed:
                ts = superseded_at.get(p)
                if ts is None or _age(ts, now) < retention:
                    young += ts is not None
                    continue
            elif not old(p, grace):
                young += 1
                continue
            nbytes += st.size(p) or 0
            segs += st.delete(p)
        # a body's file goes when no manifest names it (once older than grace), or when
        # its last mention is a reduction; a file out of a body's place (not
        # blobs/<tenant>/<aa>/<sha256>), which no reader reads, as an unnamed one
        for p, state in body_files.files(odd_bodies):
            held.check()
            if state == _COMMITTED:
                continue
            if state == _UNNAMED and not old(p, grace):
                young += 1
                continue
            nbytes += st.size(p) or 0
            bodies += st.delete(p)
        held.check()
        state_removed = _vacuum_state(log, state_files, state_keep, lambda p: old(p, grace))
        held.check()  # a live writer's temp file is younger than grace
        temps_removed = sum(st.delete(p) for p in temps if old(p, grace))
        checkpoints, lists_removed, ck_bytes, ck_young = _vacuum_checkpoints(
            log, checkpoint_files, lambda p: old(p, grace), held.check)
        nbytes, young = nbytes + ck_bytes, young + ck_young
        log.refresh()
    return VacuumReport(removed, promoted, segs, bodies, nbytes, young,
                        state_files_removed=state_removed, temp_files_removed=temps_removed,
                        checkpoints_removed=checkpoints,
                        segment_lists_removed=lists_removed)


@dataclass
class _CheckpointFiles:
    """The checkpoint files of a listing of ``_log/`` (see ``_superseded_checkpoints``)."""

    docs: dict[int, str]  # seq -> its document
    lists: dict[int, list[str]]  # seq -> the segment lists that checkpoint wrote
    superseded: list[tuple[int, str]]  # (seq, the next document after it) vacuum may remove


def _superseded_checkpoints(log: EventLog, names: list[str], pointer: int
                            ) -> _CheckpointFiles:
    """The checkpoints vacuum may remove, from a listing of ``_log/``: each with the
    document of the next checkpoint after it, whose age is how long it has been superseded;
    none when the pointer is missing or unreadable. Kept: every checkpoint past the
    pointer (its pointer may be on its way), the newest one at or below it, and the one
    ``EventLog._load_checkpoint`` falls back to when that one is damaged (the newest one
    below it at a multiple of ``checkpoint_interval``: a compaction's, or a busy writer's
    past the seq that owed it, is at another seq). Segment lists are removed by
    ``_vacuum_checkpoints``, by what the documents left name."""
    docs: dict[int, str] = {}
    lists: dict[int, list[str]] = {}
    for n in names:
        if (seq := document_seq(n)) is not None:
            docs[seq] = f"_log/{n}"
        elif (seq := list_seq(n)) is not None:
            lists.setdefault(seq, []).append(f"_log/{n}")
    out = _CheckpointFiles(docs, lists, [])
    if not pointer:
        return out
    complete = sorted(docs)
    at_or_below = [seq for seq in complete if seq <= pointer]
    keep = set(at_or_below[-1:])
    keep.update([seq for seq in at_or_below
                 if seq < pointer and seq % log.checkpoint_interval == 0][-1:])
    for seq in complete:
        if seq > pointer or seq in keep:
            continue
        i = bisect.bisect_right(complete, seq)  # a log of a day holds ~10^5 of them
        out.superseded.append((seq, checkpoint_path(complete[i])))
    return out


def _vacuum_checkpoints(log: EventLog, files: _CheckpointFiles,
                        old_enough: Callable[[str], bool], check: Callable[[], None]
                        ) -> tuple[int, int, int, int]:
    """Remove the superseded checkpoints' documents that have been superseded for grace
    (a reader that opened at one meanwhile rebuilds its segments from the manifests),
    then every segment list that no document left names: a removed checkpoint's, and one
    whose document never landed once it is older than grace (a writer may be about to put
    it). A list a later checkpoint reuses stays, whoever wrote it; ``_log/`` is listed
    again first, for the documents written since the first listing (a writer's, which
    may reuse lists of a checkpoint this run removed). That narrows a race, it does not
    close it: a document landing after the second listing can still name a list removed
    here; its writer then does not move the pointer to it if it looks after the removal
    (``EventLog.write_checkpoint``), and opening passes over a checkpoint naming a missing
    list either way. Documents are removed first: none names a list gone. Returns
    (documents removed, lists removed, bytes, files kept young)."""
    st = log.storage
    removed: set[int] = set()
    nbytes = young = 0
    for seq, successor in files.superseded:
        check()
        if not old_enough(successor):
            young += 1 + len(files.lists.get(seq, ()))
            continue
        nbytes += st.size(files.docs[seq]) or 0
        st.delete(files.docs[seq])
        removed.add(seq)
    docs = {seq: p for seq, p in files.docs.items() if seq not in removed}
    for n in st.list_dir(LOG_DIR):  # written since the first listing
        if (landed := document_seq(n)) is not None and landed not in files.docs:
            docs[landed] = f"{LOG_DIR}/{n}"
    staying = sorted(docs)
    named: set[str] = set()
    for seq, data in zip(staying, log._fan_out(
            st.read_or_none, [docs[seq] for seq in staying]), strict=True):
        if data is None:
            continue  # removed meanwhile (another vacuum)
        try:  # a damaged document: never opened at, what it names is not needed
            named.update(e["path"] for e in list_entries(loads(data, docs[seq])))
        except (CorruptionError, KeyError, ValueError, TypeError):
            continue
    lists_removed = 0
    for seq, paths in files.lists.items():
        if seq in docs:
            continue  # its document stays (a list of it no document names: goes with it)
        for p in paths:
            check()
            if p in named:
                continue
            if seq not in files.docs and not old_enough(p):
                young += 1
                continue
            nbytes += st.size(p) or 0
            lists_removed += st.delete(p)
    return len(removed), lists_removed, nbytes, young


_UNNAMED, _COMMITTED, _REDUCED = 0, 1, 2  # a listed body's last mention in the manifests
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class _Bodies:
    """The files vacuum listed under ``blobs/``, held compactly: each body as its digest's
    32 bytes under its tenant, with its last mention in the manifests (about 120 bytes a
    body, where its path and a (tenant, sha256) key took about 400: a log of 5 M bodies
    lists 5 M files)."""

    def __init__(self) -> None:
        self.by_tenant: dict[str, dict[bytes, int]] = {}

    def add(self, tenant: str, sha256: str) -> None:
        self.by_tenant.setdefault(tenant, {})[bytes.fromhex(sha256)] = _UNNAMED

    def mention(self, tenant: str, sha256: str, state: int) -> None:
        bodies = self.by_tenant.get(tenant)
        if bodies is not None and _SHA256_HEX.fullmatch(sha256):
            digest = bytes.fromhex(sha256)
            if digest in bodies:
                bodies[digest] = state

    def files(self, odd: list[str]) -> Iterator[tuple[str, int]]:
        """(path, last mention) of every listed file; ``odd`` ones are unnamed."""
        for tenant, bodies in self.by_tenant.items():
            for digest, state in bodies.items():
                yield blob_path(tenant, digest.hex()), state
        for p in odd:
            yield p, _UNNAMED


def _list_bodies(st: Storage) -> tuple[_Bodies, list[str]]:
    """The files under ``blobs/``: bodies in their place, and the paths of the others
    (``blobs/<t>/<aa>/<name>`` with a name that is no sha256 or in another ``aa``; deeper
    or shallower files are not a body's and are left alone, as ever)."""
    bodies, odd = _Bodies(), []
    for p in st.walk_files("blobs"):
        parts = p.split("/")
        if len(parts) != 4:
            continue
        _, tenant, aa, name = parts
        if aa == name[:2] and _SHA256_HEX.fullmatch(name):
            bodies.add(tenant, name)
        else:
            odd.append(p)
    return bodies, odd


def _note_pack(log: EventLog, key: tuple[str, str],
               packs: dict[str, tuple[Manifest, list[int]]]) -> None:
    """Remember the pack holding ``key``'s body, when a pack does, with its commit."""
    _reduced, staged = log.blob_location(key)
    piece = piece_of(staged) if staged else None
    if piece is None:
        return
    m = log.staged_commit(key)
    if m is not None:
        packs.setdefault(piece.file, (m, []))[1].append(piece.size)


def _promote_kept(st: Storage, m: Manifest,
                  latest: dict[tuple[str, str], str]) -> tuple[int, int]:
    """Promote what a committed staging area still holds (bodies committed again after a
    reduction, or a dead writer's) and remove it: (bodies promoted, bytes freed)."""
    promoted = nbytes = 0
    packs = Packs(st)
    for b in m.blobs:
        if b.staged is None:
            continue
        piece = piece_of(b.staged)
        body = None if piece is None else packs.body(piece)
        if (body is None) if piece else not st.exists(b.staged):
            continue  # gone: promoted by its writer, or removed
        key = (b.tenant, b.sha256)
        if latest.get(key) != "reduce" and not st.exists(blob_path(*key)):
            try:
                if body is None:
                    st.copy(b.staged, blob_path(*key))
                else:  # written whole: renamed into place, or one PUT
                    st.write(blob_path(*key), body)
                promoted += 1
            except NotFound:  # the writer's own promotion moved it meanwhile
                if not st.exists(blob_path(*key)):
                    raise
                continue
        nbytes += b.size
        if piece is None:
            st.delete(b.staged)
    if packs.found:
        _sync_all(st)  # a writer's own copies out of these packs may not be durable yet
    for f in packs.found:
        st.delete(f)
    return promoted, nbytes


def _sync_all(st: Storage) -> None:
    """Make what was written on this storage so far durable (one syncfs on local disk;
    S3 and memory write durably as they go)."""
    batch = st.durable_batch() if st.durable else None
    if batch is not None:
        try:
            batch.sync()
        finally:
            batch.close()


def _vacuum_state(log: EventLog, files: list[str], keep: set[str] | None,
                  old_enough: Callable[[str], bool]) -> int:
    """Remove materialized-state files that neither the pointer nor the generation it
    replaced names, once older than grace: a materialize that died before publishing
    leaves such files, and a live one is writing them (``vacuum`` refuses a short grace
    while one is young). Nothing is removed when the pointer cannot be read (``keep``
    None). A materialize's pending folder goes whole or not at all, once its newest file
    is older than grace: its writer publishes right after its last file, so a folder
    being published is not taken from under it (unless the grace is shorter than that)."""
    if keep is None:
        return 0
    groups: dict[str, list[str]] = {}
    for f in files:
        if f not in keep:
            parts = f.split("/")
            pending = f.startswith("state/_pending/") and len(parts) > 3
            groups.setdefault("/".join(parts[:3]) if pending else f, []).append(f)
    n = 0
    for group in groups.values():
        if all(old_enough(f) for f in group):
            n += sum(log.storage.delete(f) for f in group)
    return n


def _age(ts_iso: str, now: float) -> float:
    from datetime import datetime

    return now - datetime.fromisoformat(ts_iso).timestamp()


# --- compact ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CompactReport:
    segments_before: int
    segments_after: int
    rewritten: int  # small segments replaced
    written: int  # new segments
    seq: int | None


#: batches ``compact`` copies into one at a time: each batch read holds its segment's
#: file (a memory map, or its bytes) until then
GATHER_BATCHES = 512


def _gathered(batches: Iterable[pa.RecordBatch]) -> pa.Table:
    """The batches as one table of one record batch, copied together ``GATHER_BATCHES``
    at a time, so the old segments' files go as it grows: a group of a recorder's
    windows is tens of thousands of segments of a few events (3.3 GB of RSS for 50,509
    of them, held to the end, against a few MB now)."""
    parts: list[pa.Table] = []
    pending: list[pa.RecordBatch] = []
    for b in batches:
        pending.append(b)
        if len(pending) == GATHER_BATCHES:
            parts.append(pa.Table.from_batches(pending, ev.LOG_SCHEMA).combine_chunks())
            pending = []
    parts.append(pa.Table.from_batches(pending, ev.LOG_SCHEMA))
    return pa.concat_tables(parts).combine_chunks()  # one record batch, not one per part


def compact(log: LogLike, *, storage_options: dict[str, Any] | None = None,
            target_rows: int = COMPACT_TARGET_ROWS, min_rows: int | None = None) -> CompactReport:
    """Rewrite runs of small consecutive segments (under ``min_rows`` events each; default
    ``target_rows // 2``) into segments of about ``target_rows``.

    Events, LSNs and seqs are unchanged (compacted segments store ``lsn`` and ``seq``);
    one manifest of kind ``compact`` adds the new files and supersedes the old ones, so
    readers skip them. A checkpoint follows, so opening stays flat. Segments are read
    as a stream, one group at a time: memory holds about ``target_rows`` events, whatever
    the size of the log, and the files of ``GATHER_BATCHES`` old segments at most.
    """
    if not is_count(target_rows) or target_rows < 1:
        raise ValidationError(f"compact: target_rows must be an int >= 1, got "
                              f"{short_repr(target_rows)}")
    if min_rows is not None and (not is_count(min_rows) or min_rows < 0):
        raise ValidationError(f"compact: min_rows must be an int >= 0 or None, got "
                              f"{short_repr(min_rows)}")
    target_rows = int(target_rows)
    min_rows = None if min_rows is None else int(min_rows)
    log = as_log(log, storage_options=storage_options)
    small = target_rows // 2 if min_rows is None else min_rows
    with lease(log) as held:
        log.refresh()
        segs = log.segments()
        before = len(segs)
        groups: list[list[SegmentInfo]] = []
        cur: list[SegmentInfo] = []
        rows = 0  # in cur (a running total: a recorder's log has many tiny segments)
        for s in segs:
            if s.rows >= small:
                if len(cur) > 1:
                    groups.append(cur)
                cur, rows = [], 0
                continue
            if cur and rows + s.rows > target_rows:
                if len(cur) > 1:
                    groups.append(cur)
                cur, rows = [], 0
            cur.append(s)
            rows += s.rows
        if len(cur) > 1:
            groups.append(cur)
        if not groups:
            return CompactReport(before, before, 0, 0, None)
        txn = uuid.uuid4().hex
        new: list[SegmentInfo] = []
        for i, g in enumerate(groups):
            # streamed, not through the segment cache: memory holds one group (about
            # ``target_rows`` events), never every segment compacted so far
            table = _gathered(log.scan(g[-1].last_lsn, g[0].first_lsn))
            if table.num_rows != sum(s.rows for s in g):
                raise CorruptionError(f"{log.root}: compacting {g[0].path}: read "
                                      f"{table.num_rows} events, the manifests list "
                                      f"{sum(s.rows for s in g)}")

            def fill(sink: Any, table: pa.Table = table) -> None:
                with pa.ipc.new_file(sink, ev.LOG_SCHEMA) as w:
                    w.write_table(table)

            path = f"segments/{txn}-{i:05d}.arrow"
            size, sha = log.storage.write_hashed(path, fill)
            new.append(SegmentInfo(path, table.num_rows, size, sha, g[0].first_lsn,
                                   min(s.seq for s in g), has_lsn=True))
        gone = tuple(s.path for g in groups for s in g)

        def make(seq: int, first: int) -> Manifest:
            return Manifest(seq=seq, txn=txn, kind="compact", first_lsn=first, n_events=0,
                            ts=now_iso(), segments=tuple(new), supersedes=gone)

        held.check()
        m = log.publish(make, txn)
        log.write_checkpoint()
    return CompactReport(before, before - len(gone) + len(new), len(gone), len(new), m.seq)

