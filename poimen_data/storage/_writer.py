"""The one hashing writer: a file-like sink for Arrow and JSON writers that writes and
hashes what it is given, used by segments (``Storage.write_hashed``) and exports
(``Storage.open_atomic``, published onto its name only when the block exits cleanly).
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from poimen_data.storage._pools import HASH_POOL


class HashingSink:
    """Writes each buffer to ``f`` and hashes it on the one-thread hash pool (FIFO, so in
    order; ``hashlib`` releases the GIL on large buffers). A queued buffer stays alive in
    its pending call until hashed."""

    closed = False

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.failed: BaseException | None = None
        self._last: Future[Any] | None = None

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        self.size += n
        self._last = HASH_POOL.submit(self._update, data)
        return n

    def _update(self, data: Any) -> None:
        if self.failed is None:
            try:
                self.sha.update(data)
            except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
                self.failed = exc

    def finish(self) -> str:
        """Wait for the hash to catch up; its hex digest (never a digest of lost bytes)."""
        if self._last is not None:
            self._last.result()  # FIFO on one thread: every earlier update ran
        if self.failed is not None:
            raise self.failed
        return self.sha.hexdigest()

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


_CHUNK = 1 << 19
_QUEUE = 2


class AtomicWriter:
    """A binary file at a temporary name, published onto its final name only when the
    block exits cleanly (a failed write leaves nothing there). ``open_tmp`` gives the
    temp file, ``publish`` moves it into place, ``discard`` removes it.

    Writes are joined into 512 KiB blocks for one drain thread that hashes and writes
    them (both release the GIL, and a large block needs the GIL back only twice, so the
    thread does not queue behind the encoder for every small piece); the queue is
    bounded, so memory is too. ``bytes`` and ``sha256`` describe what was published.
    """

    def __init__(self, url: str, open_tmp: Callable[[], Any],
                 publish: Callable[[Any], None], discard: Callable[[Any], None]) -> None:
        self.url = url
        self.bytes = 0
        self.sha256 = ""
        self._open, self._publish, self._discard = open_tmp, publish, discard
        self._hash = hashlib.sha256()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(_QUEUE)
        self._error: BaseException | None = None
        self._f: Any = None
        # a thread of its own, not a pool's: a drain runs as long as its writer is open,
        # so a bounded pool could leave one writer blocked behind others
        self._drainer = threading.Thread(target=self._drain, name="poimen-writer",
                                         daemon=True)

    def __enter__(self) -> AtomicWriter:
        self._f = self._open()
        self._drainer.start()
        return self

    def _drain(self) -> None:
        try:
            while (block := self._queue.get()) is not None:
                self._hash.update(block)
                self._f.write(block)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the writing thread
            self._error = exc
            while self._queue.get() is not None:
                pass

    # the file-like surface that pyarrow and the JSON writers use
    def write(self, data: Any) -> int:
        if self._error is not None:
            raise self._error
        if not isinstance(data, bytes):
            data = bytes(data)  # a view of a buffer its owner (pyarrow) may reuse
        n = len(data)
        self._pending.append(data)
        self._pending_bytes += n
        self.bytes += n
        if self._pending_bytes >= _CHUNK:
            self._flush_pending()
        return n

    def _flush_pending(self) -> None:
        if self._pending:
            self._queue.put(b"".join(self._pending))
            self._pending, self._pending_bytes = [], 0

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._flush_pending()
        self._pending = []
        self._queue.put(None)
        if self._drainer.ident is not None:  # started
            self._drainer.join()
        if exc_type is not None:
            self._discard(self._f)
            return
        try:
            if self._error is not None:
                raise self._error
            self._publish(self._f)
        except BaseException:
            self._discard(self._f)
            raise
        self.sha256 = self._hash.hexdigest()
