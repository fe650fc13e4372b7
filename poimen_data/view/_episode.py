"""What the episode and attempt pages show, built from ``episode()`` and a few queries.

The episode page reads refs only; bodies are read when an attempt is opened, exactly
its own (``attempt_bodies``), and a retry's diff is one more request of its own.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from poimen_data.errors import NotFound
from poimen_data.fold._query import AttemptView, BranchView, EpisodeView
from poimen_data.log._blobs import BlobStore
from poimen_data.model._events import BlobRef

#: States an attempt page colours, in the order the legend lists them.
ATTEMPT_STATES = ("succeeded", "failed", "timed_out", "cancelled", "dispatched", "recovered")
#: Characters of a body shown on the page (the size says how much there is).
SHOW_CHARS = 200_000


@dataclass(frozen=True)
class Step:
    """One step of a branch's trajectory: its attempts grouped (retries side by side)."""

    step: str
    step_index: int | None
    branch_id: int           # the branch that recorded these attempts
    inherited: bool
    attempts: tuple[AttemptView, ...]


@dataclass(frozen=True)
class BranchPage:
    branch: BranchView
    status: str              # "live" | "abandoned"
    steps: tuple[Step, ...]
    counts: dict[str, int]   # own attempts per display state
    cost: Decimal
    tokens_in: int
    tokens_out: int


def display_state(a: AttemptView, recovered: set[tuple[int, str, int]], branch: int) -> str:
    return "recovered" if (branch, a.step, a.attempt) in recovered else a.state


def trajectory(view: EpisodeView, branch_id: int) -> list[tuple[int, AttemptView]]:
    """(recording branch, attempt) along a branch's trajectory: the parent's trajectory
    below the fork point, then the branch's own attempts (DESIGN section 2)."""
    by_id = {b.branch_id: b for b in view.branches}
    b = by_id[branch_id]
    own = [(branch_id, a) for a in b.attempts]
    if b.parent_branch_id is None or b.parent_branch_id not in by_id:
        return own
    limit = b.fork_step_index if b.fork_step_index is not None else 0
    inherited = [(bid, a) for bid, a in trajectory(view, b.parent_branch_id)
                 if a.step_index is not None and a.step_index < limit]
    return inherited + own


def _steps(view: EpisodeView, branch_id: int) -> tuple[Step, ...]:
    out: list[Step] = []
    for bid, a in trajectory(view, branch_id):
        last = out[-1] if out else None
        if last is not None and last.step == a.step and last.branch_id == bid:
            out[-1] = Step(last.step, last.step_index, bid, last.inherited,
                           (*last.attempts, a))
        else:
            out.append(Step(a.step, a.step_index, bid, bid != branch_id, (a,)))
    return tuple(out)


def branch_pages(view: EpisodeView, recovered: set[tuple[int, str, int]]
                 ) -> list[BranchPage]:
    pages = []
    for b in view.branches:
        counts = Counter(display_state(a, recovered, b.branch_id) for a in b.attempts)
        cost = sum((a.usage.cost_usd for a in b.attempts
                    if a.usage is not None and a.usage.cost_usd is not None), Decimal(0))
        tin = sum(a.usage.input_tokens or 0 for a in b.attempts if a.usage is not None)
        tout = sum(a.usage.output_tokens or 0 for a in b.attempts if a.usage is not None)
        pages.append(BranchPage(b, "live" if b.is_live else "abandoned",
                                _steps(view, b.branch_id),
                                {s: counts[s] for s in ATTEMPT_STATES if counts[s]},
                                cost, tin, tout))
    return pages


#: The per-run tables the episode page reads (one run's rows each: ``run_tables``).
PAGE_TABLES = ("runs", "branches", "attempts", "verdicts", "anomalies")


def run_facts(tables: Mapping[str, pa.Table]) -> dict[str, Any]:
    """The run's row, its verdicts, anomalies and recovered attempts (no bodies), from
    the run's rows of ``PAGE_TABLES``."""
    cols = ("run_id", "tenant", "workflow_version", "state", "live_branch", "n_branches",
            "n_attempts", "n_failed_attempts", "cost_usd", "started_at", "ended_at",
            "verifying_lsn", "last_lsn")
    row = tables["runs"].select(list(cols)).to_pylist()
    vcols = ["verifier", "branch_id", "snapshot_lsn", "passed", "score", "detail", "lsn"]
    verdicts = tables["verdicts"].select(vcols).sort_by("lsn").to_pylist()
    anomalies = [(a["lsn"], a["kind"], a["reason"]) for a in tables["anomalies"]
                 .select(["lsn", "kind", "reason"])
                 .sort_by([("lsn", "ascending"), ("reason", "ascending")]).to_pylist()]
    att = tables["attempts"]
    att = att.filter(pc.fill_null(att.column("recovered"), False))
    recovered = zip(att.column("branch_id").to_pylist(), att.column("step_id").to_pylist(),
                    att.column("attempt_no").to_pylist(), strict=True)
    return {"run": row[0] if row else None,
            "verdicts": verdicts,
            "anomalies": anomalies,
            "recovered": {(int(b), str(s), int(n)) for b, s, n in recovered}}


def find_attempt(view: EpisodeView, branch_id: int, step: str, attempt: int) -> AttemptView:
    for b in view.branches:
        if b.branch_id == branch_id:
            for a in b.attempts:
                if a.step == step and a.attempt == attempt:
                    return a
    raise NotFound(f"no attempt {step}#{attempt} on branch {branch_id} of run "
                   f"{view.run_id!r} at lsn {view.at_lsn}")


def previous_attempt(view: EpisodeView, branch_id: int, a: AttemptView) -> AttemptView | None:
    """The attempt a retry followed: the same step's attempt before it on its branch."""
    for b in view.branches:
        if b.branch_id == branch_id:
            for p in b.attempts:
                if p.step == a.step and p.attempt == a.attempt - 1:
                    return p
    return None


@dataclass(frozen=True)
class Body:
    label: str
    ref: BlobRef | None
    text: str | None         # None: never captured
    reduced: bool = False
    truncated: bool = False


def reduction_summary(con: duckdb.DuckDBPyConnection, ref: BlobRef) -> BlobRef | None:
    rows = con.execute("SELECT summary FROM reductions WHERE original.tenant = $t AND "
                       "original.sha256 = $s ORDER BY lsn DESC LIMIT 1",
                       {"t": ref.tenant, "s": ref.sha256}).fetchall()
    if not rows or rows[0][0] is None:
        return None
    s = rows[0][0]
    return BlobRef(s["tenant"], s["sha256"], s["size"])


def read_body(blobs: BlobStore, con: duckdb.DuckDBPyConnection, label: str,
              ref: BlobRef | None) -> Body:
    """A body as text; a reduced one as its summary (``reduced``); None when absent."""
    if ref is None:
        return Body(label, None, None)
    data = blobs.get(ref)
    reduced = data is None
    if reduced:
        summary = reduction_summary(con, ref)
        data = blobs.get(summary) if summary is not None else None
        if data is None:
            return Body(label, ref, "", reduced=True)
    assert data is not None
    text = data.decode("utf-8", errors="replace")
    return Body(label, ref, text[:SHOW_CHARS], reduced, len(text) > SHOW_CHARS)


def attempt_bodies(blobs: BlobStore, con: duckdb.DuckDBPyConnection,
                   a: AttemptView) -> tuple[Body, Body]:
    return read_body(blobs, con, "prompt", a.prompt), read_body(blobs, con, "output", a.output)


def prompt_diff(old: str, new: str, old_label: str, new_label: str) -> list[tuple[str, str]]:
    """A unified diff as (kind, line): kind is "add", "del", "hunk" or "same"."""
    out = []
    for line in difflib.unified_diff(old.splitlines(), new.splitlines(), old_label,
                                     new_label, lineterm="", n=3):
        kind = ("hunk" if line.startswith(("@@", "---", "+++")) else
                "add" if line.startswith("+") else "del" if line.startswith("-") else "same")
        out.append((kind, line))
    return out
