"""``poimen demo``: record the synthetic workload, run the batch chain on it, and report.

The report is what a new user reads first, so it shows the shape of the data (runs by
state, attempts by outcome, where steps fail), what the chain did, which files hold what,
and three queries to try next. Running it twice is safe: it replaces its own root and
refuses to touch a directory that is not a poimen log.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from poimen_data.errors import NotFound
from poimen_data.fold import connect
from poimen_data.jobs import chain as st
from poimen_data.jobs.chain import summary_table, titled
from poimen_data.log import open_log
from poimen_data.workload import synth

QUERIES = (
    ("Which steps fail most, by workflow version?",
     "select workflow_version, step_id, count(*) as attempts, "
     "round(avg((state in ('failed','timed_out'))::int), 3) as failure_rate "
     "from attempts group by all order by failure_rate desc limit 10"),
    ("Was the key context dropped before the failures?",
     "select state, round(avg((len(context.dropped) > 0)::int), 3) as dropped_share, "
     "count(*) as n from attempts group by state order by n desc"),
    ("Read the prompt of a failed attempt",
     "select run_id, step_id, attempt_no, error, left(blob_text(prompt), 300) as prompt "
     "from attempts where state = 'failed' limit 3"),
)


class DemoRootError(Exception):
    """The demo root exists and is not a poimen log: it is never deleted."""


def prepare_root(root: str) -> str:
    """Make ``root`` empty for the demo; returns "created" or "replaced"."""
    try:
        old = open_log(root, create=False)
    except NotFound:
        if "://" not in root and os.path.isdir(root) and os.listdir(root):
            raise DemoRootError(f"{root} exists and is not a poimen log; the demo will not "
                                "overwrite it (choose another --root)") from None
        return "created"
    old.storage.delete_tree("")
    return "replaced"


def _files(log: Any) -> list[tuple[str, int, int]]:
    """(area, files, bytes) under the root, by top-level directory."""
    area: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rel in log.storage.walk_files(""):
        top = rel.split("/", 1)[0] if "/" in rel else rel
        if top == "exports":
            top = rel
        size = log.storage.size(rel) or 0
        area[top][0] += 1
        area[top][1] += size
    return [(k, v[0], v[1]) for k, v in sorted(area.items())]


def _counts(title: str, counts: dict[str, int], key: str) -> Table:
    t = titled(title)
    t.add_column(key)
    t.add_column("count", justify="right")
    for k, v in counts.items():
        t.add_row(k, str(v))
    t.add_row("[bold]total[/]", f"[bold]{sum(counts.values())}[/]")
    return t


def failure_table(failure_by_step: dict[tuple[str, str], tuple[int, int]]) -> Table:
    """Failure rate of attempts per (workflow, step), one column per version."""
    versions = sorted({wv.split("@")[1] for wv, _ in failure_by_step})
    rows: dict[tuple[str, str], dict[str, tuple[int, int]]] = defaultdict(dict)
    for (wv, step), counts in failure_by_step.items():
        wf, ver = wv.split("@")
        rows[(wf, step)][ver] = counts
    t = titled("Failure rate by step and workflow version (failed or timed out)")
    t.add_column("workflow")
    t.add_column("step")
    for version in versions:
        t.add_column(version, justify="right")
    for (wf, step), by_v in sorted(rows.items()):
        cells = []
        for version in versions:
            a, f = by_v.get(version, (0, 0))
            cells.append(f"{f / a:.0%} of {a}" if a else "-")
        t.add_row(wf, step, *cells)
    return t


def _verdicts(log: Any) -> Table:
    with connect(log) as con:
        rows = con.sql("select verifier, count(*) as verdicts, "
                       "sum(passed::int) as passed, round(avg(score), 3) as mean_score "
                       "from verdicts group by verifier order by verifier").fetchall()
    t = titled("Verdicts (from the verdicts view)")
    for c in ("verifier", "verdicts", "passed", "mean score"):
        t.add_column(c, justify="left" if c == "verifier" else "right")
    for r in rows:
        t.add_row(*(str(x) for x in r))
    return t


def run(root: str, *, runs: int = 300, seed: int = 0, batch: int = 16,
        console: Console | None = None, quiet: bool = False) -> dict[str, Any]:
    """Record, materialize, check, grade and export into ``root``; print the report
    unless ``quiet``; return the facts as JSON values."""

    out = console or Console()
    t0 = time.perf_counter()
    how = prepare_root(root)
    log = open_log(root)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=out, transient=True,
                  disable=quiet or not out.is_terminal) as p:
        task = p.add_task("recording runs", total=runs)
        summary = synth.generate(log, runs=runs, seed=seed, batch=batch,
                                 progress=lambda done, total: p.update(task, completed=done))
    t_record = time.perf_counter() - t0
    results: list[st.StageResult] = []
    with out.status("running the chain", spinner="dots") if not quiet else _Null() as status:
        def on_stage(r: st.StageResult) -> None:
            if status is not None:
                status.update(f"{r.name}: {r.status}; next stage...")
        results = st.run_chain(log, st.STAGES,
                               out_dir=f"{root.rstrip('/')}/exports", on_stage=on_stage)
    total = time.perf_counter() - t0
    files = _files(log)
    facts = {"root": log.root, "root_was": how, "seconds": round(total, 2),
             "record_seconds": round(t_record, 2), "summary": summary.as_dict(),
             "stages": [r.__dict__ for r in results],
             "files": [{"path": p, "files": n, "bytes": b} for p, n, b in files],
             "queries": [q for _, q in QUERIES]}
    if not quiet:
        _report(out, log, summary, results, files, how, t_record, total)
    return facts


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _report(out: Console, log: Any, s: Any, results: list[st.StageResult],
            files: list[tuple[str, int, int]], how: str, t_record: float,
            total: float) -> None:
    verb = "Replaced the previous demo root" if how == "replaced" else "Created"
    out.print(f"[bold]{verb} {escape(str(log.root))}[/]: recorded {s.runs} runs "
              f"({s.events:,} events, "
              f"{s.commits:,} commits, head LSN {s.head:,}) in {t_record:.1f} s; "
              f"everything took {total:.1f} s.")
    out.print(_counts("Runs by state", s.runs_by_state, "state"))
    out.print(_counts("Attempts by outcome", s.attempts_by_outcome, "state"))
    out.print(f"Shapes: {s.retries} retries, {s.forks} rewinds ({s.forks_of_forks} forks "
              f"of forks), {s.cancelled_while_verifying} cancelled while verifying, "
              f"{s.recovered} dispatched attempts recovered, {s.left_dispatched} still "
              "dispatched.")
    out.print(failure_table(s.failure_by_step))
    out.print(f"Bodies: {s.bodies:,} distinct ({s.body_bytes / 1e6:.1f} MB stored for "
              f"{s.ref_bytes / 1e6:.1f} MB referenced; {s.shared_bodies} shared between "
              f"runs), sizes {s.min_body:,} B to {s.max_body:,} B.")
    out.print(summary_table(results, "The batch chain (python -m pipelines.nightly)"))
    out.print(_verdicts(log))
    ft = titled(f"Files under {log.root}")
    ft.add_column("path")
    ft.add_column("files", justify="right")
    ft.add_column("bytes", justify="right")
    for p, n, b in files:
        ft.add_row(p, str(n), f"{b:,}")
    out.print(ft)
    out.print("[bold]Try next[/] (add --root if you used one):")
    for title, q in QUERIES:
        out.print(f"  # {title}\n  poimen sql \"{q}\"", soft_wrap=True, highlight=False)
    out.print("  poimen show <run_id> --all-branches     # one episode, every branch")
    out.print("  poimen view                             # browse runs and episodes in a web page")
