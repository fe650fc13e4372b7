"""Former home of ``Storage``: the names it exported, kept importable while callers move
to ``poimen_data.storage``."""

from poimen_data.storage import IO_POOL, BackgroundPool, Storage, open_storage

__all__ = ["IO_POOL", "BackgroundPool", "Storage", "open_storage"]
