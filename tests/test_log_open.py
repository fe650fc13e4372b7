"""Opening a log is flat in its length: checkpoints, and no listing of manifests.

The proof is the number of storage calls an open makes (deterministic), on local disk and on
S3; ``poimen bench`` measures the time ratio.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import BUCKET, S3Endpoint

import poimen_data as pdm
from poimen_data import events as E

N_BIG = 10_000


def _fill(log: pdm.EventLog, n: int) -> None:
    for i in range(n):
        with log.transaction() as tx:
            tx.append(E.RunStarted("acme", f"r{i}", "wf"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A log of 10,000 commits and one of 10, written through the real commit path."""
    d = tmp_path_factory.mktemp("open")
    _fill(pdm.open_log(str(d / "big"), durable=False), N_BIG)
    _fill(pdm.open_log(str(d / "small"), durable=False), 10)
    return d / "big", d / "small"


def _open_calls(url: str, storage_options: dict | None = None) -> tuple[int, int]:
    log = pdm.open_log(url, storage_options=storage_options, create=False)
    return log.head, sum(log.storage.calls.values())


def test_open_local_reads_as_little_for_10000_commits_as_for_10(built: tuple[Path, Path]) -> None:
    big, small = built
    head_big, calls_big = _open_calls(str(big))
    head_small, calls_small = _open_calls(str(small))
    assert (head_big, head_small) == (N_BIG, 10)
    # small: config, pointer miss, 10 manifests, a probe, staging list, the probe of .head
    assert calls_small == 15
    # big: config, pointer, checkpoint, its segment lists' sizes, a probe, staging list,
    # .head; checkpoint 10,000 names three lists (6,400 + 3,200 + 400 segments: the
    # binary digits of its 100 checkpoints, see poimen_data/log/_lists.py)
    assert _list_rows(big) == [6400, 3200, 400]
    assert calls_big == 6 + 3
    log = pdm.open_log(str(big))
    assert log.read_events().column("run_id").to_pylist()[-3:] == ["r9997", "r9998", "r9999"]


def _list_rows(root: Path) -> list[int]:
    """The rows of each segment list the pointer's checkpoint names, in order."""
    import json

    import pyarrow as pa

    seq = json.loads((root / "_log/_last_checkpoint.json").read_bytes())["seq"]
    doc = json.loads((root / f"_log/{seq:020d}.checkpoint.json").read_bytes())
    return [pa.ipc.open_file(pa.py_buffer((root / e["path"]).read_bytes())).read_all().num_rows
            for e in doc["segment_lists"]]


def _upload(s3: S3Endpoint, local: Path, prefix: str) -> None:
    """Copy a log's files into the moto server's bucket through its Python API (an HTTP PUT
    per file would take minutes); the log is then read over HTTP like any S3 log."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for dirpath, _dirs, files in os.walk(local):
        for name in files:
            path = Path(dirpath) / name
            key = f"{prefix}/{path.relative_to(local).as_posix()}"
            backend.put_object(BUCKET, key, path.read_bytes())


def test_open_s3_reads_as_little_for_10000_commits_as_for_10(
    built: tuple[Path, Path], s3: S3Endpoint
) -> None:
    big, small = built
    prefix = os.urandom(6).hex()
    _upload(s3, big, f"{prefix}/big")
    _upload(s3, small, f"{prefix}/small")
    head_big, calls_big = _open_calls(f"s3://{BUCKET}/{prefix}/big", s3.storage_options)
    head_small, calls_small = _open_calls(f"s3://{BUCKET}/{prefix}/small", s3.storage_options)
    assert (head_big, head_small) == (N_BIG, 10)
    assert (calls_big, calls_small) == (6 + 3, 15)
    log = pdm.open_log(f"s3://{BUCKET}/{prefix}/big", storage_options=s3.storage_options)
    assert log.read_events(at_lsn=5).column("run_id").to_pylist() == [f"r{i}" for i in range(5)]
