"""A process recording through a group-commit recorder until it is killed (crash tests).

Run as ``python tests/child_recorder.py ROOT N_PRODUCERS``; storage options (for S3) come
as JSON in ``POIMEN_TEST_STORAGE_OPTIONS``. Each producer records runs of two events (a
start and a dispatch with a 4 KB prompt of its own), one after the other. When a record's
future resolves, the line ``RUN SEQ FIRST_LSN LAST_LSN`` goes to stdout (flushed) before
anything else happens on that thread: the parent knows every resolved record.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import Future

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log._recorder import Recorder

_OUT = threading.Lock()


def prompt(run_id: str) -> bytes:
    return (f"prompt of {run_id} ".encode() * 300)[:4096]


def record_run(rec: Recorder, run_id: str) -> Future[pdm.CommitInfo]:
    body = prompt(run_id)
    ref = rec.ref("acme", body)
    return rec.record([E.RunStarted("acme", run_id, "wf-1"),
                       E.AttemptDispatched("acme", run_id, 0, "s", 0, 1, prompt=ref)],
                      blobs={ref: body})


def main() -> None:
    root, n = sys.argv[1], int(sys.argv[2])
    so = os.environ.get("POIMEN_TEST_STORAGE_OPTIONS")
    log = pdm.open_log(root, storage_options=json.loads(so) if so else None)
    rec = log.recorder(max_delay_ms=2)

    def report(run_id: str, fut: Future[pdm.CommitInfo]) -> None:
        if fut.exception() is None:
            info = fut.result()
            with _OUT:
                sys.stdout.write(f"{run_id} {info.seq} {info.first_lsn} {info.last_lsn}\n")
                sys.stdout.flush()

    def producer(p: int) -> None:
        for k in range(10_000):
            run_id = f"r{p}-{k}"
            fut = record_run(rec, run_id)
            fut.add_done_callback(lambda f, r=run_id: report(r, f))
            fut.result()

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
