"""Bench scenarios of group commit (issue 17): 64 producers through one recorder against
the same producers committing one by one, on local disk and on S3 (moto), and N writer
processes racing for one log. Run ``python -m poimen_data.bench._recorder`` as a writer.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from poimen_data.bench._core import Ctx, Goal, Result, fmt_rate, fmt_ratio, fmt_time, percentile
from poimen_data.bench._core import open_log as _open

PRODUCERS = 64
BODY = 4096
WRITER_COUNTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class AllOf(Goal):
    """A goal on both figures: ``ours >= limit`` and ``ratio >= min_ratio``."""

    min_ratio: float = 0.0

    def met(self, ours: float | None, ratio: float | None) -> bool | None:
        if ours is None or ratio is None:
            return None
        return ours >= self.limit and ratio >= self.min_ratio


GOALS: dict[str, Goal] = {
    "group_commit": AllOf(">= 20,000 events/s and >= 10x one by one", "ours", ">=",
                          20_000, min_ratio=10.0),
    "group_commit_p99": Goal("p99 < 25 ms", "ours", "<=", 0.025),
    "group_commit_s3": Goal(">= 10x one by one", "ratio", ">=", 10.0),
    "s3_writers": Goal("N=8 records/s >= N=1", "ratio", ">=", 1.0),
    "recorder_memory": Goal("peak RSS for 3x the records <= 1.25x", "ratio", "<=", 1.25),
}


def _child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child of the bench, without a crash point."""
    env = {k: v for k, v in os.environ.items() if k != "POIMEN_CRASH_AT"}
    return {**env, **extra}


def _attempt(run_id: str, ref: Any) -> list[Any]:
    """One attempt as the engine records it: its dispatch (with the prompt) and its end."""
    from poimen_data.model import _events as ev

    return [ev.AttemptDispatched("acme", run_id, 0, "step", 0, 1, prompt=ref),
            ev.AttemptFinished("acme", run_id, 0, "step", 1, "succeeded")]


@dataclass
class Driven:
    """What ``_drive`` measured: the wall time, every call's latency, this process's user
    and system CPU seconds, the CPU seconds (user + system) of each kind of thread
    (``ROLES``), and the machine's busy cores on average (every process's, ``_BusyCores``;
    None without ``/proc/stat``), all from the release to the last call's end."""

    wall: float
    lat: list[float]
    user: float
    system: float
    roles: dict[str, float]
    busy_cores: float | None = None


class _BusyCores:
    """How many of the machine's cores were busy on average, every process counted, from
    this reading to ``end()``: read from ``/proc/stat`` (ticks of 10 ms; None elsewhere).
    What tells whether a side was short of CPU: its own CPU seconds alone cannot, on a
    machine other jobs share."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[int, int] | None:
        """(busy, all) ticks of every core since boot."""
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
        total = sum(ticks[:8])  # guest time is counted in user already
        return total - idle, total

    def end(self) -> float | None:
        stop = self._read()
        if self._start is None or stop is None or stop[1] == self._start[1]:
            return None
        busy, total = stop[0] - self._start[0], stop[1] - self._start[1]
        return busy / total * (os.cpu_count() or 1)


# The threads of this process by what they do, named by the prefix of their names: the
# producers are the bench's own; the recorder's two threads and the pools of
# ``storage._pools`` (their threads start on first use, so every second of theirs a run
# counts is its own)
ROLES = {"producers": "bench-producer", "gatherer": "poimen-recorder-gather",
         "committer": "poimen-recorder-commit", "promotion": "poimen-promote",
         "writes": "poimen-io", "other": ""}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by its name, read
    from the thread's own CPU clock (exact to the nanosecond, not the 10 ms ticks of
    ``/proc``)."""
    out = {}
    for t in threading.enumerate():
        if t.ident is None or not t.is_alive():
            continue
        try:
            out[f"{t.name}@{t.ident}"] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except OSError:  # it ended meanwhile
            continue
    return out


def _by_role(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    roles = dict.fromkeys(ROLES, 0.0)
    for name, cpu in after.items():
        role = next(r for r, prefix in ROLES.items() if name.startswith(prefix))
        roles[role] += cpu - before.get(name, 0.0)
    return roles


def _drive(per: int, one: Callable[[int, int, bytes], None]) -> Driven:
    """``PRODUCERS`` threads released together, each calling ``one(p, k, body)`` ``per``
    times in a row (the bodies made and the threads started before the release are not
    counted)."""
    bodies = [[os.urandom(BODY) for _ in range(per)] for _ in range(PRODUCERS)]
    barrier = threading.Barrier(PRODUCERS + 1)
    done = threading.Barrier(PRODUCERS + 1)  # every producer done ...
    read = threading.Event()  # ... and alive until their CPU clocks are read
    lat: list[float] = []
    errors: list[BaseException] = []

    def producer(p: int) -> None:
        barrier.wait()
        mine = []
        try:
            for k in range(per):
                t = time.perf_counter()
                one(p, k, bodies[p][k])
                mine.append(time.perf_counter() - t)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        lat.extend(mine)
        done.wait()
        read.wait()

    threads = [threading.Thread(target=producer, args=(p,), name=f"bench-producer-{p}")
               for p in range(PRODUCERS)]
    for t in threads:
        t.start()
    barrier.wait()
    c0, t0, cpu0, busy = os.times(), time.perf_counter(), _thread_cpu(), _BusyCores()
    done.wait()
    try:
        wall, c1, cpu1 = time.perf_counter() - t0, os.times(), _thread_cpu()
        busy_cores = busy.end()
    finally:
        read.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Driven(wall, lat, c1.user - c0.user, c1.system - c0.system, _by_role(cpu0, cpu1),
                  busy_cores)


def _drive_async(per: int, one: Callable[[int, int, bytes], Awaitable[None]]) -> Driven:
    """``_drive`` for asyncio: ``PRODUCERS`` tasks on one event loop, released together,
    each awaiting ``one(p, k, body)`` ``per`` times in a row. The loop runs on a thread of
    its own, counted as the producers' (``ROLES``); a record's latency runs until its task
    is resumed, as an engine's run sees it."""
    bodies = [[os.urandom(BODY) for _ in range(per)] for _ in range(PRODUCERS)]
    ready = threading.Barrier(2)  # every task waits for the release ...
    done = threading.Barrier(2)  # ... every task ended ...
    read = threading.Event()  # ... and the loop's thread alive until its clock is read
    released = threading.Event()
    lat: list[float] = []
    errors: list[BaseException] = []

    async def main() -> None:
        go = asyncio.Event()

        async def producer(p: int) -> None:
            await go.wait()
            for k in range(per):
                t = time.perf_counter()
                await one(p, k, bodies[p][k])
                lat.append(time.perf_counter() - t)

        tasks = [asyncio.create_task(producer(p)) for p in range(PRODUCERS)]
        await asyncio.sleep(0)  # each task is at go.wait() now
        ready.wait()  # the loop blocks here while the clocks are read: nothing to run
        released.set()
        go.set()
        try:
            await asyncio.gather(*tasks)
        finally:  # the loop blocks again while the clocks are read
            done.wait()
            read.wait()

    def loop_thread() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors.append(exc)
        if not released.is_set():
            ready.abort()  # failed before the release: the caller stops waiting

    thread = threading.Thread(target=loop_thread, name="bench-producer-asyncio")
    thread.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        thread.join()
        raise errors[0] if errors else RuntimeError("the producers' loop ended") from None
    c0, t0, cpu0, busy = os.times(), time.perf_counter(), _thread_cpu(), _BusyCores()
    done.wait()
    try:
        wall, c1, cpu1 = time.perf_counter() - t0, os.times(), _thread_cpu()
        busy_cores = busy.end()
    finally:
        read.set()
    thread.join()
    if errors:
        raise errors[0]
    return Driven(wall, lat, c1.user - c0.user, c1.system - c0.system, _by_role(cpu0, cpu1),
                  busy_cores)


def _grouped(log: Any, per: int) -> Driven:
    with log.recorder(max_delay_ms=5) as rec:
        def one(p: int, k: int, body: bytes) -> None:
            ref = rec.ref("acme", body)
            rec.record(_attempt(f"g{p}-{k}", ref), blobs={ref: body}).result()

        return _drive(per, one)


def _grouped_async(log: Any, per: int) -> Driven:
    with log.recorder(max_delay_ms=5) as rec:
        async def one(p: int, k: int, body: bytes) -> None:
            ref = rec.ref("acme", body)
            await rec.arecord(_attempt(f"a{p}-{k}", ref), blobs={ref: body})

        return _drive_async(per, one)


def _one_by_one(log: Any, per: int) -> Driven:
    def one(p: int, k: int, body: bytes) -> None:
        with log.transaction() as tx:
            ref = tx.put_blob("acme", body)
            tx.extend(_attempt(f"o{p}-{k}", ref))

    return _drive(per, one)


#: bytes of segment per record (2 events) in ``group_commit``, as measured: the size of
#: the placeholder segment the bare writer of ``_floor`` writes per window
SEGMENT_BYTES_PER_RECORD = 870
#: how long a producer of ``_floor`` waits for its window at most: a bench never hangs
FLOOR_WAIT_S = 300.0


def _floor(root: str, per: int, *, promote: bool = True) -> Driven:
    """A bare writer under ``group_commit``: the same producers (each hashing its body and
    waiting on a ``Future``) handing their bodies to a writer that does this format's file
    work through the same storage calls as a log, one window at a time, and builds,
    checks or encodes no event. Per window (whatever came in while the last one was
    written): its pack and a segment-sized file of placeholder bytes, one ``syncfs``, the
    manifest put in ``_log/`` (``put_if_absent``: written, fsynced, linked, its directory
    fsynced), the futures resolved; then, on a second thread, each body written to
    ``blobs/`` as promotion writes it, one more ``syncfs``, the probe for a next manifest
    that promotion makes, the pack and its staging area removed. Where there is no
    ``syncfs``, each file is fsynced instead. Not done: the window's delay (a window is
    whatever waited), checkpoints (one per 100 commits).

    ``promote=False``: no promotion, each body left in its window's pack for good (a
    storage format this project does not have: what it would allow)."""
    from poimen_data.log._manifest import blob_path, manifest_path
    from poimen_data.storage import open_storage

    os.makedirs(root, exist_ok=True)  # as open_log makes a log's root, and then pins it
    storage = open_storage(root)
    storage.pin_root()
    cv = threading.Condition()
    inbox: list[tuple[str, bytes, Future[int]]] = []
    stopped = False
    promoter = ThreadPoolExecutor(1, thread_name_prefix="bench-floor-promote")
    promotions: list[Future[None]] = []

    def durable(write: Callable[[bool], None]) -> None:
        """``write(sync)`` files, made durable by one syncfs after, or by an fsync each
        (``sync``) where there is none."""
        batch = storage.durable_batch()
        try:
            write(batch is None)
            if batch is not None:
                batch.sync()
        finally:
            if batch is not None:
                batch.close()

    def copy_to_blobs(seq: int, window: list[tuple[str, bytes, Future[int]]]) -> None:
        def copy_out(sync: bool) -> None:
            for sha, body, _fut in window:
                storage.write(blob_path("acme", sha), body, durable=sync)

        durable(copy_out)
        storage.read_or_none(manifest_path(seq + 1))  # promotion's look for a reducer
        storage.delete(f"_staging/{seq}/bodies.pack")
        storage.delete_tree(f"_staging/{seq}")  # its staging area, empty now

    def publish(seq: int, window: list[tuple[str, bytes, Future[int]]]) -> None:
        pack = b"".join(body for _sha, body, _fut in window)
        segment = bytes(SEGMENT_BYTES_PER_RECORD * len(window))

        def stage(sync: bool) -> None:
            storage.write_new(f"_staging/{seq}/bodies.pack", pack, sync=sync)
            storage.write_new(f"segments/{seq}.arrow", segment, sync=sync)

        durable(stage)
        doc = {"seq": seq, "blobs": [sha for sha, _body, _fut in window]}
        if not storage.put_if_absent(manifest_path(seq), json.dumps(doc).encode()):
            raise RuntimeError(f"the floor's manifest {seq} was there already")
        if promote:
            promotions.append(promoter.submit(copy_to_blobs, seq, window))
        for _sha, _body, fut in window:
            fut.set_result(seq)

    def writer() -> None:
        """Publishes windows until stopped; whatever it cannot publish fails (no producer
        is left waiting, whatever happens here)."""
        seq, failed = 0, None
        window: list[tuple[str, bytes, Future[int]]] = []
        try:
            while True:
                with cv:
                    while not inbox and not stopped:
                        cv.wait()
                    if not inbox:
                        return
                    window = inbox[:]
                    inbox.clear()
                seq += 1
                if failed is None:
                    try:
                        publish(seq, window)
                    except BaseException as exc:  # noqa: BLE001 - its producers raise it
                        failed = exc
                for _sha, _body, fut in window:
                    if not fut.done():
                        fut.set_exception(failed or RuntimeError("not published"))
        finally:
            with cv:
                left, window = window + inbox, []
                inbox.clear()
            for _sha, _body, fut in left:
                if not fut.done():
                    fut.set_exception(failed or RuntimeError("the floor's writer ended"))

    def one(p: int, k: int, body: bytes) -> None:
        fut: Future[int] = Future()
        item = (hashlib.sha256(body).hexdigest(), body, fut)
        with cv:
            inbox.append(item)
            cv.notify()
        fut.result(timeout=FLOOR_WAIT_S)

    thread = threading.Thread(target=writer, name="bench-floor-writer", daemon=True)
    thread.start()
    try:
        return _drive(per, one)
    finally:
        with cv:
            stopped = True
            cv.notify()
        thread.join()
        promoter.shutdown()
        for f in promotions:
            f.result()


def _compare(root: Callable[[str], str], per_ours: int, per_ref: int,
             reps: int, *, floor: bool = False, **open_kw: Any) -> dict[str, Any]:
    """Interleaved rounds of both sides; rates from summed work and time, latencies
    pooled over the rounds. Each side records into one log through its rounds, as a
    long-running engine does: its later rounds cross the checkpoints its commits owe
    (every ``checkpoint_interval``-th seq), which a fresh log per round, about 70 commits,
    never reached. ``floor`` (local disk only): three more sides in the rounds, the bare
    writer of ``_floor``, the same with every body left in its pack (``promote=False``),
    and the producers as asyncio tasks through ``arecord`` (``_grouped_async``)."""
    out: dict[str, Any] = {"ours_s": [], "ref_s": [], "ours_lat": [], "ref_lat": [],
                           "commits": [], "ours_flush_s": [], "ref_flush_s": [],
                           "ours_cpu_user_s": 0.0, "ours_cpu_system_s": 0.0,
                           "ours_roles_s": dict.fromkeys(ROLES, 0.0),
                           "floor_s": [], "floor_cpu_s": 0.0,
                           "packed_s": [], "packed_cpu_s": 0.0,
                           "async_s": [], "async_lat": [], "async_cpu_s": 0.0,
                           # the machine's busy cores times seconds, while each side ran
                           "ours_busy_s": 0.0, "floor_busy_s": 0.0, "packed_busy_s": 0.0,
                           "async_busy_s": 0.0, "busy_known": True}
    names = ("ours", "ref", "async") if floor else ("ours", "ref")
    logs = {name: _open(root(name), **open_kw) for name in names}
    # warm-up, untimed (the first Arrow conversion imports pandas: 0.2 s)
    for fn in (_grouped, _one_by_one, _grouped_async) if floor else (_grouped, _one_by_one):
        fn(_open(root(f"warm-{fn.__name__}"), **open_kw), 1)
    if floor:
        _floor(root("warm-floor"), 1)
    # As a latency-minded engine does once started (README "Recording from many
    # producers"): the objects its imports made are left out of every later full
    # collection, which would otherwise stop all 64 producers for 70 to 80 ms once or
    # twice a run (the p99).
    gc.collect()
    gc.freeze()
    try:
        for i in range(reps):
            sides: list[tuple[str, Any, int]] = [("ours", _grouped, per_ours),
                                                 ("ref", _one_by_one, per_ref)]
            if floor:
                sides += [("floor", _floor, per_ours), ("async", _grouped_async, per_ours),
                          ("packed", functools.partial(_floor, promote=False), per_ours)]
            turn = i % len(sides)
            for name, fn, per in sides[turn:] + sides[:turn]:
                if name in ("floor", "packed"):
                    d = fn(root(f"{name}{i}"), per)
                else:
                    log = logs[name]
                    head = log.head_seq
                    d = fn(log, per)
                if name != "ref":
                    if d.busy_cores is None:
                        out["busy_known"] = False
                    else:
                        out[f"{name}_busy_s"] += d.busy_cores * d.wall
                if name in ("floor", "packed", "async"):
                    out[f"{name}_s"].append(d.wall)
                    out[f"{name}_cpu_s"] += d.user + d.system
                    if name == "async":
                        out["async_lat"] += d.lat
                        log.flush()  # its promotions end before the next side runs
                    continue
                t0 = time.perf_counter()
                log.flush()  # promotion: off the commit's path, but it must keep up
                out[f"{name}_flush_s"].append(time.perf_counter() - t0)
                out[f"{name}_s"].append(d.wall)
                out[f"{name}_lat"] += d.lat
                if name == "ours":  # this process's CPU while recording (promotion too)
                    out["ours_cpu_user_s"] += d.user
                    out["ours_cpu_system_s"] += d.system
                    for role, cpu in d.roles.items():
                        out["ours_roles_s"][role] += cpu
                    out["commits"].append(log.head_seq - head)
    finally:
        gc.unfreeze()
    n = PRODUCERS * 2
    out["ours"] = n * per_ours * reps / sum(out["ours_s"])
    out["ref"] = n * per_ref * reps / sum(out["ref_s"])
    records = PRODUCERS * per_ours * reps
    out["records_per_commit"] = records / sum(out["commits"])
    out["user_us_per_record"] = out["ours_cpu_user_s"] / records * 1e6
    out["system_us_per_record"] = out["ours_cpu_system_s"] / records * 1e6
    out["roles_us_per_record"] = {role: cpu / records * 1e6
                                  for role, cpu in out["ours_roles_s"].items()}
    extra = ("floor", "packed", "async") if floor else ()
    for side in extra:
        out[side] = n * per_ours * reps / sum(out[f"{side}_s"])
        out[f"{side}_cpu_us_per_record"] = out[f"{side}_cpu_s"] / records * 1e6
    for side in ("ours", *extra):  # the machine's, on average
        out[f"{side}_busy_cores"] = (out[f"{side}_busy_s"] / sum(out[f"{side}_s"])
                                     if out["busy_known"] else None)
    for side, per in (("ours", per_ours), ("ref", per_ref)):  # until promoted, too
        out[f"{side}_drained"] = n * per * reps / (sum(out[f"{side}_s"])
                                                  + sum(out[f"{side}_flush_s"]))
    return out


def _local(ctx: Ctx) -> dict[str, Any]:
    if "group_local" not in ctx.cache:
        d = ctx.dir("group")
        per_ours, per_ref = (10, 2) if ctx.quick else (40, 6)
        ctx.cache["group_local"] = _compare(lambda name: str(d / name), per_ours,
                                            per_ref, 3 if not ctx.quick else 2, floor=True)
    return ctx.cache["group_local"]


def _result(ctx: Ctx, name: str, title: str, **kw: Any) -> Result:
    r = Result(name, title, "ok", GOALS[name].text, **kw)
    r.details.setdefault("quick", ctx.quick)
    return r


def group_commit(ctx: Ctx) -> Result:
    """64 producer threads, each recording single attempts (2 events + a 4 KB prompt) one
    after the other and waiting for each to be durable, through one recorder on a durable
    local log; the reference is the same producers each committing its own transaction.
    The note adds the bare writers of ``_floor`` and the producers as asyncio tasks."""
    return _compared(ctx, "group_commit", "group commit", _local(ctx),
                     f"{PRODUCERS} threads, durable local disk")


def _compared(ctx: Ctx, name: str, title: str, m: dict[str, Any], where: str) -> Result:
    """The result of a ``_compare``: events/s of the recorder against one by one."""
    ratio = m["ours"] / m["ref"]
    p99 = percentile(m["ours_lat"], 0.99)
    # on local disk the user part is mostly Python, which runs one thread at a time (the
    # GIL): what one core of it allows bounds the recorder whatever the disk does (on S3
    # much of it is the HTTP client's, beside the waits on requests)
    roles = m["roles_us_per_record"]
    cpus = os.cpu_count() or 1
    whole = m["user_us_per_record"] + m["system_us_per_record"]
    ceiling = "" if name != "group_commit" else (
        "; the user part is mostly Python, run one thread at a time (the GIL): one core "
        f"of it allows {fmt_rate(2e6 / m['user_us_per_record'], 'events/s')}; all of it "
        f"on this machine's {cpus} cores at most "
        f"{fmt_rate(2e6 * cpus / whole, 'events/s')}")

    def busy(side: str) -> str:
        cores = m[f"{side}_busy_cores"]
        return "" if cores is None else f"; the machine's cores busy meanwhile: {cores:.2f}" \
                                        f" of {cpus} (every process)"

    floor_text = ""
    extra: dict[str, Any] = {"ours_busy_cores": m["ours_busy_cores"]}
    if "floor" in m:  # what the disk and the threads allow before any event (_floor)
        floor_text = (
            "; the same producers handing only their bodies to a bare writer doing this "
            "format's file work one window at a time, and no event (a pack and a "
            "segment-sized file, a syncfs, a manifest put; each body then written to "
            f"blobs/): {fmt_rate(m['floor'], 'events/s')} "
            f"({m['floor_cpu_us_per_record']:.0f} us CPU per record{busy('floor')}), "
            f"ours at {m['ours'] / m['floor']:.0%} of it")
        floor_text += (
            "; the same bare writer with each body left in its window's pack for good (no "
            f"file per body in blobs/, a format this log does not have): "
            f"{fmt_rate(m['packed'], 'events/s')} ({m['packed_cpu_us_per_record']:.0f} us "
            f"CPU per record{busy('packed')})")
        async_p99 = percentile(m["async_lat"], 0.99)
        floor_text += (
            f"; the same producers as {PRODUCERS} asyncio tasks on one event loop "
            f"(arecord): {fmt_rate(m['async'], 'events/s')} (p99 {fmt_time(async_p99)}; "
            f"{m['async_cpu_us_per_record']:.0f} us CPU per record{busy('async')})")
        extra |= {"floor_events_per_s": m["floor"], "t_floor_s": m["floor_s"],
                  "floor_cpu_us_per_record": m["floor_cpu_us_per_record"],
                  "floor_busy_cores": m["floor_busy_cores"],
                  "packed_events_per_s": m["packed"], "t_packed_s": m["packed_s"],
                  "packed_cpu_us_per_record": m["packed_cpu_us_per_record"],
                  "packed_busy_cores": m["packed_busy_cores"],
                  "async_events_per_s": m["async"], "t_async_s": m["async_s"],
                  "async_p99_s": async_p99,
                  "async_cpu_us_per_record": m["async_cpu_us_per_record"],
                  "async_busy_cores": m["async_busy_cores"]}
    return _result(ctx, name, title, ours=m["ours"], reference=m["ref"],
                   ratio=ratio, unit="events/s", ref_unit="events/s",
                   ours_text=fmt_rate(m["ours"], "events/s") + f" (p99 {fmt_time(p99)})",
                   reference_text="one by one " + fmt_rate(m["ref"], "events/s"),
                   ratio_text=fmt_ratio(ratio),
                   note=f"{where}; {m['records_per_commit']:.1f} records per commit; "
                        "until every body is promoted to blobs/ too: "
                        f"{fmt_rate(m['ours_drained'], 'events/s')} against "
                        f"{fmt_rate(m['ref_drained'], 'events/s')} "
                        f"({fmt_ratio(m['ours_drained'] / m['ref_drained'])}); this "
                        f"process's CPU per record while recording: "
                        f"{m['user_us_per_record']:.0f} us user + "
                        f"{m['system_us_per_record']:.0f} us system{ceiling}; by "
                        "thread (user + system): " + ", ".join(
                            f"{role} {us:.0f} us" for role, us in roles.items())
                        + busy("ours") + floor_text,
                   details={"t_ours_s": m["ours_s"], "t_ref_s": m["ref_s"],
                            "t_ours_flush_s": m["ours_flush_s"],
                            "t_ref_flush_s": m["ref_flush_s"],
                            "ours_drained": m["ours_drained"], "ref_drained": m["ref_drained"],
                            "commits": m["commits"],
                            "user_us_per_record": m["user_us_per_record"],
                            "system_us_per_record": m["system_us_per_record"],
                            "roles_us_per_record": roles,
                            "records_per_commit": m["records_per_commit"], **extra})


def group_commit_p99(ctx: Ctx) -> Result:
    """The p99 latency of one record (``record(...).result()``) in ``group_commit``,
    against the p99 of one commit of the same producers committing one by one."""
    m = _local(ctx)
    p99, ref = percentile(m["ours_lat"], 0.99), percentile(m["ref_lat"], 0.99)
    p50 = percentile(m["ours_lat"], 0.5)
    return _result(ctx, "group_commit_p99", "group commit p99", ours=p99, reference=ref,
                   ratio=p99 / ref, unit="s", ref_unit="s",
                   ours_text=f"p99 {fmt_time(p99)} (median {fmt_time(p50)})",
                   reference_text=f"one by one p99 {fmt_time(ref)}",
                   ratio_text=fmt_ratio(p99 / ref),
                   note=f"{len(m['ours_lat'])} records",
                   details={"t_ours_s": m["ours_s"], "t_ref_s": m["ref_s"],
                            "p50_s": p50})


# --- memory of a producer that does not wait --------------------------------------------

#: A fresh interpreter records ``n`` records (an attempt and a body of ``size`` bytes)
#: without waiting for their futures, then drains; prints its time and peak RSS (VmHWM:
#: its own, not the parent's carried over exec).
_FIRE_AND_FORGET = r"""
import json, os, sys, time
from poimen_data.bench._recorder import _attempt
from poimen_data.log import _log
from poimen_data.log._log import open_log
root, n, size, bound = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kw = {} if bound == "default" else {"max_pending_bytes": int(bound)}
if bound != "default":  # the packs kept for promotion: filled at both sizes too
    _log.RETAINED_PACK_BYTES = int(bound)
log = open_log(root)
seed = os.urandom(size)
t0 = time.perf_counter()
with log.recorder(**kw) as rec:
    for i in range(n):
        body = i.to_bytes(8, "big") + seed[8:]
        ref = rec.ref("acme", body)
        rec.record(_attempt(f"f{i}", ref), blobs={ref: body})
seconds = time.perf_counter() - t0
log.flush()
assert log.head == 2 * n, log.head
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_rss": int(hwm.split()[1]) * 1024}))
"""
FIRE_BODY = 16 << 10


def _fire_and_forget(root: str, n: int, bound: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _FIRE_AND_FORGET, root, str(n),
                          str(FIRE_BODY), bound], capture_output=True, text=True,
                         check=False, env=_child_env())
    if out.returncode:
        raise RuntimeError(f"fire-and-forget child failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def recorder_memory(ctx: Ctx) -> Result:
    """A producer recording as fast as it can without waiting for its futures (16 KiB
    bodies, a durable local log): the recorder's bound on what it holds keeps the peak
    RSS flat whatever the number of records. Ours: 3x the records; reference: 1x; each
    in its own process. The full run uses the default bound (256 MiB of bodies); the
    quick one 8 MiB, and 8 MiB of packs kept for promotion instead of 64 (its records
    would reach neither default, and the smaller run would not fill what the bigger
    one does)."""
    n, bound = (2_000, str(8 << 20)) if ctx.quick else (30_000, "default")
    d = ctx.dir("recorder-memory")
    ref = _fire_and_forget(str(d / "one"), n, bound)
    ours = _fire_and_forget(str(d / "three"), 3 * n, bound)
    mib = 1 << 20
    ratio = ours["peak_rss"] / ref["peak_rss"]
    bound_text = ("256 MiB of bodies (the default)" if bound == "default"
                  else f"{int(bound) >> 20} MiB of bodies, and of packs kept for promotion")
    return _result(ctx, "recorder_memory", "recorder memory", ours=ours["peak_rss"] / mib,
                   reference=ref["peak_rss"] / mib, ratio=ratio, unit="MiB", ref_unit="MiB",
                   ours_text=f"{3 * n:,} records: peak {ours['peak_rss'] / mib:.0f} MiB",
                   reference_text=f"{n:,} records: peak {ref['peak_rss'] / mib:.0f} MiB",
                   ratio_text=fmt_ratio(ratio),
                   note=f"one producer thread, {FIRE_BODY >> 10} KiB bodies "
                        f"({3 * n * FIRE_BODY / mib:,.0f} MiB in all for ours), never "
                        f"waiting for a future; bound: {bound_text}; "
                        f"{3 * n / ours['seconds']:,.0f} against "
                        f"{n / ref['seconds']:,.0f} records/s handed over and committed",
                   details={"t_ours_s": [ours["seconds"]], "t_ref_s": [ref["seconds"]],
                            "peak_rss_ours": ours["peak_rss"],
                            "peak_rss_ref": ref["peak_rss"]})


# --- S3 on moto ----------------------------------------------------------------------------


def _atomic_conditional_put() -> None:
    """moto checks ``If-None-Match`` and stores in two unlocked steps, so racing writers
    could both win; serializing its PUT handler restores S3's guarantee (as the tests do)."""
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_poimen_atomic", False):
        return
    original, lock = S3Response.put_object, threading.Lock()

    def put_object(self: S3Response) -> object:
        with lock:
            return original(self)

    put_object._poimen_atomic = True  # type: ignore[attr-defined]
    S3Response.put_object = put_object  # type: ignore[method-assign,assignment]


#: how long the bench waits for a line from one of its children at most (its start, its
#: answer): a stalled child fails the bench instead of stalling it
CHILD_LINE_S = 300.0


def _line(child: subprocess.Popen[bytes], what: str, timeout: float = CHILD_LINE_S) -> bytes:
    """The next line ``child`` prints (b"" once it closed its output), waited for at most
    ``timeout`` seconds: ``RuntimeError`` naming ``what`` after that. The children are
    started unbuffered (``bufsize=0``): ``readline`` then reads one byte at a time and never
    ahead, so a line printed together with the next leaves nothing buffered here that
    ``select`` would not see."""
    assert child.stdout is not None
    ready, _w, _x = select.select([child.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError(f"{what}: no answer from the child (pid {child.pid}) in "
                           f"{timeout:g} s")
    return child.stdout.readline()


def _start_moto() -> Any:
    """A started moto server on 127.0.0.1 (a free port), its request log quiet."""
    from moto.server import ThreadedMotoServer

    _atomic_conditional_put()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


@contextmanager
def moto_s3(*, own_process: bool = False,
            clocks: list[Callable[[], float]] | None = None
            ) -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto S3 server on 127.0.0.1 with a bucket: yields (bucket URL, storage options).

    ``own_process`` serves it from a child process, as a real S3 is: in this process moto
    would share the GIL (and one core) with the writers it serves, and its own CPU (most
    of a commit's, here) would be charged to whichever side makes more requests. A
    function reading that process's CPU seconds so far (every thread's, from its own
    clock) is appended to ``clocks``; call it from one thread at a time."""
    import boto3

    child = None
    server = None
    if own_process:
        child = subprocess.Popen([sys.executable, "-m", "poimen_data.bench._recorder",
                                  "--moto"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 env=_child_env(), bufsize=0)
        cause: RuntimeError | None = None
        try:
            line = _line(child, "the moto server process")
        except RuntimeError as exc:
            line, cause = b"", exc
        if not line.strip().isdigit():
            child.kill()
            child.wait()
            raise RuntimeError("the moto server process did not start"
                               + (f": {cause}" if cause else "")) from cause
        host, port = "127.0.0.1", int(line)
        if clocks is not None:
            clocks.append(functools.partial(_ask_cpu, child))
    else:
        wz = logging.getLogger("werkzeug")
        level = wz.level
        server = _start_moto()
        host, port = server.get_host_and_port()
    try:
        url = f"http://{host}:{port}"
        bucket = f"poimen-bench-{uuid.uuid4().hex[:12]}"  # moto's state is per process
        boto3.client("s3", endpoint_url=url, aws_access_key_id="bench",
                     aws_secret_access_key="bench", region_name="eu-west-1").create_bucket(
            Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
        yield (f"s3://{bucket}/{uuid.uuid4().hex}",
               {"key": "bench", "secret": "bench",
                "client_kwargs": {"endpoint_url": url, "region_name": "eu-west-1"}})
    finally:
        if server is not None:
            server.stop()
            wz.setLevel(level)
        if child is not None:
            assert child.stdin is not None
            child.stdin.close()  # the child stops its server and exits
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _ask_cpu(child: subprocess.Popen[bytes]) -> float:
    """The CPU seconds the moto child has used so far (see ``_moto_main``)."""
    assert child.stdin is not None
    child.stdin.write(b"cpu\n")
    child.stdin.flush()
    return float(_line(child, "the moto server's CPU clock"))


def _moto_main() -> None:
    """The child of ``moto_s3(own_process=True)``: prints its port, serves until its
    standard input closes; for each line ``cpu`` on it, prints the CPU seconds it has
    used so far (``time.process_time``: every thread, ended ones too)."""
    server = _start_moto()
    sys.stdout.write(f"{server.get_host_and_port()[1]}\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() == "cpu":
            sys.stdout.write(f"{time.process_time():.9f}\n")
            sys.stdout.flush()
    server.stop()


def group_commit_s3(ctx: Ctx) -> Result:
    """``group_commit`` on a log in S3 (moto on loopback): one manifest PUT per window
    instead of one per record."""
    per_ours, per_ref = (3, 1) if ctx.quick else (8, 2)
    with moto_s3(own_process=True) as (base, opts):
        m = _compare(lambda name: f"{base}/{name}", per_ours, per_ref, 2,
                     storage_options=opts)
    return _compared(ctx, "group_commit_s3", "group commit S3", m,
                     f"{PRODUCERS} threads on moto (loopback)")


# --- N writer processes on one log ------------------------------------------------------------


@contextmanager
def _children(what: str, argvs: list[list[str]], opts: dict[str, Any] | None
              ) -> Iterator[list[subprocess.Popen[bytes]]]:
    """A child of this module per argument list (``python -m poimen_data.bench._recorder
    *argv``, the storage options in its environment), each ready (it printed ``ready``:
    the rendezvous) when this yields; any still running on the way out is killed."""
    env = _child_env(POIMEN_BENCH_STORAGE_OPTIONS=json.dumps(opts) if opts else "")
    procs = [subprocess.Popen([sys.executable, "-m", "poimen_data.bench._recorder", *argv],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, bufsize=0)
             for argv in argvs]
    try:
        for p in procs:
            if _line(p, f"{what} start") != b"ready\n":
                raise RuntimeError(f"{what} failed: {p.communicate()[1].decode()[-500:]}")
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _release(procs: list[subprocess.Popen[bytes]]) -> None:
    """Send every child its ``go`` line, together."""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()


def _child_log(root: str) -> Any:
    """The log of a child of ``_children``, opened with the storage options it was given."""
    so = os.environ.get("POIMEN_BENCH_STORAGE_OPTIONS")
    return _open(root, storage_options=json.loads(so) if so else None, create=False)


def _rendezvous() -> None:
    """A child's side: say ``ready``, then wait for the line that releases it."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()


def _writers(root: str, opts: dict[str, Any] | None, n: int, records: int,
             producers: int, server: Callable[[], float] | None = None
             ) -> dict[str, float]:
    """``n`` processes released together, each committing ``records`` records (2 events
    + a 4 KB body): one by one (``producers=0``), or from that many threads through a
    recorder. Total records/s, lost publish races per publish, the writers' CPU per
    record (each from its release to its end, every thread) and the machine's busy cores
    (every process, ``busy_cores``) over the run; with ``server``, the moto child's clock
    (see ``moto_s3``), its CPU per record too (``server_ms_per_record``)."""
    argvs = [[root, f"w{i}", str(records), str(producers)] for i in range(n)]
    with _children("writer", argvs, opts) as procs:  # every writer opened the log
        cpu0 = None if server is None else server()
        t0, busy = time.perf_counter(), _BusyCores()
        _release(procs)
        retries = publishes = requests = 0
        writers_cpu = 0.0
        for p in procs:
            out, err = p.communicate(timeout=900)
            if p.returncode:
                raise RuntimeError(f"writer failed: {err.decode()[-500:]}")
            r, c, cpu, req = out.split()[-4:]
            retries, publishes = retries + int(r), publishes + int(c)
            writers_cpu += float(cpu)
            requests = -1 if int(req) < 0 or requests < 0 else requests + int(req)
        wall, busy_cores = time.perf_counter() - t0, busy.end()
        cpu1 = None if server is None else server()
    rates = {"records_per_s": n * records / wall, "publishes_per_s": publishes / wall,
             "retries_per_publish": retries / publishes, "wall_s": wall,
             "writers_ms_per_record": writers_cpu / (n * records) * 1e3}
    if requests >= 0:  # every writer counted its requests (an object store)
        rates["requests_per_record"] = requests / (n * records)
    if busy_cores is not None:
        rates["busy_cores"] = busy_cores
    if cpu0 is not None and cpu1 is not None:
        rates["server_ms_per_record"] = (cpu1 - cpu0) / (n * records) * 1e3
    return rates


def _writer_table(ctx: Ctx, base: str, opts: dict[str, Any] | None, records: int,
                  producers: int, server: Callable[[], float] | None = None
                  ) -> dict[int, dict[str, float]]:
    out = {}
    for n in (1, 8) if ctx.quick else WRITER_COUNTS:
        root = f"{base}/w{n}-{producers}"
        _open(root, storage_options=opts)  # created once, before the race
        out[n] = _writers(root, opts, n, records, producers, server)
    return out


def s3_writers(ctx: Ctx) -> Result:
    """N = 1, 2, 4, 8 processes writing one log in S3 (moto): each commits its records
    through a recorder fed by 8 threads (ours), and one by one (in the note); then the same
    on local disk (details and note). Total records/s, commits/s and lost publish races
    per commit; for S3 with a recorder, the cores the writers, moto and the whole machine
    kept busy at N = 1 and N = 8, the writers' HTTP requests per record, and moto's ceiling
    measured in the same run (``_ceiling``): what it allows at those requests per record. The
    goal: N = 8 no slower in total than N = 1."""
    q = ctx.quick
    clocks: list[Callable[[], float]] = []
    with moto_s3(own_process=True, clocks=clocks) as (base, opts):
        # 160 records a writer: at N = 8 the log passes a checkpoint (seq 100), whose
        # writer promotes what the others committed since the last one (README, step 6)
        s3 = _writer_table(ctx, base, opts, 8 if q else 160, 8, clocks[0])
        # one by one: full runs only, as on local disk (9 more processes to start)
        s3_one = {} if q else _writer_table(ctx, base, opts, 20, 0, clocks[0])
        ceiling = _ceiling(ctx, f"{base}/w1-8", opts, clocks[0])
    d = str(ctx.dir("writers"))  # local disk: full runs only (8 processes start slowly)
    local = {} if q else _writer_table(ctx, d, None, 160, 8)
    local_one = {} if q else _writer_table(ctx, d, None, 50, 0)
    one, eight = s3[1]["records_per_s"], s3[8]["records_per_s"]

    def line(t: dict[int, dict[str, float]]) -> str:
        if not t:
            return "not run (--quick)"
        return ", ".join(f"N={n}: {v['records_per_s']:.0f} records/s in "
                         f"{v['publishes_per_s']:.1f} commits/s "
                         f"({v['retries_per_publish']:.2f} lost races per commit)"
                         for n, v in t.items())

    # what N = 1 and N = 8 spent, in cores: short of CPU, or waiting? (moto is one Python
    # process, on the same cores as the writers)
    cpu = ""
    for n in (1, 8):
        v = s3[n]
        rate = v["records_per_s"] / 1e3
        cpu += (f"; {'on S3 with a recorder, ' if n == 1 else ''}at N={n} the writers "
                f"used {v['writers_ms_per_record'] * rate:.2f} cores "
                f"({v['writers_ms_per_record']:.1f} ms of CPU per record)")
        if "server_ms_per_record" in v:
            cpu += (f", moto {v['server_ms_per_record'] * rate:.2f} "
                    f"({v['server_ms_per_record']:.1f} ms)")
        if "busy_cores" in v:
            cpu += f", the machine {v['busy_cores']:.2f} of {os.cpu_count() or 1} busy"
        cpu += f"; {v['requests_per_record']:.1f} requests per record"
    # what the server answers at most, in requests per second, and so in records per second
    # at N = 8's requests per record
    procs_n, threads = CEILING_CLIENTS
    cpu += (f"; moto's ceiling in this run, for its cheapest request: "
            f"{ceiling['requests_per_s']:.0f} requests/s (HEADs of one object from {procs_n} "
            f"processes x {threads} threads, moto at {ceiling['server_cores']:.2f} cores"
            + (f", the machine {ceiling['busy_cores']:.2f} busy" if "busy_cores" in ceiling
               else "")
            + f"): at most {ceiling['requests_per_s'] / s3[8]['requests_per_record']:.0f} "
              f"records/s at N=8's requests per record, "
              f"{ceiling['requests_per_s'] / s3[1]['requests_per_record']:.0f} at N=1's")
    return _result(ctx, "s3_writers", "S3 writers", ours=eight, reference=one,
                   ratio=eight / one, unit="records/s", ref_unit="records/s",
                   ours_text=f"N=8 {fmt_rate(eight, 'records/s')}",
                   reference_text=f"N=1 {fmt_rate(one, 'records/s')}",
                   ratio_text=fmt_ratio(eight / one),
                   note=f"S3 with a recorder per "
                        f"process: {line(s3)}; S3 one by one: {line(s3_one)}; local disk "
                        f"with a recorder: {line(local)}; local one by one: {line(local_one)}"
                        + cpu,
                   details={"t_ours_s": [s3[8]["wall_s"]], "t_ref_s": [s3[1]["wall_s"]],
                            "s3_ceiling": ceiling,
                            **{name: {str(k): v for k, v in t.items()} for name, t in
                               (("s3", s3), ("s3_one_by_one", s3_one), ("local", local),
                                ("local_one_by_one", local_one))}})


def _count_requests(storage: Any) -> Callable[[], int] | None:
    """Count every HTTP request ``storage`` sends from now on, from every thread (botocore's
    ``before-send`` event of s3fs's client: a retry, and each request of a call that makes
    several, such as a move's copy and delete, counted); None for a storage that sends
    none (local disk). The returned function reads the count."""
    fs = getattr(storage, "fs", None)
    if fs is None or not hasattr(fs, "set_session"):
        return None
    import fsspec.asyn

    n = [0]

    def count(**_kw: Any) -> None:  # on s3fs's event loop thread; None: send it
        n[0] += 1

    async def hook() -> None:
        await fs.set_session()
        fs.s3.meta.events.register("before-send.s3", count)

    fsspec.asyn.sync(fs.loop, hook)
    return lambda: n[0]


#: the server's ceiling (``_ceiling``): processes, threads each, seconds (full, quick)
CEILING_CLIENTS = (2, 8)
CEILING_S = (3.0, 0.5)


def _heads_main(root: str, seconds: float, threads: int) -> None:
    """A client of ``_ceiling``: prints ``ready``, waits for a line, then HEADs the log's
    ``_poimen.json`` from ``threads`` threads for ``seconds``; prints how many it made and
    the seconds it took (exits 1, printing nothing, when a thread failed)."""
    st = _child_log(root).storage
    st.exists("_poimen.json")  # connected
    _rendezvous()
    t0 = time.monotonic()
    end = t0 + seconds
    counts = [0] * threads
    failed: list[BaseException] = []

    def heads(i: int) -> None:
        try:
            while time.monotonic() < end:
                st.exists("_poimen.json")
                counts[i] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            failed.append(exc)

    workers = [threading.Thread(target=heads, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if failed:
        sys.stderr.write(f"a client thread failed: {failed[0]!r}\n")
        sys.exit(1)
    sys.stdout.write(f"{sum(counts)} {time.monotonic() - t0:.6f}\n")
    sys.stdout.flush()


def _ceiling(ctx: Ctx, root: str, opts: dict[str, Any], server: Callable[[], float]
             ) -> dict[str, float]:
    """How many requests the S3 server answers at most, in this run: ``CEILING_CLIENTS``
    processes of threads doing nothing but HEADs of one small object (the cheapest request)
    for a few seconds. Requests/s, the server's cores (its own clock) and the machine's."""
    procs_n, threads = CEILING_CLIENTS
    seconds = CEILING_S[ctx.quick]
    argvs = [["--heads", root, str(seconds), str(threads)]] * procs_n
    with _children("client", argvs, opts) as procs:  # every client connected
        cpu0, busy = server(), _BusyCores()
        _release(procs)
        total, sending = 0, 0.0
        for p in procs:  # each client's count and the seconds it sent them in, read as it
            # prints them: not its start-up or exit
            line = _line(p, "client", seconds + CHILD_LINE_S).split()
            if len(line) != 2:
                raise RuntimeError(f"client failed: {p.communicate()[1].decode()[-500:]}")
            total, sending = total + int(line[0]), max(sending, float(line[1]))
        cpu1, busy_cores = server(), busy.end()
        for p in procs:
            p.communicate(timeout=300)
    ceiling = {"requests_per_s": total / sending, "server_cores": (cpu1 - cpu0) / sending}
    if busy_cores is not None:
        ceiling["busy_cores"] = busy_cores
    return ceiling


def _writer_main(root: str, who: str, records: int, producers: int) -> None:
    """One writer process of ``s3_writers``: prints ``ready``, waits for a line, commits,
    prints its lost publish races, its publishes and the CPU seconds it spent since the
    line came (every thread, promotion's too)."""
    log = _child_log(root)
    from datetime import UTC, datetime

    from poimen_data.model._arrow import events_to_table
    from poimen_data.model._events import BlobRef

    warm = _attempt("warm", BlobRef("acme", "0" * 64, 1))  # the first conversion is slow
    events_to_table(warm, [datetime.now(UTC)] * len(warm))
    log.refresh()
    requests = _count_requests(log.storage)
    _rendezvous()
    cpu0, requests0 = time.process_time(), (requests() if requests else 0)
    if producers:
        with log.recorder(max_delay_ms=5) as rec:
            def producer(p: int) -> None:
                for k in range(records // producers):
                    body = os.urandom(BODY)
                    ref = rec.ref("acme", body)
                    rec.record(_attempt(f"{who}-{p}-{k}", ref), blobs={ref: body}).result()

            threads = [threading.Thread(target=producer, args=(p,)) for p in range(producers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        publishes = rec.commits
    else:
        for k in range(records):
            with log.transaction() as tx:
                ref = tx.put_blob("acme", os.urandom(BODY))
                tx.extend(_attempt(f"{who}-{k}", ref))
        publishes = records
    log.flush()
    sent = requests() - requests0 if requests else -1  # -1: local disk, no requests
    sys.stdout.write(f"{log.publish_retries} {publishes} {time.process_time() - cpu0:.6f} "
                     f"{sent}\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--moto"]:
        _moto_main()
    elif sys.argv[1] == "--heads":
        _heads_main(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        _writer_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
