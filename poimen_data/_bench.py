"""``poimen bench``: every speed goal of the project, measured next to its reference.

The machines this runs on are shared and noisy (another job can halve the speed of a
core for a minute), so an absolute time alone says little. Every scenario therefore times
*ours* and a *reference* doing the same work in the same run, interleaved (the order
alternates each repetition, so a slow minute hurts both), and reports medians and their
ratio. Where the project's goal is absolute (events/s, ms, runs/s) the goal is checked on
the absolute figure, but a reference is still measured beside it, so a reader can tell a
slow machine from a slow code path.

Data comes from the demo generator (``poimen_data.synth``), work directories live in one
temporary directory that is removed at the end. ``run()`` returns ``Result`` values;
``run_cli()`` is what ``poimen bench`` calls: it prints a table and writes JSON. The
scenarios themselves are in ``_bench_scenarios``.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

JSON_SCHEMA = "poimen-bench/1"
REPRODUCE = "poimen bench --json bench.json"


# --- what a scenario reports -------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """A limit on one figure of a result: ``subject`` is ``"ratio"`` or ``"ours"``;
    no subject means the figure is reported, not judged."""

    text: str
    subject: str | None = None
    op: str = ">="
    limit: float = 0.0

    def met(self, ours: float | None, ratio: float | None) -> bool | None:
        value = {"ratio": ratio, "ours": ours}.get(self.subject or "")
        if self.subject is None or value is None:
            return None
        return value >= self.limit if self.op == ">=" else value <= self.limit


@dataclass
class Result:
    """One row of the table. ``ours`` and ``reference`` are in ``unit`` / ``ref_unit``;
    ``ratio`` is ours / reference of the figures the goal speaks of (a rate ratio for
    rates, a time ratio for times; ``goal`` says which is better). ``status`` is
    ``ok``, ``n/a`` (the capability is not built yet: no number at all, never a fake
    one) or ``error`` (the scenario raised; ``note`` has the message)."""

    name: str
    title: str
    status: str
    goal: str
    ours: float | None = None
    reference: float | None = None
    ratio: float | None = None
    unit: str = ""
    ref_unit: str = ""
    ours_text: str = ""
    reference_text: str = ""
    ratio_text: str = ""
    met: bool | None = None
    note: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("ours", "reference", "ratio"):
            v = d[k]
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None
        return d


# --- formatting --------------------------------------------------------------------------


def fmt_num(x: float) -> str:
    """A figure with three significant digits and a k/M suffix (``1.23 M``)."""
    for div, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def fmt_rate(x: float, unit: str) -> str:
    return f"{fmt_num(x)} {unit}"


def fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def fmt_bytes_rate(x: float) -> str:
    for div, suffix in ((1 << 30, "GiB/s"), (1 << 20, "MiB/s"), (1 << 10, "KiB/s")):
        if x >= div:
            return f"{x / div:.3g} {suffix}"
    return f"{x:.3g} B/s"


def fmt_ratio(r: float) -> str:
    return f"{r:.3g}x" if r >= 0.01 else f"{r:.2e}x"


# --- timing ------------------------------------------------------------------------------


def interleave(fns: dict[str, Callable[[], Any]], reps: int,
               setup: dict[str, Callable[[], Any]] | None = None,
               each: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Time every function ``reps`` times, rotating which goes first each repetition.

    ``each`` runs untimed at the start of every repetition (the next input both sides
    work on); ``setup[name]`` runs untimed right before each call of ``name`` (a fresh
    log, a restored state...). A collection runs before each timed call so one
    function's garbage is not paid by the next. Returns the seconds of each call, per name.
    """
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        if each is not None:
            each()
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if setup and name in setup:
                setup[name]()
            gc.collect()
            t = time.perf_counter()
            fns[name]()
            out[name].append(time.perf_counter() - t)
    return out


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank method (p99 of 200 = 2nd largest)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


# --- sizes and the shared context ---------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is. ``QUICK`` keeps the whole run under a minute on two
    cores and still exercises every code path; ``FULL`` is what the goals speak of."""

    reps: int
    open_reps: int
    bulk_events: int
    object_events: int
    small_commits: int
    peer_commits: int
    many_commits: int
    few_commits: int
    commit_events: int
    fold_events: int
    state_runs: int
    lookups: int
    grade_runs: int
    export_runs: int
    s3_commits: int


FULL = Sizes(reps=3, open_reps=7, bulk_events=1_000_000, object_events=100_000,
             small_commits=200, peer_commits=50, many_commits=10_000, few_commits=10,
             commit_events=100, fold_events=1_000_000, state_runs=100_000, lookups=200,
             grade_runs=10_000, export_runs=1_000, s3_commits=30)
QUICK = Sizes(reps=3, open_reps=5, bulk_events=100_000, object_events=10_000,
              small_commits=30, peer_commits=10, many_commits=500, few_commits=10,
              commit_events=100, fold_events=50_000, state_runs=2_000, lookups=30,
              grade_runs=500, export_runs=20, s3_commits=6)


class Ctx:
    """What scenarios share within one run: sizes, the work directory, the generated
    events (one table, sliced: ``synth.events_table`` is a prefix-stable tiling, so a
    slice of a big table is the table a smaller call would give) and built logs."""

    def __init__(self, quick: bool, work: Path, seed: int = 1) -> None:
        self.quick = quick
        self.sizes = QUICK if quick else FULL
        self.work = work
        self.seed = seed
        self.cache: dict[str, Any] = {}
        self._events: pa.Table | None = None
        self._n = 0

    def dir(self, name: str) -> Path:
        """A fresh, empty directory under the work directory."""
        p = self.work / name
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
        return p

    def events(self, n: int, offset: int = 0) -> pa.Table:
        """Rows ``offset .. offset + n`` of the generated workload (``EVENT_SCHEMA``)."""
        need = max(offset + n, 20_000)
        if self._events is None or self._n < need:
            from .synth import events_table

            self._events = events_table(need, seed=self.seed)
            self._n = need
        assert self._events is not None
        return self._events.slice(offset, n)

    def block_rows(self) -> int:
        """Events in one tile of ``events_table`` (a block of 500 generated runs): the
        unit to cut the workload at when a scenario wants a given number of runs."""
        if "block_rows" not in self.cache:
            runs = self.events(20_000).column("run_id")
            copies = pc.match_substring(runs.fill_null(""), "-x1")
            self.cache["block_rows"] = int(pc.index(copies, True).as_py())
        return int(self.cache["block_rows"])


# --- the registry --------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    goal: Goal
    fn: Callable[[Ctx], Result]
    needs: tuple[str, ...] = ()  # "module:attribute" that must exist, else n/a


def _scenarios() -> list[Scenario]:
    from ._bench_scenarios import SCENARIOS

    return SCENARIOS


def _missing(needs: tuple[str, ...]) -> str | None:
    """The first capability of ``needs`` that is not there yet, or None."""
    for need in needs:
        mod, _, attr = need.partition(":")
        try:
            m = importlib.import_module(mod)
        except ImportError:
            return need
        if attr and not hasattr(m, attr):
            return need
    return None


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
    missing = _missing(s.needs)
    if missing is not None:
        return Result(s.name, s.title, "n/a", s.goal.text, note=f"n/a: not built yet ({missing})")
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
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True)
    p.write_text(json.dumps(report_doc(results, quick, wall_s), indent=2, sort_keys=True)
                 + "\n")


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
