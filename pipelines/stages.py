"""The stages of the batch chain a team schedules: compact, materialize, check, grade, export.

Each stage is a function ``(log, ...) -> StageResult`` usable on its own. A stage whose
library function has not landed yet is *skipped* with a note instead of failing, so the
chain can be scheduled today and grows as the library does. Library errors are results
(status ``failed``), never tracebacks: a scheduler reads the summary, not a stack.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

#: The order of the chain: grading first, so the state that ``check`` proves and that
#: ``export`` reads already holds the new verdicts (grading reads snapshots at older LSNs,
#: which a state at the head cannot serve anyway).
STAGES = ("compact", "grade", "materialize", "check", "export")
#: Where each library function may live: the public name first, then its module.
HOMES: dict[str, tuple[str, ...]] = {
    "materialize": ("poimen_data", "poimen_data._state", "poimen_data._fold"),
    "check": ("poimen_data", "poimen_data._state", "poimen_data._fold"),
    "connect": ("poimen_data", "poimen_data._fold", "poimen_data._query"),
    "episode": ("poimen_data", "poimen_data._query"),
    "grade": ("poimen_data", "poimen_data._grade"),
    "export_live": ("poimen_data", "poimen_data._export"),
    "compact": ("poimen_data", "poimen_data._maint"),
    "vacuum": ("poimen_data", "poimen_data._maint"),
    "reduce": ("poimen_data", "poimen_data._maint"),
    "view_sql": ("poimen_data", "poimen_data._fold"),
}


class NotYet(Exception):
    """A library function this stage needs has not landed yet."""


class StageFailed(Exception):
    """The stage ran and its answer is no (e.g. state != re-fold); the message says why."""


def lookup(name: str) -> Callable[..., Any]:
    """The library function ``name`` (e.g. ``"materialize"``), or raise ``NotYet``."""
    for mod in HOMES.get(name, ("poimen_data",)):
        try:
            fn = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    raise NotYet(f"poimen_data.{name} is not available yet")


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
    if isinstance(x, datetime):
        return x.isoformat()
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return repr(x)


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str  # "ok" | "skipped" | "failed"
    seconds: float
    detail: str  # one line for people
    data: dict[str, Any] = field(default_factory=dict)  # JSON facts for scripts


def _run(name: str, body: Callable[[], tuple[str, Any]]) -> StageResult:
    t0 = time.perf_counter()
    try:
        detail, data = body()
        status = "ok"
    except NotYet as exc:
        status, detail, data = "skipped", f"{exc} (stage skipped)", {}
    except StageFailed as exc:
        status, detail = "failed", str(exc.args[0]).splitlines()[0]
        data = exc.args[1] if len(exc.args) > 1 else {}
    except Exception as exc:  # one stage's fault, library bug included, is a result
        status, detail, data = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0], {}
    return StageResult(name, status, round(time.perf_counter() - t0, 3), detail,
                       jsonable(data))


def compact(log: Any) -> StageResult:
    def body() -> tuple[str, Any]:
        r = lookup("compact")(log)
        return (f"{r.segments_before} -> {r.segments_after} segments "
                f"({r.rewritten} rewritten)", r)
    return _run("compact", body)


def materialize(log: Any) -> StageResult:
    def body() -> tuple[str, Any]:
        covers = lookup("materialize")(log)
        lsn = getattr(covers, "lsn", covers)
        return f"state covers LSN {lsn} (head {log.head})", {"covers_lsn": lsn}
    return _run("materialize", body)


def check(log: Any) -> StageResult:
    """State == cold re-fold. A mismatch is a ``failed`` stage naming the first difference."""
    def body() -> tuple[str, Any]:
        r = lookup("check")(log)
        if not getattr(r, "ok", r):
            raise StageFailed(str(r), r)
        return str(r), r
    return _run("check", body)


def grade(log: Any, verifiers: Sequence[Any] | None = None, *,
          progress: Callable[[int, int], None] | None = None) -> StageResult:
    def body() -> tuple[str, Any]:
        fn = lookup("grade")
        vs = list(verifiers) if verifiers else default_verifiers()
        r = fn(log, vs, progress=progress) if progress else fn(log, vs)
        return (f"{r.runs_graded} runs graded ({r.runs_passed} passed, {r.runs_failed} "
                f"failed, {r.runs_errored} errored), {r.verdicts_recorded} verdicts, "
                f"{r.runs_skipped} skipped", r)
    return _run("grade", body)


def default_verifiers() -> list[Any]:
    """The example verifiers: states only, and one that reads the final answer."""
    try:
        from poimen_data import verifiers as v
    except ImportError:
        raise NotYet("poimen_data.verifiers is not available yet") from None
    return [v.exit_code, v.output_mentions("RESULT: resolved", last_steps=1,
                                           name="resolved")]


def export(log: Any, out_dir: str, formats: Sequence[str] = ("jsonl", "parquet"), *,
           progress: Callable[[Any], None] | None = None) -> StageResult:
    def body() -> tuple[str, Any]:
        fn = lookup("export_live")
        files = []
        for fmt in formats:
            dest = f"{out_dir.rstrip('/')}/live.{fmt}"
            r = fn(log, dest, format=fmt, progress=progress) if progress else \
                fn(log, dest, format=fmt)
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
