"""``poimen bench --quick`` runs in the suite: every scenario reports a number.

Never asserts a timing (the machines are shared and noisy): only that each scenario ran,
produced finite positive figures, and that the JSON carries what the README's table and
later comparisons read. A scenario may say "n/a" only when its module is really missing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from poimen_data.bench import _runner as _bench
from poimen_data.bench._core import fmt_rate, fmt_time
from poimen_data.bench._recorder import (
    PRODUCERS,
    ROLES,
    SEGMENT_BYTES_PER_RECORD,
    _BusyCores,
    _count_requests,
    _floor,
    _line,
)
from poimen_data.bench._runner import Result, run, run_cli, scenario_names, write_json
from poimen_data.errors import ValidationError

RESULT_KEYS = {"name", "title", "status", "goal", "ours", "reference", "ratio", "unit",
               "ref_unit", "ours_text", "reference_text", "ratio_text", "met", "note",
               "seconds", "details"}
EXPECTED = ["bulk_ingest", "event_objects", "small_commit", "small_commit_vs_peer", "open",
            "small_files", "cold_refold", "fold_engine", "incremental", "point_query",
            "grading", "export", "s3_commit", "scale_fold", "scale_sql", "group_commit",
            "group_commit_p99", "group_commit_s3", "s3_writers", "recorder_memory", "view"]


@pytest.fixture(scope="module")
def quick_results() -> list[Result]:
    return run(quick=True)


@pytest.mark.slow
def test_quick_bench_reports_every_scenario(quick_results: list[Result]) -> None:
    assert [r.name for r in quick_results] == EXPECTED == scenario_names()
    for r in quick_results:
        assert r.status == "ok", f"{r.name}: {r.note}\n{r.details.get('traceback', '')}"
        for value in (r.ours, r.reference, r.ratio):
            assert isinstance(value, float) and math.isfinite(value) and value > 0, r
        assert r.ours_text and r.reference_text and r.ratio_text and r.goal
        assert r.met in (True, False, None)
        assert r.details["t_ours_s"] and r.details["t_ref_s"]
    group = quick_results[EXPECTED.index("group_commit")]  # the CPU a record costs
    user = group.details["user_us_per_record"]
    system = group.details["system_us_per_record"]
    assert math.isfinite(user) and user > 0 and math.isfinite(system) and system >= 0
    assert f"{user:.0f} us user + {system:.0f} us system; the user part" in group.note
    # ... and by thread, from each thread's own CPU clock: the recorder's threads and the
    # producers all counted (none ended before its clock was read), no more than the
    # process spent (other threads, if any, are not Python's)
    roles = group.details["roles_us_per_record"]
    assert list(roles) == list(ROLES)
    assert all(roles[r] > 0 for r in ("producers", "gatherer", "committer", "writes"))
    assert 0.6 * (user + system) <= sum(roles.values()) <= 1.05 * (user + system) + 5, roles
    assert f"by thread (user + system): producers {roles['producers']:.0f} us" in group.note
    # ... and the bare writer beside it: the same producers, no events
    floor = group.details["floor_events_per_s"]
    assert f"{group.details['floor_cpu_us_per_record']:.0f} us CPU per record" in group.note
    assert f"ours at {group.ours / floor:.0%} of it" in group.note
    # ... the bare writer with no file per body, and the producers as asyncio tasks
    d = group.details
    for side in ("packed", "async"):
        assert d[f"{side}_events_per_s"] > 0 and len(d[f"t_{side}_s"]) == 2, d
        assert f"{d[f'{side}_cpu_us_per_record']:.0f} us CPU per record" in group.note
    assert "each body left in its window's pack for good" in group.note
    assert (f"{PRODUCERS} asyncio tasks on one event loop (arecord): "
            f"{fmt_rate(d['async_events_per_s'], 'events/s')} "
            f"(p99 {fmt_time(d['async_p99_s'])}" in group.note)
    if sys.platform.startswith("linux"):  # the machine's busy cores, from /proc/stat
        busy = group.details["ours_busy_cores"]
        assert 0 < busy <= (os.cpu_count() or 1) + 0.05, busy
        assert f"cores busy meanwhile: {busy:.2f} of" in group.note
    writers = quick_results[EXPECTED.index("s3_writers")]  # commits/s, and the CPU spent
    for n in ("1", "8"):
        v = writers.details["s3"][n]
        assert (f"N={n}: {v['records_per_s']:.0f} records/s in {v['publishes_per_s']:.1f} "
                f"commits/s ({v['retries_per_publish']:.2f} lost races per commit)"
                in writers.note)
        cores = v["writers_ms_per_record"] * v["records_per_s"] / 1e3
        text = (f"at N={n} the writers used {cores:.2f} cores "
                f"({v['writers_ms_per_record']:.1f} ms of CPU per record), moto "
                f"{v['server_ms_per_record'] * v['records_per_s'] / 1e3:.2f} "
                f"({v['server_ms_per_record']:.1f} ms)")
        assert text in writers.note, (text, writers.note)
        assert v["server_ms_per_record"] > 0  # moto's own clock: it answered requests
        if sys.platform.startswith("linux"):
            assert f"the machine {v['busy_cores']:.2f} of" in writers.note
        # each writer's requests: at least the pack, segment and manifest of a window and
        # a body's promotion per record
        assert v["requests_per_record"] > 1, v
        assert f"{v['requests_per_record']:.1f} requests per record" in writers.note
    ceiling = writers.details["s3_ceiling"]  # moto's, measured in the same run
    assert ceiling["requests_per_s"] > 0 and ceiling["server_cores"] > 0, ceiling
    allows = ceiling["requests_per_s"] / writers.details["s3"]["8"]["requests_per_record"]
    assert (f"for its cheapest request: {ceiling['requests_per_s']:.0f} requests/s"
            in writers.note)
    assert f"at most {allows:.0f} records/s at N=8's requests per record" in writers.note


@pytest.mark.slow
def test_quick_bench_json_has_the_expected_keys(quick_results: list[Result],
                                                tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench.json"
    path.parent.mkdir()  # a missing directory is refused, as for an export
    write_json(str(path), quick_results, quick=True, wall_s=1.0)
    doc: dict[str, Any] = json.loads(path.read_text())
    assert {"schema", "created", "quick", "command", "machine", "wall_s", "results"} <= set(doc)
    assert doc["schema"] == "poimen-bench/1" and doc["quick"] is True
    assert "--quick" in doc["command"]
    assert {"platform", "cpus", "versions"} <= set(doc["machine"])
    assert [r["name"] for r in doc["results"]] == EXPECTED
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        if r["status"] == "ok":
            assert all(isinstance(r[k], float) and r[k] > 0 for k in ("ours", "reference",
                                                                       "ratio"))
    md = _bench.markdown(quick_results)
    assert md.count("\n") == len(EXPECTED) + 1 and md.startswith("| scenario | ours |")


def test_run_cli_one_scenario_prints_and_writes_json(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    path = tmp_path / "one.json"
    assert run_cli(True, str(path), "Event Objects", str(tmp_path / "work")) == 0
    out = capsys.readouterr().out
    assert "event objects" in out and "met?" in out
    doc = json.loads(path.read_text())
    assert [r["name"] for r in doc["results"]] == ["event_objects"]
    assert doc["results"][0]["status"] == "ok"
    assert list((tmp_path / "work").iterdir()) == []  # the work directory is removed


def test_bench_json_never_writes_through_a_link_nor_makes_a_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before the run (exit 2, one line), and by ``write_json`` itself: a symlink,
    live or dangling, is not followed to a file outside the path named; a missing
    directory is not made; a regular file is replaced whole."""
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    live, dangling = tmp_path / "live.json", tmp_path / "dangling.json"
    live.symlink_to(outside)
    dangling.symlink_to(tmp_path / "made-outside.json")
    for path in (live, dangling, tmp_path / "missing" / "b.json"):
        assert run_cli(True, str(path), "event_objects", str(tmp_path / "work")) == 2
        assert capsys.readouterr().out.startswith("error: bench --json: ")
        with pytest.raises(ValidationError, match="bench --json: "):
            write_json(str(path), [], quick=True)
    assert outside.read_text() == "keep" and not (tmp_path / "made-outside.json").exists()
    assert not (tmp_path / "missing").exists() and not (tmp_path / "work").exists()
    plain = tmp_path / "plain.json"
    plain.write_text("old")
    write_json(str(plain), [], quick=True)
    assert json.loads(plain.read_text())["results"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dangling.json", "live.json", "outside.json", "plain.json"]


def test_run_cli_unknown_scenario_is_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(True, None, "no-such-thing", None) == 2
    assert "no scenario" in capsys.readouterr().out


def test_floor_writer_does_the_format_file_work(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The bare writer beside ``group_commit`` really does the file work it claims, through
    the storage calls a log makes: per window a pack and a segment-sized file, made durable
    (one syncfs, or an fsync each), the manifest put; each body then written to ``blobs/``
    with its own bytes, durable again, the pack and its staging area removed."""
    from poimen_data.storage import _local

    calls: list[tuple[str, str]] = []

    def counted(name: str, method: Any) -> Any:
        def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
            calls.append((name, args[0] if args else ""))
            return method(self, *args, **kw)
        return wrapper

    for name in ("write_new", "put_if_absent", "write", "delete", "delete_tree",
                 "read_or_none"):
        monkeypatch.setattr(_local.LocalStorage, name,
                            counted(name, getattr(_local.LocalStorage, name)))
    monkeypatch.setattr(_local.SyncFsBatch, "sync",
                        counted("syncfs", _local.SyncFsBatch.sync))
    root = tmp_path / "floor"
    d = _floor(str(root), 2)
    assert d.wall > 0 and len(d.lat) == PRODUCERS * 2
    blobs = sorted(root.glob("blobs/acme/*/*"))
    assert len(blobs) == PRODUCERS * 2
    for b in blobs:
        data = b.read_bytes()
        assert len(data) == 4096 and hashlib.sha256(data).hexdigest() == b.name
        assert b.parent.name == b.name[:2]
    manifests = sorted(p.name for p in (root / "_log").iterdir())
    seqs = list(range(1, len(manifests) + 1))
    assert manifests == [f"{seq:020d}.json" for seq in seqs]
    docs = [json.loads((root / "_log" / n).read_text()) for n in manifests]
    assert sorted(sha for doc in docs for sha in doc["blobs"]) == [b.name for b in blobs]
    for seq, doc in zip(seqs, docs, strict=True):  # a segment-sized file per window
        segment = root / "segments" / f"{seq}.arrow"
        assert segment.stat().st_size == SEGMENT_BYTES_PER_RECORD * len(doc["blobs"])
    assert list((root / "_staging").iterdir()) == []
    by = {name: sorted(path for n, path in calls if n == name)
          for name in ("write_new", "put_if_absent", "write", "delete", "delete_tree",
                       "read_or_none")}
    assert by["write_new"] == sorted([f"_staging/{seq}/bodies.pack" for seq in seqs]
                                     + [f"segments/{seq}.arrow" for seq in seqs])
    assert by["put_if_absent"] == [f"_log/{m}" for m in manifests]
    assert by["write"] == sorted(f"blobs/acme/{b.name[:2]}/{b.name}" for b in blobs)
    assert by["delete"] == sorted(f"_staging/{seq}/bodies.pack" for seq in seqs)
    assert by["delete_tree"] == sorted(f"_staging/{seq}" for seq in seqs)
    # after each window's promotion, its look for a next manifest (found for all but one)
    assert by["read_or_none"] == sorted(f"_log/{seq + 1:020d}.json" for seq in seqs)
    if _local._syncfs is not None:  # one for the window's files, one for its bodies
        assert sum(n == "syncfs" for n, _path in calls) == 2 * len(seqs)


def test_busy_cores_counts_at_least_this_process() -> None:
    """The machine's busy cores over a stretch in which this process spins on one core:
    at least the share of a core it got (other processes only add), at most every core.
    ``/proc/stat`` is sampled at each 10 ms tick: the lower bound is halved, so that
    sampling (a spin preempted often on a loaded machine) cannot fail it by chance, while
    a reading of nothing, or of the wrong columns, still does."""
    busy = _BusyCores()
    t0, c0 = time.perf_counter(), time.process_time()
    while time.process_time() - c0 < 0.3:
        pass
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cores = busy.end()
    if not Path("/proc/stat").exists():
        assert cores is None
        return
    assert cores is not None
    assert 0.5 * cpu / wall <= cores <= (os.cpu_count() or 1), (cores, cpu, wall)


def test_a_child_of_the_bench_that_stalls_fails_it_instead_of_stalling_it() -> None:
    """A child started as the bench starts them (unbuffered) that prints two lines at once and
    then waits on its input forever (no sleep: a read that never ends until it is killed):
    both lines are read (nothing left buffered out of ``select``'s sight), the third wait
    ends in ``RuntimeError`` after the timeout, naming what was waited for. The waits run on a
    thread, so that a wait that never ends fails this test instead of hanging it."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('ready\\nmore',"
                              " flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    got: list[Any] = []

    def wait_lines() -> None:
        got.append(_line(child, "a stalled child", timeout=60))
        got.append(_line(child, "a stalled child", timeout=60))  # printed with the first
        t0 = time.monotonic()
        try:
            _line(child, "a stalled child", timeout=0.5)
        except RuntimeError as exc:
            got.append(exc)
        got.append(time.monotonic() - t0)

    waiter = threading.Thread(target=wait_lines, daemon=True)
    try:
        waiter.start()
        waiter.join(timeout=120)
        assert not waiter.is_alive(), "a wait for a line did not end"
        first, second, exc, waited = got
        assert (first, second) == (b"ready\n", b"more\n")
        assert isinstance(exc, RuntimeError)
        assert str(exc) == f"a stalled child: no answer from the child (pid {child.pid}) in 0.5 s"
        assert waited >= 0.4
        assert child.poll() is None  # it was waiting all along
    finally:
        child.kill()
        child.communicate()


def test_requests_are_counted_at_the_http_layer(s3: Any, tmp_path: Path) -> None:
    """What ``s3_writers`` counts per record: every HTTP request the storage sends, from
    any thread, a call that makes several counted for each (a move copies, then
    deletes); none on local disk."""
    import threading
    import uuid

    from conftest import BUCKET

    import poimen_data as pdm

    log = pdm.open_log(f"s3://{BUCKET}/{uuid.uuid4().hex}", storage_options=s3.storage_options)
    st = log.storage
    sent = _count_requests(st)
    assert sent is not None and sent() == 0
    st.write("x/a", b"a")
    assert sent() == 1  # a PUT
    assert st.read_or_none("x/none") is None
    assert sent() == 2  # a GET, answered 404
    st.move("x/a", "x/b")
    moved = sent()
    assert moved == 4, moved  # a copy and a delete
    threads = [threading.Thread(target=st.exists, args=("x/b",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sent() == moved + 8  # a HEAD each
    assert _count_requests(pdm.open_log(str(tmp_path / "local")).storage) is None

