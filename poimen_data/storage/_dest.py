"""A local export destination: only a regular file (or nothing) is ever replaced, the
directory must exist, and the temp file of a killed export does not stay for good: it
holds a lock while its writer lives, and the next export to the same path removes it.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
import uuid
from typing import IO

try:
    import fcntl
except ImportError:  # Windows: no lock; the age alone decides
    fcntl = None  # type: ignore[assignment]

from poimen_data.errors import ValidationError

STALE_TEMP_S = 60.0  # only unlocked temp files this old are a dead export's
_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def temp_name(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{uuid.uuid4().hex}.tmp")


def check_dest(path: str, who: str = "export") -> None:
    """Refuse a destination that is not a regular file, or whose directory is missing."""
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise ValidationError(f"{who}: directory {parent} does not exist (create it first)")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    for test, what in _KINDS:
        if test(mode):
            raise ValidationError(f"{who}: {path} is {what}; refusing to replace it")


def open_temp(path: str) -> tuple[IO[bytes], str]:
    """A new file at a temporary name next to ``path``, locked (``flock``) while this
    process lives, after removing the temp files of dead exports to the same path."""
    sweep_stale(path)
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours: just made, nobody else has it
    return os.fdopen(fd, "wb"), tmp


def publish(f: IO[bytes], tmp: str, path: str, who: str = "export") -> None:
    """fsync the written file and move it onto ``path`` (checked again just before)."""
    f.flush()
    os.fsync(f.fileno())
    try:
        check_dest(path, who)
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    finally:
        f.close()


def discard(tmp: str | None) -> None:
    if tmp is not None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def sweep_stale(path: str, older_than: float = STALE_TEMP_S) -> list[str]:
    """Remove the temp files of exports to ``path`` whose process died: regular files
    named ``.<name>.<32 hex>.tmp``, unlocked, and older than ``older_than`` seconds (the
    age covers the instant between a temp file's creation and its lock)."""
    parent, name = os.path.split(path)
    parent = parent or "."
    pattern = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{32}}\.tmp")
    removed = []
    cutoff = time.time() - older_than
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not pattern.fullmatch(entry.name):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff \
                        and not _locked(entry.path):
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


def _locked(path: str) -> bool:
    """Whether a live export holds the temp file's lock (its lock dies with it)."""
    if fcntl is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock we may have taken
    return False
