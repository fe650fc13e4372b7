"""Laziness: a snapshot holds refs, never bodies; a verifier reads exactly the bodies it
asks for through ctx.blobs, and a reduced body (get -> None) is a normal answer."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

import poimen_data as pdm
from poimen_data.jobs._grade import Verdict, VerifierCtx, grade
from poimen_data.testing import CountingBlobStore, record_run
from poimen_data.verifiers import exit_code, output_mentions

STEPS = [("plan", ["succeeded"]), ("code", ["failed", "succeeded"])]


@pytest.fixture
def log() -> pdm.EventLog:
    return pdm.open_log(f"memory://grade-lazy-{uuid.uuid4().hex}")


def detail_of(log: pdm.EventLog, verifier: str) -> list[tuple[Any, ...]]:
    con = pdm.connect(log)
    rows = con.execute("select run_id, passed, score, detail from verdicts where verifier = ? "
                       "order by lsn", [verifier]).fetchall()
    con.close()
    return rows


def test_exit_code_verifier_reads_no_body(log: pdm.EventLog) -> None:
    for run in ("a", "b", "c"):
        record_run(log, run, STEPS)
    blobs = CountingBlobStore(log.blobs)
    report = grade(log, [exit_code], blobs=blobs)
    assert (report.runs_graded, report.runs_passed) == (3, 3)
    assert blobs.gets == 0


def test_text_verifier_resolving_two_refs_makes_exactly_two_gets(log: pdm.EventLog) -> None:
    record_run(log, "a", STEPS)  # 3 attempts with outputs; the last of each step: 2
    blobs = CountingBlobStore(log.blobs)
    report = grade(log, [output_mentions("succeeded")], blobs=blobs)
    assert blobs.gets == 2
    assert report.runs_passed == 1
    assert detail_of(log, "output_mentions@1") == [
        ("a", True, 1.0, "2/2 outputs mention 'succeeded'")]


def test_a_one_megabyte_prompt_stays_out_of_the_snapshot(log: pdm.EventLog) -> None:
    prompt = bytes(range(256)) * 4096
    assert len(prompt) == 1 << 20
    record_run(log, "a", [("plan", ["succeeded"])], prompt=prompt)
    seen: list[VerifierCtx] = []

    def look(ctx: VerifierCtx) -> Verdict:
        seen.append(ctx)
        return Verdict(True)

    blobs = CountingBlobStore(log.blobs)
    grade(log, [look], blobs=blobs)
    (ctx,) = seen
    (attempt,) = ctx.episode.branches[0].attempts
    assert attempt.prompt.size == len(prompt)
    assert len(ctx.episode.serialize()) < 64 * 1024
    assert blobs.gets == 0
    assert blobs.get(attempt.prompt) == prompt
    assert blobs.gets == 1


def test_after_reduce_get_returns_none_and_the_text_verifier_completes(
        log: pdm.EventLog) -> None:
    record_run(log, "a", STEPS)
    seen: list[VerifierCtx] = []

    def outputs(ctx: VerifierCtx) -> Verdict:
        seen.append(ctx)
        return Verdict(True)

    grade(log, [outputs])
    (ctx,) = seen
    code_out = [a.output for a in ctx.episode.branches[0].attempts
                if (a.step, a.attempt) == ("code", 2)][0]
    pdm.reduce(log, [code_out], lambda body: b"summary: " + body[:8])
    assert log.blobs.get(code_out) is None
    blobs = CountingBlobStore(log.blobs)
    report = grade(log, [output_mentions("succeeded")], blobs=blobs)
    assert blobs.gets == 2
    assert (report.runs_graded, report.runs_errored, report.runs_passed) == (1, 0, 1)
    assert detail_of(log, "output_mentions@1") == [
        ("a", True, 1.0, "1/1 outputs mention 'succeeded'; reduced: code")]


def test_two_counting_stores_do_not_see_each_others_calls(log: pdm.EventLog) -> None:
    record_run(log, "a", STEPS)
    record_run(log, "b", STEPS)
    text, states = CountingBlobStore(log.blobs), CountingBlobStore(log.blobs)
    grade(log, [output_mentions("succeeded")], runs=["a"], blobs=text)
    grade(log, [exit_code], runs=["b"], blobs=states)
    assert (text.gets, states.gets) == (2, 0)
    grade(log, [output_mentions("succeeded")], runs=["b"], blobs=states)
    assert (text.gets, states.gets) == (2, 2)
