"""``LogInternals``: what transactions, the blob store and maintenance need from the log.

``EventLog`` implements it with public methods; ``Transaction``, ``FsBlobStore`` and
``jobs._maint`` use nothing else of the log, so the commit protocol is audited in one class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from poimen_data.log._manifest import Manifest, SegmentInfo
from poimen_data.storage import Storage

if TYPE_CHECKING:
    from poimen_data.log._txn import Transaction

BlobKey = tuple[str, str]  # (tenant, sha256)


class LogInternals(Protocol):
    storage: Storage

    @property
    def root(self) -> str: ...

    @property
    def head(self) -> int: ...

    def refresh(self) -> int: ...

    def transaction(self) -> Transaction: ...

    # bodies, as of the last refresh
    def blob_location(self, key: BlobKey) -> tuple[bool, str | None]: ...

    def body_present(self, key: BlobKey) -> bool: ...

    def is_reduced(self, key: BlobKey) -> bool: ...

    def ever_reduced(self, key: BlobKey) -> bool: ...

    def is_recommitted(self, key: BlobKey) -> bool: ...

    def stored_copies(self, key: BlobKey) -> set[str]: ...

    def lost_seq(self, key: BlobKey) -> int | None: ...

    # publishing
    def publish(self, make: Callable[[int, int], Manifest], txn: str) -> Manifest: ...

    def publish_unknown(self, txn: str) -> bool: ...

    def after_publish(self, m: Manifest, *, packs: Mapping[str, bytes] | None = None
                      ) -> None: ...

    def promote(self, m: Manifest) -> None: ...

    def staged_commit(self, key: BlobKey) -> Manifest | None: ...

    def maybe_checkpoint(self, seq: int) -> None: ...

    def write_checkpoint(self, seq: int | None = None) -> int: ...

    # segments and manifests (maintenance)
    def segments(self, at_lsn: int | None = None, min_lsn: int = 1) -> list[SegmentInfo]: ...

    def manifests(self, since_seq: int = 0) -> Iterator[Manifest]: ...
