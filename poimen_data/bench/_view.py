"""The ``view`` scenario of ``poimen bench`` (issue 14): how long ``poimen view`` takes to
serve its runs page (first page, default sort) and an episode page, over HTTP from a
uvicorn thread on 127.0.0.1, against the same work done directly in the same run.
"""

from __future__ import annotations

import random
import time
import urllib.request
from typing import Any

from poimen_data.bench._core import Ctx, Goal, Result, fmt_ratio, fmt_time, interleave, median
from poimen_data.bench._scale_fold import build_log

GOAL = Goal("runs page median <= 300 ms (episode <= 150 ms)", "ours", "<=", 300.0)
EPISODE_GOAL_MS = 150.0
#: The issue's goal is judged on the 10-million-event log of the scale scenarios.
EVENTS = {True: 20_000, False: 10_000_000}
REPS = {True: 5, False: 15}


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=600) as resp:  # noqa: S310 - loopback only
        body: bytes = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: {resp.status}")
        return body


def view(ctx: Ctx) -> Result:
    """Median server time of the runs page and of an episode page (a different run each
    time), served warm (the viewer keeps its connection per LSN). The references do the
    same reads without the web layer: the page's SQL on a ``connect()`` connection, and
    ``episode(..., all_branches=True)``; the ratio is runs page / its SQL."""
    from poimen_data.fold._connect import connect
    from poimen_data.fold._query import episode
    from poimen_data.fold._state import materialize
    from poimen_data.log._log import open_log

    # the one upward import of the bench, made when the scenario runs: it measures the face
    from poimen_data.view import Server, create_app
    from poimen_data.view._runs import RunQuery, page_sql

    n = EVENTS[ctx.quick]
    root = ctx.dir("view") / "log"
    build_log(root, n)  # in commits of a million events, freed after
    materialize(open_log(str(root), create=False))
    ro = open_log(str(root), create=False, read_only=True)
    con = connect(ro)
    ids = [r for (r,) in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
    rng = random.Random(14)
    picks = [ids[rng.randrange(len(ids))] for _ in range(REPS[ctx.quick])]
    cur: dict[str, Any] = {"i": -1}
    sql, params = page_sql(RunQuery())

    def next_run() -> None:
        cur["i"] += 1
        cur["run"] = picks[cur["i"]]

    with Server(create_app(ro)) as server:
        t0 = time.perf_counter()
        _get(server.url)  # the first request at a head opens the connection
        cold = time.perf_counter() - t0
        t = interleave({
            "runs": lambda: _get(server.url),
            "runs_ref": lambda: con.execute(sql, params).fetchall(),
            "episode": lambda: _get(server.url + "runs/" + cur["run"]),
            "episode_ref": lambda: episode(ro, cur["run"], all_branches=True),
        }, REPS[ctx.quick], each=next_run)
    con.close()
    runs, runs_ref = median(t["runs"]), median(t["runs_ref"])
    ep, ep_ref = median(t["episode"]), median(t["episode_ref"])
    ep_met = ep * 1e3 <= EPISODE_GOAL_MS
    r = Result("view", "viewer pages", "ok", GOAL.text, ours=runs * 1e3,
               reference=runs_ref * 1e3, ratio=runs / runs_ref, unit="ms", ref_unit="ms",
               ours_text=f"runs {fmt_time(runs)}, episode {fmt_time(ep)}",
               reference_text=f"SQL {fmt_time(runs_ref)}, episode() {fmt_time(ep_ref)}",
               ratio_text=f"{fmt_ratio(runs / runs_ref)} (episode {fmt_ratio(ep / ep_ref)})",
               note=f"{n:,} events, {len(ids):,} runs, served over HTTP on 127.0.0.1; "
                    f"episode goal {'met' if ep_met else 'MISSED'}; first request at a "
                    f"new head (opens the connection) {fmt_time(cold)}",
               details={"t_ours_s": t["runs"], "t_ref_s": t["runs_ref"],
                        "t_episode_s": t["episode"], "t_episode_ref_s": t["episode_ref"],
                        "episode_ms": ep * 1e3, "episode_goal_met": ep_met,
                        "cold_first_request_s": cold, "events": n, "runs": len(ids),
                        "quick": ctx.quick})
    return r
