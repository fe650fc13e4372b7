"""Storage: the only fsspec user. One backend class per kind behind ``Storage`` (capability
flags, never ``kind`` checks, drive the callers), one retry layer, one hashing writer and
the package's thread pools."""

from __future__ import annotations

from poimen_data.storage._base import PARALLEL_HASH_BYTES, DurableBatch, Storage
from poimen_data.storage._local import open_regular
from poimen_data.storage._open import open_storage
from poimen_data.storage._pools import (
    CHECK_POOL,
    HASH_POOL,
    IO_POOL,
    PIECE_POOL,
    PROMOTE_POOL,
    BackgroundPool,
)
from poimen_data.storage._retry import DEFAULT_RETRY_DEADLINE_S, RetryPolicy
from poimen_data.storage._writer import AtomicWriter, HashingSink

__all__ = [
    "CHECK_POOL",
    "DEFAULT_RETRY_DEADLINE_S",
    "HASH_POOL",
    "IO_POOL",
    "PARALLEL_HASH_BYTES",
    "PIECE_POOL",
    "PROMOTE_POOL",
    "AtomicWriter",
    "BackgroundPool",
    "DurableBatch",
    "HashingSink",
    "RetryPolicy",
    "Storage",
    "open_regular",
    "open_storage",
]
