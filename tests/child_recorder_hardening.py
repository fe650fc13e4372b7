"""Recorder cases that hung for ever before they were mended, each run in its own process
(``python tests/child_recorder_hardening.py KIND ROOT``, KIND one of emfile, callback,
fork, stopped, committer, room) so that a regression fails by the parent's timeout instead of
hanging the suite; prints its findings as JSON lines for ``test_recorder.py`` to compare.
"""

import errno
import json
import os
import resource
import signal
import sys
import threading

import poimen_data as pdm
from poimen_data import events as E
from poimen_data.log._recorder import blob_ref


def attempt(run):
    body = f"prompt of {run} ".encode() * 50
    ref = blob_ref("acme", body)
    return [E.AttemptDispatched("acme", run, 0, "s", 0, 1, prompt=ref)], {ref: body}

def outcome(call):
    try:
        got = call()
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if got is None else str(got)

def exhaust():
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return held

def watch_joins(log):
    """An event set each time a record with a body joins a window (its future is running
    then): the gatherer's transactions report each body staged."""
    joined = threading.Event()
    opened = log.transaction
    def transaction():
        tx = opened()
        put = tx.put_checked
        def put_checked(*args, **kw):
            ref = put(*args, **kw)
            joined.set()
            return ref
        tx.put_checked = put_checked
        return tx
    log.transaction = transaction
    return joined

log = pdm.open_log(sys.argv[2])
kind = sys.argv[1]
if kind == "emfile":
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (512, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    tried = threading.Event()  # the gatherer tried to open syncfs's descriptor
    refused = []
    opened = log.storage.durable_batch
    def durable_batch():
        try:
            return opened()
        except OSError as exc:
            refused.append(exc.errno == errno.EMFILE)
            raise
        finally:
            tried.set()
    log.storage.durable_batch = durable_batch
    out = {}
    with log.recorder(max_delay_ms=10**9) as rec:
        def record(run):
            evs, blobs = attempt(run)
            out[run] = rec.record(evs, blobs=blobs)
        record("before")
        rec.flush()
        log.flush()  # its promotion done before the descriptors run out
        held = exhaust()
        tried.clear()
        record("during")  # no descriptor for syncfs, nor for any file of the window
        rec.flush()
        for fd in held:
            os.close(fd)
        held = exhaust()
        tried.clear()
        record("a")
        assert tried.wait(timeout=60)  # its window opened without syncfs's descriptor
        for fd in held:  # ... and has descriptors again for its files
            os.close(fd)
        record("b")
        rec.flush()
        record("after")
    exc = out["during"].exception()
    print(json.dumps({"during": [type(exc).__name__, exc.errno == errno.EMFILE],
                      "refused": refused,
                      **{k: out[k].result().seq for k in ("before", "a", "b", "after")}}))
elif kind == "callback":
    seen = []
    rec = log.recorder(max_delay_ms=10**9)
    def waits(_f):
        seen.extend(outcome(c) for c in (second.result, second.exception, rec.flush,
                                         lambda: second.result(timeout=0)))
    evs, blobs = attempt("first")
    first = rec.record(evs, blobs=blobs)
    evs, blobs = attempt("second")
    second = rec.record(evs, blobs=blobs)
    first.add_done_callback(waits)
    first.add_done_callback(lambda f: sys.exit(3))  # logged; the committer goes on
    second.add_done_callback(lambda f: seen.append(outcome(first.result)))  # resolved
    rec.flush()  # the window closes: first resolves, then second
    evs, blobs = attempt("third")
    third = rec.record(evs, blobs=blobs)
    rec.close()
    print(json.dumps({"seen": seen, "seqs": [f.result().seq for f in (first, second, third)]}))
elif kind == "stopped":
    rec = log.recorder(max_delay_ms=10**9)
    def broken():
        raise RuntimeError("no transaction")
    log.transaction = broken  # the gatherer cannot open a window: the net under it
    evs, blobs = attempt("lost")
    lost = rec.record(evs, blobs=blobs)
    rec.flush()  # it waited for ever: the gatherer thread had died
    print(json.dumps({"failed_by_flush": lost.done(), "lost": outcome(lost.result),
                      "again": outcome(lambda: rec.record(evs)),
                      "close": outcome(rec.close), "head": log.head,
                      "pending": list(rec.pending)}))
elif kind == "committer":
    from poimen_data.log._recorder import Recorder
    gate = threading.Event()
    class Breaking(Recorder):
        def _commit_windows(self):  # the committer stops on an error of its own
            assert gate.wait(timeout=60)
            raise RuntimeError("committer broke")
    joined = watch_joins(log)
    rec = Breaking(log, max_delay_ms=10**9)
    retried = []
    evs, blobs = attempt("held")
    held = rec.record(evs, blobs=blobs)
    # a retry from its callback, which runs on the gatherer dropping its window
    held.add_done_callback(
        lambda f: retried.append(outcome(lambda: rec.record(evs, blobs=blobs))))
    assert joined.wait(timeout=60)  # "held" is in the gatherer's open window
    gate.set()
    rec.flush()
    print(json.dumps({"failed_by_flush": held.done(), "held": outcome(held.result),
                      "retried": retried, "close": outcome(rec.close), "head": log.head,
                      "pending": list(rec.pending)}))
elif kind == "room":
    rec = log.recorder(max_delay_ms=10**9, max_pending_events=1)
    other = pdm.open_log(sys.argv[2] + "-other").recorder(max_delay_ms=10**9,
                                                           max_pending_events=1)
    held = other.record([E.RunStarted("acme", "held", "wf-1")])  # its bound is reached
    again, seen = [], []
    def retry(_f):  # the first record still counts: the bound is reached
        again.append(rec.record([E.RunStarted("acme", "again", "wf-1")]))
        again.append(other.record([E.RunStarted("acme", "across", "wf-1")]))
        seen.append(list(other.pending))  # past the other's bound too, nobody waiting
    first = rec.record([E.RunStarted("acme", "first", "wf-1")])
    first.add_done_callback(retry)
    rec.flush()
    rec.flush()  # the callback's record went in before the first flush returned
    other.flush()
    rec.close()
    other.close()
    print(json.dumps({"again": [first.result().seq, again[0].result().seq, log.head],
                      "across": [held.result().seq, again[1].result().seq], "seen": seen,
                      "pending": list(rec.pending) + list(other.pending)}))
else:
    joined = watch_joins(log)
    rec = log.recorder(max_delay_ms=10**9)
    evs, blobs = attempt("done")
    done = rec.record(evs, blobs=blobs)
    rec.flush()
    joined.clear()
    evs, blobs = attempt("pending")
    pending = rec.record(evs, blobs=blobs)
    assert joined.wait(timeout=60)  # in an open window: running
    holding, release = threading.Event(), threading.Event()
    def hold():  # as a committer resolving it would, on a thread the child has not
        with pending._condition:
            holding.set()
            assert release.wait(timeout=60)
    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(timeout=60)
    rec._cond.acquire()  # the fork happens while the recorder's lock is held
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # exits normally: its atexit must not wait on either lock
        signal.alarm(60)  # should it hang all the same: no orphan left behind
        evs, blobs = attempt("child")
        print(json.dumps({"record": outcome(lambda: rec.record(evs, blobs=blobs)),
                          "result": outcome(pending.result),
                          "exception": outcome(pending.exception),
                          "flush": outcome(rec.flush), "close": outcome(rec.close),
                          "pending": outcome(lambda: rec.pending),
                          "states": [pending.done(), pending.running(), pending.cancelled(),
                                     pending.cancel(), done.done()],
                          "done": outcome(done.result)}))
        sys.exit(0)
    rec._cond.release()
    release.set()
    holder.join()
    status = os.waitpid(pid, 0)[1]
    rec.close()
    print(json.dumps({"child_status": status, "pending": pending.result().seq}))
