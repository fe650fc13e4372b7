"""The batch chain a team schedules: compact, grade, materialize, check, export.

Each stage is a function ``(log, ...) -> StageResult`` usable on its own; ``run_chain``
runs them in order. Library errors are results (status ``failed``), never tracebacks: a
scheduler reads the summary, not a stack. ``pipelines/nightly.py`` and ``poimen demo``
call this module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time as _time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, Literal

from rich.table import Table
from rich.text import Text

from poimen_data.fold._check import check as _check
from poimen_data.fold._state import materialize as _materialize
from poimen_data.jobs._export import ExportFormat, export_live
from poimen_data.jobs._grade import grade as _grade
from poimen_data.jobs._maint import compact as _compact

#: The order of the chain: grading first, so the state that ``check`` proves and that
#: ``export`` reads already holds the new verdicts (grading reads snapshots at older LSNs,
#: which a state at the head cannot serve anyway).
STAGES = ("compact", "grade", "materialize", "check", "export")
StageStatus = Literal["ok", "failed", "skipped"]
STYLE = {"ok": "green", "skipped": "yellow", "failed": "bold red"}


class StageFailed(Exception):
    """The stage ran and its answer is no (e.g. state != re-fold); the message says why."""


def jsonable(x: Any, depth: int = 0) -> Any:
    """Reports and views as plain JSON values (dataclasses, refs, Decimal, datetime)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k) if not isinstance(k, tuple) else "/".join(map(str, k)):
                jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [jsonable(v, depth + 1) for v in x]
    if isinstance(x, Decimal):
        return str(x)
    if isinstance(x, datetime | date | time):  # ISO 8601, as SQL results hand them over
        return x.isoformat()
    if isinstance(x, timedelta):  # an interval: its seconds
        return x.total_seconds()
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "nan", "inf", "-inf": JSON has no such numbers (jq refuses NaN)
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, uuid.UUID):
        return str(x)
    return repr(x)


@dataclass(frozen=True)
class StageResult:
    name: str
    status: StageStatus
    seconds: float
    detail: str  # one line for people
    data: dict[str, Any] = field(default_factory=dict)  # JSON facts for scripts


def _run(name: str, body: Callable[[], tuple[str, Any]]) -> StageResult:
    t0 = _time.perf_counter()
    try:
        detail, data = body()
        status: StageStatus = "ok"
    except StageFailed as exc:
        status, detail = "failed", str(exc.args[0]).splitlines()[0]
        data = exc.args[1] if len(exc.args) > 1 else {}
    except Exception as exc:  # one stage's fault, library bug included, is a result
        status, detail, data = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0], {}
    return StageResult(name, status, round(_time.perf_counter() - t0, 3), detail,
                       jsonable(data))


def compact(log: Any) -> StageResult:
    def body() -> tuple[str, Any]:
        r = _compact(log)
        return (f"{r.segments_before} -> {r.segments_after} segments "
                f"({r.rewritten} rewritten)", r)
    return _run("compact", body)


def materialize(log: Any) -> StageResult:
    def body() -> tuple[str, Any]:
        r = _materialize(log)
        return str(r), r
    return _run("materialize", body)


def check(log: Any) -> StageResult:
    """State == cold re-fold. A mismatch is a ``failed`` stage naming the first difference."""
    def body() -> tuple[str, Any]:
        r = _check(log)
        if not r.ok:
            raise StageFailed(str(r), r)
        return str(r), r
    return _run("check", body)


def grade(log: Any, verifiers: Sequence[Any] | None = None, *,
          progress: Callable[[int, int], None] | None = None) -> StageResult:
    def body() -> tuple[str, Any]:
        vs = list(verifiers) if verifiers else default_verifiers()
        r = _grade(log, vs, progress=progress)
        return (f"{r.runs_graded} runs graded ({r.runs_passed} passed, {r.runs_failed} "
                f"failed, {r.runs_errored} errored), {r.verdicts_recorded} verdicts, "
                f"{r.runs_skipped} skipped", r)
    return _run("grade", body)


def default_verifiers() -> list[Any]:
    """The example verifiers: states only, and one that reads the final answer."""
    from poimen_data.jobs import verifiers as v

    return [v.exit_code, v.output_mentions("RESULT: resolved", last_steps=1,
                                           name="resolved")]


def export(log: Any, out_dir: str, formats: Sequence[ExportFormat] = ("jsonl", "parquet"), *,
           progress: Callable[[Any], None] | None = None) -> StageResult:
    def body() -> tuple[str, Any]:
        import fsspec.core
        from fsspec.implementations.local import LocalFileSystem

        fs, path = fsspec.core.url_to_fs(out_dir)
        if isinstance(fs, LocalFileSystem):  # the chain's output directory: made here, as
            os.makedirs(path, exist_ok=True)  # export_live never creates a directory
        files = []
        for fmt in formats:
            dest = f"{out_dir.rstrip('/')}/live.{fmt}"
            r = export_live(log, dest, format=fmt, progress=progress)
            files.append(r)
        parts = ", ".join(f"{r.path} ({r.records} records, {r.bytes:,} B)" for r in files)
        return parts, {"files": files}
    return _run("export", body)


def run_chain(log: Any, stages: Sequence[str] = STAGES, *, out_dir: str | None = None,
              verifiers: Sequence[Any] | None = None,
              on_stage: Callable[[StageResult], None] | None = None) -> list[StageResult]:
    """Run ``stages`` in order; a failed stage does not stop the ones after it, except
    that ``check`` is not attempted on a state that failed to materialize."""
    results: list[StageResult] = []
    for name in stages:
        if name == "compact":
            r = compact(log)
        elif name == "materialize":
            r = materialize(log)
        elif name == "check":
            if any(x.name == "materialize" and x.status == "failed" for x in results):
                r = StageResult("check", "skipped", 0.0, "materialize failed")
            else:
                r = check(log)
        elif name == "grade":
            r = grade(log, verifiers)
        elif name == "export":
            r = export(log, out_dir or f"{log.root.rstrip('/')}/exports")
        else:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
        results.append(r)
        if on_stage is not None:
            on_stage(r)
    return results


def titled(title: str, **kw: Any) -> Table:
    """A table at least as wide as its title (rich would wrap a long title), shown as it
    is (a path in it is not rich markup)."""
    return Table(title=Text(title, style="table.title"), min_width=len(title) + 4, **kw)


def summary_table(results: Sequence[StageResult], title: str = "nightly") -> Table:
    t = titled(title)
    t.add_column("stage")
    t.add_column("status")
    t.add_column("seconds", justify="right")
    t.add_column("what happened", overflow="fold")
    for r in results:
        t.add_row(Text(r.name), f"[{STYLE[r.status]}]{r.status}[/]", f"{r.seconds:.2f}",
                  Text(r.detail))  # Text: paths and messages are not rich markup
    return t
