"""The only module that imports fsspec: a root URL becomes a ``Storage`` with the few
operations the log needs, above all an atomic put-if-absent per backend.

Local disk: temp file + fsync + ``os.link`` (fails if the name is taken); S3: a
conditional PUT (``If-None-Match: *``, sent by s3fs for mode ``"xb"``); ``memory://``:
a process-wide lock around check-and-write (the store itself is process-wide). Any other
backend is refused for writing, because it has no real put-if-absent.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec
import fsspec.asyn
import pyarrow as pa

from poimen_data.errors import NotFound, PoimenError

_MEMORY_LOCK = threading.Lock()
PARALLEL_HASH_BYTES = 4 << 20  # below this, a thread costs more than the hash it overlaps


class Storage:
    """A root on some filesystem; every path argument is relative to the root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 durable: bool = True) -> None:
        self.durable = durable
        #: storage calls that touch the backend, by operation: how tests prove that
        #: opening a log costs the same whatever its length
        self.calls: collections.Counter[str] = collections.Counter()
        self._dirs: set[str] = set()  # local directories known to exist (blobs/<t>/<aa>, ...)
        if not isinstance(url, str | os.PathLike) or not str(url):
            raise PoimenError(f"not a storage URL: {url!r}")
        url = os.fspath(url)
        opts = dict(storage_options or {})
        if url.startswith(("s3://", "s3a://")):
            # Another process's new keys must never hide behind a cached listing.
            opts.setdefault("use_listings_cache", False)
        try:
            fs, root = fsspec.core.url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as exc:
            raise PoimenError(f"cannot open storage {url!r}: {exc}") from None
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        if "file" in protocols or "local" in protocols:
            self.kind = "local"
            root = os.path.abspath(root)
        elif "memory" in protocols:
            self.kind = "memory"
        elif "s3" in protocols or "s3a" in protocols:
            self.kind = "s3"
        else:
            self.kind = protocols[0]
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.storage_options = dict(storage_options or {})

    # -- names ----------------------------------------------------------------------

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str) -> str:
        """A URL for ``rel`` that other fsspec users (DuckDB, pyarrow) can open."""
        if self.kind == "local":
            return self.full(rel)
        proto = "s3" if self.kind == "s3" else self.kind
        return f"{proto}://{self.full(rel).lstrip('/')}"

    @property
    def writable(self) -> bool:
        return self.kind in ("local", "memory", "s3")

    def _require_writable(self) -> None:
        if not self.writable:
            raise PoimenError(
                f"storage {self.url!r} ({self.kind}) has no atomic put-if-absent; "
                "it is refused for writers"
            )

    # -- reads ----------------------------------------------------------------------

    def read(self, rel: str) -> bytes:
        self.calls["read"] += 1
        path = self.full(rel)
        try:
            if self.kind == "local":
                with open(path, "rb") as f:
                    return f.read()
            if self.kind == "s3":
                return self._s3("get_object", path)
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise NotFound(f"no such file: {self.url_of(rel)}") from None

    def read_or_none(self, rel: str) -> bytes | None:
        try:
            return self.read(rel)
        except NotFound:
            return None

    def exists(self, rel: str) -> bool:
        self.calls["exists"] += 1
        if self.kind == "local":
            return os.path.exists(self.full(rel))
        if self.kind == "s3":
            return self.size(rel) is not None
        return bool(self.fs.exists(self.full(rel)))

    def size(self, rel: str) -> int | None:
        self.calls["size"] += 1
        try:
            if self.kind == "local":
                return os.stat(self.full(rel)).st_size
            if self.kind == "s3":
                return int(self._s3("head_object", self.full(rel))["ContentLength"])
            return int(self.fs.size(self.full(rel)))
        except FileNotFoundError:
            return None

    def mtime(self, rel: str) -> float | None:
        """Modification time as a Unix timestamp, or None when the file is gone."""
        try:
            if self.kind == "local":
                return os.stat(self.full(rel)).st_mtime
            info = self.fs.info(self.full(rel))
        except FileNotFoundError:
            return None
        for key in ("LastModified", "created", "mtime"):
            v = info.get(key)
            if v is not None:
                return v.timestamp() if hasattr(v, "timestamp") else float(v)
        return None

    def walk_files(self, rel: str) -> Iterator[str]:
        """Every file below ``rel`` (relative paths). Maintenance only: never on a commit path."""
        self.calls["list"] += 1
        base = self.full(rel)
        if self.kind == "local":
            if not os.path.isdir(base):
                return
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    yield os.path.relpath(os.path.join(dirpath, name), self.root)
            return
        self.invalidate(rel)
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return
        prefix = self.root.strip("/") + "/"
        for p in found:
            p = p.lstrip("/")
            if p.startswith(prefix):
                yield p[len(prefix):]

    def list_dir(self, rel: str) -> list[str]:
        """Names directly below ``rel`` (maintenance and recovery at open only)."""
        self.calls["list"] += 1
        base = self.full(rel)
        if self.kind == "local":
            try:
                return sorted(os.listdir(base))
            except FileNotFoundError:
                return []
        self.invalidate(rel)
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def _makedirs(self, d: str) -> None:
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            if len(self._dirs) < 100_000 and "/_staging" not in d:  # staging dirs come and go
                self._dirs.add(d)

    def _s3(self, op: str, path: str, **kw: Any) -> Any:
        """One S3 request for one key (s3fs's file API adds a HEAD, or a LIST on a miss)."""
        bucket, key, _ = self.fs.split_path(path)

        async def call() -> Any:
            resp = await self.fs._call_s3(op, Bucket=bucket, Key=key, **kw)
            if op != "get_object":
                return resp
            body = resp["Body"]
            try:
                return await body.read()
            finally:
                body.close()

        return fsspec.asyn.sync(self.fs.loop, call)

    def invalidate(self, rel: str = "") -> None:
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache(self.full(rel))

    # -- writes ---------------------------------------------------------------------

    def write(self, rel: str, data: bytes, *, durable: bool | None = None) -> None:
        """Write a whole file; atomic for readers (temp + rename locally, one PUT on S3)."""
        self._require_writable()
        path = self.full(rel)
        if self.kind == "local":
            self._makedirs(os.path.dirname(path))
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if self.durable if durable is None else durable:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            return
        self.fs.pipe_file(path, bytes(data))

    def write_new(self, rel: str, data: bytes | pa.Buffer) -> None:
        """Create a file under a name nobody else writes (a txn's segment or staged body).

        No temp file and rename: nothing reads the name before a manifest lists it, and a
        manifest lists it only after this returned (and, locally, fsynced); a crash
        midway leaves a partial file that no manifest covers, which ``vacuum`` removes.
        """
        self._require_writable()
        if self.kind != "local":
            self.write(rel, bytes(data))
            return
        path = self.full(rel)
        self._makedirs(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(data)
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        os.close(fd)

    def write_hashed(self, rel: str, fill: Callable[[Any], None],
                     size_hint: int = 0) -> tuple[int, str]:
        """Write a new file by ``fill(sink)`` under a name nobody else writes (see
        ``write_new``); return its size and sha256.

        Locally a large file streams straight into the file (no in-memory copy) while a
        thread hashes the same buffers in order, finishing during the fsync; small files
        and other backends assemble the bytes in memory and write them in one go.
        """
        self._require_writable()
        if self.kind != "local" or size_hint < PARALLEL_HASH_BYTES:
            sink = pa.BufferOutputStream()
            fill(sink)
            buf = sink.getvalue()
            self.write_new(rel, buf)
            return buf.size, hashlib.sha256(buf).hexdigest()
        path = self.full(rel)
        self._makedirs(os.path.dirname(path))
        f = open(path, "xb")  # noqa: SIM115 - closed below; a name already there is not ours
        pool = ThreadPoolExecutor(1, thread_name_prefix="poimen-hash")
        try:
            with f:
                sink = _HashingSink(f, pool)
                fill(sink)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())  # the hash thread catches up meanwhile
            pool.shutdown(wait=True)
            sink.check()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return sink.size, sink.sha.hexdigest()

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        """Create ``rel`` with ``data`` unless it exists. True when this call created it.

        The check and the write are one atomic step on every supported backend, so of
        several racers exactly one wins.
        """
        self._require_writable()
        path = self.full(rel)
        if self.kind == "local":
            d = os.path.dirname(path)
            self._makedirs(d)
            tmp = os.path.join(d, f".tmp-{uuid.uuid4().hex}")
            with open(tmp, "wb") as f:
                f.write(data)
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            if self.durable:
                _fsync_dir(d)
            return True
        if self.kind == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
                return True
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        except OSError as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                return False
            raise
        return True

    def delete(self, rel: str, *, check: bool = True) -> bool:
        """Remove one file; False when it was already gone. ``check=False`` spares the
        existence probe on object stores (which delete a missing key silently) and then
        always answers True."""
        self._require_writable()
        path = self.full(rel)
        try:
            if self.kind == "local":
                os.unlink(path)
            else:
                if check and not self.exists(rel):
                    return False
                self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    def delete_tree(self, rel: str) -> int:
        """Remove every file below ``rel``; returns how many."""
        if self.kind == "local":
            with contextlib.suppress(OSError):  # empty (a promoted txn's staging): done
                os.rmdir(self.full(rel))
                return 0
        n = 0
        for f in list(self.walk_files(rel)):
            n += self.delete(f)
        if self.kind == "local":
            base = self.full(rel)
            for dirpath, _dirs, _files in os.walk(base, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        return n

    def move(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``, replacing it (callers move content-addressed bodies, so
        a replaced ``dst`` had the same bytes). Atomic for readers of ``dst``."""
        self._require_writable()
        if self.kind == "local":
            dpath = self.full(dst)
            try:
                os.replace(self.full(src), dpath)
            except FileNotFoundError:
                if not os.path.exists(self.full(src)):
                    raise NotFound(f"no such file: {self.url_of(src)}") from None
                os.makedirs(os.path.dirname(dpath), exist_ok=True)
                os.replace(self.full(src), dpath)
            return
        self.copy(src, dst)  # content-addressed: replacing dst changes no byte
        self.delete(src, check=False)

    def copy(self, src: str, dst: str) -> None:
        """Copy ``src`` to ``dst`` atomically for readers of ``dst``."""
        self._require_writable()
        if self.kind == "local":
            dpath = self.full(dst)
            os.makedirs(os.path.dirname(dpath), exist_ok=True)
            tmp = f"{dpath}.tmp-{uuid.uuid4().hex}"
            try:
                os.link(self.full(src), tmp)
            except FileNotFoundError:
                raise NotFound(f"no such file: {self.url_of(src)}") from None
            os.replace(tmp, dpath)
            return
        try:
            if self.kind == "s3":  # one server-side COPY (s3fs's copy lists and HEADs first)
                bucket, key, _ = self.fs.split_path(self.full(src))
                self._s3("copy_object", self.full(dst),
                         CopySource={"Bucket": bucket, "Key": key})
            else:
                self.fs.copy(self.full(src), self.full(dst))
        except FileNotFoundError:
            raise NotFound(f"no such file: {self.url_of(src)}") from None


class BackgroundPool:
    """A lazily started thread pool that survives ``fork`` (a child starts its own: the
    parent's threads are not there) and interpreter shutdown (work then runs inline)."""

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


class _HashingSink:
    """A file-like sink for Arrow writers that writes each buffer to ``f`` and hashes it
    on a one-thread pool (FIFO, so in order; ``hashlib`` releases the GIL on large
    buffers). A queued buffer stays alive in its pending call until hashed."""

    closed = False

    def __init__(self, f: Any, pool: ThreadPoolExecutor) -> None:
        self.f = f
        self.pool = pool
        self.sha = hashlib.sha256()
        self.size = 0
        self.failed: BaseException | None = None

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        self.size += n
        self.pool.submit(self._update, data)
        return n

    def _update(self, data: Any) -> None:
        if self.failed is None:
            try:
                self.sha.update(data)
            except BaseException as exc:  # noqa: BLE001 - re-raised by check()
                self.failed = exc

    def check(self) -> None:
        """After the pool is shut down: raise if a hash update failed (never a bad sha)."""
        if self.failed is not None:
            raise self.failed

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
