"""Blob stores: the ``BlobStore`` protocol and the store of an event log.

Bodies are content-addressed by sha256 within a tenant: ``blobs/<tenant>/<aa>/<sha256>``.
``get`` verifies the body against its ref and never crosses tenants; it returns None for
a body that was reduced and raises ``NotFound`` when no committed body exists.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from poimen_data.errors import CorruptionError, NotFound
from poimen_data.log._manifest import blob_path
from poimen_data.log._staged import read_staged, staged_file
from poimen_data.model._events import BlobRef, check_ref

if TYPE_CHECKING:
    from poimen_data.log._internals import LogInternals


@runtime_checkable
class BlobStore(Protocol):
    """What reads and stores bodies by ``BlobRef`` (``log.blobs``; a verifier's
    ``ctx.blobs``; a test's counting wrapper)."""

    def get(self, ref: BlobRef) -> bytes | None:
        """The body's bytes, checked against its sha256; None once it was reduced."""
        ...

    def put(self, tenant: str, data: bytes) -> BlobRef:
        """Store a body of ``tenant`` and return its ref (content-addressed: the same
        bytes give the same ref)."""
        ...


class FsBlobStore:
    """The blob store of one ``EventLog``."""

    def __init__(self, log: LogInternals) -> None:
        self._log = log

    def __repr__(self) -> str:
        return f"FsBlobStore({self._log.root!r})"

    def put(self, tenant: str, data: bytes) -> BlobRef:
        """Store a body outside an event transaction: a blob-only commit (no LSN)."""
        with self._log.transaction() as tx:
            ref = tx.put_blob(tenant, data)
        return ref

    def get(self, ref: BlobRef) -> bytes | None:
        """The body's bytes, verified against its sha256, wherever it is (``blobs/``, or
        staging until its commit is promoted); None once it was reduced. ``NotFound``
        when no such body was committed, or a committed one is gone."""
        check_ref(ref, "get")
        key = (ref.tenant, ref.sha256)
        home = blob_path(ref.tenant, ref.sha256)
        for fresh in (False, True):
            if fresh:
                self._log.refresh()
            reduced, staged = self._log.blob_location(key)
            if reduced:
                return None
            # A body committed again after a reduction lives in its staging area; any
            # other body is in blobs/, or still in staging until its promotion (which may
            # move it between two reads: hence blobs/ once more at the end).
            if staged is not None and self._log.is_recommitted(key):
                places = [staged, home]
            elif staged is not None:
                places = [home, staged, home]
            else:
                places = [home]
            for rel in places:
                data = read_staged(self._log.storage, rel)
                if data is not None:
                    return self._verified(ref, data, staged_file(rel))
        seq = self._log.lost_seq(key)
        if seq is not None or staged is not None:  # NotFound still: a reader's error only
            when = f" (seq {seq})" if seq is not None else ""
            raise NotFound(f"body {ref.tenant}/{ref.sha256} was committed{when} but is "
                           "missing from staging and from blobs/: lost")
        raise NotFound(f"no committed body for ref {ref.tenant}/{ref.sha256}")

    def exists(self, ref: BlobRef) -> bool:
        try:
            return self.get(ref) is not None
        except NotFound:
            return False

    def _verified(self, ref: BlobRef, data: bytes, rel: str) -> bytes:
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise CorruptionError(f"{self._log.storage.url_of(rel)}: body does not match "
                                  "its sha256 (damaged)")
        if len(data) != ref.size:
            raise NotFound(f"no committed body of size {ref.size} for ref "
                           f"{ref.tenant}/{ref.sha256}")
        return data
