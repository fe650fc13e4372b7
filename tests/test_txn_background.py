"""The background work of a transaction (bodies and segments written on the I/O pool, big
tables checked on a thread) survives fork and interpreter shutdown, and stays bounded."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

import poimen_data as pdm
from poimen_data import events as E
from poimen_data import synth
from poimen_data.log._txn import BACKGROUND_CHECK_ROWS, MAX_IO_IN_FLIGHT

TS = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _commit_body_and_table(root: str, who: str, table: pa.Table) -> int:
    log = pdm.open_log(root)
    with log.transaction() as tx:
        ref = tx.put_blob("acme", f"body of {who}".encode())
        tx.append(E.RunStarted("acme", who, "wf-1", ts=TS))
        tx.append(E.AttemptDispatched("acme", who, 0, "s", 0, 1, prompt=ref, ts=TS))
    with log.transaction() as tx:
        tx.extend(table)  # big: checked on the check pool, segment on the I/O pool
    return log.head


def _child(root: str, table: pa.Table, conn: mp.connection.Connection) -> None:
    conn.send(_commit_body_and_table(root, "child", table))


def test_a_forked_child_commits_with_its_own_pools(tmp_path: Path) -> None:
    table = synth.events_table(BACKGROUND_CHECK_ROWS + 100, seed=4)
    root = str(tmp_path / "log")
    assert _commit_body_and_table(root, "parent", table) == table.num_rows + 2  # pools up
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_child, args=(root, table, theirs))
    p.start()
    try:
        assert ours.poll(120), "the forked child never finished its commits"
        assert ours.recv() == 2 * (table.num_rows + 2)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    events = pdm.open_log(root).read_events()
    assert events.num_rows == 2 * (table.num_rows + 2)
    child_attempt = table.num_rows + 3  # after the parent's two commits, the child's 2nd row
    ref = E.BlobRef(**events.column("prompt")[child_attempt].as_py())
    assert pdm.open_log(root).blobs.get(ref) == b"body of child"


def test_a_commit_during_interpreter_shutdown_writes_inline(tmp_path: Path) -> None:
    """A non-daemon thread that commits after the main thread returned (the pools refuse
    new work then) still commits. The gate opens after concurrent.futures shut down:
    threading's exit hooks run in reverse order of registration, and ours is first."""
    root = tmp_path / "log"
    script = textwrap.dedent(f"""
        import sys, threading
        assert "concurrent.futures.thread" not in sys.modules
        gate = threading.Event()
        threading._register_atexit(gate.set)   # runs after concurrent.futures' own hook
        import poimen_data as pdm
        from poimen_data import events as E
        log = pdm.open_log({str(root)!r})

        def late():
            gate.wait()
            with log.transaction() as tx:
                ref = tx.put_blob("acme", b"late body")
                tx.append(E.RunStarted("acme", "late", "wf-1"))
                tx.append(E.AttemptDispatched("acme", "late", 0, "s", 0, 1, prompt=ref))
            print("head", log.head)

        threading.Thread(target=late).start()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "head 2", "")
    log = pdm.open_log(str(root))
    ref = E.BlobRef(**log.read_events().column("prompt")[1].as_py())
    assert log.blobs.get(ref) == b"late body"


def test_bodies_in_flight_are_bounded_per_transaction(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    most = 0
    with log.transaction() as tx:
        refs = []
        for i in range(200):
            refs.append(tx.put_blob("acme", f"body {i}".encode() * 400))
            most = max(most, len(tx._io))
        tx.append(E.RunStarted("acme", "r", "wf-1", ts=TS))
        for j, ref in enumerate(refs):
            tx.append(E.AttemptDispatched("acme", "r", 0, f"s{j}", j, 1, prompt=ref, ts=TS))
    assert most == MAX_IO_IN_FLIGHT
    assert log.head == 201
    assert [log.blobs.get(r) for r in refs] == [f"body {i}".encode() * 400 for i in range(200)]
