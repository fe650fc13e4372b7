"""vacuum beside a writer it cannot see in the manifests: a materialize between writing
its pending state files and publishing them. The test puts vacuum at that very instant (a
hook at the step, in this process: a rendezvous, not a sleep) and checks what the docs
promise: a grace under ``WRITER_ACTIVE_S`` is refused, a forced one makes the materialize
fail before it publishes, and the state served is never left naming a missing file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.fold import _state


def _runs(log: pdm.EventLog, first: int, n: int) -> None:
    for i in range(first, first + n):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"run-{i}", "wf"))
            tx.append(E.AttemptDispatched("acme", f"run-{i}", 0, "s", 0, 1))
            tx.append(E.AttemptFinished("acme", f"run-{i}", 0, "s", 1, "failed"))


def _served(log: pdm.EventLog) -> list[tuple[Any, ...]]:
    with pdm.connect(log, source="state") as con:
        return con.sql("select run_id, state, n_attempts from runs order by 1").fetchall()


def test_vacuum_refuses_a_live_materialize_and_a_forced_one_publishes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = pdm.open_log(tmp_path / "log")
    _runs(log, 0, 5)
    pdm.materialize(log)
    before = _state.read_pointer(log)
    _runs(log, 5, 3)
    real = _state._publish
    forced: list[int] = []

    def vacuum_first(*args: Any) -> Any:  # the pending files are written, not published
        with pytest.raises(pdm.WritersActive, match="state/_pending/"):
            pdm.vacuum(log, grace=0)
        forced.append(pdm.vacuum(log, grace=0, force=True).state_files_removed)
        return real(*args)

    monkeypatch.setattr(_state, "_publish", vacuum_first)
    with pytest.raises(pdm.PoimenError, match=r"materialize: \d+ of its new state files "
                                              r"were removed while it ran .*nothing was "
                                              r"published, run it again"):
        pdm.materialize(log)
    assert forced and forced[0] > 0
    monkeypatch.undo()
    assert _state.read_pointer(log) == before and pdm.check(log).ok  # the state before
    report = pdm.materialize(log)
    assert report.lsn == log.head and pdm.check(log).ok
    assert len(_served(log)) == 8


def test_a_full_materialize_writes_again_a_state_file_that_is_gone(tmp_path: Path) -> None:
    """full=True is the repair (README): it rewrote only files the old pointer did not
    name, so a named file deleted by hand stayed missing and check failed for good."""
    root = tmp_path / "log"
    log = pdm.open_log(root)
    _runs(log, 0, 6)
    pdm.materialize(log)
    want = _served(log)
    ptr = _state.read_pointer(log)
    assert ptr is not None
    victim = ptr.tables["runs"][0].path
    (root / victim).unlink()
    assert not pdm.check(log).ok
    report = pdm.materialize(log, full=True)
    assert report.full and report.files_written >= 1
    assert (root / victim).is_file()
    assert pdm.check(log).ok and _served(log) == want



def test_a_pending_folder_goes_whole_once_its_newest_file_is_older_than_grace(
        tmp_path: Path) -> None:
    """A materialize publishes right after writing its last pending file: vacuum judges its
    folder by that newest file, so a folder whose first files are old but whose last is
    fresh (a long materialize about to publish) is left whole."""
    import os
    import subprocess
    import sys
    import time

    root = tmp_path / "log"
    log = pdm.open_log(root)
    _runs(log, 0, 4)
    pdm.materialize(log)
    _runs(log, 4, 2)
    env = dict(os.environ, POIMEN_CRASH_AT="state_written")  # dies just before publishing
    res = subprocess.run([sys.executable, "-c", "import sys, poimen_data as p; "
                          "p.materialize(p.open_log(sys.argv[1]))", str(root)],
                         env=env, capture_output=True, timeout=120)
    assert res.returncode == 137, res.stderr.decode()[-2000:]
    pending = sorted(p for p in root.joinpath("state", "_pending").rglob("*") if p.is_file())
    assert len(pending) >= 2
    hour_ago = time.time() - 3600
    for p in pending[:-1]:
        os.utime(p, (hour_ago, hour_ago))
    assert pdm.vacuum(log, grace=60).state_files_removed == 0
    assert sorted(p for p in root.joinpath("state", "_pending").rglob("*")
                  if p.is_file()) == pending
    os.utime(pending[-1], (hour_ago, hour_ago))
    assert pdm.vacuum(log, grace=60).state_files_removed == len(pending)
    assert not any(p.is_file() for p in root.joinpath("state", "_pending").rglob("*"))
    assert pdm.check(log).ok
