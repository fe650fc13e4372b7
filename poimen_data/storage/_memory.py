"""``memory://``: one process-wide store (fsspec's), so put-if-absent is a process-wide
lock around check-and-write. Writes are dictionary updates: never worth a thread.
"""

from __future__ import annotations

import threading

from poimen_data.storage._base import Storage

_MEMORY_LOCK = threading.Lock()


class MemoryStorage(Storage):
    kind = "memory"
    background_io = False

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        self._require_writable()
        path = self.full(rel)
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True
