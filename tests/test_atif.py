"""ATIF out and in (issue 15): every exported trajectory validates with the ``atif``
package's own models and carries poimen's identity in ``extra``; imported trajectories
become runs (an attempt per agent turn), a second import adds nothing, a round trip keeps
messages, tool calls and metrics, and a bad file imports nothing and names file and step."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import atif
import pytest
from test_export import rich_log

import poimen_data as pdm
from poimen_data import events as ev

FIXTURE = Path(__file__).resolve().parent / "data" / "atif_session.json"
T = "acme"


def trajectories(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    docs = [json.loads(line) for line in data.split(b"\n")[:-1]]
    for d in docs:
        atif.Trajectory.model_validate(d)  # the package's own models
    return docs


def native_log(root: str) -> tuple[pdm.EventLog, int]:
    """One run with a retry, tool calls, usage, an attempt without output, a verdict."""
    log = pdm.open_log(root)
    with log.transaction() as tx:
        tx.append(ev.RunStarted(T, "r-1", "wf@v2"))
        p1 = tx.put_blob(T, b"plan the fix")
        o1 = tx.put_blob(T, b"1. read 2. patch")
        tx.append(ev.AttemptDispatched(T, "r-1", 0, "plan", 0, 1, prompt=p1))
        tx.append(ev.AttemptFinished(T, "r-1", 0, "plan", 1, "succeeded", output=o1,
                                     usage=ev.Usage(100, 20, 60, 5, Decimal("0.000123456"),
                                                    812.5),
                                     tools=ev.ToolInfo(("read_file", "grep"))))
        p2 = tx.put_blob(T, b"patch it")
        tx.append(ev.AttemptDispatched(T, "r-1", 0, "code", 1, 1, prompt=p2))
        tx.append(ev.AttemptFinished(T, "r-1", 0, "code", 1, "timed_out",
                                     error="timed out after 120 s"))
        p3 = tx.put_blob(T, b"patch it, again")
        o3 = tx.put_blob(T, "fixed ✓".encode())
        tx.append(ev.AttemptDispatched(T, "r-1", 0, "code", 1, 2, prompt=p3))
        tx.append(ev.AttemptFinished(T, "r-1", 0, "code", 2, "succeeded", output=o3,
                                     usage=ev.Usage(cost_usd=Decimal("0.5"))))
        tx.append(ev.VerifyingEntered(T, "r-1"))
    snap = log.head
    with log.transaction() as tx:
        tx.append(ev.VerdictRecorded(T, "r-1", 0, "judge@1", snap, True, 0.5))
    return log, snap


def test_export_maps_attempts_to_steps_with_identity_in_extra(tmp_path: Path) -> None:
    log, snap = native_log(str(tmp_path / "log"))
    rep = pdm.export_live(log, tmp_path / "out.jsonl", format="atif")
    (doc,) = trajectories(tmp_path / "out.jsonl")
    assert (rep.runs, rep.records) == (1, 3)
    assert doc["schema_version"] == "ATIF-v1.8" and doc["session_id"] == "r-1"
    assert doc["agent"] == {"name": "poimen", "version": "wf@v2"}
    assert doc["extra"]["poimen"] == {
        "run_id": "r-1", "tenant": T, "live_branch": 0, "workflow_version": "wf@v2",
        "export_lsn": log.head,
        "verdicts": [{"verifier": "judge@1", "passed": True, "score": 0.5,
                      "snapshot_lsn": snap}]}
    steps = doc["steps"]
    assert [s["step_id"] for s in steps] == list(range(1, 7))
    assert [(s["source"], s["message"]) for s in steps] == [
        ("user", "plan the fix"), ("agent", "1. read 2. patch"), ("user", "patch it"),
        ("agent", ""), ("user", "patch it, again"), ("agent", "fixed ✓")]
    assert steps[1]["tool_calls"] == [
        {"tool_call_id": "plan.1.0", "function_name": "read_file", "arguments": {}},
        {"tool_call_id": "plan.1.1", "function_name": "grep", "arguments": {}}]
    assert steps[1]["metrics"] == {
        "prompt_tokens": 100, "completion_tokens": 20, "cached_tokens": 60,
        "cost_usd": 0.000123456,
        "extra": {"cost_usd": "0.000123456", "reasoning_tokens": 5, "latency_ms": 812.5}}
    assert steps[1]["extra"]["poimen"] == {
        "branch_id": 0, "step_id": "plan", "step_index": 0, "attempt_no": 1,
        "state": "succeeded", "workflow_version": "wf@v2", "prompt_reduced": False,
        "output_reduced": False, "output_captured": True}
    assert steps[3]["extra"]["poimen"]["state"] == "timed_out"
    assert steps[3]["extra"]["poimen"]["output_captured"] is False
    assert steps[3]["extra"]["poimen"]["error"] == "timed out after 120 s"
    assert "metrics" not in steps[3] and "tool_calls" not in steps[3]
    assert doc["final_metrics"] == {
        "total_prompt_tokens": 100, "total_completion_tokens": 20, "total_cached_tokens": 60,
        "total_cost_usd": 0.500123456, "extra": {"total_cost_usd": "0.500123456"},
        "total_steps": 6}


def test_every_trajectory_of_a_rich_log_validates(tmp_path: Path) -> None:
    """Forks of forks, a cancelled run's dispatched attempt, invalid UTF-8, reduced bodies,
    large unicode bodies: each run one valid trajectory, an agent step per attempt."""
    log, _ = rich_log(str(tmp_path / "log"))
    rep = pdm.export_live(log, tmp_path / "all.jsonl", format="atif", batch_size=64)
    docs = trajectories(tmp_path / "all.jsonl")
    assert [d["session_id"] for d in docs] == ["r-a", "r-b", "r-c"]
    agents = [[s for s in d["steps"] if s["source"] == "agent"] for d in docs]
    assert [len(a) for a in agents] == [6, 2, 2] and rep.records == 10
    assert [s["extra"]["poimen"]["branch_id"] for s in agents[0]] == [0, 1, 1, 2, 2, 2]
    assert agents[1][1]["extra"]["poimen"]["state"] == "dispatched"
    assert agents[1][1]["message"] == ""
    assert agents[2][0]["message"] == "half an answ\ufffd"
    users = [s["message"] for s in docs[2]["steps"] if s["source"] == "user"]
    assert users == ["summary: a long question"] * 2
    assert [s["extra"]["poimen"]["prompt_reduced"] for s in agents[2]] == [True, True]
    assert _sha(tmp_path / "all.jsonl") == pdm.export_live(
        log, tmp_path / "again.jsonl", format="atif", source="log").sha256


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_import_records_runs_once_and_round_trips(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    rep = pdm.import_atif(log, [FIXTURE])
    assert rep.attempts == 3 and len(rep.runs) == 1 and rep.skipped == ()
    (run,) = rep.runs
    assert run.startswith("atif-")
    head = log.head
    log.flush()  # bodies promoted out of staging (in the background) before listing
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "log").rglob("*")
                   if p.is_file() and "_log" not in p.parts)
    again = pdm.import_atif(log, [FIXTURE, FIXTURE])
    assert (again.runs, again.skipped, again.attempts, again.lsn) == ((), (run, run), 0, None)
    assert log.head == head
    assert files == sorted(p.relative_to(tmp_path) for p in (tmp_path / "log").rglob("*")
                           if p.is_file() and "_log" not in p.parts)

    con = pdm.connect(log)
    rows = con.sql("select step_id, step_index, attempt_no, state, usage.input_tokens, "
                   "usage.output_tokens, usage.cache_read_input_tokens, usage.cost_usd, "
                   "tools.calls from attempts order by step_index").fetchall()
    assert rows == [
        ("turn-1", 0, 1, "succeeded", 4210, 96, 3900, Decimal("0.002701000"), ["Read"]),
        ("turn-2", 1, 1, "succeeded", 4588, 212, 4210, Decimal("0.004533000"), ["Bash"]),
        ("turn-3", 2, 1, "succeeded", 4921, 47, 4588, Decimal("0.001218000"), None)]
    assert con.sql("select state from runs").fetchall() == [("verifying",)]
    # the prompt of a turn is the conversation before it; the output is the turn itself
    prompt, output = con.sql("select blob_text(prompt), blob_text(output) from attempts "
                             "where step_index = 1").fetchall()[0]
    original = json.loads(FIXTURE.read_text())
    assert [s["message"] for s in json.loads(prompt)["steps"]] == [
        s["message"] for s in original["steps"][:3]]
    assert json.loads(output)["step"]["tool_calls"] == original["steps"][3]["tool_calls"]

    pdm.export_live(log, tmp_path / "back.jsonl", format="atif")
    (back,) = trajectories(tmp_path / "back.jsonl")
    assert back["session_id"] == original["session_id"]
    assert back["agent"] == original["agent"] and back["notes"] == original["notes"]
    assert len(back["steps"]) == len(original["steps"])
    for got, want in zip(back["steps"], original["steps"], strict=True):
        for k, v in want.items():
            if k == "metrics":  # the original metrics, plus the exact cost as a string
                assert {m: got[k][m] for m in v if m != "extra"} == {
                    m: x for m, x in v.items() if m != "extra"}
                assert v.get("extra", {}).items() <= got[k]["extra"].items()
                assert got[k]["extra"]["cost_usd"] == str(
                    Decimal(str(v["cost_usd"])).quantize(Decimal("1e-9")))
            else:
                assert got[k] == v, k
    fm = back["final_metrics"]
    assert {k: fm[k] for k in original["final_metrics"]} == original["final_metrics"]
    assert back["extra"]["poimen"]["run_id"] == run

    # an exported trajectory imports again as a new run (its identity is not the import's)
    again = pdm.import_atif(log, [tmp_path / "back.jsonl"])
    assert len(again.runs) == 1 and again.attempts == 3


def test_export_of_native_runs_imports_and_exports_the_same_steps(tmp_path: Path) -> None:
    log, _ = native_log(str(tmp_path / "log"))
    pdm.export_live(log, tmp_path / "a.jsonl", format="atif")
    other = pdm.open_log(str(tmp_path / "other"))
    rep = pdm.import_atif(other, [tmp_path / "a.jsonl"], tenant="beta")
    assert rep.attempts == 3
    pdm.export_live(other, tmp_path / "b.jsonl", format="atif")
    (a,), (b,) = trajectories(tmp_path / "a.jsonl"), trajectories(tmp_path / "b.jsonl")

    def strip(doc: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in s.items() if k != "extra"} for s in doc["steps"]]

    assert strip(a) == strip(b)
    assert b["final_metrics"] == a["final_metrics"]


def _bad_step(tmp_path: Path) -> Path:
    doc = json.loads(FIXTURE.read_text())
    doc["steps"][3]["tool_calls"][0]["arguments"] = "not an object"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    return bad


def test_bad_file_names_file_and_step_and_imports_nothing(tmp_path: Path) -> None:
    log = pdm.open_log(str(tmp_path / "log"))
    bad = _bad_step(tmp_path)
    with pytest.raises(pdm.ValidationError, match=r"bad\.json: step 4 \(step_id 4\) "
                                                  r"tool_calls\.0\.arguments"):
        pdm.import_atif(log, [FIXTURE, bad])
    assert log.head == 0 and log.head_seq == 0
    assert not (tmp_path / "log" / "blobs").exists() and \
        not list((tmp_path / "log").glob("segments/*"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(FIXTURE.read_text().replace("\n", " ") + "\n{\"schema_version\": \n")
    with pytest.raises(pdm.ValidationError, match=r"broken\.jsonl line 2: not valid JSON"):
        pdm.import_atif(log, [broken])
    no_agent = tmp_path / "user_only.json"
    no_agent.write_text(json.dumps({"schema_version": "ATIF-v1.8",
                                    "agent": {"name": "a", "version": "1"},
                                    "steps": [{"step_id": 1, "source": "user",
                                               "message": "hi"}]}))
    with pytest.raises(pdm.ValidationError, match="user_only.json: no agent step"):
        pdm.import_atif(log, [no_agent])
    negative = json.loads(FIXTURE.read_text())
    negative["steps"][5]["metrics"]["completion_tokens"] = -3
    (tmp_path / "negative.json").write_text(json.dumps(negative))
    with pytest.raises(pdm.ValidationError, match=r"negative\.json: step 6 \(step_id 6\) "
                                                  r"metrics .*output_tokens"):
        pdm.import_atif(log, [FIXTURE, tmp_path / "negative.json"])
    assert log.head == 0


def test_cli_import_and_export(tmp_path: Path) -> None:
    root = str(tmp_path / "log")
    pdm.open_log(root)

    def poimen(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "poimen_data.cli", *args, "--root", root],
                              capture_output=True, text=True, check=False)

    r = poimen("import", "atif", str(FIXTURE))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("imported 1 runs (3 attempts), 0 already in the log")
    r = poimen("import", "atif", str(FIXTURE))
    assert r.stdout.startswith("imported 0 runs (0 attempts), 1 already in the log")
    r = poimen("import", "atif", str(_bad_step(tmp_path)))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "step 4" in r.stderr
    assert "Traceback" not in r.stderr
    out = tmp_path / "t.jsonl"
    r = poimen("export", "--format", "atif", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert len(trajectories(out)) == 1


@pytest.mark.parametrize(("prompt", "output"), [
    (b'{"atif":"context","steps":[1]}', b"answer"),
    (b'{"atif":"context","steps":"abc"}', b"answer"),
    (b'{"atif":"context","steps":[{"source":"user","message":"x","bogus":1}]}', b"answer"),
    (b'{"atif":"context","steps":[],"trajectory":{"agent":5}}', b"answer"),
    (b"question", b'{"atif":"agent_step","step":{"bogus":1}}'),
    (b"question", b'{"atif":"agent_step","step":{"message":"m","metrics":5}}'),
])
def test_a_body_that_only_looks_imported_goes_out_as_text(tmp_path: Path, prompt: bytes,
                                                          output: bytes) -> None:
    """A prompt or output starting with the import's tag, written by a user or a model,
    is taken as an imported trajectory's structure only when that is valid ATIF: else
    it is the step's text, and the trajectory still validates (it once crashed the
    export or wrote invalid ATIF)."""
    log = pdm.open_log(tmp_path / "log", durable=False)
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "r", "v"))
        p, o = tx.put_blob("acme", prompt), tx.put_blob("acme", output)
        tx.append(ev.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=p))
        tx.append(ev.AttemptFinished("acme", "r", 0, "s", 1, "succeeded", output=o))
    dest = tmp_path / "out.atif.jsonl"
    pdm.export_live(log, str(dest), format="atif")
    (doc,) = trajectories(dest)
    atif.Trajectory.model_validate(doc)
    assert doc["agent"] == {"name": "poimen", "version": "v"}
    assert [(s["source"], s["message"]) for s in doc["steps"]] == [
        ("user", prompt.decode()), ("agent", output.decode())]


def test_money_keeps_its_nine_places_under_a_millionth(tmp_path: Path) -> None:
    """``str`` of a Decimal turns to the exponent form below 1e-6 ("0E-9" for zero)."""
    log = pdm.open_log(tmp_path / "log", durable=False)
    costs = [Decimal(0), Decimal("0.000000001"), Decimal("0.00000025")]
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "r", "v"))
        for i, cost in enumerate(costs):
            o = tx.put_blob("acme", f"answer {i}".encode())
            p = tx.put_blob("acme", f"question {i}".encode())
            tx.append(ev.AttemptDispatched("acme", "r", 0, f"s{i}", i, 1, prompt=p))
            tx.append(ev.AttemptFinished("acme", "r", 0, f"s{i}", 1, "succeeded", output=o,
                                         usage=ev.Usage(cost_usd=cost)))
    dest = tmp_path / "out.jsonl"
    pdm.export_live(log, str(dest), format="jsonl")
    got = [json.loads(line)["metadata"]["usage"]["cost_usd"]
           for line in dest.read_text().splitlines()]
    assert got == ["0.000000000", "0.000000001", "0.000000250"]
    pdm.export_live(log, str(tmp_path / "out.atif"), format="atif")
    (doc,) = trajectories(tmp_path / "out.atif")
    assert [s["metrics"]["extra"]["cost_usd"] for s in doc["steps"]
            if s["source"] == "agent"] == got
    assert doc["final_metrics"]["extra"]["total_cost_usd"] == "0.000000251"


def test_attempt_verdicts_ride_on_their_own_agent_step(tmp_path: Path) -> None:
    """The trajectory carries the run's verdicts only; each attempt's own verdicts are on
    its agent step (they were all put on the trajectory as the first row's, the others'
    lost)."""
    log = pdm.open_log(tmp_path / "log")
    with log.transaction() as tx:
        tx.append(ev.RunStarted(T, "r", "wf"))
        for index, sid in enumerate(("a", "b", "c")):
            p = tx.put_blob(T, sid.encode())
            tx.append(ev.AttemptDispatched(T, "r", 0, sid, index, 1, prompt=p))
            tx.append(ev.AttemptFinished(T, "r", 0, sid, 1, "succeeded", output=p))
        tx.append(ev.VerifyingEntered(T, "r"))
    snap = log.head
    with log.transaction() as tx:
        tx.append(ev.VerdictRecorded(T, "r", 0, "tests@1", snap, True, 1.0))
        tx.append(ev.VerdictRecorded(T, "r", 0, "judge-a@1", snap, False, 0.1,
                                     step_id="a", attempt_no=1))
        tx.append(ev.VerdictRecorded(T, "r", 0, "judge-b@1", snap, True, 0.9,
                                     step_id="b", attempt_no=1))
    out = tmp_path / "r.atif.jsonl"
    pdm.export_live(log, str(out), format="atif")
    (doc,) = trajectories(out)
    assert doc["extra"]["poimen"]["verdicts"] == [
        {"verifier": "tests@1", "passed": True, "score": 1.0, "snapshot_lsn": snap}]
    got = {s["extra"]["poimen"]["step_id"]: s["extra"]["poimen"].get("verdicts")
           for s in doc["steps"] if s["source"] == "agent"}
    assert got == {
        "a": [{"verifier": "judge-a@1", "passed": False, "score": 0.1, "snapshot_lsn": snap}],
        "b": [{"verifier": "judge-b@1", "passed": True, "score": 0.9, "snapshot_lsn": snap}],
        "c": None}
    atif.Trajectory.model_validate(doc)


def test_token_sums_past_what_json_holds_are_one_error_and_no_file(tmp_path: Path) -> None:
    """Each count may be up to 2**63 - 1; three of them add up past 2**64 - 1, which the
    JSON writer cannot hold: a ValidationError naming the run (it was a bare TypeError)."""
    log = pdm.open_log(tmp_path / "log")
    big = ev.Usage(input_tokens=2**63 - 1)
    with log.transaction() as tx:
        tx.append(ev.RunStarted(T, "r", "wf"))
        for n in (1, 2, 3):
            p = tx.put_blob(T, b"p%d" % n)
            tx.append(ev.AttemptDispatched(T, "r", 0, "s", 0, n, prompt=p))
            tx.append(ev.AttemptFinished(T, "r", 0, "s", n, "failed", output=p, usage=big))
    out = tmp_path / "r.atif.jsonl"
    with pytest.raises(pdm.ValidationError, match=r"run 'r': its total_prompt_tokens add up "
                                                  r"past 2\*\*64 - 1"):
        pdm.export_live(log, str(out), format="atif")
    assert list(tmp_path.iterdir()) == [tmp_path / "log"]  # no file, no temp file
    assert pdm.export_live(log, str(tmp_path / "r.jsonl")).records == 3  # the rest can
