"""Every background thread pool of the package, in one place.

A pool starts lazily, survives ``fork`` (a child starts its own: the parent's threads
are not there) and interpreter shutdown (work then runs inline).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class BackgroundPool:
    """A lazily started, fork-safe thread pool."""

    def __init__(self, name: str, workers: int) -> None:
        self.name, self.workers = name, workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool, self._lock = None, threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            pool = self._pool
        try:
            return pool.submit(fn, *args)
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            done: Future[Any] = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed over in the future
                done.set_exception(exc)
            return done


# Writes and fsyncs release the GIL: a transaction's files land on this pool while its
# Python work (validation) goes on.
IO_POOL = BackgroundPool("poimen-io", 4)
# Promotions of all logs of this process, one at a time (a commit's bodies in order).
PROMOTE_POOL = BackgroundPool("poimen-promote", 1)
# Bulk-table checks that run while the commit writes its segment.
CHECK_POOL = BackgroundPool("poimen-check", 2)
# Hashing beside a streamed write: one thread, so one writer's buffers hash in order.
HASH_POOL = BackgroundPool("poimen-hash", 1)
# Bodies copied out of a recorder window's pack at its promotion, on an object store: one
# PUT each, this many at a time (the promotions themselves stay one at a time, in order).
PIECE_POOL = BackgroundPool("poimen-piece", 16)
# Directory listings of a maintenance walk (``Storage.walk_files``), a few at once; its
# tasks never walk themselves, so they never wait on this pool.
LIST_POOL = BackgroundPool("poimen-list", 8)
