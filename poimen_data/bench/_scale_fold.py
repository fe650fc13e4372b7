"""Scale scenarios of ``poimen bench`` (issue 13): the partitioned materialize of a large
log against a plain DuckDB fold of the same segments, and incremental after +1% against
full. Each measured step runs in a child process, which reports its own peak RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from poimen_data.bench._core import Ctx, Goal, Result, fmt_ratio, fmt_time

FULL_EVENTS = 10_000_000
QUICK_EVENTS = 200_000
COMMIT_ROWS = 1_000_000
MEMORY_LIMIT = "1536MB"  # the default budget (1.5 GiB)
GOAL = Goal("full <= 3x plain DuckDB fold, same memory limit", "ratio", "<=", 3.0)

#: The child's program: one step, then its time and ``ru_maxrss`` as JSON on stdout.
_CHILD = r"""
import json, shutil, sys, tempfile, time
import duckdb
import poimen_data as pdm
from poimen_data.fold._fold import VIEW_SQL
from poimen_data.log._log import open_log
root, step, limit = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if step == "full":
    pdm.materialize(root, full=True, memory_limit=limit)
elif step == "incremental":
    r = pdm.materialize(root, memory_limit=limit)
    assert not r.full, r
elif step == "duckdb":
    # the reference: the same view SQL over the same segments (streamed, as ours), each
    # table written with COPY ... TO parquet, under the same memory limit
    log = open_log(root, create=False, read_only=True)
    out = tempfile.mkdtemp(prefix="poimen-ref-")
    con = duckdb.connect()
    con.execute(f"SET memory_limit = '{limit}'")
    con.execute(f"SET temp_directory = '{out}/tmp'")
    con.execute("SET preserve_insertion_order = false")
    con.register("_scan", log.scan_events())
    con.execute("CREATE TEMP TABLE events AS SELECT * FROM _scan")
    for name, sql in VIEW_SQL.items():
        con.execute(f"CREATE TEMP TABLE {name} AS {sql}")
        con.execute(f"COPY {name} TO '{out}/{name}.parquet' (FORMAT parquet)")
    con.close()
    shutil.rmtree(out)
# VmHWM: ru_maxrss would also count the parent's resident pages at fork (kept over exec)
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss": int(hwm.split()[1]) * 1024}))
"""


def run_child(root: Path | str, step: str, limit: str = MEMORY_LIMIT) -> dict[str, float]:
    """One step in a fresh interpreter: ``{"seconds", "peak_rss"}`` (bytes)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(root), step, limit],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{step} child failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def build_log(root: Path, n: int, *, offset: int = 0) -> int:
    """Append ``n`` events of ``synth.events_table`` (rows ``offset..offset+n`` of one
    prefix-stable tiling) in commits of ``COMMIT_ROWS``; returns the head."""
    from poimen_data.log._log import open_log
    from poimen_data.workload.synth import events_table

    log = open_log(str(root), durable=False)
    table = events_table(offset + n)
    for lo in range(offset, offset + n, COMMIT_ROWS):
        with log.transaction() as tx:
            tx.extend(table.slice(lo, min(COMMIT_ROWS, offset + n - lo)))
    del table
    return int(log.head)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def scale_fold(ctx: Ctx) -> Result:
    """Full materialize of ``FULL_EVENTS`` (quick: ``QUICK_EVENTS``) events under a 1.5 GiB
    budget against the plain DuckDB fold of the same segments (same SQL, same memory
    limit, COPY to parquet); then +1% events and an incremental materialize against the
    full one. Times and peak RSS come from child processes, one step each."""
    n = QUICK_EVENTS if ctx.quick else FULL_EVENTS
    d = ctx.dir("scale_fold")
    root = d / "log"
    build_log(root, n)
    full = run_child(root, "full")
    ref = run_child(root, "duckdb")
    build_log(root, n // 100, offset=n)
    inc = run_child(root, "incremental")
    ratio = full["seconds"] / ref["seconds"]
    inc_ratio = inc["seconds"] / full["seconds"]
    details: dict[str, Any] = {"events": n, "added": n // 100, "memory_limit": MEMORY_LIMIT,
                               "full": full, "duckdb": ref, "incremental": inc,
                               "incremental_over_full": inc_ratio, "quick": ctx.quick,
                               "t_ours_s": [full["seconds"]], "t_ref_s": [ref["seconds"]]}
    r = Result("scale_fold", "scale: materialize", "ok", GOAL.text, ours=full["seconds"],
               reference=ref["seconds"], ratio=ratio, unit="s", ref_unit="s",
               ours_text=f"{fmt_time(full['seconds'])}, peak {_gib(full['peak_rss'])}",
               reference_text=f"DuckDB {fmt_time(ref['seconds'])}, peak "
                              f"{_gib(ref['peak_rss'])}",
               ratio_text=fmt_ratio(ratio),
               note=f"{n:,} events, memory_limit {MEMORY_LIMIT}; incremental after +1%: "
                    f"{fmt_time(inc['seconds'])} ({inc_ratio:.1%} of full), peak "
                    f"{_gib(inc['peak_rss'])}",
               details=details)
    return r


__all__ = ["build_log", "run_child", "scale_fold"]
