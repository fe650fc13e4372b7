"""Any other fsspec backend, for reading only: without an atomic put-if-absent it cannot
take part in the commit protocol, so every write is refused."""

from __future__ import annotations

from poimen_data.errors import PoimenError
from poimen_data.storage._base import Storage


class ReadOnlyStorage(Storage):
    writable = False
    atomic_put_if_absent = False
    listing_consistent = False

    def __init__(self, *args: object, kind: str, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.kind = kind  # type: ignore[misc]  # the backend's own protocol name

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        self._require_writable()
        raise PoimenError("unreachable")  # pragma: no cover
