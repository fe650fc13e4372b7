"""The one retry layer of storage: a bounded total time per operation, exponential backoff
with full jitter. Backends below it (s3fs, botocore) are configured not to retry, so one
failing request costs one attempt per round here, never a product of three retry loops.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from poimen_data.errors import StorageError

T = TypeVar("T")
DEFAULT_RETRY_DEADLINE_S = 30.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long one storage operation may keep retrying a transient failure."""

    deadline_s: float = DEFAULT_RETRY_DEADLINE_S
    base_s: float = 0.05  # first backoff ceiling; doubles per attempt
    cap_s: float = 2.0  # largest backoff ceiling

    def __post_init__(self) -> None:
        if not self.deadline_s >= 0:  # also refuses NaN
            raise ValueError(f"retry deadline must be >= 0 seconds, got {self.deadline_s!r}")

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)], so racing writers that
        failed together do not retry together."""
        return random.uniform(0.0, min(self.cap_s, self.base_s * (2 ** min(attempt, 30))))

    def run(self, what: str, fn: Callable[[], T],
            transient: Callable[[BaseException], bool]) -> T:
        """``fn()`` until it succeeds, fails for good, or the deadline passes; then a
        ``StorageError`` naming ``what`` (the last failure is its cause)."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if not transient(exc):
                    raise
                left = self.deadline_s - (time.monotonic() - start)
                if left <= 0:
                    raise StorageError(
                        f"{what}: storage kept failing for {self.deadline_s:g} s "
                        f"({attempt + 1} attempts): {exc}") from exc
                time.sleep(min(left, self.backoff(attempt)))
                attempt += 1
