"""Fault points for crash tests: with ``POIMEN_CRASH_AT=<point>`` in the environment the
process exits (``os._exit(137)``) when it reaches that point (docs/DESIGN.md, "Python API").

A commit writes its bodies and segment on I/O threads, so when one point fires another
write may be under way. The process then dies once the writes already started have
finished, and starts no new one: a crash test sees "died right after this point" with no
request still travelling to storage (on S3 such a request could land after the parent's
vacuum and look like an orphan the crash left)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

CRASH_POINTS = (
    "blob_staged",
    "segment_written",
    "manifest_published",
    "blobs_promoted",
    "checkpoint_lists_written",
    "state_written",
    "state_published",
)

_cond = threading.Condition()
_writing = 0
_dying = False


@contextlib.contextmanager
def write_in_flight() -> Iterator[None]:
    """Mark a write of a commit's file under way (a crash point waits for it)."""
    global _writing
    with _cond:
        if _dying:
            os._exit(137)
        _writing += 1
    try:
        yield
    finally:
        with _cond:
            _writing -= 1
            _cond.notify_all()


def crash_point(name: str) -> None:
    """Die here (``os._exit(137)``) when ``POIMEN_CRASH_AT`` names this point (crash tests)."""
    if os.environ.get("POIMEN_CRASH_AT") != name:
        return
    global _dying
    with _cond:
        _dying = True
        _cond.wait_for(lambda: _writing == 0, timeout=60)
    os._exit(137)
