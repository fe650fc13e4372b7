"""The ``poimen view`` web app: Starlette routes over a read-only log.

Pages are rendered on the server (Jinja2, autoescaped); the only script is the small
inline one that fetches an attempt's bodies when it is opened. Each response carries a
Content-Security-Policy that allows that script by nonce and nothing else. Bad input of
any kind answers with an error page of one line, never a traceback.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import duckdb
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from poimen_data.errors import NotFound, PoimenError, ValidationError, raised_in_scan
from poimen_data.fold._connect import connect
from poimen_data.fold._query import episode, one_episode, run_labels, run_tables
from poimen_data.log._blobs import BlobStore
from poimen_data.log._log import EventLog, LogLike, as_log
from poimen_data.model._events import check_run_id
from poimen_data.view import _episode as ep
from poimen_data.view import _runs as rq
from poimen_data.view import _sql as sq
from poimen_data.view import _svg as svg

TEMPLATES = Path(__file__).parent / "templates"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
#: Connections kept per LSN (a new head makes a new one; old ones are closed).
KEEP_CONNECTIONS = 3
#: Runs-page summaries kept, by (LSN, filter).
KEEP_SUMMARIES = 64

Handler = Callable[[Request], Awaitable[Response]]



@dataclass(frozen=True)
class Reading:
    """Where a request reads: ``lsn``, the ``head`` when it came in, and ``at``, the LSN
    the user asked for with ``?at_lsn=`` (None at the head; links keep it)."""

    lsn: int
    head: int
    at: int | None

    def page(self) -> dict[str, Any]:
        """What every page's header shows of it."""
        return {"lsn": self.lsn, "at": self.at, "head": self.head}


class _Conn:
    """A cached connection, opened by the request that first wanted it, and its lock (a
    connection serves one query at a time; the opener holds it while it opens)."""

    def __init__(self) -> None:
        self.con: duckdb.DuckDBPyConnection | None = None
        self.error: BaseException | None = None
        self.closed = False  # evicted: whoever still waits for it opens another
        self.lock = threading.Lock()

    def close(self) -> None:
        """Close it once its running query is done (lock not held)."""
        with self.lock:
            if self.con is not None:
                self.con.close()
            self.closed = True


class Viewer:
    """The app's state: the log, the blob store bodies are read through, and a few
    DuckDB connections by LSN (one lock each: a connection serves one query at a time)."""

    def __init__(self, log: EventLog, *, blobs: BlobStore | None = None) -> None:
        self.log = log
        self.blobs: BlobStore = blobs if blobs is not None else log.blobs
        self._lock = threading.Lock()
        self._cons: dict[str, OrderedDict[int, _Conn]] = {
            "views": OrderedDict(), "sql": OrderedDict()}
        self._summaries: OrderedDict[tuple[int, rq.RunFilter], Any] = OrderedDict()

    def summary(self, lsn: int, f: rq.RunFilter,
                make: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        """What the runs page shows beside the rows (facet counts, charts, verifiers) for
        one filter at one LSN, computed once: the log at an LSN never changes, and paging
        or re-sorting the same runs should not scan every attempt again."""
        key = (lsn, f)
        with self._lock:
            if key in self._summaries:
                self._summaries.move_to_end(key)
                return self._summaries[key]
        with self.con(lsn) as con:
            value = make(con)
        with self._lock:
            self._summaries[key] = value
            while len(self._summaries) > KEEP_SUMMARIES:
                self._summaries.popitem(last=False)
        return value

    def reading(self, request: Request) -> Reading:
        """Where ``request`` reads: ``?at_lsn=``, else the head (read once per request)."""
        raw = request.query_params.get("at_lsn", "").strip()
        head = self.log.head
        if not raw:
            return Reading(head, head, None)
        try:
            lsn = int(raw)
        except ValueError:
            raise ValidationError(f"at_lsn must be a whole number, got {raw!r}") from None
        if not 0 <= lsn <= head:
            raise ValidationError(f"at_lsn {lsn} is outside 0..{head}")
        return Reading(lsn, head, lsn)

    @contextmanager
    def con(self, lsn: int, kind: str = "views") -> Iterator[duckdb.DuckDBPyConnection]:
        """The connection at ``lsn``, for one query at a time. Opening one (a fold of the
        commits after the state) and closing an evicted one (after its running query)
        happen outside the app's lock: other requests go on meanwhile."""
        entry = self._entry(lsn, kind)
        try:
            if entry.con is None:  # its opener failed: so does this request
                assert entry.error is not None
                raise entry.error
            yield entry.con
        finally:
            entry.lock.release()

    def _entry(self, lsn: int, kind: str) -> _Conn:
        """The cache entry at ``lsn``, its lock held, opened unless its opener failed."""
        cache = self._cons[kind]
        while True:
            evicted: list[_Conn] = []
            with self._lock:
                entry = cache.get(lsn)
                opener = entry is None
                if entry is None:
                    entry = cache[lsn] = _Conn()
                    entry.lock.acquire()  # held until it is open and this request is done
                    while len(cache) > KEEP_CONNECTIONS:
                        evicted.append(cache.popitem(last=False)[1])
                cache.move_to_end(lsn)
            for old in evicted:
                old.close()
            if not opener:
                entry.lock.acquire()
                if entry.closed:  # evicted between the lookup and the lock: again
                    entry.lock.release()
                    continue
                return entry
            try:
                entry.con = connect(self.log, at_lsn=lsn) if kind == "views" else \
                    sq.sandbox(self.log, lsn)
            except BaseException as exc:
                entry.error = exc
                with self._lock:
                    if cache.get(lsn) is entry:
                        del cache[lsn]
                entry.lock.release()
                raise
            return entry

    def close(self) -> None:
        with self._lock:
            entries = [e for cache in self._cons.values() for e in cache.values()]
            for cache in self._cons.values():
                cache.clear()
        for entry in entries:
            entry.close()


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(
        ["html"], default=True), trim_blocks=True, lstrip_blocks=True)
    env.globals.update(colors=svg.COLORS, states=ep.ATTEMPT_STATES, run_url=run_url,
                       link=link, money=money, when=when, size=size)
    return env


def run_url(run_id: str) -> str:
    return "/runs/" + quote(run_id, safe="")


def link(path: str, params: dict[str, Any]) -> str:
    keep = {k: v for k, v in params.items() if v is not None and v != ""}
    return path + ("?" + urlencode(keep) if keep else "")


def money(v: Any) -> str:
    return "" if v is None else f"${v:,.4f}"


def when(v: Any) -> str:
    return "" if v is None else v.strftime("%Y-%m-%d %H:%M:%S")


def size(n: int | None) -> str:
    if n is None:
        return ""
    for div, unit in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def create_app(log: LogLike, *, blobs: BlobStore | None = None,
               storage_options: dict[str, Any] | None = None,
               allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> Starlette:
    """The viewer over ``log``, opened read-only when given a root. ``blobs`` is the
    store bodies are read through (a ``CountingBlobStore`` in tests); ``allowed_hosts``
    are the Host headers answered (loopback names by default: a page on another site
    cannot reach the viewer through DNS rebinding)."""
    if not isinstance(log, EventLog):
        from poimen_data.log._log import open_log

        log = open_log(log, storage_options, create=False, read_only=True)
    viewer = Viewer(as_log(log), blobs=blobs)
    env = _env()

    def render(request: Request, name: str, code: int = 200, **ctx: Any) -> Response:
        nonce = secrets.token_urlsafe(12)
        page = env.get_template(name).render(nonce=nonce, root=viewer.log.root,
                                              path=request.url.path, **ctx)
        return HTMLResponse(page, status_code=code, headers=headers(nonce))

    def guarded(fn: Callable[[Request], Response]) -> Handler:
        async def endpoint(request: Request) -> Response:
            try:
                return await run_in_threadpool(fn, request)
            except (rq.BadRequest, ValidationError, sq.QueryRefused) as exc:
                return error(request, 400, exc)
            except NotFound as exc:
                return error(request, 404, exc)
            except (PoimenError, duckdb.Error) as exc:
                return error(request, 500, exc if not isinstance(exc, duckdb.Error)
                             else raised_in_scan(exc) or exc)
        return endpoint

    def error(request: Request, status: int, exc: BaseException) -> Response:
        return render(request, "error.html", status, status=status,
                      message=sq.one_line(exc))

    def runs_page(request: Request) -> Response:
        r = viewer.reading(request)
        lsn = r.lsn
        q = rq.parse_query(request.query_params)
        facets, verifiers, heat = viewer.summary(lsn, q.filter, lambda con: (
            rq.facets(con, q.filter), rq.verifiers(con),
            svg.failure_heatmap(rq.failure_rates(con, q.filter))))
        with viewer.con(lsn) as con:
            rows = rq.page(con, q)
        cost = None
        if facets.started_lo is not None:
            cost = svg.cost_bars(facets.started_lo, facets.bucket_s, facets.cost,
                                 rq.COST_BUCKETS)
        keep = {**q.filter.params(), "sort": q.sort, "dir": q.direction,
                "limit": q.limit, "at_lsn": r.at}
        pages = max(1, -(-facets.total // q.limit))
        return render(request, "runs.html", q=q, f=q.filter, facets=facets, rows=rows,
                      verifiers=verifiers, heat=heat, cost=cost, keep=keep, pages=pages,
                      sizes=rq.PAGE_SIZES, **r.page())

    def episode_page(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        check_run_id(run_id, "view")
        r = viewer.reading(request)
        lsn = r.lsn
        # one run's rows, read like episode() reads them: never a scan of a whole view
        tables = run_tables(viewer.log, run_id, at_lsn=lsn, names=ep.PAGE_TABLES)
        view = one_episode(tables, run_id, at_lsn=lsn, all_branches=True)
        facts = ep.run_facts(tables)
        recovered = facts["recovered"]
        state_of = {(b.branch_id, a.step, a.attempt): ep.display_state(a, recovered,
                                                                        b.branch_id)
                    for b in view.branches for a in b.attempts}
        return render(request, "episode.html", view=view, facts=facts,
                      branches=ep.branch_pages(view, recovered), state_of=state_of,
                      tree=svg.branch_tree(view, state_of), **r.page())

    def labels_part(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        check_run_id(run_id, "view")
        labels = run_labels(viewer.log, run_id, at_lsn=viewer.reading(request).lsn)
        return render(request, "_labels.html", labels=labels)

    def attempt_target(request: Request) -> tuple[Any, Any, int, Reading]:
        run_id = request.path_params["run_id"]
        check_run_id(run_id, "view")
        r = viewer.reading(request)
        p = request.query_params
        try:
            branch, n = int(p.get("branch", "")), int(p.get("n", ""))
        except ValueError:
            raise rq.BadRequest("branch and n must be whole numbers") from None
        view = episode(viewer.log, run_id, all_branches=True, at_lsn=r.lsn)
        a = ep.find_attempt(view, branch, p.get("step", ""), n)
        return view, a, branch, r

    def attempt_page(request: Request) -> Response:
        view, a, branch, r = attempt_target(request)
        with viewer.con(r.lsn) as con:
            prompt, output = ep.attempt_bodies(viewer.blobs, con, a)
        prev = ep.previous_attempt(view, branch, a)
        name = "_attempt_body.html" if request.query_params.get("part") == "1" \
            else "attempt.html"
        return render(request, name, view=view, a=a, branch=branch, prev=prev,
                      bodies=(prompt, output), **r.page())

    def diff_page(request: Request) -> Response:
        view, a, branch, r = attempt_target(request)
        prev = ep.previous_attempt(view, branch, a)
        if prev is None:
            raise NotFound(f"{a.step}#{a.attempt} on branch {branch} is not a retry")
        with viewer.con(r.lsn) as con:
            old = ep.read_body(viewer.blobs, con, "prompt", prev.prompt)
            new = ep.read_body(viewer.blobs, con, "prompt", a.prompt)
        lines = ep.prompt_diff(old.text or "", new.text or "",
                               f"{a.step} #{prev.attempt} ({prev.state})",
                               f"{a.step} #{a.attempt} ({a.state})")
        name = "_diff_body.html" if request.query_params.get("part") == "1" else "diff.html"
        return render(request, name, view=view, a=a, prev=prev, lines=lines, **r.page())

    def sql_page(request: Request) -> Response:
        r = viewer.reading(request)
        query = request.query_params.get("q", "")
        result, message = None, None
        if query.strip():
            try:
                with viewer.con(r.lsn, "sql") as con:
                    result = sq.run_query(con, query)
            except sq.QueryRefused as exc:
                message = sq.one_line(exc)
        return render(request, "sql.html", 400 if message else 200, query=query,
                      result=result, message=message, show_rows=sq.SHOW_ROWS, **r.page())

    def sql_download(request: Request) -> Response:
        lsn = viewer.reading(request).lsn
        fmt = request.query_params.get("format", "csv")
        if fmt not in ("csv", "parquet"):
            raise rq.BadRequest(f"format must be csv or parquet, got {fmt!r}")
        with viewer.con(lsn, "sql") as con:
            data = sq.download(con, request.query_params.get("q", ""),
                               "csv" if fmt == "csv" else "parquet")
        media = "text/csv" if fmt == "csv" else "application/vnd.apache.parquet"
        return Response(data, media_type=media, headers={
            **headers(None),
            "Content-Disposition": f'attachment; filename="poimen-query.{fmt}"'})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        viewer.close()

    def not_found(request: Request) -> Response:
        raise NotFound(f"no page {request.url.path}")

    routes = [Route("/", guarded(runs_page)),
              Route("/runs/{run_id}", guarded(episode_page)),
              Route("/runs/{run_id}/attempt", guarded(attempt_page)),
              Route("/runs/{run_id}/labels", guarded(labels_part)),
              Route("/runs/{run_id}/diff", guarded(diff_page)),
              Route("/sql", guarded(sql_page)),
              Route("/sql/download", guarded(sql_download)),
              Route("/{rest:path}", guarded(not_found))]
    app = Starlette(routes=routes, middleware=[
        Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))],
        lifespan=lifespan)
    app.state.viewer = viewer
    return app


def headers(nonce: str | None) -> dict[str, str]:
    script = f"'nonce-{nonce}'" if nonce else "'none'"
    return {"Content-Security-Policy": (
                f"default-src 'none'; script-src {script}; style-src 'unsafe-inline'; "
                "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
                "base-uri 'none'; frame-ancestors 'none'"),
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
