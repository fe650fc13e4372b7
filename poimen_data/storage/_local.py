"""Local disk: temp file + fsync + ``os.link`` for put-if-absent (``link`` fails if the name
is taken), temp file + ``os.replace`` for whole-file writes, ``O_EXCL`` for new files.
Local errors are never retried: they are not transient, and they are not ambiguous.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import stat
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from poimen_data.errors import CorruptionError, NotFound, StorageError
from poimen_data.storage import _dest
from poimen_data.storage._base import PARALLEL_HASH_BYTES, Storage
from poimen_data.storage._writer import AtomicWriter, HashingSink

_logger = logging.getLogger(__name__)


def open_regular(path: str) -> int:
    """A file descriptor of ``path`` opened for reading, which must be a regular file:
    every file of a log is one. A directory or a device in its place is a
    ``CorruptionError`` naming it, and a FIFO is one too instead of a read that waits for
    ever (opened without blocking, then looked at)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptionError(f"{path}: not a regular file ({_kind(mode)}); a log's "
                                  "files all are")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a file"


#: the file a log's root holds from its making on (``pin_root`` tells a root made again
#: by it)
ROOT_MARKER = "_poimen.json"


class LocalStorage(Storage):
    kind = "local"
    durable_fsync = True
    leaves_temp_files = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.root = os.path.abspath(self.root)
        self._dirs: set[str] = set()  # directories known to exist (blobs/<t>/<aa>, ...)
        self._pinned = False  # see pin_root
        self._root_id: tuple[int | None, ...] | None = None

    def url_of(self, rel: str) -> str:
        return self.full(rel)

    def native_path(self, rel: str) -> str | None:
        return self.full(rel)

    def pin_root(self) -> None:
        self._pinned = True
        self._root_id = self._identity()

    def _identity(self) -> tuple[int | None, ...] | None:
        """What tells this root from one made again under its name: the device and inode
        of the directory and of the log's ``_poimen.json`` (written once, when the log is
        made; None for a root without one), and that file's modification time in
        nanoseconds (a freed inode number is soon given again, to the next directory or
        file made); None when the directory is gone."""
        try:
            d = os.stat(self.root)
        except OSError:
            return None
        if not stat.S_ISDIR(d.st_mode):
            return None
        try:
            f = os.stat(os.path.join(self.root, ROOT_MARKER))
        except OSError:
            return d.st_dev, d.st_ino, None, None
        return d.st_dev, d.st_ino, f.st_ino, f.st_mtime_ns

    def _check_root(self) -> None:
        """``StorageError`` when the pinned root is gone, or is another directory now,
        made again under its name (see ``pin_root``)."""
        if not self._pinned:
            return
        now = self._identity()
        was = self._root_id
        same = now is not None and (was is None or now == was or (
            was[2] is None and now[:2] == was[:2]))  # pinned without a marker: its inode
        if not same:
            raise StorageError(f"{self.root}: the log's directory is gone (deleted or moved "
                               "away while open, or made again); nothing was written")

    def _makedirs(self, d: str) -> None:
        if d not in self._dirs:
            if self._pinned:
                self._makedirs_below_root(d)
            else:
                os.makedirs(d, exist_ok=True)
            if len(self._dirs) < 100_000 and "/_staging" not in d:  # staging dirs come and go
                self._dirs.add(d)

    def _makedirs_below_root(self, d: str) -> None:
        """``os.makedirs`` that never makes the root (see ``pin_root``)."""
        if d == self.root:
            self._check_root()
            return
        if os.path.dirname(d) == self.root:  # right under it: not in a root made again
            self._check_root()  # (deeper, a missing parent leads here first)
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        except FileNotFoundError:
            self._makedirs_below_root(os.path.dirname(d))
            with contextlib.suppress(FileExistsError):
                os.mkdir(d)

    # -- reads ----------------------------------------------------------------------

    def _read(self, path: str) -> bytes:
        with os.fdopen(open_regular(path), "rb") as f:
            return f.read()

    def _read_range(self, path: str, offset: int, size: int) -> bytes:
        with os.fdopen(open_regular(path), "rb") as f:
            return os.pread(f.fileno(), size, offset)

    def exists(self, rel: str) -> bool:
        self.calls["exists"] += 1
        return os.path.exists(self.full(rel))

    def _size(self, path: str) -> int:
        return os.stat(path).st_size

    def mtime(self, rel: str) -> float | None:
        try:
            return os.stat(self.full(rel)).st_mtime
        except FileNotFoundError:
            return None

    def walk_files(self, rel: str) -> Iterator[str]:
        self.calls["list"] += 1
        base = self.full(rel)
        if not os.path.isdir(base):
            return
        for dirpath, _dirs, files in os.walk(base):
            where = os.path.relpath(dirpath, self.root)  # once a directory, not a file
            for name in files:
                yield name if where == "." else f"{where}/{name}"

    def list_dir(self, rel: str) -> list[str]:
        self.calls["list"] += 1
        try:
            return sorted(os.listdir(self.full(rel)))
        except FileNotFoundError:
            return []

    def invalidate(self, rel: str = "") -> None:
        pass

    # -- writes ---------------------------------------------------------------------

    def _create(self, path: str, data: bytes | pa.Buffer, durable: bool) -> None:
        """Create ``path`` (it must not exist) and write it whole, fsynced when ``durable``;
        on any failure (ENOSPC) leave nothing behind. os.open and os.write, no buffered
        file object: open()'s fstat, ioctl and seek would cost a third of a small file (a
        body copied out of a pack is one)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # as open(): umask
        except FileNotFoundError:
            self._check_root()  # a directory it knew, gone with the root
            raise
        try:
            try:
                view = memoryview(data)  # pa.Buffer has the buffer protocol
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise

    def write(self, rel: str, data: bytes, *, durable: bool | None = None) -> None:
        path = self.full(rel)
        self._makedirs(os.path.dirname(path))
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self._create(tmp, data, self.durable if durable is None else durable)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def write_new(self, rel: str, data: bytes | pa.Buffer, *, sync: bool = True) -> None:
        path = self.full(rel)
        self._makedirs(os.path.dirname(path))
        self._create(path, data, sync and self.durable)

    def write_hashed(self, rel: str, fill: Callable[[Any], None],
                     size_hint: int = 0, *, sync: bool = True) -> tuple[int, str]:
        """A large file streams straight into the file (no in-memory copy) while a thread
        hashes the same buffers in order, finishing during the fsync."""
        if size_hint < PARALLEL_HASH_BYTES:
            return super().write_hashed(rel, fill, size_hint, sync=sync)
        path = self.full(rel)
        self._makedirs(os.path.dirname(path))
        try:
            f = open(path, "xb")  # noqa: SIM115 - closed below; a name already there is not ours
        except FileNotFoundError:
            self._check_root()
            raise
        sink = HashingSink(f)
        try:
            with f:
                fill(sink)
                f.flush()
                if sync and self.durable:
                    os.fsync(f.fileno())  # the hash thread catches up meanwhile
            sha = sink.finish()
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return sink.size, sha

    def durable_batch(self) -> SyncFsBatch | None:
        if not self.durable or _syncfs is None:
            return None  # elsewhere each staged file is fsynced as it is written
        return SyncFsBatch(self.root)

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        path = self.full(rel)
        d = os.path.dirname(path)
        self._makedirs(d)
        tmp = os.path.join(d, f".tmp-{uuid.uuid4().hex}")
        self._create(tmp, data, self.durable)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            # once linked, the file is visible: failing here would read as "not put"
            # (and a commit's abort would remove what its manifest names); a temp file
            # left behind is vacuum's, as a dead writer's is
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if self.durable:
            _fsync_dir(d)
        return True

    def delete(self, rel: str, *, check: bool = True) -> bool:
        try:
            os.unlink(self.full(rel))
        except FileNotFoundError:
            return False
        return True

    def delete_tree(self, rel: str) -> int:
        with contextlib.suppress(OSError):  # empty (a promoted txn's staging): done
            os.rmdir(self.full(rel))
            return 0
        n = sum(self.delete(f) for f in list(self.walk_files(rel)))
        for dirpath, _dirs, _files in os.walk(self.full(rel), topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
        return n

    def move(self, src: str, dst: str) -> None:
        dpath = self.full(dst)
        try:
            os.replace(self.full(src), dpath)
        except FileNotFoundError:
            if not os.path.exists(self.full(src)):
                raise NotFound(f"no such file: {self.url_of(src)}") from None
            self._makedirs(os.path.dirname(dpath))
            try:
                os.replace(self.full(src), dpath)
            except FileNotFoundError:  # another promoter (a roll-forward) moved it first
                raise NotFound(f"no such file: {self.url_of(src)}") from None

    def copy(self, src: str, dst: str) -> None:
        dpath = self.full(dst)
        self._makedirs(os.path.dirname(dpath))
        tmp = f"{dpath}.tmp-{uuid.uuid4().hex}"
        try:
            os.link(self.full(src), tmp)
        except FileNotFoundError:
            raise NotFound(f"no such file: {self.url_of(src)}") from None
        os.replace(tmp, dpath)

    def open_read(self, rel: str) -> Any:
        return open(self.full(rel), "rb")  # noqa: SIM115 - the caller's to close

    def arrow_filesystem(self) -> Any:
        from pyarrow.fs import LocalFileSystem

        return LocalFileSystem()

    def open_atomic(self, rel: str) -> AtomicWriter:
        """An export's writer (see ``_dest``): only a regular file or nothing is replaced,
        the directory must exist, and a dead export's temp file is swept by the next one."""
        path = self.full(rel)
        _dest.check_dest(path)
        tmp: list[str] = []

        def open_tmp() -> Any:
            f, name = _dest.open_temp(path)
            tmp.append(name)
            return f

        def publish(f: Any) -> None:
            _dest.publish(f, tmp[0], path)

        def discard(f: Any) -> None:
            with contextlib.suppress(Exception):
                f.close()
            _dest.discard(tmp[0] if tmp else None)

        return AtomicWriter(path, open_tmp, publish, discard)


def _load_syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the call releases the GIL
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


_syncfs = _load_syncfs()


class SyncFsBatch:
    """Many new files made durable by one ``syncfs(2)`` of their file system.

    Why this is as durable as an fsync of each file and of its directory: ``syncfs``
    writes back every dirty page and inode of the file system (the files' data, their
    inodes, the directory blocks holding their names, the allocation bitmaps), waits for
    that writeback, then flushes the device cache (or commits the journal), like
    ``sync(2)`` but for one file system. Since Linux 5.8 it also reports a writeback
    error of any file there that happened after the descriptor it is called on was
    opened: this batch opens that descriptor before any of its files is written, so a
    lost write of one of them fails ``sync()`` instead of passing unseen. It costs one
    device flush per batch instead of one per file (64 bodies of 4 KB: ~10 ms instead
    of 64 flushes), at the price of also writing back other dirty files of the file
    system, which is why only batches of many small files use it.
    """

    def __init__(self, root: str) -> None:
        self._fd: int | None = os.open(root, os.O_RDONLY | os.O_DIRECTORY)

    def sync(self) -> None:
        assert self._fd is not None and _syncfs is not None
        if _syncfs(self._fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# What a file system that syncs no directories answers (PostgreSQL's fsync_fname takes
# the same as "not supported"): opening one to read, or fsync on it
_NO_DIR_OPEN = frozenset({errno.EACCES, errno.EISDIR})
_NO_DIR_SYNC = frozenset({errno.EINVAL, errno.EBADF})
_said_no_dir_sync = False


def _fsync_dir(d: str) -> None:
    """Make a new name in ``d`` durable (after ``os.link``). It is visible already, so a
    failure cannot undo it, and raising would read as "not put" (a commit's abort would
    remove what its visible manifest names): it is logged as an error instead, naming the
    directory, since that name may not survive a power loss (a disk that failed a sync
    may well fail the next ones too). A file system that cannot sync a directory at all
    is said once, as a warning."""
    fd = None
    try:
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in (_NO_DIR_OPEN if fd is None else _NO_DIR_SYNC):
            _no_dir_sync(d, exc)
        else:
            _logger.error("%s: syncing the directory after a new file's link failed (%s); "
                          "that name may not survive a power loss", d, exc)
    finally:
        if fd is not None:
            os.close(fd)


def _no_dir_sync(d: str, exc: OSError) -> None:
    global _said_no_dir_sync
    if not _said_no_dir_sync:
        _said_no_dir_sync = True
        _logger.warning("%s: this file system does not sync directories (%s): a new "
                        "file's name may not survive a power loss (said once)", d, exc)
