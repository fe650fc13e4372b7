"""Where a committed but unpromoted body lies: its own file in its commit's staging area,
or a piece of that commit's pack.

A recorder window stages all its new bodies as one file, ``_staging/<txn>/bodies.pack``
(the bodies one after the other): one file to create, write and sync (or one PUT) where a
window of 64 records would otherwise make 64. Its manifest names each body's piece as a
*packed location*, ``<pack path>#<offset>:<size>``; any other staged body's location is
the path of its own file. Promotion copies each piece to ``blobs/`` and then removes the
pack (docs/DESIGN.md, "Bodies"), so a pack lives from its window's commit to the end of
that commit's promotion, as any staging area does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from poimen_data.storage import Storage

PACK_NAME = "bodies.pack"


def pack_path(txn: str) -> str:
    return f"_staging/{txn}/{PACK_NAME}"


@dataclass(frozen=True, slots=True)
class Piece:
    """A body's bytes inside a pack."""

    file: str
    offset: int
    size: int

    @property
    def location(self) -> str:
        return f"{self.file}#{self.offset}:{self.size}"

    def of(self, pack: bytes) -> bytes:
        return pack[self.offset:self.offset + self.size]


class Packs:
    """Packs read whole, once each, for their pieces to be copied out (promotion, vacuum);
    ``found`` are the packs that were there (or that the caller wrote and handed over: one
    may be gone since), to remove once their pieces are durable."""

    def __init__(self, storage: Storage, written: Mapping[str, bytes] | None = None) -> None:
        self._storage = storage
        # ``written``: packs whose bytes the caller holds (it wrote them), read from there
        self._read: dict[str, bytes | None] = dict(written or {})

    def body(self, piece: Piece) -> bytes | None:
        """The piece's bytes, or None when its pack is gone."""
        if piece.file not in self._read:
            self._read[piece.file] = self._storage.read_or_none(piece.file)
        pack = self._read[piece.file]
        return None if pack is None else piece.of(pack)

    @property
    def found(self) -> list[str]:
        return [f for f, pack in self._read.items() if pack is not None]


def piece_of(staged: str) -> Piece | None:
    """The piece a packed location names; None for a body in a file of its own."""
    file, sep, where = staged.partition("#")
    if not sep:
        return None
    offset, _, size = where.partition(":")
    return Piece(file, int(offset), int(size))


def staged_file(staged: str) -> str:
    """The file holding a staged body: its own, or its pack."""
    return staged.partition("#")[0]


def read_staged(storage: Storage, staged: str) -> bytes | None:
    """A staged body's bytes, or None when its file is gone (promoted or removed)."""
    piece = piece_of(staged)
    if piece is None:
        return storage.read_or_none(staged)
    return storage.read_range(piece.file, piece.offset, piece.size)


def staged_size(storage: Storage, staged: str) -> int | None:
    """A staged body's size, or None when its file is gone."""
    piece = piece_of(staged)
    if piece is None:
        return storage.size(staged)
    return piece.size if storage.exists(piece.file) else None


def staged_exists(storage: Storage, staged: str) -> bool:
    return storage.exists(staged_file(staged))
