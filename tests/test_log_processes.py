"""Durability across processes: restart, the crash matrix, and concurrent writers.

Children are real processes (tests/child_writer.py); the parent never trusts a warm
in-process cache: it reopens the log from storage.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_writer import PROMPT_TEMPLATE, assembled_prompt, big_output
from conftest import Root, snapshot_files
from typer.testing import CliRunner

import poimen_data as pdm
from poimen_data import cli
from poimen_data import events as E
from poimen_data.log._manifest import blob_path

CHILD = str(Path(__file__).with_name("child_writer.py"))
WRITE_POINTS = ["blob_staged", "segment_written", "manifest_published", "blobs_promoted"]


def _env(root: Root, crash_at: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("POIMEN_CRASH_AT", None)
    if crash_at:
        env["POIMEN_CRASH_AT"] = crash_at
    if root.storage_options:
        env["POIMEN_TEST_STORAGE_OPTIONS"] = json.dumps(root.storage_options)
    return env


def _child(root: Root, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHILD, args[0], root.url, *args[1:]],
                          env=_env(root, crash_at), capture_output=True, timeout=120)


def _assert_consistent(log: pdm.EventLog) -> None:
    """No committed event points at a missing body; nothing uncovered is stored."""
    events = log.read_events()
    covered: set[tuple[str, str]] = set()
    listed_segments: set[str] = set()
    for m in log.manifests():
        covered.update((b.tenant, b.sha256) for b in m.blobs)
        listed_segments.update(s.path for s in m.segments)
    reduced = {(d["tenant"], d["sha256"]) for d in events.column("original").drop_null()
               .to_pylist()}
    for col in ("prompt", "output", "summary"):
        for d in events.column(col).drop_null().to_pylist():
            ref = pdm.BlobRef(d["tenant"], d["sha256"], d["size"])
            assert (ref.tenant, ref.sha256) in covered
            body = log.blobs.get(ref)
            if body is None:  # missing only after a blob_reduced event for it
                assert (ref.tenant, ref.sha256) in reduced
                continue
            assert hashlib.sha256(body).hexdigest() == ref.sha256
    for f in log.storage.walk_files("blobs"):
        _, tenant, _, sha = f.split("/")
        assert (tenant, sha) in covered, f"orphan body {f}"
    assert list(log.storage.walk_files("_staging")) == []
    for f in log.storage.walk_files("segments"):
        assert f in listed_segments, f"orphan segment {f}"
    assert events.column("lsn").to_pylist() == list(range(1, log.head + 1))


def test_restart_reads_back_the_assembled_prompt_and_output(proc_root: Root) -> None:
    res = _child(proc_root, "record", "run-restart")
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    log = proc_root.open()
    events = log.read_events()
    assert events.column("kind").to_pylist() == ["run_started", "attempt_dispatched",
                                                 "attempt_finished"]
    prompt_ref = E.event_from_row(events.slice(1, 1).to_pylist()[0]).prompt
    output_ref = E.event_from_row(events.slice(2, 1).to_pylist()[0]).output
    assert prompt_ref is not None and output_ref is not None
    prompt = log.blobs.get(prompt_ref)
    output = log.blobs.get(output_ref)
    assert prompt == assembled_prompt()
    assert prompt != PROMPT_TEMPLATE.template.encode()
    assert "日本語".encode() in prompt and b"$context" not in prompt
    assert output == big_output() and len(output) > 1_000_000
    assert hashlib.sha256(prompt).hexdigest() == prompt_ref.sha256
    assert hashlib.sha256(output).hexdigest() == output_ref.sha256
    assert (prompt_ref.size, output_ref.size) == (len(prompt), len(output))


@pytest.mark.parametrize("point", WRITE_POINTS)
def test_crash_matrix(proc_root: Root, point: str) -> None:
    log = proc_root.open()
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "run-c", "wf-1"))
    res = _child(proc_root, "crash", "run-c", crash_at=point)
    assert res.returncode == 137, res.stderr.decode()[-2000:]

    reopened = proc_root.open()
    pdm.vacuum(reopened, grace=0, force=True)  # the writer is dead: its files may go now
    after = proc_root.open()
    published = point in ("manifest_published", "blobs_promoted")
    assert after.head == (3 if published else 1)
    _assert_consistent(after)
    if published:
        t = after.read_events()
        refs = [E.event_from_row(r) for r in t.slice(1).to_pylist()]
        assert after.blobs.get(refs[0].prompt) == b"prompt of run-c " * 100
        assert after.blobs.get(refs[1].output) == b"output of run-c " * 100
    else:
        assert list(after.storage.walk_files("blobs")) == []


def test_reader_finds_a_published_body_before_promotion(proc_root: Root) -> None:
    reader = proc_root.open()  # opened before the writer publishes
    res = _child(proc_root, "crash", "run-p", crash_at="manifest_published")
    assert res.returncode == 137
    assert list(reader.storage.walk_files("blobs")) == []  # nothing promoted yet
    assert reader.head == 2
    refs = [E.event_from_row(r) for r in reader.read_events().to_pylist()]
    assert reader.blobs.get(refs[0].prompt) == b"prompt of run-p " * 100
    assert list(reader.storage.walk_files("blobs")) == []  # served from staging
    log = proc_root.open()  # opening rolls forward: now the body is promoted
    assert log.storage.exists(blob_path("acme", refs[0].prompt.sha256))
    assert list(log.storage.walk_files("_staging")) == []
    assert log.blobs.get(refs[1].output) == b"output of run-p " * 100


def test_reads_of_a_root_write_nothing_not_even_a_roll_forward(proc_root: Root,
                                                              tmp_path: Path) -> None:
    """connect, episode, export_live and check given a root open it read-only: a commit
    whose writer died before promoting its bodies stays as it was (its bodies are read from
    staging); only a writer's open rolls it forward."""
    log = proc_root.open()
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", "run-p", "wf-1"))
    pdm.materialize(log)  # a state for check to check
    res = _child(proc_root, "crash", "run-p", crash_at="manifest_published")
    assert res.returncode == 137, res.stderr.decode()[-2000:]
    before = snapshot_files(proc_root.open(read_only=True))
    assert any(f.startswith("_staging/") for f in before)
    assert not any(f.startswith("blobs/") for f in before)
    kw = {"storage_options": proc_root.storage_options}
    with pdm.connect(proc_root.url, source="log", **kw) as con:
        got = con.sql("select blob_text(prompt), blob_text(output) from attempts "
                      "where run_id = 'run-p'").fetchall()
    assert got == [("prompt of run-p " * 100, "output of run-p " * 100)]
    ep = pdm.episode(proc_root.url, "run-p", source="log", **kw)
    assert [a.state for b in ep.branches for a in b.attempts] == ["failed"]
    out = tmp_path / "live.jsonl"
    report = pdm.export_live(proc_root.url, str(out), format="jsonl", source="log", **kw)
    assert report.records == 1 and "output of run-p" in out.read_text()
    assert pdm.check(proc_root.url, **kw).ok
    if proc_root.backend == "local":  # the CLI's reading commands too
        for args in (["sql", "select count(*) from attempts"], ["show", "run-p"], ["check"],
                     ["export", "--out", str(tmp_path / "cli.jsonl")], ["log"]):
            r = CliRunner().invoke(cli.app, [*args, "--root", proc_root.url],
                                   catch_exceptions=False)
            assert r.exit_code == 0, (args, r.output)
    assert snapshot_files(proc_root.open(read_only=True)) == before
    proc_root.open()  # a writer's open rolls the commit forward
    assert any(f.startswith("blobs/") for f in snapshot_files(proc_root.open(read_only=True)))


@pytest.mark.parametrize("n_commits", [25])
def test_four_processes_commit_at_once(proc_root: Root, n_commits: int) -> None:
    proc_root.open()  # create the log once, before the race
    n = n_commits if proc_root.backend == "local" else 8
    procs = [
        subprocess.Popen([sys.executable, CHILD, "hammer", proc_root.url, f"w{i}", str(n)],
                         env=_env(proc_root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
        for i in range(4)
    ]
    for p in procs:  # rendezvous: every writer is open and waiting
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]

    log = proc_root.open()
    total = 4 * n * 2
    assert log.head == total
    events = log.read_events()
    assert sorted(events.column("lsn").to_pylist()) == list(range(1, total + 1))
    assert sorted(set(events.column("seq").to_pylist())) == list(range(1, 4 * n + 1))
    runs = events.column("run_id").to_pylist()
    assert {r: runs.count(r) for r in set(runs)} == {f"run-w{i}": 2 * n for i in range(4)}
    for i in range(4):  # every writer's commits in its own order
        mine = events.filter(
            pa_equal(events, "run_id", f"run-w{i}")).column("step_index").drop_null()
        assert mine.to_pylist() == list(range(n))
    _assert_consistent(log)


def pa_equal(t, col: str, value: str):
    import pyarrow.compute as pc

    return pc.equal(t.column(col), value)
