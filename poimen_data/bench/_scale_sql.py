"""Scale scenario ``scale_sql`` (issue 13): ``connect()`` + a group-by on a big materialized
log against the same query run by plain DuckDB over the state files the pointer names,
with and without a 1% tail of new events; every figure is timed in a child process, which
also reports its peak RSS (so the parent's caches and imports never count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pyarrow.compute as pc

from poimen_data.bench._core import (
    Ctx,
    Goal,
    Result,
    Scenario,
    fmt_ratio,
    fmt_time,
    median,
)

QUERY = "select state, count(*) from runs group by 1"
#: events in the log (quick, full); ``POIMEN_BENCH_SCALE_EVENTS`` overrides both
EVENTS = (200_000, 10_000_000)
PER_COMMIT = 1_000_000
TAIL = 0.01
GOAL = Goal("ratio <= 2x (<= 5x with a 1% tail; peak RSS < 1 GB)", "ratio", "<=", 2.0)

#: Timed in a child: imports and the interpreter are paid before the clock starts. Peak
#: RSS is the child's own VmHWM: Linux carries the parent's ru_maxrss across exec.
_CHILD = r"""
import json, resource, sys, time

def peak_kib():
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

mode, root, query = sys.argv[1:4]
if mode == "ours":
    import poimen_data as pdm
    t = time.perf_counter()
    con = pdm.connect(root)
    rows = con.sql(query).fetchall()
    used = con.execute("select getvariable('poimen_source')").fetchall()[0][0]
else:  # what a user of the format does: the pointer's files, read_parquet, the query
    import duckdb
    t = time.perf_counter()
    with open(f"{root}/state/_current.json", "rb") as f:
        ptr = json.load(f)
    files = [f"{root}/{e[1]}" for e in ptr["tables"]["runs"]]
    con = duckdb.connect()
    con.execute(f"create view runs as select * from read_parquet({files!r})")
    rows = con.sql(query).fetchall()
    used = "duckdb"
seconds = time.perf_counter() - t
print(json.dumps({"s": seconds, "rss_kib": peak_kib(),
                  "runs": sum(n for _s, n in rows), "source": used}))
"""


def _child(mode: str, root: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, root, QUERY], check=True,
                         capture_output=True, text=True, timeout=3600).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _pairs(root: str, reps: int) -> dict[str, list[dict[str, Any]]]:
    """Ours and the reference, ``reps`` times each, alternating which goes first."""
    got: dict[str, list[dict[str, Any]]] = {"ours": [], "ref": []}
    for i in range(reps):
        for mode in (("ours", "ref") if i % 2 == 0 else ("ref", "ours")):
            got[mode].append(_child(mode, root))
    return got


def _extend(log: Any, ctx: Ctx, n: int, tag: str) -> None:
    """``n`` generated events whose run ids carry ``tag`` (so every commit adds runs)."""
    for lo in range(0, n, PER_COMMIT):
        t = ctx.events(min(PER_COMMIT, n - lo))
        i = t.schema.get_field_index("run_id")
        t = t.set_column(i, "run_id", pc.binary_join_element_wise(
            t.column("run_id"), f"-{tag}{lo // PER_COMMIT}", ""))
        with log.transaction() as tx:
            tx.extend(t)


def scale_sql(ctx: Ctx) -> Result:
    """``poimen sql``'s path (``connect`` then the query) on a materialized log of
    ``EVENTS`` events, against DuckDB reading the pointer's ``runs`` files itself, in the
    same run; then again after a 1% tail of new runs (ours folds the tail, the reference
    still reads the state only). The ratio judged is the one without a tail."""
    from poimen_data.log._log import open_log

    n = int(os.environ.get("POIMEN_BENCH_SCALE_EVENTS", EVENTS[0 if ctx.quick else 1]))
    root = str(ctx.dir("scale_sql") / "log")
    log = open_log(root, durable=False)
    _extend(log, ctx, n, "c")
    subprocess.run([sys.executable, "-c", "import sys, poimen_data as p; "
                    "p.materialize(sys.argv[1])", root], check=True, timeout=7200)
    reps = ctx.sizes.reps
    plain = _pairs(root, reps)
    _extend(log, ctx, max(1, int(n * TAIL)), "tail")
    tail = _pairs(root, reps)
    assert {r["source"] for r in plain["ours"]} == {"state"}, plain["ours"]
    assert {r["source"] for r in tail["ours"]} == {"state+log"}, tail["ours"]
    assert tail["ours"][0]["runs"] > tail["ref"][0]["runs"] == plain["ours"][0]["runs"]
    ours, ref = (median(r["s"] for r in plain[k]) for k in ("ours", "ref"))
    ours_t, ref_t = (median(r["s"] for r in tail[k]) for k in ("ours", "ref"))
    rss = max(r["rss_kib"] for r in plain["ours"] + tail["ours"]) / 1024
    rss_ref = max(r["rss_kib"] for r in plain["ref"] + tail["ref"]) / 1024
    note = (f"{n:,} events, {plain['ours'][0]['runs']:,} runs; with a 1% tail: "
            f"{fmt_time(ours_t)} vs {fmt_time(ref_t)} = {fmt_ratio(ours_t / ref_t)}; "
            f"peak RSS ours {rss:.0f} MiB, reference {rss_ref:.0f} MiB (children)")
    r = Result("scale_sql", "SQL at scale", "ok", GOAL.text, ours=ours, reference=ref,
               ratio=ours / ref, unit="s", ref_unit="s", ours_text=fmt_time(ours),
               reference_text=f"DuckDB over the state files {fmt_time(ref)}",
               ratio_text=fmt_ratio(ours / ref), note=note,
               details={"quick": ctx.quick, "events": n,
                        "t_ours_s": [r["s"] for r in plain["ours"]],
                        "t_ref_s": [r["s"] for r in plain["ref"]],
                        "t_ours_tail_s": [r["s"] for r in tail["ours"]],
                        "t_ref_tail_s": [r["s"] for r in tail["ref"]],
                        "tail_ratio": ours_t / ref_t, "peak_rss_mib": rss,
                        "peak_rss_ref_mib": rss_ref})
    ctx.dir("scale_sql")  # the log can be large: gone before the next scenario
    return r


SCENARIO = Scenario("scale_sql", "SQL at scale", GOAL, scale_sql)

__all__ = ["SCENARIO", "scale_sql"]
