"""Fault points for crash tests: with ``POIMEN_CRASH_AT=<point>`` in the environment the
process exits (``os._exit(137)``) when it reaches that point (DESIGN section 4)."""

from __future__ import annotations

import os

CRASH_POINTS = (
    "blob_staged",
    "segment_written",
    "manifest_published",
    "blobs_promoted",
    "state_written",
    "state_published",
)


def crash_point(name: str) -> None:
    """Die here (``os._exit(137)``) when ``POIMEN_CRASH_AT`` names this point (crash tests)."""
    if os.environ.get("POIMEN_CRASH_AT") == name:
        os._exit(137)
