"""The runs page as SQL over the ``runs``, ``attempts`` and ``verdicts`` views.

Filters become bound parameters (never formatted into the text); the sort column comes
from a fixed list; pages are cut by the server with LIMIT/OFFSET. Facet counts, the total
and the time range come back from one scan of ``runs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

import duckdb

from poimen_data.fold._query import FAILED_STATES
from poimen_data.model._limits import COST_MAX

#: Columns the page can sort by (the SQL text is chosen from this list, never from input).
SORTS = ("started_at", "ended_at", "run_id", "state", "tenant", "workflow_version",
         "n_branches", "n_attempts", "n_failed_attempts", "cost_usd")
PAGE_SIZES = (25, 50, 100, 200)
DEFAULT_SORT = "started_at"
DEFAULT_LIMIT = 50
FACETS = ("state", "tenant", "workflow_version")
FAILED = "(" + ", ".join(f"'{state}'" for state in FAILED_STATES) + ")"  # as SQL

Direction = Literal["asc", "desc"]


class BadRequest(ValueError):
    """A query parameter that cannot be read: the page answers 400 with this line."""


@dataclass(frozen=True)
class RunFilter:
    """What the runs page shows: every field is optional; text fields match exactly,
    ``q`` is a case-insensitive substring of the run id or of any attempt's error."""

    state: str | None = None
    tenant: str | None = None
    workflow_version: str | None = None
    min_branches: int | None = None
    min_attempts: int | None = None
    min_failed: int | None = None
    min_cost: Decimal | None = None
    max_cost: Decimal | None = None
    verdict: str | None = None      # "<verifier>:passed" | "<verifier>:failed" | "none"
    started_from: datetime | None = None
    started_to: datetime | None = None
    ended_from: datetime | None = None
    ended_to: datetime | None = None
    q: str | None = None

    def params(self) -> dict[str, str]:
        """The filter as query parameters (for links that keep it)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = v.isoformat() if isinstance(v, datetime) else str(v)
        return out

    @property
    def active(self) -> bool:
        return bool(self.params())


@dataclass(frozen=True)
class RunQuery:
    filter: RunFilter = field(default_factory=RunFilter)
    sort: str = DEFAULT_SORT
    direction: Direction = "desc"
    page: int = 1
    limit: int = DEFAULT_LIMIT


#: the largest whole number a filter or page number takes (its rows' offset fits BIGINT)
MAX_WHOLE = 10**12


def _int(name: str, raw: str) -> int:
    try:
        v = int(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a whole number, got {raw!r}") from None
    if not 0 <= v <= MAX_WHOLE:  # past it, DuckDB's BIGINT arithmetic overflows
        raise BadRequest(f"{name} must be between 0 and {MAX_WHOLE:,}, got {raw[:40]!r}")
    return v


def _time(name: str, raw: str) -> datetime:
    try:
        t = datetime.fromisoformat(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a date or time (ISO 8601), got {raw!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _money(name: str, raw: str) -> Decimal:
    try:
        d = Decimal(raw)
    except InvalidOperation:
        raise BadRequest(f"{name} must be a number, got {raw!r}") from None
    if not d.is_finite():
        raise BadRequest(f"{name} must be a finite number, got {raw!r}")
    if abs(d) > COST_MAX:  # what decimal(18, 9) holds: the column's type
        raise BadRequest(f"{name} must be within -{COST_MAX} .. {COST_MAX}, got {raw[:40]!r}")
    return d


def parse_query(params: Mapping[str, str]) -> RunQuery:
    """A ``RunQuery`` from request parameters; empty values mean "no filter"."""
    p = {k: v.strip() for k, v in params.items() if v.strip()}
    kw: dict[str, Any] = {}
    for name in ("state", "tenant", "workflow_version", "verdict", "q"):
        if name in p:
            kw[name] = p[name]
    for name, key in (("min_branches", "min_branches"), ("min_attempts", "min_attempts"),
                      ("min_failed", "min_failed")):
        if name in p:
            kw[key] = _int(name, p[name])
    for name in ("min_cost", "max_cost"):
        if name in p:
            kw[name] = _money(name, p[name])
    for name in ("started_from", "started_to", "ended_from", "ended_to"):
        if name in p:
            kw[name] = _time(name, p[name])
    sort = p.get("sort", DEFAULT_SORT)
    if sort not in SORTS:
        raise BadRequest(f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
    direction = p.get("dir", "desc")
    if direction not in ("asc", "desc"):
        raise BadRequest(f"dir must be asc or desc, got {direction!r}")
    page = _int("page", p["page"]) if "page" in p else 1
    limit = _int("limit", p["limit"]) if "limit" in p else DEFAULT_LIMIT
    if limit not in PAGE_SIZES:
        raise BadRequest(f"limit must be one of {', '.join(map(str, PAGE_SIZES))}")
    return RunQuery(RunFilter(**kw), sort, "asc" if direction == "asc" else "desc",
                    max(page, 1), limit)


def conditions(f: RunFilter) -> tuple[dict[str, str], dict[str, Any]]:
    """(facet or "rest" -> SQL condition over ``runs``, bound parameters)."""
    params: dict[str, Any] = {}
    conds: dict[str, list[str]] = {k: [] for k in (*FACETS, "rest")}
    for name in FACETS:
        value = getattr(f, name)
        if value is not None:
            conds[name].append(f"{name} = $f_{name}")
            params[f"f_{name}"] = value
    rest = conds["rest"]
    for attr, col in (("min_branches", "n_branches"), ("min_attempts", "n_attempts"),
                      ("min_failed", "n_failed_attempts"), ("min_cost", "cost_usd")):
        if getattr(f, attr) is not None:
            rest.append(f"{col} >= ${attr}")
            params[attr] = getattr(f, attr)
    if f.max_cost is not None:
        rest.append("cost_usd <= $max_cost")
        params["max_cost"] = f.max_cost
    for attr, col, op in (("started_from", "started_at", ">="),
                          ("started_to", "started_at", "<"),
                          ("ended_from", "ended_at", ">="), ("ended_to", "ended_at", "<")):
        if getattr(f, attr) is not None:
            rest.append(f"{col} {op} ${attr}")
            params[attr] = getattr(f, attr)
    if f.verdict == "none":
        rest.append("run_id NOT IN (SELECT run_id FROM verdicts)")
    elif f.verdict is not None:
        verifier, _, outcome = f.verdict.rpartition(":")
        if not verifier or outcome not in ("passed", "failed"):
            raise BadRequest(f"verdict must be VERIFIER:passed, VERIFIER:failed or none, "
                             f"got {f.verdict!r}")
        # a run graded several times counts by its latest verdict of that verifier
        rest.append("run_id IN (SELECT run_id FROM verdicts WHERE verifier = $verifier "
                    "GROUP BY run_id HAVING arg_max(passed, lsn) = $passed)")
        params["verifier"] = verifier
        params["passed"] = outcome == "passed"
    if f.q is not None:
        rest.append("(contains(lower(run_id), $q) OR run_id IN (SELECT run_id FROM "
                    "attempts WHERE contains(lower(error), $q)))")
        params["q"] = f.q.lower()
    return {k: " AND ".join(v) or "TRUE" for k, v in conds.items()}, params


def where_all(conds: dict[str, str]) -> str:
    return " AND ".join(f"({c})" for c in conds.values())


#: Time buckets of the cost chart.
COST_BUCKETS = 30


@dataclass(frozen=True)
class Facets:
    total: int
    counts: dict[str, list[tuple[str | None, int]]]
    started_lo: float | None
    bucket_s: float
    cost: list[tuple[int, Decimal, int]]   # (time bucket, cost, runs) of the matching runs


def facets(con: duckdb.DuckDBPyConnection, f: RunFilter) -> Facets:
    """The total, each facet's counts under every other filter (so a chosen value still
    shows its alternatives), and the matching runs' cost by start-time bucket: one
    scan of ``runs``."""
    conds, params = conditions(f)
    flags = ", ".join(f"({c}) AS c_{k}" for k, c in conds.items())
    parts = []
    for name in FACETS:
        others = " AND ".join(f"c_{k}" for k in conds if k != name)
        parts.append(f"SELECT '{name}' AS facet, {name}::VARCHAR AS value, count(*) AS n, "
                     f"NULL::DECIMAL(38, 9) AS cost FROM f WHERE {others} GROUP BY {name}")
    every = " AND ".join(f"c_{k}" for k in conds)
    parts.append(f"SELECT 'total', NULL, count(*), NULL FROM f WHERE {every}")
    parts.append("SELECT 'lo', min(t)::VARCHAR, 0, NULL FROM f WHERE " + every)
    parts.append("SELECT 'width', ((max(t) - min(t)) / $buckets)::VARCHAR, 0, NULL FROM f "
                 f"WHERE {every}")
    parts.append(
        f"SELECT 'cost', least(floor((t - r.lo) / greatest(r.w, 1e-6)), $buckets - 1)"
        f"::BIGINT::VARCHAR, count(*), coalesce(sum(cost_usd), 0) FROM f, "
        f"(SELECT min(t) AS lo, (max(t) - min(t)) / $buckets AS w FROM f WHERE {every}) r "
        f"WHERE {every} AND t IS NOT NULL GROUP BY 2")
    sql = (f"WITH f AS MATERIALIZED (SELECT state, tenant, workflow_version, cost_usd, "
           f"epoch(started_at) AS t, {flags} FROM runs) " + " UNION ALL ".join(parts))
    counts: dict[str, list[tuple[str | None, int]]] = {k: [] for k in FACETS}
    total, lo, width, cost = 0, None, 0.0, []
    for facet, value, n, c in con.execute(sql, {**params, "buckets": COST_BUCKETS}).fetchall():
        if facet == "total":
            total = int(n)
        elif facet == "lo":
            lo = None if value is None else float(value)
        elif facet == "width":
            width = 0.0 if value is None else float(value)
        elif facet == "cost":
            cost.append((int(value), Decimal(c), int(n)))
        else:
            counts[facet].append((value, int(n)))
    for k in counts:
        counts[k].sort(key=lambda vn: (-vn[1], vn[0] or ""))
    return Facets(total, counts, lo, max(width, 1e-6), sorted(cost))


PAGE_COLUMNS = ("run_id", "state", "tenant", "workflow_version", "live_branch", "n_branches",
                "n_attempts", "n_failed_attempts", "cost_usd", "started_at", "ended_at",
                "last_lsn")


def page_sql(q: RunQuery) -> tuple[str, dict[str, Any]]:
    """The SQL of one page of runs and its parameters (also what the bench times)."""
    conds, params = conditions(q.filter)
    order = "ASC" if q.direction == "asc" else "DESC"
    sql = (f"SELECT {', '.join(PAGE_COLUMNS)} FROM runs WHERE {where_all(conds)} "
           f"ORDER BY {q.sort} {order} NULLS LAST, run_id {order} "
           "LIMIT $limit OFFSET $offset")
    return sql, {**params, "limit": q.limit, "offset": (q.page - 1) * q.limit}


def page(con: duckdb.DuckDBPyConnection, q: RunQuery) -> list[dict[str, Any]]:
    """One page of runs, each with ``verdicts``: [(verifier, latest passed, count)]."""
    sql, params = page_sql(q)
    cur = con.execute(sql, params)
    rows = [dict(zip(PAGE_COLUMNS, r, strict=True)) for r in cur.fetchall()]
    if rows:
        by_run: dict[str, list[tuple[str, bool, int]]] = {}
        for run_id, verifier, passed, n in con.execute(
                "SELECT run_id, verifier, arg_max(passed, lsn), count(*) FROM verdicts "
                "WHERE run_id IN (SELECT unnest($ids)) GROUP BY run_id, verifier "
                "ORDER BY run_id, verifier", {"ids": [r["run_id"] for r in rows]}).fetchall():
            by_run.setdefault(run_id, []).append((verifier, bool(passed), int(n)))
        for r in rows:
            r["verdicts"] = by_run.get(r["run_id"], [])
    return rows


def verifiers(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [v for (v,) in con.execute(
        "SELECT DISTINCT verifier FROM verdicts WHERE verifier IS NOT NULL ORDER BY 1"
    ).fetchall()]


def failure_rates(con: duckdb.DuckDBPyConnection, f: RunFilter
                  ) -> list[tuple[str, str, int, int, int]]:
    """(workflow_version, step_id, step_index, attempts, failed or timed out) over the
    attempts of the matching runs."""
    conds, params = conditions(f)
    scope = "" if not f.active else \
        f"WHERE run_id IN (SELECT run_id FROM runs WHERE {where_all(conds)})"
    rows = con.execute(
        "SELECT coalesce(workflow_version, '?'), coalesce(step_id, '?'), "
        "coalesce(min(step_index), -1), count(*), "
        f"count(*) FILTER (WHERE state IN {FAILED}) FROM attempts {scope} "
        "GROUP BY ALL ORDER BY 1, 3, 2", params).fetchall()
    return [(str(a), str(b), int(c), int(d), int(e)) for a, b, c, d, e in rows]
