"""``poimen bench --quick`` runs in the suite: every scenario reports a number.

Never asserts a timing (the machines are shared and noisy): only that each scenario ran,
produced finite positive figures, and that the JSON carries what the README's table and
later comparisons read. A scenario may say "n/a" only when its module is really missing.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from poimen_data.bench import _runner as _bench
from poimen_data.bench._recorder import PRODUCERS, ROLES, _floor
from poimen_data.bench._runner import Result, run, run_cli, scenario_names, write_json

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
    # ... and the floor under it: the same producers, a bare writer, no events
    floor = group.details["floor_events_per_s"]
    assert math.isfinite(floor) and floor > 0
    assert f"ours at {group.ours / floor:.0%} of it" in group.note
    writers = quick_results[EXPECTED.index("s3_writers")]  # the CPU a record costs
    w = {n: writers.details["s3"][n]["writers_ms_per_record"] for n in ("1", "8")}
    assert all(math.isfinite(v) and v > 0 for v in w.values()), w
    assert f"(all threads): N=1 {w['1']:.1f} ms, N=8 {w['8']:.1f} ms" in writers.note
    if sys.platform.startswith("linux"):  # ... and moto's, in its own process
        ms = {n: writers.details["s3"][n]["server_ms_per_record"] for n in ("1", "8")}
        assert all(math.isfinite(v) and v > 0 for v in ms.values()), ms
        assert f"(its own process): N=1 {ms['1']:.1f} ms, N=8 {ms['8']:.1f} ms" in writers.note


@pytest.mark.slow
def test_quick_bench_json_has_the_expected_keys(quick_results: list[Result],
                                                tmp_path: Path) -> None:
    path = tmp_path / "out" / "bench.json"
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


def test_run_cli_unknown_scenario_is_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(True, None, "no-such-thing", None) == 2
    assert "no scenario" in capsys.readouterr().out


def test_floor_writer_does_the_format_file_work(tmp_path: Path) -> None:
    """The bare writer under ``group_commit`` (the floor the note compares with) really
    writes what it claims: every body in its own file under ``blobs/`` with its own
    bytes, the manifests in ``_log/`` naming them all (no temp file left), every pack and
    staging area removed."""
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
    assert manifests and all(n.endswith(".json") for n in manifests)
    named = [sha for n in manifests
             for sha in json.loads((root / "_log" / n).read_text())["blobs"]]
    assert sorted(named) == [b.name for b in blobs]
    assert list((root / "_staging").iterdir()) == []
