"""Export for the learning loop (docs/DESIGN.md, "Export", issue 5): the live trajectory only,
byte-identical from materialized state and from a cold re-fold, loadable by the tools
people train with, streaming in bounded memory, never a partial file at ``dest``."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

import poimen_data as pdm
from poimen_data import ExportProgress, export_live, materialize, reduce
from poimen_data import events as ev

T = "acme"


def text(kind: str, run: str, branch: int, step: str, no: int) -> str:
    return f"{kind} of {run}/{branch}/{step}#{no}"


class Recorder:
    """Writes events the way the engine does: each body in the commit of its transition."""

    def __init__(self, log: pdm.EventLog) -> None:
        self.log = log

    def commit(self, *events: ev.Event) -> int:
        with self.log.transaction() as tx:
            tx.extend(events)
        assert tx.commit_info is not None
        return tx.commit_info.last_lsn

    def attempt(self, run: str, branch: int, step: str, index: int, no: int, state: str, *,
                prompt: str | None = "", output: str | bytes | None = "",
                usage: ev.Usage | None = None) -> tuple[ev.BlobRef | None, ev.BlobRef | None]:
        prompt = text("prompt", run, branch, step, no) if prompt == "" else prompt
        output = text("output", run, branch, step, no) if output == "" else output
        with self.log.transaction() as tx:
            p = None if prompt is None else tx.put_blob(T, prompt.encode())
            tx.append(ev.AttemptDispatched(T, run, branch, step, index, no, prompt=p))
            o = None
            if state != "dispatched":
                data = output.encode() if isinstance(output, str) else output
                o = None if data is None else tx.put_blob(T, data)
                tx.append(ev.AttemptFinished(T, run, branch, step, no, state, output=o,
                                             usage=usage))
        return p, o


#: Escapes and multi-byte characters across the 16 KiB chunks the JSON writer escapes by.
UNICODE = "Zürich, 東京: \"ok\"\n\ttab \x01 \\ end 🙂\n" * 1200


def rich_log(root: str) -> tuple[pdm.EventLog, dict[str, Any]]:
    """Retries, a run rewound twice (a fork of a fork), a cancel, a timed-out attempt and a
    reduced prompt shared by two attempts. Runs are recorded out of run_id order."""
    log = pdm.open_log(root)
    r = Recorder(log)
    r.commit(ev.RunStarted(T, "r-c", "wf-1"), ev.RunStarted(T, "r-a", "wf-1"),
             ev.RunStarted(T, "r-b", "wf-2"))
    shared = "the same long question, asked twice"
    p_c, _ = r.attempt("r-c", 0, "ask", 0, 1, "timed_out", prompt=shared,
                       output=b"half an answ\xe9")  # cut mid-character: invalid UTF-8
    r.attempt("r-c", 0, "ask", 0, 2, "succeeded", prompt=shared, usage=ev.Usage(
        input_tokens=1000, output_tokens=20, cost_usd=Decimal("0.0012"), latency_ms=812.5))
    # r-a, branch 0
    r.attempt("r-a", 0, "plan", 0, 1, "succeeded", usage=ev.Usage(
        input_tokens=10, output_tokens=5, cost_usd=Decimal("0.000015")))
    r.attempt("r-b", 0, "plan", 0, 1, "succeeded", output=UNICODE)
    r.attempt("r-a", 0, "code", 1, 1, "failed")
    r.attempt("r-a", 0, "code", 1, 2, "succeeded")
    r.attempt("r-a", 0, "test", 2, 1, "failed")
    r.attempt("r-a", 0, "test", 2, 2, "succeeded")
    snap0 = r.commit(ev.VerifyingEntered(T, "r-a"))
    r.commit(ev.VerdictRecorded(T, "r-a", 0, "judge@1", snap0, False, 0.25))
    # rewind 1: branch 1 forks branch 0 at step 1
    r.commit(ev.BranchForked(T, "r-a", 1, 0, 1))
    r.attempt("r-a", 1, "code", 1, 1, "failed", usage=ev.Usage(cost_usd=Decimal("0.5")))
    r.attempt("r-a", 1, "code", 1, 2, "succeeded")
    r.attempt("r-b", 0, "code", 1, 1, "dispatched")
    r.commit(ev.RunCancelled(T, "r-b", "operator"))
    r.attempt("r-a", 1, "test", 2, 1, "timed_out", output=None)
    r.attempt("r-a", 1, "test", 2, 2, "succeeded")
    snap1 = r.commit(ev.VerifyingEntered(T, "r-a"))
    # rewind 2: branch 2 forks branch 1 at step 2 (a fork of a fork)
    r.commit(ev.BranchForked(T, "r-a", 2, 1, 2))
    r.attempt("r-a", 2, "test", 2, 1, "failed")
    r.attempt("r-a", 2, "test", 2, 2, "succeeded")
    r.attempt("r-a", 2, "ship", 3, 1, "succeeded")
    snap2 = r.commit(ev.VerifyingEntered(T, "r-a"))
    r.commit(ev.VerdictRecorded(T, "r-a", 2, "judge@1", snap2, True, 0.75),
             ev.VerdictRecorded(T, "r-a", 2, "lint@2", snap2, True),
             ev.RunFinished(T, "r-a", "succeeded"))
    assert p_c is not None
    red = reduce(log, [p_c], lambda body: b"summary: a long question")
    assert red.lsn == log.head
    return log, {"snap1": snap1, "snap2": snap2}


#: The live trajectory of r-a: (branch_id, step_id, step_index, attempt_no, state).
LIVE_A = [
    (0, "plan", 0, 1, "succeeded"),       # inherited from branch 0 (below fork 1 at step 1)
    (1, "code", 1, 1, "failed"),          # inherited from branch 1 (below fork 2 at step 2)
    (1, "code", 1, 2, "succeeded"),       # inherited from branch 1
    (2, "test", 2, 1, "failed"),          # branch 2's own
    (2, "test", 2, 2, "succeeded"),
    (2, "ship", 3, 1, "succeeded"),
]


def lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines export, each checked to be in canonical form."""
    data = path.read_bytes()
    assert data.endswith(b"\n")
    out = [orjson.loads(x) for x in data.split(b"\n")[:-1]]
    canonical = b"".join(orjson.dumps(r, option=orjson.OPT_SORT_KEYS) + b"\n" for r in out)
    assert canonical == data
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "pairs", "atif"])
def test_state_and_refold_give_the_same_bytes(tmp_path: Path, fmt: str) -> None:
    log, _ = rich_log(str(tmp_path / "log"))
    assert materialize(log).lsn == log.head
    a = export_live(log, tmp_path / "state.out", format=fmt, source="state")
    cold = pdm.open_log(str(tmp_path / "log"))  # a fresh handle: nothing cached
    b = export_live(cold, tmp_path / "log.out", format=fmt, source="log")
    assert sha(tmp_path / "state.out") == sha(tmp_path / "log.out") == a.sha256 == b.sha256
    assert (a.source, b.source) == ("state", "log")
    assert a.export_lsn == b.export_lsn == log.head
    assert a.bytes == b.bytes == (tmp_path / "state.out").stat().st_size
    records, reduced = {"jsonl": (9, 2), "parquet": (10, 2), "pairs": (3, 1),
                        "atif": (10, 2)}[fmt]
    assert (a.records, a.runs, a.reduced) == (records, 3 if fmt != "pairs" else 2, reduced)
    assert (b.records, b.runs, b.reduced) == (a.records, a.runs, a.reduced)
    # a smaller batch budget cuts other batches (and row groups) but the same records
    c = export_live(log, tmp_path / "small.out", format=fmt, source="log", batch_size=64)
    assert c.records == records
    if fmt != "parquet":
        assert sha(tmp_path / "small.out") == sha(tmp_path / "state.out")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "pairs", "atif"])
def test_auto_serves_an_older_state_and_refolds_only_what_changed(tmp_path: Path,
                                                                  fmt: str) -> None:
    log, _ = rich_log(str(tmp_path / "log"))
    at = materialize(log).lsn
    r = Recorder(log)
    r.attempt("r-c", 0, "ask", 0, 3, "failed")  # a touched run: a retry after the state
    r.attempt("r-c", 0, "ask", 0, 4, "succeeded")
    r.commit(ev.RunStarted(T, "r-0", "wf-3"))   # a new run, first in run_id order
    r.attempt("r-0", 0, "plan", 0, 1, "failed")
    r.attempt("r-0", 0, "plan", 0, 2, "succeeded")
    out_b = next(e["output"] for e in log.read_events().to_pylist()
                 if e["run_id"] == "r-b" and e["kind"] == "attempt_finished")
    reduce(log, [ev.BlobRef(**out_b)], lambda body: b"summary: unicode")  # no run touched
    assert log.head > at

    auto = export_live(log, tmp_path / "auto.out", format=fmt)
    cold = export_live(pdm.open_log(str(tmp_path / "log")), tmp_path / "log.out",
                       format=fmt, source="log")
    assert (auto.source, cold.source) == ("state+log", "log")
    assert auto.sha256 == cold.sha256 == sha(tmp_path / "auto.out")
    assert (auto.records, auto.runs, auto.reduced) == (cold.records, cold.runs, cold.reduced)
    assert auto.runs == (4 if fmt != "pairs" else 3)  # pairs: r-a, r-c and r-0
    if fmt == "jsonl":
        got = lines(tmp_path / "auto.out")
        assert [m["metadata"]["run_id"] for m in got][:2] == ["r-0", "r-0"]
        assert [m["metadata"]["attempt_no"] for m in got if m["metadata"]["run_id"] == "r-c"
                ] == [1, 2, 3, 4]
        b = [m for m in got if m["metadata"]["run_id"] == "r-b"]
        assert (b[0]["messages"][1]["content"], b[0]["metadata"]["output_reduced"]) == (
            "summary: unicode", True)
    # at the state's own LSN auto serves the state as is; before it, it folds the log
    assert export_live(log, tmp_path / "at.out", format=fmt, at_lsn=at).source == "state"
    assert export_live(log, tmp_path / "before.out", format=fmt, at_lsn=at - 1
                       ).source == "log"
    with pytest.raises(pdm.NotFound):
        export_live(log, tmp_path / "no.out", format=fmt, source="state")


def test_bodies_read_ahead_while_folding_change_no_byte(tmp_path: Path) -> None:
    """On remote storage (here ``memory://``) the pool reads the first batch's likely
    bodies while the log is folded; the files are those of a local log of the same events,
    whatever the budget (all, part or none of the first batch guessed) and the runs."""
    local, _ = rich_log(str(tmp_path / "log"))
    remote, _ = rich_log(f"memory://export-{uuid.uuid4().hex}")
    assert remote.storage.kind == "memory"
    for fmt in ("jsonl", "parquet", "atif"):
        for budget, runs in ((64 << 20, None), (64, None), (1, None), (64 << 20, ["r-c"])):
            a = export_live(local, tmp_path / "a.out", format=fmt, batch_size=budget,
                            runs=runs, source="log")
            b = export_live(remote, f"memory://export-out-{uuid.uuid4().hex}/b.out",
                            format=fmt, batch_size=budget, runs=runs, source="log")
            assert (b.sha256, b.records, b.reduced) == (a.sha256, a.records, a.reduced)


def test_live_trajectory_of_a_run_rewound_twice(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    log, info = rich_log(str(tmp_path / "log"))
    rep = export_live(log, tmp_path / "a.jsonl", runs=["r-a"], source="log")
    got = lines(tmp_path / "a.jsonl")
    assert rep.records == len(got) == 6 and rep.runs == 1
    assert [(m["metadata"]["branch_id"], m["metadata"]["step_id"],
             m["metadata"]["step_index"], m["metadata"]["attempt_no"],
             m["metadata"]["state"]) for m in got] == LIVE_A
    by_branch = [m["metadata"]["branch_id"] for m in got]
    assert (by_branch.count(0), by_branch.count(1), by_branch.count(2)) == (1, 2, 3)
    # nothing of an abandoned branch at or after its fork point: branch 0 had 5
    # attempts (4 at step_index >= 1), branch 1 had 4 (2 at step_index >= 2)
    assert not [m for m in got if m["metadata"]["branch_id"] == 0
                and m["metadata"]["step_index"] >= 1]
    assert not [m for m in got if m["metadata"]["branch_id"] == 1
                and m["metadata"]["step_index"] >= 2]
    for m, (b, step, _i, no, _s) in zip(got, LIVE_A, strict=True):
        assert m["messages"] == [
            {"role": "user", "content": text("prompt", "r-a", b, step, no)},
            {"role": "assistant", "content": text("output", "r-a", b, step, no)}]
        assert m["metadata"]["export_lsn"] == log.head
        assert m["metadata"]["tenant"] == T and m["metadata"]["workflow_version"] == "wf-1"
        # only the verdicts on the live branch graded this trajectory
        assert m["metadata"]["verdicts"] == [
            {"verifier": "judge@1", "passed": True, "score": 0.75,
             "snapshot_lsn": info["snap2"]},
            {"verifier": "lint@2", "passed": True, "score": None,
             "snapshot_lsn": info["snap2"]}]
    assert got[0]["metadata"]["usage"] == {
        "input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": None,
        "reasoning_tokens": None, "cost_usd": "0.000015000", "latency_ms": None}
    assert got[1]["metadata"]["usage"]["cost_usd"] == "0.500000000"

    export_live(log, tmp_path / "a.parquet", format="parquet", runs=["r-a"])
    rows = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert [(r["branch_id"], r["step_id"], r["step_index"], r["attempt_no"], r["state"])
            for r in rows] == LIVE_A
    assert rows[1]["cost_usd"] == Decimal("0.5") and rows[1]["input_tokens"] is None

    pairs = export_live(log, tmp_path / "p.jsonl", format="pairs", runs=["r-a"])
    got_pairs = lines(tmp_path / "p.jsonl")
    assert pairs.records == 2
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in got_pairs] == [
        (text("prompt", "r-a", 1, "code", 1), text("output", "r-a", 1, "code", 2),
         text("output", "r-a", 1, "code", 1)),
        (text("prompt", "r-a", 2, "test", 1), text("output", "r-a", 2, "test", 2),
         text("output", "r-a", 2, "test", 1))]
    assert [(p["metadata"]["rejected_branch_id"], p["metadata"]["rejected_attempt_no"],
             p["metadata"]["chosen_branch_id"], p["metadata"]["chosen_attempt_no"])
            for p in got_pairs] == [(1, 1, 1, 2), (2, 1, 2, 2)]

    # the whole log: runs by run_id, the cancel's dispatched attempt (no output) left out
    # of the chat and counted, the reduced prompt exported as its summary and flagged
    rep = export_live(log, tmp_path / "all.jsonl")
    every = lines(tmp_path / "all.jsonl")
    assert (rep.records, rep.skipped_no_output, rep.skipped_no_prompt) == (9, 1, 0)
    assert [m["metadata"]["run_id"] for m in every] == ["r-a"] * 6 + ["r-b"] + ["r-c"] * 2
    assert all(msg["content"] is not None for m in every for msg in m["messages"])
    assert every[6]["messages"][1] == {"role": "assistant", "content": UNICODE}
    with pytest.raises(pdm.ValidationError, match="keep_unanswered applies to the jsonl"):
        export_live(log, tmp_path / "x.parquet", format="parquet", keep_unanswered=True)
    kept = export_live(log, tmp_path / "kept.jsonl", keep_unanswered=True)
    assert (kept.records, kept.skipped_no_output) == (10, 0)
    b = lines(tmp_path / "kept.jsonl")[6:8]
    assert [(m["metadata"]["step_id"], m["metadata"]["state"]) for m in b] == [
        ("plan", "succeeded"), ("code", "dispatched")]
    assert b[1]["messages"] == [{"role": "user", "content": text("prompt", "r-b", 0, "code",
                                                                   1)}]
    c = every[7:]
    assert [m["messages"][0]["content"] for m in c] == ["summary: a long question"] * 2
    assert [(m["metadata"]["prompt_reduced"], m["metadata"]["output_reduced"])
            for m in c] == [(True, False), (True, False)]
    assert [m["messages"][1]["content"] for m in c] == [
        "half an answ\ufffd", text("output", "r-c", 0, "ask", 2)]
    only = export_live(log, tmp_path / "ok.jsonl", only_succeeded=True)
    assert only.records == 6  # r-a: plan, code#2, test#2, ship; r-b: plan; r-c: ask#2
    assert {m["metadata"]["state"] for m in lines(tmp_path / "ok.jsonl")} == {"succeeded"}


def test_parquet_loads_in_pyarrow_polars_duckdb_and_datasets(tmp_path: Path) -> None:
    import datasets
    import duckdb
    import polars as pl
    import pyarrow.parquet as pq

    log, _ = rich_log(str(tmp_path / "log"))
    path = tmp_path / "live.parquet"
    rep = export_live(log, path, format="parquet")
    export_live(log, tmp_path / "live.jsonl", keep_unanswered=True)
    chat = lines(tmp_path / "live.jsonl")
    expect_prompts = [m["messages"][0]["content"] for m in chat]
    expect_outputs = [m["messages"][1]["content"] if len(m["messages"]) > 1 else None
                      for m in chat]

    t = pq.read_table(path)
    df = pl.read_parquet(path)
    con = duckdb.connect()
    duck = con.execute("SELECT prompt, output FROM read_parquet(?)", [str(path)]).fetchall()
    hf = datasets.load_dataset("parquet", data_files=str(path), split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert rep.records == t.num_rows == df.height == len(duck) == hf.num_rows == 10
    for prompts, outputs in [
        (t.column("prompt").to_pylist(), t.column("output").to_pylist()),
        (df["prompt"].to_list(), df["output"].to_list()),
        ([r[0] for r in duck], [r[1] for r in duck]),
        (hf["prompt"], hf["output"]),
    ]:
        assert prompts == expect_prompts
        assert outputs == expect_outputs
    assert None in expect_outputs  # the cancelled run's dispatched attempt
    assert df["cost_usd"].sum() == Decimal("0.501215")
    assert hf[0]["verdicts"][0] == {"verifier": "judge@1", "passed": True, "score": 0.75,
                                    "snapshot_lsn": t.column("verdicts")[0][0]["snapshot_lsn"]
                                    .as_py()}


def big_log(root: str, attempts: int, body_bytes: int) -> tuple[pdm.EventLog, int]:
    """One run with ``attempts`` retries of one step, each with a distinct prompt and output
    of ``body_bytes`` ASCII bytes. Returns the log and the bytes of all bodies."""
    log = pdm.open_log(root)
    Recorder(log).commit(ev.RunStarted(T, "big", "wf-1"))
    half = body_bytes // 2
    for no in range(1, attempts + 1):
        with log.transaction() as tx:
            p = tx.put_blob(T, os.urandom(half).hex().encode())
            o = tx.put_blob(T, os.urandom(half).hex().encode())
            tx.append(ev.AttemptDispatched(T, "big", 0, "solve", 0, no, prompt=p))
            tx.append(ev.AttemptFinished(T, "big", 0, "solve", no,
                                         "succeeded" if no == attempts else "failed", output=o))
    return log, attempts * 2 * body_bytes


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_peak_memory_is_bounded_by_the_batch_budget(tmp_path: Path, fmt: str) -> None:
    budget = 2 << 20
    log, total = big_log(str(tmp_path / "log"), attempts=48, body_bytes=256 << 10)
    assert total >= 10 * budget
    log.read_events()  # segments cached before measuring: only the export is measured
    tracemalloc.start()
    try:
        rep = export_live(log, tmp_path / "out", format=fmt, batch_size=budget,
                          max_workers=4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rep.records == 48
    # two batches in flight (one being written, one being fetched), for parquet also the
    # row group being assembled, plus a fixed few MiB (the writer thread's queue, one
    # record being encoded). tracemalloc sees Python objects, which hold every body.
    batches = 2 if fmt == "jsonl" else 3
    assert peak < batches * budget + (4 << 20), f"peak {peak} bytes"
    assert peak < total / 2


@pytest.mark.parametrize("backend", ["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_failed_export_leaves_no_partial_file(tmp_path: Path, backend: str,
                                                request: pytest.FixtureRequest) -> None:
    import fsspec

    log, _ = big_log(str(tmp_path / "log"), attempts=20, body_bytes=8 << 10)
    opts = None
    if backend == "local":
        folder = str(tmp_path / "out")
        os.mkdir(folder)  # an export never creates a missing directory
    elif backend == "memory":
        folder = f"memory://export-{uuid.uuid4().hex}"
    else:
        opts = request.getfixturevalue("s3").storage_options
        folder = f"s3://poimen-test/{uuid.uuid4().hex}"
    fs, base = fsspec.core.url_to_fs(folder, **(opts or {}))
    dest = f"{folder}/live.jsonl"
    first = export_live(log, dest, dest_options=opts)
    assert first.records == 20
    published = fs.cat_file(f"{base}/live.jsonl")
    assert hashlib.sha256(published).hexdigest() == first.sha256
    assert len(published) == first.bytes and published.count(b"\n") == 20

    # the body of the last attempt's output disappears from under the log
    last = log.read_events().to_pylist()[-1]["output"]
    os.unlink(tmp_path / "log" / "blobs" / T / last["sha256"][:2] / last["sha256"])
    seen: list[ExportProgress] = []
    with pytest.raises(pdm.NotFound):
        export_live(log, dest, dest_options=opts, batch_size=16 << 10,
                    progress=seen.append)
    assert seen and seen[-1].records >= 10  # batches were written before the failure
    fs.invalidate_cache()
    assert fs.cat_file(f"{base}/live.jsonl") == published
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)] == ["live.jsonl"]


def test_bodies_of_every_size_are_encoded_exactly(tmp_path: Path) -> None:
    """Small records take one orjson call, large ones are escaped in chunks; bodies are
    fetched in groups shared across rows. Either way each line is exactly the canonical
    encoding of the expected record. (Speed is measured by ``poimen bench --only export``,
    not by a timed test.)"""
    from poimen_data.jobs import _export
    from poimen_data.jobs import _export_formats as fmts

    chunk, one_call = fmts._CHUNK, fmts._ONE_CALL
    # non-ASCII and escapes straddling the chunk boundaries, invalid UTF-8, a body
    # exactly at the one-call limit and one just over it
    edge = ("x" * (chunk - 1) + "é\"🙂\n" + "y" * (chunk - 2) + "東\x00").encode()
    bodies = [b"", b"short", edge, b"a" * one_call, b"b" * (one_call + 1),
              edge * 5 + b"\xff\xfe cut \xe6\x9d", "ü".encode() * (one_call // 2)]
    log = pdm.open_log(str(tmp_path / "log"))
    rec = Recorder(log)
    rec.commit(ev.RunStarted(T, "big", "wf-1"))
    n = _export._GROUP_REFS + 7  # more refs than one fetch group holds
    expect = []
    for no in range(1, n + 1):
        prompt, output = bodies[no % len(bodies)], bodies[(no * 3) % len(bodies)]
        state = "succeeded" if no == n else "failed"
        rec.attempt("big", 0, "solve", 0, no, state, prompt=prompt.decode("latin-1"),
                    output=output)
        expect.append((prompt.decode("utf-8", "replace"), output.decode("utf-8", "replace"),
                       state))
    # the Recorder encodes a str prompt as UTF-8: use the bytes actually stored
    got_prompts = [log.blobs.get(ev.BlobRef(**r["prompt"]))
                   for r in log.read_events().to_pylist() if r["prompt"] is not None]
    expect = [(p.decode("utf-8", "replace"), o, st)
              for p, (_, o, st) in zip(got_prompts, expect, strict=True)]

    rep = export_live(log, tmp_path / "out.jsonl", batch_size=one_call)
    want = b"".join(orjson.dumps({
        "messages": [{"content": p, "role": "user"}, {"content": o, "role": "assistant"}],
        "metadata": {"run_id": "big", "tenant": T, "branch_id": 0, "step_id": "solve",
                     "step_index": 0, "attempt_no": no, "state": st, "workflow_version": "wf-1",
                     "usage": dict.fromkeys(fmts.USAGE_FIELDS), "verdicts": [],
                     "prompt_reduced": False, "output_reduced": False,
                     "export_lsn": log.head}}, option=orjson.OPT_SORT_KEYS) + b"\n"
        for no, (p, o, st) in enumerate(expect, 1))
    data = (tmp_path / "out.jsonl").read_bytes()
    assert data == want
    assert (rep.records, rep.runs, rep.bytes, rep.sha256) == (
        n, 1, len(want), hashlib.sha256(want).hexdigest())

    # pairs: every failed attempt with the one success, byte for byte
    export_live(log, tmp_path / "pairs.jsonl", format="pairs", batch_size=one_call)
    pairs = lines(tmp_path / "pairs.jsonl")
    assert [(x["prompt"], x["rejected"], x["chosen"]) for x in pairs] == [
        (p, o, expect[-1][1]) for p, o, _ in expect[:-1]]


def test_a_body_committed_again_after_its_reduction_still_exports_its_summary(tmp_path) -> None:
    """Events alone say what is reduced (README, Export): the same assembled prompt put
    again after its reduction is stored again and read by blob_text, yet both attempts
    that name it export the summary, from the log and from the state alike."""
    import pyarrow.parquet as pq

    log = pdm.open_log(tmp_path / "log")
    with log.transaction() as tx:
        p = tx.put_blob("acme", b"the same prompt")
        o = tx.put_blob("acme", b"answer one")
        tx.extend([ev.RunStarted("acme", "r", "v1"),
                   ev.AttemptDispatched("acme", "r", 0, "s", 0, 1, prompt=p),
                   ev.AttemptFinished("acme", "r", 0, "s", 1, "failed", output=o)])
    reduce(log, [p], lambda body: b"a summary")
    with log.transaction() as tx:
        assert tx.put_blob("acme", b"the same prompt") == p
        o2 = tx.put_blob("acme", b"answer two")
        tx.extend([ev.AttemptDispatched("acme", "r", 0, "s", 0, 2, prompt=p),
                   ev.AttemptFinished("acme", "r", 0, "s", 2, "succeeded", output=o2)])
    assert log.blobs.get(p) == b"the same prompt"
    with pdm.connect(log, source="log") as con:
        assert con.sql("select attempt_no, blob_text(prompt) from attempts order by 1"
                       ).fetchall() == [(1, "the same prompt"), (2, "the same prompt")]
    want = [(1, "a summary", True, "answer one"), (2, "a summary", True, "answer two")]
    shas = set()
    for source in ("log", "state"):
        if source == "state":
            materialize(log)
        out = tmp_path / f"{source}.parquet"
        report = export_live(log, str(out), format="parquet", source=source)
        assert report.reduced == 2
        assert [(r["attempt_no"], r["prompt"], r["prompt_reduced"], r["output"])
                for r in pq.read_table(out).to_pylist()] == want
        shas.add(hashlib.sha256(out.read_bytes()).hexdigest())
    assert len(shas) == 1


def test_a_body_reduced_after_the_reductions_were_read_is_found_by_reading_them_again(
        tmp_path) -> None:
    """An export reads the reductions committed after its LSN once, at its first body
    found reduced; a second reduction committed later (by another process) was missed, and
    the export failed with NotFound. The fetcher is driven directly: no timing involved."""
    from concurrent.futures import ThreadPoolExecutor

    from poimen_data.jobs import _export

    log = pdm.open_log(tmp_path / "log")
    with log.transaction() as tx:
        refs = [tx.put_blob("acme", b"body %d" % i) for i in range(2)]
        tx.append(ev.RunStarted("acme", "r", "wf"))
    other = pdm.open_log(tmp_path / "log")
    with ThreadPoolExecutor(1) as pool:
        fetcher = _export._Fetcher(log, pool)
        reduce(other, [refs[0]], lambda body: b"summary 0")
        assert fetcher._body(refs[0]) == (b"summary 0", True)  # reads the reductions
        reduce(other, [refs[1]], lambda body: b"summary 1")
        assert fetcher._body(refs[1]) == (b"summary 1", True)  # read again


@pytest.mark.parametrize("inside", ["_log/00000000000000000001.json", "_poimen.json",
                                    "segments/x.arrow", "blobs/acme/new.jsonl",
                                    "state/runs/x.parquet"])
def test_an_export_never_writes_into_the_log_s_own_files(tmp_path, inside: str) -> None:
    """export_live replaced a manifest or a segment it was pointed at (the log then failed
    to open); anything of the log's own layout is refused now, a folder of one's own under
    the root is not."""
    root = tmp_path / "log"
    log = pdm.open_log(root)
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "r", "wf"))
    pdm.materialize(log)
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for dest in (str(root / inside), f"file://{root}/{inside}"):
        with pytest.raises(pdm.ValidationError, match="inside the log's own"):
            export_live(log, dest)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    (root / "exports").mkdir()
    report = export_live(str(root), str(root / "exports" / "live.jsonl"))
    assert report.export_lsn == log.head and (root / "exports" / "live.jsonl").is_file()
    assert pdm.open_log(root).head == log.head


def test_an_export_from_the_log_reads_each_segment_once(tmp_path: Path) -> None:
    """From a log with no state that fits the budget (one bucket group), the fold's views
    read ``events`` many times, and each read scanned the whole log again (23 scans of
    it for one export: 11.8 MiB/s in ``poimen bench``'s export against 79 now). The
    export folds it once into tables; the bytes are those of the state's export."""
    from poimen_data.workload.synth import generate

    log = pdm.open_log(str(tmp_path / "log"))
    generate(log, runs=30, seed=3, batch=5)
    scan, reads = log._scan_segment, []

    def counted(s: Any) -> Any:
        reads.append(s.path)
        return scan(s)

    log._scan_segment = counted  # type: ignore[method-assign]
    cold = export_live(log, str(tmp_path / "cold.jsonl"), source="log")
    assert cold.source == "log"
    assert sorted(reads) == sorted(s.path for s in log.segments()), len(reads)
    log._scan_segment = scan  # type: ignore[method-assign]
    materialize(log)
    warm = export_live(log, str(tmp_path / "warm.jsonl"), source="state")
    assert (tmp_path / "cold.jsonl").read_bytes() == (tmp_path / "warm.jsonl").read_bytes()
    assert cold.sha256 == warm.sha256 and cold.records == warm.records > 0
