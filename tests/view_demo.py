"""The demo root the viewer tests browse: a small synthetic workload, one run rewound
twice with every attempt state, and one run whose strings are XSS payloads."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import poimen_data as pdm
from poimen_data import events as E
from poimen_data import synth
from poimen_data.verifiers import exit_code

SYNTH_RUNS = 24
REWOUND = "rewound-twice"
XSS = "xss-run"
JS_LINK = "jsrun"
T = datetime(2025, 1, 6, 13, 10, tzinfo=UTC)  # just after the synthetic runs

PAYLOADS = ('<script>window.__pwned=1;alert(1)</script>',
            '<img src=x onerror="window.__pwned=2;alert(2)">',
            '<a href="javascript:window.__pwned=3;alert(3)">click me</a>')
PAYLOAD = " ".join(PAYLOADS)

#: branch -> own attempts per display state, as the episode page must count them
REWOUND_COUNTS = {0: {"succeeded": 2, "failed": 2},
                  1: {"succeeded": 1, "timed_out": 1, "cancelled": 1},
                  2: {"succeeded": 1, "dispatched": 1, "recovered": 1}}
REWOUND_PROMPTS = {(1, "code", 2): "fix the bug in parser.py\ncontext: the failing test log\n"}
TOTAL_RUNS = SYNTH_RUNS + 3


def _usage(cost: str) -> pdm.Usage:
    return pdm.Usage(input_tokens=100, output_tokens=20, cost_usd=Decimal(cost), latency_ms=5)


def _rewound(log: pdm.EventLog) -> None:
    t, r = "acme", REWOUND
    with log.transaction() as tx:
        def attempt(branch: int, step: str, index: int, n: int, state: str,
                    prompt: str | None = None) -> None:
            p = tx.put_blob(t, (prompt or f"{step} attempt {n} on branch {branch}\n").encode())
            tx.append(E.AttemptDispatched(t, r, branch, step, index, n, prompt=p, ts=T,
                                          context=pdm.ContextPartition(
                                              ("ticket/T-1", f"kb/{step}"), (), ("history/3",))))
            if state == "dispatched":
                return
            out = tx.put_blob(t, f"{step} #{n} on branch {branch}: {state}".encode())
            error = None if state == "succeeded" else f"{step} {state}"
            tx.append(E.AttemptFinished(t, r, branch, step, n, state, output=out, error=error,
                                        usage=_usage("0.01"), ts=T))

        tx.append(E.RunStarted(t, r, "codefix@v9", labels={"ticket": "T-1"}, ts=T))
        attempt(0, "plan", 0, 1, "succeeded")
        attempt(0, "code", 1, 1, "failed", "fix the bug in parser.py\n")
        attempt(0, "code", 1, 2, "succeeded")
        attempt(0, "test", 2, 1, "failed")
        tx.append(E.VerifyingEntered(t, r, ts=T))
        tx.append(E.BranchForked(t, r, 1, 0, 1, ts=T))           # rewind to "code"
        attempt(1, "code", 1, 1, "timed_out", "fix the bug in parser.py\n")
        attempt(1, "code", 1, 2, "succeeded", REWOUND_PROMPTS[(1, "code", 2)])
        attempt(1, "test", 2, 1, "cancelled")
        tx.append(E.BranchForked(t, r, 2, 1, 2, ts=T))           # rewind to "test"
        attempt(2, "test", 2, 1, "dispatched")
        attempt(2, "test", 2, 2, "succeeded")
        attempt(2, "report", 3, 1, "dispatched")
    with log.transaction() as tx:                              # recovery after a crash
        tx.append(E.AttemptRecovered(t, r, 2, "test", 1, "failed", error="lost worker",
                                     ts=T))


def _xss(log: pdm.EventLog) -> None:
    t = "acme"
    with log.transaction() as tx:
        p = tx.put_blob(t, f"prompt with {PAYLOAD}".encode())
        o = tx.put_blob(t, f"output with {PAYLOAD}".encode())
        tx.append(E.RunStarted(t, XSS, PAYLOADS[1], labels={"note": PAYLOADS[0]}, ts=T))
        tx.append(E.AttemptDispatched(t, XSS, 0, PAYLOADS[0], 0, 1, prompt=p, ts=T,
                                      context=pdm.ContextPartition((PAYLOADS[1],), (),
                                                                   (PAYLOADS[2],))))
        tx.append(E.AttemptFinished(t, XSS, 0, PAYLOADS[0], 1, "failed", output=o,
                                    error=f"error: {PAYLOAD}",
                                    tools=pdm.ToolInfo(("javascript:alert(4)",)), ts=T))
        tx.append(E.VerifyingEntered(t, XSS, ts=T))
        tx.append(E.VerdictRecorded(t, XSS, 0, "<script>window.__pwned=5</script>@1", 5,
                                    False, detail=PAYLOAD, ts=T))
        tx.append(E.RunStarted(t, JS_LINK, "javascript:alert(6)", ts=T))


def xss_lsn(log: pdm.EventLog) -> int:
    """The LSN of the first event of the XSS runs (the pages before it show none)."""
    con = pdm.connect(log)
    try:
        return int(con.execute("select min(lsn) from events where run_id = ?",
                               [XSS]).fetchall()[0][0])
    finally:
        con.close()


def build(root: Path) -> pdm.EventLog:
    log = pdm.open_log(root)
    synth.generate(log, runs=SYNTH_RUNS, seed=5, batch=64)
    pdm.grade(log, [exit_code])
    _rewound(log)
    _xss(log)
    return log
