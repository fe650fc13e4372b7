"""``check``: prove that the materialized state equals a cold re-fold of the log.

The re-fold runs the same partitioned build as ``materialize`` (in passes under the same
memory budget, or on Dask workers) but keeps only each file's sha256; every state file is
read back and checked against its pointer entry, and any difference is named row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from poimen_data.errors import CorruptionError, StateChanged
from poimen_data.fold import _build as B
from poimen_data.fold import _state as S
from poimen_data.fold._fold import FOLD_VERSION
from poimen_data.log._log import EventLog, LogLike, as_log

MAX_TRIES = 5


@dataclass(frozen=True)
class CheckReport:
    """What ``check`` found: ``ok`` when every file of the state equals, byte for byte,
    the file a cold re-fold of the log at the state's LSN gives (so every episode does)."""

    ok: bool
    lsn: int | None
    files: int
    episodes: int
    first_difference: str | None

    def __str__(self) -> str:
        if self.ok:
            return (f"state at lsn {self.lsn} equals a cold re-fold: {self.files} files, "
                    f"{self.episodes} episodes")
        return f"state differs from a cold re-fold: {self.first_difference}"


def _first_row_difference(a: pa.Table, b: pa.Table) -> str:
    for i, (x, y) in enumerate(zip(a.to_pylist(), b.to_pylist(), strict=False)):
        if x != y:
            cols = [k for k in x if x[k] != y.get(k)]
            return f"row {i} differs in {cols}: state {x} != re-fold {y}"
    return f"state has {a.num_rows} rows, re-fold {b.num_rows}"


def _cold(log: EventLog, ptr: S.Pointer, budget: B.Budget, executor: Any,
          passes: int | None, keep: set[str]) -> tuple[S._Build, dict[str, bytes]]:
    """The cold build's entries, and the bytes of its files whose sha256 the state lacks."""
    kept: dict[str, bytes] = {}

    def sink(table: str, f: B.FileEntry, data: bytes) -> None:
        if f.sha256 not in keep:
            kept[f.path] = data

    w = B.Writer(sink)
    groups = S.plan_groups(log, ptr.lsn, budget, passes)
    remote = None if executor is None else S._remote_fold(log, ptr.lsn, budget, "", set())
    try:
        b = S.build_full(log, ptr.lsn, w, budget, groups, executor, remote)
        w.close()
        S._finish(b, sink)
    finally:
        w.close()
    return b, kept


def _check_once(log: EventLog, budget: B.Budget, executor: Any,
                passes: int | None) -> CheckReport:
    try:
        ptr = S.read_pointer(log)
    except CorruptionError as exc:
        return CheckReport(False, None, 0, 0, str(exc))
    if ptr is None:
        return CheckReport(False, None, 0, 0, f"no materialized state in {log.root}")
    if not ptr.usable:
        return CheckReport(False, ptr.lsn, 0, 0, f"state made by fold {ptr.fold_version} "
                           f"with other settings or fold (this is fold {FOLD_VERSION})")
    n = 0
    for t in S.STATE_TABLES:  # every file there and intact
        for f in ptr.tables.get(t, ()):
            try:
                S.read_bytes(log, f, ptr)
            except CorruptionError as exc:
                return CheckReport(False, ptr.lsn, n, 0, str(exc))
            n += 1
    shas = {f.sha256 for es in ptr.tables.values() for f in es}
    cold, kept = _cold(log, ptr, budget, executor, passes, shas)
    if kept and executor is not None:  # name the difference from bytes made here
        cold, kept = _cold(log, ptr, budget, None, passes, shas)
    n = 0
    for t in S.STATE_TABLES:
        want = {f.key: f for f in ptr.tables.get(t, ())}
        got = cold.tables.get(t, {})
        for k in sorted(set(want) | set(got)):
            if k not in got or k not in want:
                where = "state" if k in want else "re-fold"
                return CheckReport(False, ptr.lsn, n, 0, f"table {t} bucket {k[0]} chunk "
                                   f"{k[1]}: only the {where} has it")
            n += 1
            if want[k].sha256 != got[k].sha256:
                a = S.read_file(log, want[k], ptr)
                b = pq.read_table(pa.py_buffer(kept[got[k].path]))
                return CheckReport(False, ptr.lsn, n, 0, f"table {t} bucket {k[0]} chunk "
                                   f"{k[1]} ({want[k].path}): {_first_row_difference(a, b)}")
    runs = sum(f.rows for f in ptr.tables.get("runs", ()))
    return CheckReport(True, ptr.lsn, n, runs, None)


@B.scan_errors()
def check(log: LogLike, *, storage_options: dict[str, Any] | None = None,
          memory_limit: int | str | None = None,
          temp_directory: str | None = None, executor: Any = None,
          passes: int | None = None) -> CheckReport:
    """Re-fold the log at the state's LSN, cold, and compare every file by sha256 (equal
    files give equal episodes: the report's ``episodes`` counts them), naming the first
    differing row.

    The re-fold is bounded like ``materialize`` (``memory_limit``, ``temp_directory``,
    ``executor=`` a Dask client, ``passes`` to force the number of bucket groups). A
    concurrent materialize that replaces the state while it is checked makes check start
    again on the new pointer.
    """
    log = as_log(log, storage_options=storage_options, read_only=True)
    budget = B.budget_of(memory_limit, temp_directory)
    for _ in range(MAX_TRIES - 1):
        try:
            return _check_once(log, budget, executor, passes)
        except StateChanged:
            continue
    return _check_once(log, budget, executor, passes)


__all__ = ["CheckReport", "check"]
