"""``poimen bench``: every speed goal of the project, measured next to its reference.

The machines this runs on are shared and noisy (another job can halve the speed of a
core for a minute), so an absolute time alone says little. Every scenario therefore times
*ours* and a *reference* doing the same work in the same run, interleaved (the order
alternates each repetition, so a slow minute hurts both), and reports medians and their
ratio. Where the project's goal is absolute (events/s, ms, runs/s) the goal is checked on
the absolute figure, but a reference is still measured beside it, so a reader can tell a
slow machine from a slow code path.

Data comes from the demo generator (``poimen_data.workload.synth``), work directories live in one
temporary directory that is removed at the end. ``run()`` returns ``Result`` values;
``run_cli()`` is what ``poimen bench`` calls: it prints a table and writes JSON. The
scenarios themselves are in ``_scenarios``, their shared pieces in ``_core``.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from poimen_data.bench._core import (
    JSON_SCHEMA,
    REPRODUCE,
    Ctx,
    Result,
    Scenario,
)
from poimen_data.bench._scenarios import SCENARIOS


def _scenarios() -> list[Scenario]:
    return SCENARIOS


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def scenario_names() -> list[str]:
    return [s.name for s in _scenarios()]


def select(only: str | None) -> list[Scenario]:
    """Every scenario, or the one ``only`` names (by key or title, any case)."""
    all_ = _scenarios()
    if only is None:
        return all_
    want = _norm(only)
    chosen = [s for s in all_ if want in (s.name, _norm(s.title))]
    if not chosen:
        raise KeyError(f"no scenario {only!r}; scenarios: {', '.join(s.name for s in all_)}")
    return chosen


def _run_one(s: Scenario, ctx: Ctx) -> Result:
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        r = s.fn(ctx)
    except Exception as exc:  # one broken scenario must not hide the others' numbers
        r = Result(s.name, s.title, "error", s.goal.text,
                   note=f"{type(exc).__name__}: {exc}",
                   details={"traceback": traceback.format_exc(limit=8)})
    r.seconds = time.perf_counter() - t0
    r.details["cpu_s"] = time.process_time() - c0  # all threads: wall on an idle machine
    if r.status == "ok":
        r.met = s.goal.met(r.ours, r.ratio)
    return r


def run(quick: bool = False, only: str | None = None, root: str | None = None,
        on_result: Callable[[Result], None] | None = None) -> list[Result]:
    """Run the scenarios (all, or the one ``only`` names) and return their results.

    ``root``: the directory to make the temporary work directory in (the disk being
    measured); default the system temp dir. ``on_result`` sees each result as it lands.
    """
    chosen = select(only)
    if root is not None:
        os.makedirs(root, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="poimen-bench-", dir=root))
    ctx = Ctx(quick, work)
    results = []
    try:
        for s in chosen:
            r = _run_one(s, ctx)
            results.append(r)
            if on_result is not None:
                on_result(r)
    finally:
        ctx.cache.clear()
        shutil.rmtree(work, ignore_errors=True)
    return results


# --- output --------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("pyarrow", "duckdb", "polars", "deltalake", "fsspec", "s3fs", "moto"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except ImportError:
            continue
    return out


def report_doc(results: list[Result], quick: bool, wall_s: float | None = None) -> dict[str, Any]:
    """The JSON document: the machine, the command and every result."""
    return {
        "schema": JSON_SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "command": REPRODUCE.replace("bench", "bench --quick", 1) if quick else REPRODUCE,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                    "versions": _versions()},
        "wall_s": wall_s,
        "results": [r.to_json() for r in results],
    }


def write_json(path: str, results: list[Result], quick: bool,
               wall_s: float | None = None) -> None:
    """The report at ``path``: a new or regular file in an existing directory (a symlink,
    a directory or a device is refused, as an export's destination is), written whole
    under a temporary name and moved there."""
    from poimen_data.storage import _dest

    path = os.path.abspath(path)
    _dest.check_dest(path, "bench --json")
    f, tmp = _dest.open_temp(path)
    try:
        f.write((json.dumps(report_doc(results, quick, wall_s), indent=2, sort_keys=True)
                 + "\n").encode())
    except BaseException:
        f.close()
        _dest.discard(tmp)
        raise
    _dest.publish(f, tmp, path, "bench --json")


def _met_text(r: Result) -> str:
    if r.status != "ok":
        return r.status
    return {True: "yes", False: "NO", None: "-"}[r.met]


def rows(results: list[Result]) -> list[tuple[str, str, str, str, str, str]]:
    """(scenario, ours, reference, ratio, goal, met?) as text, one per result."""
    out = []
    for r in results:
        if r.status == "ok":
            out.append((r.title, r.ours_text, r.reference_text, r.ratio_text, r.goal,
                        _met_text(r)))
        else:
            out.append((r.title, r.note if r.status == "n/a" else "error", "", "", r.goal,
                        _met_text(r)))
    return out


def markdown(results: list[Result]) -> str:
    """The table as markdown, for the README's performance section."""
    lines = ["| scenario | ours | reference | ratio | goal | met? |",
             "|---|---|---|---|---|---|"]
    for row in rows(results):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)


def print_table(results: list[Result], quick: bool, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"poimen bench{' --quick' if quick else ''}", show_lines=False)
    for col in ("scenario", "ours", "reference", "ratio", "goal", "met?"):
        t.add_column(col, overflow="fold")
    styles = {"yes": "green", "NO": "bold red", "error": "bold red", "n/a": "yellow"}
    for row in rows(results):
        t.add_row(*row[:5], f"[{styles.get(row[5], '')}]{row[5]}[/]" if row[5] in styles
                  else row[5])
    console.print(t)
    for r in results:
        if r.note and r.status == "ok":
            console.print(f"[dim]{r.title}: {r.note}[/]")
        elif r.status == "error":
            console.print(f"[red]{r.title}: {r.note}[/]")


def run_cli(quick: bool, json_path: str | None, only: str | None, root: str | None) -> int:
    """``poimen bench``: run, print the table, write JSON. Exit code 0 when every chosen
    scenario ran (missed goals are findings, not failures), 1 when one raised, 2 for an
    unknown ``--only`` name."""
    from rich.console import Console

    console = Console()
    try:
        select(only)
    except KeyError as exc:
        console.print(f"[red]{exc.args[0]}[/]")
        return 2
    if json_path:  # before the run: not refused after minutes of it
        from poimen_data.errors import ValidationError
        from poimen_data.storage import _dest

        try:
            _dest.check_dest(os.path.abspath(json_path), "bench --json")
        except ValidationError as exc:
            console.print(f"error: {exc}", markup=False, highlight=False)
            return 2
    t0 = time.perf_counter()
    with console.status("benchmarking...") as status:
        def progress(r: Result) -> None:
            status.update(f"benchmarking... {r.title} done ({r.seconds:.1f} s)")

        results = run(quick=quick, only=only, root=root, on_result=progress)
    wall = time.perf_counter() - t0
    print_table(results, quick, console)
    console.print(f"[dim]{len(results)} scenarios in {wall:.0f} s; reproduce: "
                  f"{report_doc([], quick)['command']}[/]")
    if json_path:
        write_json(json_path, results, quick, wall)
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":  # pragma: no cover - a convenience for development
    args = sys.argv[1:]
    sys.exit(run_cli("--quick" in args, None, None, None))
