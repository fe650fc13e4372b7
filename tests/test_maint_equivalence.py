"""Compaction and vacuum change no answer: every view and every episode, by digest."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
from conftest import Root

import poimen_data as pdm
from poimen_data import synth
from poimen_data.fold._fold import VIEWS, fold_tables
from poimen_data.fold._state import parquet_bytes


def _digests(log: pdm.EventLog, at_lsn: int | None = None) -> dict[str, str]:
    tables = fold_tables(log.read_events(at_lsn=at_lsn))
    out = {name: hashlib.sha256(parquet_bytes(tables[name])).hexdigest() for name in VIEWS}
    lsn = log.head if at_lsn is None else at_lsn
    for run_id in sorted(set(tables["runs"].column("run_id").to_pylist())):
        view = pdm.episode(log, run_id, all_branches=True, at_lsn=lsn, source="log")
        out[f"episode:{run_id}"] = hashlib.sha256(view.serialize()).hexdigest()
    return out


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_views_and_episodes_identical_after_compact_and_vacuum(
    backend: str, tmp_path: Path
) -> None:
    url = str(tmp_path / "log") if backend == "local" else f"memory://eq-{uuid.uuid4().hex}"
    root = Root(url, None, backend)
    log = root.open()
    summary = synth.generate(log, runs=8, seed=7, batch=1)
    assert summary.commits > 100, summary.commits  # many small commits: what compaction is for
    mid = log.head // 2
    before, before_mid = _digests(log), _digests(log, mid)
    assert len([k for k in before if k.startswith("episode:")]) == 8

    rep = pdm.compact(log, target_rows=1000)
    assert rep.rewritten > 100 and rep.segments_after < 10
    assert _digests(root.open()) == before
    assert _digests(root.open(), mid) == before_mid

    v = pdm.vacuum(root.open(), grace=0)
    assert v.segments_removed == rep.rewritten
    fresh = root.open()
    assert _digests(fresh) == before
    assert _digests(fresh, mid) == before_mid
