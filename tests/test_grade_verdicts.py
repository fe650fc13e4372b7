"""Grading survives a bad verdict (issue 16, C): a score or detail the log cannot hold is
an error verdict for that (run, verifier), the batch goes on, the worker never dies."""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest

import poimen_data as pdm
from poimen_data.jobs._grade import Verdict, VerifierCounts, VerifierCtx, grade
from poimen_data.jobs._grade_exec import DETAIL_MAX, safe_verdict
from poimen_data.testing import record_run
from poimen_data.verifiers import exit_code

OK = [("plan", ["succeeded"]), ("code", ["failed", "succeeded"])]
BAD = [("plan", ["succeeded"]), ("code", ["failed", "timed_out"])]


def _verdicts(log: pdm.EventLog) -> dict[tuple[str, str], tuple[Any, ...]]:
    con = pdm.connect(log)
    rows = con.execute("select run_id, verifier, passed, score, detail from verdicts").fetchall()
    con.close()
    return {(r[0], r[1]): r[2:] for r in rows}


class _BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def huge_score(ctx: VerifierCtx) -> Verdict:
    return Verdict(True, score=10**400)  # type: ignore[arg-type]


def nan_score(ctx: VerifierCtx) -> Verdict:
    return Verdict(True, score=math.nan)


def int_passed(ctx: VerifierCtx) -> Verdict:
    return Verdict(1)  # type: ignore[arg-type]


def surrogate_detail(ctx: VerifierCtx) -> Verdict:
    return Verdict(False, detail="bad \ud800 text")


def long_detail(ctx: VerifierCtx) -> Verdict:
    return Verdict(True, detail="x" * (DETAIL_MAX + 1))


def bad_repr(ctx: VerifierCtx) -> Any:
    return _BadRepr()


def surrogate_raise(ctx: VerifierCtx) -> Verdict:
    raise ValueError("kaput \udc00")


def test_bad_verdicts_are_error_verdicts_and_good_ones_are_recorded() -> None:
    log = pdm.open_log(f"memory://grade-values-{uuid.uuid4().hex}")
    record_run(log, "a", OK)
    record_run(log, "b", BAD)
    bad = [huge_score, nan_score, int_passed, surrogate_detail, long_detail, bad_repr,
           surrogate_raise]
    # One thread: a worker killed by the first bad verdict would leave every later pair
    # to its deadline (an error verdict too, but "deadline ... abandoned").
    report = grade(log, [*bad, exit_code], threads=1, deadline_s=20)
    assert report.verdicts_recorded == 16
    assert report.per_verifier[-1] == VerifierCounts("exit_code@1", 2, 0, 1, 1, 0)
    assert all(c == VerifierCounts(c.verifier, 2, 0, 0, 0, 2) for c in report.per_verifier[:-1])
    rows = _verdicts(log)
    assert rows["a", "exit_code@1"][0] is True and rows["b", "exit_code@1"][0] is False
    want = {
        "huge_score@0": "error: score must be a finite double, got an int of 1329 bits",
        "nan_score@0": "error: score must be a finite double, got nan",
        "int_passed@0": "error: returned Verdict(passed=1, score=None, detail=None), "
                        "not a Verdict(passed: bool)",
        "surrogate_detail@0": "error: detail must be valid UTF-8 text (it holds a lone "
                              "surrogate)",
        "long_detail@0": f"error: detail of {DETAIL_MAX + 1:,} chars is over {DETAIL_MAX:,}",
        "bad_repr@0": "error: returned <unprintable _BadRepr: RuntimeError>, not a "
                      "Verdict(passed: bool)",
        "surrogate_raise@0": "error: ValueError: kaput \\udc00",
    }
    for run in ("a", "b"):
        for name, detail in want.items():
            assert rows[run, name] == (False, None, detail)


@pytest.mark.parametrize("value", [
    Verdict(True, score=2**53 + 1), Verdict(True, score=-math.inf), Verdict(True, score="1"),
    Verdict(True, detail=b"bytes \xff"),  # type: ignore[arg-type]
])
def test_safe_verdict_never_raises(value: Any) -> None:
    passed, score, detail, errored = safe_verdict(value)
    if isinstance(value.detail, bytes):  # str() of bytes is storable text: kept
        assert (passed, errored, detail) == (True, False, str(value.detail))
    else:
        assert (passed, score, errored) == (False, None, True)
        assert detail is not None and detail.startswith("error: score ")
