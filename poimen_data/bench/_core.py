"""The pieces every bench scenario uses: goals, results, sizes, the run context, and the
interleaved timing and formatting helpers (see ``_runner`` for what ``poimen bench`` does).
"""

from __future__ import annotations

import gc
import math
import shutil
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

JSON_SCHEMA = "poimen-bench/1"
REPRODUCE = "poimen bench --json bench.json"


def open_log(root: Path | str, **kw: Any) -> Any:
    """``open_log`` of a scenario's log (imported when a scenario runs)."""
    from poimen_data.log._log import open_log as open_

    return open_(str(root), **kw)


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
    """How big each scenario is. ``QUICK`` exercises every code path in about two minutes
    on two idle cores (118 s on 2026-12-02; the child processes and S3 servers of the
    write scenarios take most of it); ``FULL`` is what the goals speak of."""

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
            from poimen_data.workload.synth import events_table

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
