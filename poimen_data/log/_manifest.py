"""Manifests and checkpoints: the JSON documents that make commits visible.

A manifest is ``_log/<seq, 20 digits>.json``; a checkpoint is
``_log/<seq>.checkpoint.json`` holding the whole log state at that seq, found through the
pointer ``_log/_last_checkpoint.json``. Both carry a sha256 of their own canonical body,
so a damaged or truncated file is detected, never trusted. JSON is written with sorted
keys and no spaces (orjson), so the bytes are canonical.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from poimen_data.errors import CorruptionError

FORMAT_NAME = "poimen-log"
FORMAT_VERSION = 1
LOG_DIR = "_log"
POINTER = f"{LOG_DIR}/_last_checkpoint.json"


def manifest_path(seq: int) -> str:
    return f"{LOG_DIR}/{seq:020d}.json"


def checkpoint_path(seq: int) -> str:
    return f"{LOG_DIR}/{seq:020d}.checkpoint.json"


def blob_path(tenant: str, sha256: str) -> str:
    return f"blobs/{tenant}/{sha256[:2]}/{sha256}"


def staged_blob_path(txn: str, tenant: str, sha256: str) -> str:
    return f"_staging/{txn}/{tenant}.{sha256}"


def dumps(doc: dict[str, Any]) -> bytes:
    """Canonical JSON bytes with an embedded checksum of everything else."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    body["checksum"] = hashlib.sha256(raw).hexdigest()
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def loads(data: bytes, name: str) -> dict[str, Any]:
    """Parse and verify a document written by ``dumps``; ``CorruptionError`` names ``name``."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise CorruptionError(f"{name}: not valid JSON (damaged or truncated)") from None
    if not isinstance(doc, dict) or "checksum" not in doc:
        raise CorruptionError(f"{name}: no checksum (damaged or not a poimen file)")
    want = doc.pop("checksum")
    got = hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()
    if got != want:
        raise CorruptionError(f"{name}: checksum mismatch (damaged)")
    if doc.get("format") != FORMAT_NAME or doc.get("version") != FORMAT_VERSION:
        raise CorruptionError(
            f"{name}: format {doc.get('format')!r} v{doc.get('version')!r} is not "
            f"{FORMAT_NAME} v{FORMAT_VERSION}"
        )
    return doc


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment file as a manifest or checkpoint lists it."""

    path: str
    rows: int
    size: int
    sha256: str
    first_lsn: int
    seq: int  # the seq of the commit that first committed these events (compaction: min)
    has_lsn: bool = False  # compacted segments store lsn and seq columns

    @property
    def last_lsn(self) -> int:
        return self.first_lsn + self.rows - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "rows": self.rows,
            "size": self.size,
            "sha256": self.sha256,
            "first_lsn": self.first_lsn,
            "seq": self.seq,
            "has_lsn": self.has_lsn,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SegmentInfo:
        return cls(d["path"], d["rows"], d["size"], d["sha256"], d["first_lsn"], d["seq"],
                   d.get("has_lsn", False))


@dataclass(frozen=True, slots=True)
class BlobEntry:
    """A body a commit covers: ``staged`` is its staging path, or None when it was reused."""

    tenant: str
    sha256: str
    size: int
    staged: str | None

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "sha256": self.sha256, "size": self.size,
                "staged": self.staged}


@dataclass(frozen=True, slots=True)
class Manifest:
    seq: int
    txn: str
    kind: str  # "append" | "blobs" | "compact"
    first_lsn: int
    n_events: int
    ts: str
    segments: tuple[SegmentInfo, ...] = ()
    blobs: tuple[BlobEntry, ...] = ()
    reduces: tuple[tuple[str, str], ...] = ()  # (tenant, sha256) of blob_reduced originals
    supersedes: tuple[str, ...] = ()  # compaction: segment paths it replaces
    extra: dict[str, Any] = field(default_factory=dict)
    # seqs of earlier commits of the same writer whose promotion it ran to the end and
    # which found no body gone from staging (bodies kept for vacuum, reduced ones, stay
    # there): a checkpoint need not look at them (written only when there are some: see
    # README, step 6)
    promoted: tuple[int, ...] = ()

    @property
    def last_lsn(self) -> int:
        return self.first_lsn + self.n_events - 1

    def to_bytes(self) -> bytes:
        return dumps({
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "seq": self.seq,
            "txn": self.txn,
            "kind": self.kind,
            "first_lsn": self.first_lsn,
            "last_lsn": self.last_lsn,
            "n_events": self.n_events,
            "ts": self.ts,
            "segments": [s.to_json() for s in self.segments],
            "blobs": [b.to_json() for b in self.blobs],
            "reduces": [list(r) for r in self.reduces],
            "supersedes": list(self.supersedes),
            "extra": self.extra,
            **({"promoted": list(self.promoted)} if self.promoted else {}),
        })

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Manifest:
        d = loads(data, name)
        try:
            m = cls(
                seq=d["seq"], txn=d["txn"], kind=d["kind"], first_lsn=d["first_lsn"],
                n_events=d["n_events"], ts=d["ts"],
                segments=tuple(SegmentInfo.from_json(s) for s in d["segments"]),
                blobs=tuple(BlobEntry(b["tenant"], b["sha256"], b["size"], b["staged"])
                            for b in d["blobs"]),
                reduces=tuple((r[0], r[1]) for r in d["reduces"]),
                supersedes=tuple(d["supersedes"]),
                extra=d.get("extra", {}),
                promoted=tuple(d.get("promoted", ())),
            )
        except (KeyError, TypeError, IndexError) as exc:
            raise CorruptionError(f"{name}: missing or malformed field {exc}") from None
        if not all(type(s) is int and 0 < s < m.seq for s in m.promoted):
            raise CorruptionError(f"{name}: promoted must list seqs of earlier commits")
        if m.last_lsn != d.get("last_lsn"):
            raise CorruptionError(f"{name}: last_lsn does not match first_lsn + n_events")
        return m
