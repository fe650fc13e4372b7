"""The storage interface: a root on some filesystem with the few operations the log
needs, each backend a subclass with capability flags (``_local``, ``_memory``, ``_s3``,
``_generic``). The generic methods here work through fsspec on any backend.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import pyarrow as pa

from poimen_data.errors import NotFound, PoimenError
from poimen_data.storage._pools import LIST_POOL
from poimen_data.storage._retry import RetryPolicy
from poimen_data.storage._writer import AtomicWriter

T = TypeVar("T")


class DurableBatch(Protocol):
    """New files written since the batch opened, made durable together (``sync``)."""

    def sync(self) -> None: ...

    def close(self) -> None: ...


Kind = Literal["local", "memory", "s3"] | str
LIST_AHEAD = 8  # directories a walk lists at once (``LIST_POOL``'s threads)
PARALLEL_HASH_BYTES = 4 << 20  # below this, a thread costs more than the hash it overlaps


class Storage(ABC):
    """A root on some filesystem; every path argument is relative to the root."""

    kind: ClassVar[Kind]
    #: capability flags the log and maintenance decide by (never by ``kind``)
    writable: ClassVar[bool] = True  # has an atomic put-if-absent: writers allowed
    atomic_put_if_absent: ClassVar[bool] = True
    durable_fsync: ClassVar[bool] = False  # writes can be fsynced (``durable``)
    listing_consistent: ClassVar[bool] = True  # a listing shows every finished write
    has_directories: ClassVar[bool] = True  # empty folders remain until removed
    background_io: ClassVar[bool] = True  # a write is slow enough to overlap on a thread
    ambiguous_errors: ClassVar[bool] = False  # a failed write may still have landed
    leaves_temp_files: ClassVar[bool] = False  # a killed writer may leave ``.tmp-*`` files

    def __init__(self, url: str, fs: Any, root: str, storage_options: dict[str, Any], *,
                 durable: bool = True, retry: RetryPolicy | None = None) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.storage_options = dict(storage_options)
        self.durable = durable
        self.retry = retry or RetryPolicy()
        #: storage calls that touch the backend, by operation: how tests prove that
        #: opening a log costs the same whatever its length
        self.calls: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- names ----------------------------------------------------------------------

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        """A URL for ``rel`` that other fsspec users (DuckDB, pyarrow) can open."""
        return f"{self.kind}://{self.full(rel).lstrip('/')}"

    def open_read(self, rel: str) -> Any:
        """A binary file object for reading ``rel`` piecewise (parquet row groups)."""
        return self.fs.open(self.full(rel), "rb")

    def native_path(self, rel: str) -> str | None:
        """A path DuckDB can open with its own reader and no credentials (local files);
        None where it must read through this storage (``arrow_dataset``)."""
        return None

    def arrow_filesystem(self) -> Any:
        """This storage as a ``pyarrow.fs`` filesystem (for ``pyarrow.dataset``)."""
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        return PyFileSystem(FSSpecHandler(self.fs))

    def arrow_dataset(self, rels: list[str], *, format: str = "parquet") -> Any:
        """A ``pyarrow.dataset`` over these files, read through this storage's filesystem:
        what another engine (DuckDB) scans as a Python-registered table, so it needs no
        file access of its own (and a locked-down connection can still read it)."""
        import pyarrow.dataset as ds

        return ds.dataset([self.full(r) for r in rels], format=format,
                          filesystem=self.arrow_filesystem())

    def pin_root(self) -> None:  # noqa: B027 - a no-op where there are no directories
        """The root now holds a log: never make it again. A local log's directory deleted
        or moved away under a live writer stays gone, and the next write fails with
        ``StorageError`` instead of starting a new, partial log there (an object store has
        no directories to make)."""

    def _require_writable(self) -> None:
        if not self.writable:
            raise PoimenError(
                f"storage {self.url!r} ({self.kind}) has no atomic put-if-absent; "
                "it is refused for writers"
            )

    # -- retries --------------------------------------------------------------------

    def transient(self, exc: BaseException) -> bool:
        """Whether a failure may pass if retried (local and in-process: never)."""
        return False

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        return self.retry.run(what, fn, self.transient)

    # -- reads ----------------------------------------------------------------------

    def read(self, rel: str) -> bytes:
        self.calls["read"] += 1
        try:
            return self._retrying(f"read {rel}", lambda: self._read(self.full(rel)))
        except FileNotFoundError:
            raise NotFound(f"no such file: {self.url_of(rel)}") from None

    def _read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(path))

    def read_or_none(self, rel: str) -> bytes | None:
        try:
            return self.read(rel)
        except NotFound:
            return None

    def read_range(self, rel: str, offset: int, size: int) -> bytes | None:
        """``size`` bytes of a file from ``offset``, or None when the file is gone."""
        self.calls["read"] += 1
        try:
            return self._retrying(f"read {rel}",
                                  lambda: self._read_range(self.full(rel), offset, size))
        except FileNotFoundError:
            return None

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        if size == 0:
            self._size(path)  # there, or FileNotFoundError
            return b""
        return bytes(self.fs.cat_file(path, start=offset, end=offset + size))

    def exists(self, rel: str) -> bool:
        self.calls["exists"] += 1
        return bool(self._retrying(f"exists {rel}", lambda: self.fs.exists(self.full(rel))))

    def size(self, rel: str) -> int | None:
        self.calls["size"] += 1
        try:
            return self._retrying(f"size {rel}", lambda: self._size(self.full(rel)))
        except FileNotFoundError:
            return None

    def _size(self, path: str) -> int:
        return int(self.fs.size(path))

    def mtime(self, rel: str) -> float | None:
        """Modification time as a Unix timestamp, or None when the file is gone."""
        try:
            info = self._retrying(f"info {rel}", lambda: self.fs.info(self.full(rel)))
        except FileNotFoundError:
            return None
        for key in ("LastModified", "created", "mtime"):
            v = info.get(key)
            if v is not None:
                return v.timestamp() if hasattr(v, "timestamp") else float(v)
        return None

    def walk_files(self, rel: str) -> Iterator[str]:
        """Every file below ``rel`` (relative paths, in no set order). Maintenance only:
        never on a commit path.

        One directory is listed at a time (a request, or a page of 1,000 names each, on
        S3), ``LIST_AHEAD`` directories at once, each listing cut down to its names as it
        arrives: memory holds a few directories' names, never the tree's listing. A flat
        ``find`` of ``blobs/`` held an info dict per body at once (about 1.8 KB each on
        S3: gigabytes at millions of bodies) for fewer requests (``blobs/`` has a
        directory per tenant and per two hex digits: about 257 a tenant)."""
        self.calls["list"] += 1
        self.invalidate(rel)
        todo = [self.full(rel)]
        while todo:
            batch = todo[-LIST_AHEAD:]
            del todo[-LIST_AHEAD:]
            if len(batch) == 1:
                listed = [self._names_in(batch[0], rel)]
            else:
                futures = [LIST_POOL.submit(self._names_in, d, rel) for d in batch]
                listed = [f.result() for f in futures]
            for files, dirs in listed:
                yield from files
                todo.extend(dirs)

    def _names_in(self, where: str, rel: str) -> tuple[list[str], list[str]]:
        """(files as relative paths, subdirectories as full paths) right below ``where``:
        always asked of the store (a cached listing, where a caller turned s3fs's
        listings cache on, would break vacuum's "list first, then read the manifests").
        A key ending in ``/`` (a folder marker another tool made) is no file here."""
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(where)
        try:
            found = self._retrying(f"list {rel}", lambda: self.fs.ls(where, detail=True))
        except FileNotFoundError:
            return [], []
        prefix = self.root.strip("/") + "/"
        files, dirs = [], []
        for info in found:
            name = info["name"].lstrip("/")
            if info["type"] == "directory":
                if name.rstrip("/") != where.strip("/"):  # never the directory itself
                    dirs.append(info["name"])
            elif name.startswith(prefix) and not name.endswith("/"):
                files.append(name[len(prefix):])
        return files, dirs

    def list_dir(self, rel: str) -> list[str]:
        """Names directly below ``rel`` (maintenance and recovery at open only)."""
        self.calls["list"] += 1
        base = self.full(rel)
        self.invalidate(rel)
        try:
            entries = self._retrying(f"list {rel}", lambda: self.fs.ls(base, detail=False))
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def invalidate(self, rel: str = "") -> None:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(self.full(rel))

    # -- writes ---------------------------------------------------------------------

    def write(self, rel: str, data: bytes, *, durable: bool | None = None) -> None:
        """Write a whole file, replacing it; atomic for readers."""
        self._require_writable()
        path = self.full(rel)
        self._retrying(f"write {rel}", lambda: self.fs.pipe_file(path, bytes(data)))

    def write_new(self, rel: str, data: bytes | pa.Buffer, *, sync: bool = True) -> None:
        """Create a file under a name nobody else writes (a txn's segment or staged body).

        No temp file and rename: nothing reads the name before a manifest lists it, and a
        manifest lists it only after this returned (and, locally, fsynced); a crash
        midway leaves a partial file that no manifest covers, which ``vacuum`` removes.
        ``sync=False`` skips the fsync: only for a file of a ``durable_batch`` whose
        ``sync()`` runs before any manifest lists it.
        """
        self.write(rel, bytes(data))

    def durable_batch(self) -> DurableBatch | None:
        """A batch that makes many new files durable with one call (``sync()``) instead
        of one fsync each; None when this storage syncs each write (or needs no sync).
        Open it before writing the files (``write_new(..., sync=False)``)."""
        return None

    def write_hashed(self, rel: str, fill: Callable[[Any], None],
                     size_hint: int = 0, *, sync: bool = True) -> tuple[int, str]:
        """Write a new file by ``fill(sink)`` under a name nobody else writes (see
        ``write_new``); return its size and sha256. Here the bytes are assembled in
        memory and written in one go (local disk streams large files)."""
        self._require_writable()
        sink = pa.BufferOutputStream()
        fill(sink)
        buf = sink.getvalue()
        self.write_new(rel, buf, sync=sync)
        return buf.size, hashlib.sha256(buf).hexdigest()

    @abstractmethod
    def put_if_absent(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` with ``data`` unless it exists. True when this call created it.

        The check and the write are one atomic step, so of several racers exactly one
        wins. After an ambiguous failure (the answer lost, the retry refused) this answers
        False although the first try landed: callers that must know compare the content
        (the commit looks for its txn, the lease for its owner).
        """

    def delete(self, rel: str, *, check: bool = True) -> bool:
        """Remove one file; False when it was already gone. ``check=False`` spares the
        existence probe on object stores (which delete a missing key silently) and then
        always answers True."""
        self._require_writable()
        if check and not self.exists(rel):
            return False
        try:
            self._retrying(f"delete {rel}", lambda: self._delete(self.full(rel)))
        except FileNotFoundError:
            return False
        return True

    def _delete(self, path: str) -> None:
        self.fs.rm_file(path)

    def delete_tree(self, rel: str) -> int:
        """Remove every file below ``rel``; returns how many."""
        n = 0
        for f in list(self.walk_files(rel)):
            n += self.delete(f)
        return n

    def move(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``, replacing it (callers move content-addressed bodies, so
        a replaced ``dst`` had the same bytes). Atomic for readers of ``dst``."""
        self._require_writable()
        self.copy(src, dst)  # content-addressed: replacing dst changes no byte
        self.delete(src, check=False)

    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` atomically for readers of ``dst``."""
        self._require_writable()
        try:
            self._retrying(f"copy {src}",
                           lambda: self._copy(self.full(src), self.full(dst)))
        except FileNotFoundError:
            raise NotFound(f"no such file: {self.url_of(src)}") from None

    def _copy(self, src: str, dst: str) -> None:
        self.fs.copy(src, dst)

    def open_atomic(self, rel: str) -> AtomicWriter:
        """A streamed writer for ``rel`` (an export): bytes go to a temp name beside it and
        replace ``rel`` only when the ``with`` block exits cleanly. Unlike the log's own
        files this may replace an existing file, so it needs no put-if-absent."""
        path = self.full(rel)
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp" if parent else \
            f".{name}.{uuid.uuid4().hex}.tmp"

        def publish(f: Any) -> None:
            f.close()
            self._retrying(f"publish {rel}", lambda: self.fs.mv(tmp, path))

        def discard(f: Any) -> None:
            with contextlib.suppress(Exception):
                if hasattr(f, "discard"):  # an unfinished upload is aborted, not completed
                    f.discard()
                if not f.closed:
                    f.close()
            with contextlib.suppress(OSError):
                if self.fs.exists(tmp):
                    self.fs.rm_file(tmp)

        return AtomicWriter(self.url_of(rel), lambda: self.fs.open(tmp, "wb"), publish,
                            discard)
