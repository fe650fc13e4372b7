"""A writer process for restart, crash and concurrency tests.

Run as ``python tests/child_writer.py MODE ROOT [ARGS...]``; storage options (for S3)
come as JSON in ``POIMEN_TEST_STORAGE_OPTIONS``. A parent starts it, maybe kills it at a
fault point (``POIMEN_CRASH_AT``), and reopens the log itself.
"""

from __future__ import annotations

import json
import os
import sys
from string import Template

import poimen_data as pdm
from poimen_data import events as E

PROMPT_TEMPLATE = Template(
    "System: you are $role.\nTask: fix the failing test in $path.\n"
    "Context:\n$context\nAnswer in $lang."
)
PROMPT_VARS = {
    "role": "a careful engineer",
    "path": "src/straße/ünïcode.py",
    "context": "déjà vu ✓ — 日本語のテキスト\n" * 2000,
    "lang": "English",
}


def assembled_prompt() -> bytes:
    return PROMPT_TEMPLATE.substitute(PROMPT_VARS).encode()


def big_output() -> bytes:
    return ("output line ✓ λ\n" * 70_000).encode()


def open_root(root: str) -> pdm.EventLog:
    so = os.environ.get("POIMEN_TEST_STORAGE_OPTIONS")
    return pdm.open_log(root, storage_options=json.loads(so) if so else None)


def record_run(log: pdm.EventLog, run_id: str) -> None:
    """One run as an engine would record it: dispatch (prompt) then finish (output)."""
    with log.transaction() as tx:
        tx.append(E.RunStarted("acme", run_id, "wf-1"))
    with log.transaction() as tx:
        p = tx.put_blob("acme", assembled_prompt())
        tx.append(E.AttemptDispatched("acme", run_id, 0, "write", 0, 1, prompt=p,
                                      context=E.ContextPartition(("a", "b"), ("c",), ())))
    with log.transaction() as tx:
        o = tx.put_blob("acme", big_output())
        tx.append(E.AttemptFinished("acme", run_id, 0, "write", 1, "succeeded", output=o))


def crash_commit(log: pdm.EventLog, run_id: str) -> None:
    """One commit with two fresh bodies and a reused one (the fault point may kill us)."""
    with log.transaction() as tx:
        p = tx.put_blob("acme", f"prompt of {run_id} ".encode() * 100)
        o = tx.put_blob("acme", f"output of {run_id} ".encode() * 100)
        tx.append(E.AttemptDispatched("acme", run_id, 0, "s", 0, 1, prompt=p))
        tx.append(E.AttemptFinished("acme", run_id, 0, "s", 1, "failed", output=o))


def hammer(log: pdm.EventLog, who: str, n: int) -> None:
    """``n`` small commits, each with a body of its own and one shared by every writer."""
    for i in range(n):
        with log.transaction() as tx:
            shared = tx.put_blob("acme", b"shared system preamble " * 50)
            own = tx.put_blob("acme", f"{who}-{i}".encode())
            tx.append(E.AttemptDispatched("acme", f"run-{who}", 0, "s", i, 1, prompt=shared))
            tx.append(E.AttemptFinished("acme", f"run-{who}", 0, "s", 1, "succeeded",
                                        output=own))


def paused_commit(log: pdm.EventLog, run_id: str, body: bytes) -> None:
    """Stage (or reuse) ``body``, tell the parent, wait for it, then commit."""
    with log.transaction() as tx:
        ref = tx.put_blob("acme", body)
        tx.append(E.AttemptDispatched("acme", run_id, 0, "s", 0, 1, prompt=ref))
        tx.flush()  # "staged" means on storage: put_blob writes in the background
        sys.stdout.write("staged\n")
        sys.stdout.flush()
        sys.stdin.readline()


def appender(log: pdm.EventLog, who: str, n: int) -> None:
    """``n`` one-event commits (for the compaction race)."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    for i in range(n):
        with log.transaction() as tx:
            tx.append(E.AttemptDispatched("acme", f"run-{who}", 0, "s", i, 1))


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    log = open_root(root)
    if mode == "record":
        record_run(log, sys.argv[3])
    elif mode == "crash":
        crash_commit(log, sys.argv[3])
    elif mode == "hammer":
        who, n = sys.argv[3], int(sys.argv[4])
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        sys.stdin.readline()  # the rendezvous: the parent releases every writer at once
        hammer(log, who, n)
    elif mode == "paused":
        paused_commit(log, sys.argv[3], sys.argv[4].encode())
    elif mode == "append":
        appender(log, sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
