"""The scheduled batch chain (``python -m pipelines.nightly``) and its stages alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import poimen_data as pdm
from pipelines import nightly
from poimen_data import synth
from poimen_data.jobs import chain as stages


@pytest.fixture
def root(tmp_path: Path) -> str:
    r = str(tmp_path / "log")
    synth.generate(r, runs=25, seed=4, batch=1)
    return r


def test_the_whole_chain_with_a_summary(root: str, tmp_path: Path, capsys) -> None:
    log = pdm.open_log(root, create=False)
    segments_before = len(log.segments())
    out = str(tmp_path / "exports")
    code = nightly.main(["--root", root, "--out", out, "--json"])
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(results) == list(stages.STAGES)
    assert results["compact"]["status"] == "ok"
    assert results["compact"]["data"]["segments_before"] == segments_before
    assert results["compact"]["data"]["segments_after"] == 1
    assert results["grade"]["status"] == "ok"
    verifying = pdm.connect(log).sql(
        "select count(*) from runs where state = 'verifying'").fetchall()[0][0]
    assert results["grade"]["data"]["runs_graded"] == verifying
    head = pdm.open_log(root, create=False).head
    assert results["materialize"]["status"] == "ok"
    assert results["materialize"]["data"]["lsn"] == results["materialize"]["data"]["head"] == head
    assert results["export"]["status"] == "ok"
    assert Path(out, "live.jsonl").stat().st_size > 0
    assert Path(out, "live.parquet").stat().st_size > 0
    assert results["check"]["status"] == "ok"
    assert results["check"]["detail"].startswith(f"state at lsn {head} equals a cold re-fold")
    assert code == 0


def test_tables_for_people(root: str, capsys) -> None:
    assert nightly.main(["--root", root, "--stages", "materialize"]) == 0
    text = capsys.readouterr().out
    assert "materialize: ok" in text and f"nightly on {root}" in text


def test_each_stage_alone(root: str) -> None:
    log = pdm.open_log(root, create=False)
    r = stages.materialize(log)
    assert (r.status, r.data["lsn"], r.data["full"]) == ("ok", log.head, True)
    assert r.detail.startswith(f"state covers LSN {log.head} (head {log.head}): full rebuild, ")
    r = stages.materialize(log)
    assert r.detail == f"state covers LSN {log.head} (head {log.head}): already current"
    r = stages.grade(log)
    assert r.status == "ok" and r.data["verdicts_recorded"] == 2 * r.data["runs_graded"]
    r = stages.grade(log)  # already graded at these snapshots: nothing new
    assert r.status == "ok" and r.data["verdicts_recorded"] == 0


def test_a_failed_stage_does_not_stop_the_chain(root: str, capsys) -> None:
    code = nightly.main(["--root", root, "--stages", "export,materialize", "--out",
                         "nosuchproto://x", "--json"])
    results = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [(r["name"], r["status"]) for r in results] == [("export", "failed"),
                                                           ("materialize", "ok")]
    assert "\n" not in results[0]["detail"]


def test_bad_arguments_exit_2(root: str, tmp_path: Path, capsys) -> None:
    assert nightly.main(["--root", root, "--stages", "materialize,dance"]) == 2
    assert capsys.readouterr().err == (
        "error: unknown stage 'dance'; stages are compact, grade, materialize, check, "
        "export\n")
    missing = str(tmp_path / "none")
    assert nightly.main(["--root", missing]) == 2
    assert capsys.readouterr().err == f"error: no poimen log at {missing}\n"
    assert nightly.main(["--root", root, "--verifier", "nomodule_xyz:f"]) == 2
    assert capsys.readouterr().err.startswith("error: No module named 'nomodule_xyz'")


def test_runs_as_a_module(root: str) -> None:
    p = subprocess.run([sys.executable, "-m", "pipelines.nightly", "--root", root,
                        "--stages", "materialize", "--json"], capture_output=True, text=True,
                       check=False, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)[0]["status"] == "ok"
