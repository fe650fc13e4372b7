"""The README's "Storage format" is enough to read a log: an independent reader, written
from that section with pyarrow, json and hashlib only, must give exactly the ``events``
view on logs with checkpoints, compactions, reductions and blob-only commits, with and
without the checkpoint pointer; and the README's event-schema table equals the code's."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.testing import record_run

README = Path(__file__).resolve().parents[1] / "README.md"


# --- the independent reader: pyarrow, json, hashlib; nothing from poimen_data ----------


class Damaged(Exception):
    pass


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")


def _read(root: str, rel: str) -> bytes | None:
    try:
        with open(os.path.join(root, rel), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _doc(data: bytes, name: str) -> dict[str, Any]:
    """A JSON document checked as the README says: checksum, format, version."""
    try:
        doc = json.loads(data)
    except ValueError:
        raise Damaged(f"{name}: not JSON") from None
    if not isinstance(doc, dict) or "checksum" not in doc:
        raise Damaged(f"{name}: no checksum")
    body = {k: v for k, v in doc.items() if k != "checksum"}
    if hashlib.sha256(_canonical(body)).hexdigest() != doc["checksum"]:
        raise Damaged(f"{name}: checksum")
    if doc.get("format") != "poimen-log" or doc.get("version") != 1:
        raise Damaged(f"{name}: format")
    return doc


def _checked_file(root: str, rel: str, size: int, sha256: str) -> bytes:
    data = _read(root, rel)
    if data is None or len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise Damaged(f"{rel}: size or sha256")
    return data


def _from_checkpoint(root: str) -> tuple[int, int, dict[str, dict[str, Any]]]:
    """Step 1: (seq, lsn, live segments by path) from the pointer, or nothing."""
    try:
        ptr_raw = _read(root, "_log/_last_checkpoint.json")
        if ptr_raw is None:
            raise Damaged("no pointer")
        seq = _doc(ptr_raw, "pointer")["seq"]
        name = f"_log/{seq:020d}.checkpoint.json"
        raw = _read(root, name)
        if raw is None:
            raise Damaged(f"{name}: missing")
        cp = _doc(raw, name)
        rows = []
        for sl in cp["segment_lists"]:  # their rows, one list after the other
            data = _checked_file(root, sl["path"], sl["size"], sl["sha256"])
            rows += pa.ipc.open_file(pa.py_buffer(data)).read_all().to_pylist()
        assert [r["first_lsn"] for r in rows] == sorted(r["first_lsn"] for r in rows)
        return cp["seq"], cp["lsn"], {r["path"]: r for r in rows}
    except Damaged:
        return 0, 0, {}


def spec_read(root: str) -> pa.Table:
    """Every event of the log under the local ``root``, in LSN order, as the README says."""
    seq, lsn, segments = _from_checkpoint(root)
    while True:  # step 2: probe the next manifest until one is missing
        name = f"_log/{seq + 1:020d}.json"
        raw = _read(root, name)
        if raw is None:
            break
        m = _doc(raw, name)
        assert m["seq"] == seq + 1
        assert m["first_lsn"] == lsn + 1
        assert m["last_lsn"] == m["first_lsn"] + m["n_events"] - 1
        for p in m["supersedes"]:
            segments.pop(p, None)
        for s in m["segments"]:
            segments[s["path"]] = s
        seq, lsn = m["seq"], m["last_lsn"]
    tables = []
    for s in sorted(segments.values(), key=lambda s: s["first_lsn"]):  # step 3
        if not s["rows"]:
            continue
        data = _checked_file(root, s["path"], s["size"], s["sha256"])
        t = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        assert t.num_rows == s["rows"]
        if s["has_lsn"]:  # the entry's first_lsn and seq are its first row's
            assert (t.column("lsn")[0].as_py(), t.column("seq")[0].as_py()) == (
                s["first_lsn"], s["seq"])
        else:
            n = t.num_rows
            t = t.add_column(0, pa.field("seq", pa.int64(), nullable=False),
                             pa.array([s["seq"]] * n, pa.int64()))
            t = t.add_column(0, pa.field("lsn", pa.int64(), nullable=False),
                             pa.array(range(s["first_lsn"], s["first_lsn"] + n), pa.int64()))
        tables.append(t)
    if not tables:
        return pa.table({})
    out = pa.concat_tables(tables)
    assert out.column("lsn").to_pylist() == list(range(1, lsn + 1))
    return out


def spec_body(root: str, ref: dict[str, Any]) -> bytes | None:
    """Step 4 for a promoted body: its file, checked against the ref's sha256."""
    data = _read(root, f"blobs/{ref['tenant']}/{ref['sha256'][:2]}/{ref['sha256']}")
    if data is not None:
        assert hashlib.sha256(data).hexdigest() == ref["sha256"]
    return data


# --- the logs it must read ----------------------------------------------------------------


def _events_view(log: pdm.EventLog) -> pa.Table:
    con = pdm.connect(log)
    try:
        return con.sql("select * from events order by lsn").to_arrow_table()
    finally:
        con.close()


def _busy_log(root: str, *, interval: int, runs: int) -> pdm.EventLog:
    """Many small commits, blob-only commits, a reduction, a compaction, more commits."""
    log = pdm.open_log(root, checkpoint_interval=interval, durable=False)
    refs = []
    for i in range(runs):
        record_run(log, f"r-{i:03d}", [("plan", ["succeeded"]), ("code", ["failed", "succeeded"])],
                   tenant="acme" if i % 3 else "beta",
                   prompt=f"prompt {i} — naïve café ✓".encode())
        if i % 7 == 0:
            refs.append(log.blobs.put("acme", f"blob-only {i}".encode()))  # kind "blobs"
    out = [e for e in log.read_events().to_pylist()
           if e["kind"] == "attempt_finished" and e["output"]]
    victims = [E.BlobRef(**out[k]["output"]) for k in (0, 5)]
    pdm.reduce(log, victims, lambda b: b"summary: " + b[:8])
    pdm.compact(log, target_rows=64)
    for i in range(runs, runs + 3):
        record_run(log, f"r-{i:03d}", [("plan", ["succeeded"])], verifying=False)
    with log.transaction() as tx:
        tx.append(E.RunCancelled("acme", "r-000", reason="ärger: über 9000"))
    log.flush()
    return log


@pytest.mark.parametrize("interval,runs", [(100, 110), (5, 23)])
def test_reader_equals_events_view(tmp_path: Path, interval: int, runs: int) -> None:
    root = str(tmp_path / "log")
    log = _busy_log(root, interval=interval, runs=runs)
    kinds = {json.loads(p.read_bytes())["kind"] for p in (tmp_path / "log/_log").glob("0*.json")
             if "checkpoint" not in p.name}
    assert kinds == {"append", "blobs", "compact"}
    assert (tmp_path / "log/_log/_last_checkpoint.json").exists()
    assert list((tmp_path / "log/_log").glob("*.checkpoint.segments.*.arrow"))
    want = _events_view(log)
    got = spec_read(root)
    assert got.schema == E.LOG_SCHEMA
    assert got.to_pylist() == want.to_pylist()
    cp_seq = json.loads((tmp_path / "log/_log/_last_checkpoint.json").read_bytes())["seq"]
    assert _from_checkpoint(root)[0] == cp_seq  # the checkpoint read, not passed over
    cp = json.loads((tmp_path / f"log/_log/{cp_seq:020d}.checkpoint.json").read_bytes())
    assert [len(r) for r in cp["reduced"]] == [3, 3] and cp["recommitted"] == []

    # the pointer is a hint: without it, or damaged, the reader starts from seq 1
    ptr = tmp_path / "log/_log/_last_checkpoint.json"
    saved = ptr.read_bytes()
    ptr.unlink()
    assert spec_read(root).to_pylist() == want.to_pylist()
    ptr.write_bytes(saved[:-5] + b"0000}")
    assert spec_read(root).to_pylist() == want.to_pylist()
    ptr.write_bytes(saved)
    # a damaged segment list of the checkpoint is not trusted either (its first, maybe
    # written by an earlier checkpoint)
    seg = tmp_path / "log" / cp["segment_lists"][0]["path"]
    seg.write_bytes(seg.read_bytes()[:-1] + b"\0")
    assert spec_read(root).to_pylist() == want.to_pylist()


def test_reader_checks_bodies_and_reductions(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    log = _busy_log(root, interval=5, runs=12)
    events = spec_read(root).to_pylist()
    reduced = {(e["original"]["tenant"], e["original"]["sha256"])
               for e in events if e["kind"] == "blob_reduced"}
    assert len(reduced) == 2
    n = 0
    for e in events:
        for col in ("prompt", "output", "summary"):
            ref = e[col]
            if ref is None or (ref["tenant"], ref["sha256"]) in reduced:
                continue
            body = spec_body(root, ref)
            assert body == log.blobs.get(E.BlobRef(**ref))
            n += 1
    assert n > 40
    for t, sha in reduced:  # gone after the reduction, as the README says
        assert spec_body(root, {"tenant": t, "sha256": sha}) is None


def test_reader_verifies_every_file_it_trusts(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    _busy_log(root, interval=5, runs=8)
    shutil.copytree(root, tmp_path / "copy")
    for p in (tmp_path / "log/_log").glob("0*.json"):
        doc = p.read_bytes()
        raw = json.loads(doc)
        body = {k: v for k, v in raw.items() if k != "checksum"}
        assert _canonical(raw) == doc  # the bytes are canonical, as documented
        assert hashlib.sha256(_canonical(body)).hexdigest() == raw["checksum"]
        if raw.get("kind") in ("blobs", "compact"):
            assert raw["n_events"] == 0 and raw["last_lsn"] == raw["first_lsn"] - 1
            assert raw["extra"] == {}
    last = max((tmp_path / "copy/_log").glob("0*[0-9].json"))
    seg = tmp_path / "copy" / json.loads(last.read_bytes())["segments"][0]["path"]
    seg.write_bytes(seg.read_bytes()[:-1] + b"\1")
    with pytest.raises(Damaged):
        spec_read(str(tmp_path / "copy"))


def test_checksum_json_writes_non_ascii_raw() -> None:
    from poimen_data.log._manifest import dumps, loads

    doc = {"format": "poimen-log", "version": 1, "extra": {"note": "naïve ✓ 日本"}}
    data = dumps(doc)
    assert "日本".encode() in data  # raw UTF-8, not \u escapes
    assert _doc(data, "x")["extra"] == doc["extra"]
    mine = dict(doc, checksum=hashlib.sha256(_canonical(doc)).hexdigest())
    assert loads(_canonical(mine), "mine")["extra"] == doc["extra"]


def test_readme_event_schema_table_equals_code() -> None:
    text = README.read_text()
    block = re.search(r"<!-- event-schema:start -->\n(.*?)<!-- event-schema:end -->", text,
                      flags=re.S)
    assert block is not None
    rows = [line for line in block.group(1).splitlines() if line.startswith("| `")]
    want = [f"| `{f.name}` | `{f.type}` | {'yes' if f.nullable else 'no'} |"
            for f in E.EVENT_SCHEMA]
    assert rows == want


def test_readme_event_kinds_table_equals_code() -> None:
    from poimen_data.model._events import KIND_COLUMNS, KINDS

    block = re.search(r"<!-- event-kinds:start -->\n(.*?)<!-- event-kinds:end -->",
                      README.read_text(), flags=re.S)
    assert block is not None
    rows = [line for line in block.group(1).splitlines() if line.startswith("| `")]
    want = []
    for k in KINDS:
        cols = [c for c in E.EVENT_SCHEMA.names if c in KIND_COLUMNS[k] and c != "tenant"]
        want.append(f"| `{k}` | {', '.join(f'`{c}`' for c in cols)} |")
    assert rows == want
