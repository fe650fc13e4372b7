"""A root URL becomes the ``Storage`` of its backend: local disk, ``memory://``, S3, or any
other fsspec protocol for reading only (it has no atomic put-if-absent)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec

from poimen_data.errors import PoimenError
from poimen_data.storage._base import Storage
from poimen_data.storage._generic import ReadOnlyStorage
from poimen_data.storage._local import LocalStorage
from poimen_data.storage._memory import MemoryStorage
from poimen_data.storage._retry import DEFAULT_RETRY_DEADLINE_S, RetryPolicy


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                 *, durable: bool = True,
                 retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S) -> Storage:
    """The storage of ``url``; ``storage_options`` go to fsspec (credentials, endpoint).
    ``retry_deadline_s`` bounds how long one operation retries a failing object store."""
    if not isinstance(url, str | os.PathLike) or not str(url):
        raise PoimenError(f"not a storage URL: {url!r}")
    url = os.fspath(url)
    try:
        retry = RetryPolicy(float(retry_deadline_s))
    except (TypeError, ValueError) as exc:
        raise PoimenError(f"bad retry_deadline_s: {exc}") from None
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise PoimenError(f"storage_options must be a dict of fsspec options, got "
                          f"{type(storage_options).__name__}")
    given = dict(storage_options or {})
    opts = given
    is_s3 = url.startswith(("s3://", "s3a://"))
    try:
        if is_s3:
            from poimen_data.storage._s3 import s3_options

            opts = s3_options(given)
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except (ImportError, ValueError, TypeError, AttributeError) as exc:
        raise PoimenError(f"cannot open storage {url!r}: {exc}") from None
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    kw: dict[str, Any] = {"durable": durable, "retry": retry}
    if "file" in protocols or "local" in protocols:
        return LocalStorage(url, fs, root, given, **kw)
    if "memory" in protocols:
        return MemoryStorage(url, fs, root, given, **kw)
    if "s3" in protocols or "s3a" in protocols:
        from poimen_data.storage._s3 import S3Storage

        return S3Storage(url, fs, root, given, **kw)
    return ReadOnlyStorage(url, fs, root, given, kind=protocols[0], **kw)
