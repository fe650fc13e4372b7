"""The ``poimen`` command on a demo root: each command, and each kind of bad input giving
one line on stderr and its exit status (1 error, 2 usage, 3 not available yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import poimen_data as pdm
from poimen_data import cli, synth

RUNS, SEED = 40, 1
runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console():
    """Tables as wide as they need, so the fragments below are never wrapped."""
    old = cli.out.width, cli.err.width
    cli.out.width = cli.err.width = 250
    yield
    cli.out.width, cli.err.width = old


def poimen(*args: str, input: str | None = None):
    return runner.invoke(cli.app, list(args), input=input, catch_exceptions=False)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, object]:
    root = str(tmp_path_factory.mktemp("cli") / "demo")
    cli.out.width = 250
    r = poimen("demo", "--runs", str(RUNS), "--seed", str(SEED), "--root", root)
    return root, r


def test_demo_records_and_reports(demo_root) -> None:
    root, r = demo_root
    assert r.exit_code == 0, r.stderr
    n_events = sum(len(u.events) for u in synth.units(RUNS, seed=SEED))
    assert f"Created {root}: recorded {RUNS} runs ({n_events:,} events" in r.stdout
    for fragment in ("Runs by state", "Attempts by outcome",
                     "Failure rate by step and workflow version", "Bodies:",
                     "The batch chain", f"Files under {root}", "exports/live.jsonl",
                     "Try next", 'poimen sql "select workflow_version, step_id'):
        assert fragment in r.stdout
    log = pdm.open_log(root, create=False)
    con = pdm.connect(log)
    assert con.sql("select count(*) from runs").fetchall() == [(RUNS,)]
    assert con.sql("select count(*) from verdicts").fetchall()[0][0] > 0
    assert os.path.getsize(f"{root}/exports/live.jsonl") > 0
    # the whole nightly chain ran, compact first: its commits' small segments are merged
    assert sum(m.kind == "compact" for m in log.manifests()) == 1
    assert len(log.segments()) < log.head_seq // 2


def test_demo_twice_replaces_its_root_and_never_a_foreign_dir(tmp_path: Path) -> None:
    root = str(tmp_path / "d")
    assert poimen("demo", "--runs", "5", "--root", root, "--json").exit_code == 0
    r = poimen("demo", "--runs", "6", "--root", root, "--json")
    assert r.exit_code == 0
    facts = json.loads(r.stdout)
    assert facts["root_was"] == "replaced" and facts["summary"]["runs"] == 6
    con = pdm.connect(root)
    assert con.sql("select count(*) from runs").fetchall() == [(6,)]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    r = poimen("demo", "--root", str(foreign))
    assert r.exit_code == 1
    assert r.stderr == (f"error: {foreign} exists and is not a poimen log; the demo will not "
                        "overwrite it (choose another --root)\n")
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_sql_tables_json_and_a_prompt_on_stdin(demo_root) -> None:
    root, _ = demo_root
    r = poimen("sql", "select count(*) as n from runs", "--root", root)
    assert r.exit_code == 0 and f"│ {RUNS} " in r.stdout and "(1 row)" in r.stdout
    r = poimen("sql", "select count(*) as n from runs", "--root", root, "--json")
    assert json.loads(r.stdout) == [{"n": RUNS}]
    r = poimen("sql", "select run_id from runs order by run_id", "--max-rows", "2",
               "--root", root)
    assert f"({RUNS} rows; showing 2 (--max-rows))" in r.stdout
    r = poimen("sql", "--root", root, input="select 41 + 1 as answer;\n\nselec\n\\q\n")
    assert r.exit_code == 0 and "│ 42 " in r.stdout
    assert r.stderr == 'error: SQL: Parser Error: syntax error at or near "selec"\n'


def test_sql_explain_prints_the_view_sql(demo_root) -> None:
    from poimen_data.fold import _fold

    r = poimen("sql", "--explain", "trajectories")
    assert r.exit_code == 0 and r.stdout.strip() == _fold.view_sql("trajectories").strip()
    r = poimen("sql", "--explain", "nope")
    assert r.exit_code == 1
    assert r.stderr == ("error: no view 'nope'; views are anomalies, attempts, branches, "
                        "reductions, runs, trajectories, verdicts\n")


@pytest.mark.parametrize(("query", "message"), [
    ("selec 1", 'error: SQL: Parser Error: syntax error at or near "selec"'),
    ("select * from nope", "error: SQL: Catalog Error: Table with name nope does not exist!"),
])
def test_malformed_sql_is_one_line(demo_root, query: str, message: str) -> None:
    root, _ = demo_root
    r = poimen("sql", query, "--root", root)
    assert (r.exit_code, r.stderr, r.stdout) == (1, message + "\n", "")


def test_show_an_episode_with_forks(demo_root) -> None:
    root, _ = demo_root
    con = pdm.connect(root)
    run, n_branches = con.sql("select run_id, n_branches from runs where n_branches > 2 "
                              "and run_id in (select run_id from verdicts) "
                              "order by run_id limit 1").fetchall()[0]
    r = poimen("show", run, "--all-branches", "--root", root)
    assert r.exit_code == 0
    assert r.stdout.startswith(f"{run} tenant ")
    for b in range(n_branches):
        assert f"branch {b}" in r.stdout
    assert "forked from " in r.stdout and " (live)" in r.stdout
    r = poimen("show", run, "--root", root, "--json")
    view = json.loads(r.stdout)
    assert view["run_id"] == run and len(view["branches"]) == 1
    assert view["branches"][0]["is_live"] is True
    assert view == json.loads(poimen("show", run, "--root", root, "--json").stdout)
    # the run's verdicts (run and attempt verdicts), as the verdicts view holds them
    verdicts = con.execute(
        "select verifier, snapshot_lsn, branch_id, step_id, attempt_no, passed, score, "
        "detail, lsn from verdicts where run_id = ? order by lsn", [run]).fetchall()
    assert verdicts
    assert [tuple(v.values()) for v in view["verdicts"]] == verdicts
    table = poimen("show", run, "--root", root).stdout
    assert all(v[0] in table for v in verdicts)


@pytest.mark.parametrize(("args", "message"), [
    (["show", "run-999999"], "error: no run 'run-999999'"),
    (["show", "bad id!"], "error: show: field 'run_id' must match"),
    (["grade", "-v", "justname"], "error: --verifier 'justname' must be MODULE:NAME"),
    (["grade", "-v", "nomodule_xyz:f"],
     "error: --verifier 'nomodule_xyz:f': cannot import nomodule_xyz: No module named"),
    (["grade", "-v", "poimen_data.verifiers:nope"],
     "error: --verifier 'poimen_data.verifiers:nope': poimen_data.verifiers has no nope"),
    (["export", "--format", "xml", "--out", "x.xml"],
     "error: export: format must be one of ('jsonl', 'parquet', 'pairs', 'atif'), got 'xml'"),
    (["reduce"], "error: say what to reduce: --larger-than BYTES or --ref TENANT/SHA256/SIZE"),
    (["reduce", "--ref", "acme/abc"], "error: --ref 'acme/abc' must be TENANT/SHA256/SIZE"),
    (["sql", "select 1", "--at-lsn", "999999999"], "error: at_lsn 999999999 is outside 0.."),
])
def test_bad_input_gives_one_line_and_exit_1(demo_root, args: list[str], message: str) -> None:
    root, _ = demo_root
    r = poimen(*args, "--root", root)
    assert r.exit_code == 1
    assert r.stderr.startswith(message) and r.stderr.count("\n") == 1


def test_missing_root_and_bad_url(tmp_path: Path) -> None:
    missing = str(tmp_path / "none")
    for cmd in (["log"], ["sql", "select 1"], ["show", "r1"], ["materialize"], ["grade"]):
        r = poimen(*cmd, "--root", missing)
        assert r.exit_code == 1
        assert r.stderr == (f"error: no poimen log at {missing} (make one with `poimen demo "
                            f"--root {missing}`, or pass --root / set POIMEN_ROOT)\n")
    r = poimen("log", "--root", "nosuchproto://x")
    assert (r.exit_code, r.stderr) == (
        1, "error: cannot open storage 'nosuchproto://x': Protocol not known: nosuchproto\n")
    r = runner.invoke(cli.app, ["log"], env={"POIMEN_ROOT": missing})
    assert r.exit_code == 1 and f"no poimen log at {missing}" in r.stderr


def test_log_lists_commits(demo_root) -> None:
    root, _ = demo_root
    log = pdm.open_log(root, create=False)
    n = sum(1 for _ in log.manifests())
    r = poimen("log", "--limit", "3", "--root", root)
    assert f"{root}: {n} commits, head LSN {log.head}" in r.stdout
    assert f"({n - 3} older commits not shown; --limit)" in r.stdout
    rows = json.loads(poimen("log", "--limit", "3", "--root", root, "--json").stdout)
    assert [x["seq"] for x in rows] == [n - 2, n - 1, n]
    with_events = [x for x in rows if x["events"]]
    assert with_events[-1]["last_lsn"] == log.head
    # only the last three manifests are read, however long the log (it read all n)
    fresh = pdm.open_log(root, create=False)
    before = dict(fresh.storage.calls)
    total, got = cli.commit_rows(fresh, 3)
    assert (total, got) == (n, rows)
    used = {k: v - before.get(k, 0) for k, v in fresh.storage.calls.items()
            if v != before.get(k, 0)}
    assert used == {"read": 5}, used  # seq n + 1 probed twice (the head, then the end)


def test_materialize_check_grade_export(demo_root, tmp_path: Path) -> None:
    root, _ = demo_root
    head = pdm.open_log(root, create=False).head
    r = poimen("materialize", "--root", root)
    assert r.exit_code == 0
    assert r.stdout.startswith(f"state covers LSN {head} (head {head}): ")
    r = poimen("materialize", "--root", root, "--json")
    assert json.loads(r.stdout)["lsn"] == head
    r = poimen("materialize", "--full", "--memory-limit", "256MB", "--root", root, "--json")
    rep = json.loads(r.stdout)
    assert (r.exit_code, rep["lsn"], rep["full"]) == (0, head, True)
    state = sorted((p.relative_to(root), p.read_bytes()) for p in Path(root).rglob("*")
                   if p.is_file())
    for cmd in (("materialize",), ("sql", "select 1")):  # the option named as typed
        r = poimen(*cmd, "--memory-limit", "lots", "--root", root)
        assert r.exit_code == 1 and r.stderr.startswith("error: --memory-limit: expected a "
                                                        "size") and "got 'lots'" in r.stderr
        assert r.stderr.count("\n") == 1
    assert state == sorted((p.relative_to(root), p.read_bytes())
                           for p in Path(root).rglob("*") if p.is_file())
    r = poimen("check", "--root", root)
    assert r.exit_code == 0
    assert r.stdout.startswith(f"state at lsn {head} equals a cold re-fold: ")
    assert r.stdout.endswith(f" files, {RUNS} episodes\n")
    con = pdm.connect(root)
    verifying = con.sql("select count(*) from runs where state = 'verifying'").fetchall()[0][0]
    rep = json.loads(poimen("grade", "--root", root, "--json").stdout)
    assert (rep["runs_graded"], rep["runs_skipped"]) == (0, verifying)
    run = con.sql("select run_id from runs where state = 'verifying' order by run_id "
                  "limit 1").fetchall()[0][0]
    r = poimen("grade", "-v", "poimen_data.verifiers:exit_code", "--run", run, "--force",
               "--root", root)
    assert r.exit_code == 0 and "1 verdicts in 1 commits" in r.stdout
    assert "│ exit_code@1 │ 1      │ 0       │" in r.stdout
    dest = str(tmp_path / "live.jsonl")
    rep = json.loads(poimen("export", "--out", dest, "--root", root, "--json").stdout)
    lines = Path(dest).read_text().splitlines()
    assert rep["records"] == len(lines) and rep["runs"] == RUNS
    assert json.loads(lines[0])["messages"][0]["role"] == "user"


def test_export_only_succeeded(tmp_path: Path) -> None:
    root = str(tmp_path / "x")
    synth.generate(root, runs=6, seed=4, batch=1)
    log = pdm.open_log(root, create=False)
    want = pdm.export_live(log, str(tmp_path / "want.jsonl"), only_succeeded=True)
    every = pdm.export_live(log, str(tmp_path / "every.jsonl"))
    assert 0 < want.records < every.records
    dest = str(tmp_path / "ok.jsonl")
    r = poimen("export", "--only-succeeded", "--out", dest, "--root", root)
    assert (r.exit_code, r.stderr) == (0, "")
    assert r.stdout == (f"wrote {dest}: {want.records} records of {want.runs} runs, "
                        f"{want.bytes:,} bytes, jsonl from log at LSN {log.head}, "
                        f"sha256 {want.sha256}\n")
    assert Path(dest).read_bytes() == (tmp_path / "want.jsonl").read_bytes()
    states = {json.loads(x)["metadata"]["state"] for x in Path(dest).read_text().splitlines()}
    assert states == {"succeeded"}
    r = poimen("export", "--only-succeeded", "--format", "pairs", "--out", dest,
               "--root", root)
    assert (r.exit_code, r.stderr) == (
        1, "error: export: only_succeeded leaves no failed attempt to pair\n")


def test_export_keep_unanswered(tmp_path: Path) -> None:
    root = str(tmp_path / "x")
    synth.generate(root, runs=8, seed=1, batch=1)
    log = pdm.open_log(root, create=False)
    chat = pdm.export_live(log, str(tmp_path / "chat.jsonl"))
    kept = pdm.export_live(log, str(tmp_path / "kept.jsonl"), keep_unanswered=True)
    assert chat.skipped_no_output > 0 and kept.skipped_no_output == 0
    assert kept.records == chat.records + chat.skipped_no_output
    dest = str(tmp_path / "out.jsonl")
    r = poimen("export", "--out", dest, "--root", root)
    assert r.exit_code == 0
    assert r.stdout.splitlines()[1] == (
        f"left out {chat.skipped_no_output} attempts with no output and 0 with no prompt "
        "(--keep-unanswered keeps the first)")
    r = poimen("export", "--keep-unanswered", "--out", dest, "--root", root)
    assert (r.exit_code, len(r.stdout.splitlines())) == (0, 1)
    assert Path(dest).read_bytes() == (tmp_path / "kept.jsonl").read_bytes()
    for line in Path(dest).read_text().splitlines():
        assert all(m["content"] is not None for m in json.loads(line)["messages"])


def test_maintenance_commands(tmp_path: Path) -> None:
    root = str(tmp_path / "m")
    s = synth.generate(root, runs=12, seed=2, batch=1)
    r = poimen("check", "--root", root)
    assert (r.exit_code, r.stderr) == (
        1, f"error: state differs from a cold re-fold: no materialized state in {root}\n")
    big = s.max_body - 1
    r = poimen("reduce", "--larger-than", str(big), "--dry-run", "--root", root)
    assert r.stdout == f"would reduce 1 bodies, {s.max_body:,} bytes\n"
    r = poimen("reduce", "--larger-than", str(2**63), "--dry-run", "--root", root)
    assert (r.exit_code, r.stdout) == (0, "would reduce 0 bodies, 0 bytes\n")  # past int64
    r = poimen("reduce", "--larger-than", str(big), "--keep", "64", "--root", root, "--json")
    rep = json.loads(r.stdout)
    assert len(rep["reduced"]) == 1 and rep["bytes_freed"] == s.max_body
    orig = pdm.BlobRef(**rep["reduced"][0][0])
    assert pdm.open_log(root).blobs.get(orig) is None
    rep = json.loads(poimen("compact", "--root", root, "--json").stdout)
    assert rep["segments_before"] == s.commits + 1 and rep["segments_after"] == 1
    rep = json.loads(poimen("vacuum", "--grace", "0", "--root", root, "--json").stdout)
    assert rep["segments_removed"] == s.commits + 1
    r = poimen("compact", "--root", root)
    assert r.exit_code == 0 and "segments_after" in r.stdout


def test_bench_one_scenario_and_an_unknown_one(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    r = poimen("bench", "--quick", "--only", "event_objects", "--json", str(path),
               "--work-dir", str(tmp_path / "work"))
    assert r.exit_code == 0, r.stdout
    doc = json.loads(path.read_text())
    assert [x["name"] for x in doc["results"]] == ["event_objects"]
    r = poimen("bench", "--only", "nope")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: no scenario 'nope'; scenarios: bulk_ingest, ")


@pytest.mark.parametrize("command", ["demo", "sql", "show", "materialize", "check", "grade",
                                     "export", "compact", "vacuum", "reduce", "log", "bench"])
def test_every_command_has_help_with_an_example(command: str) -> None:
    r = poimen(command, "--help")
    assert r.exit_code == 0 and "Example:" in r.stdout and f"poimen {command}" in r.stdout


def test_usage_errors_exit_2() -> None:
    assert poimen("nope").exit_code == 2
    assert poimen("demo", "--runs", "0").exit_code == 2


def test_console_script_prints_no_traceback(demo_root) -> None:
    root, _ = demo_root
    exe = Path(sys.executable).with_name("poimen")
    p = subprocess.run([str(exe), "show", "run-424242", "--root", root],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: no run 'run-424242'") and p.stderr.count("\n") == 1


def test_the_three_suggested_queries_run(demo_root) -> None:
    from poimen_data.workload.demo import QUERIES

    root, _ = demo_root
    for _title, q in QUERIES:
        r = poimen("sql", q, "--root", root, "--json")
        assert r.exit_code == 0, r.stderr
        assert len(json.loads(r.stdout)) >= 2


SQL_JSON_QUERIES = [
    "select range as i, [range, range + 1] as l, {'a': 'x\ny\"é', 'b': range / 3} as s, "
    "'nan'::double as f, date '2024-01-02' as d, null as n from range(3)",
    "select 1 as x where false",
    "select * from range(2500)",  # several of DuckDB's batches
]


@pytest.mark.parametrize("query", SQL_JSON_QUERIES)
def test_sql_json_streams_the_bytes_of_the_whole_list(tmp_path: Path, query: str) -> None:
    """``poimen sql --json`` writes a row at a time: the same bytes as ``json.dumps`` of
    the whole list (indent 2, non-ASCII kept, NaN as "nan", dates ISO)."""
    import duckdb

    from poimen_data.jobs import chain

    root = str(tmp_path / "log")
    pdm.open_log(root)
    rows = duckdb.sql(query).to_arrow_table().to_pylist()
    want = json.dumps(chain.jsonable(rows), indent=2, ensure_ascii=False) + "\n"
    r = poimen("sql", "--json", query, "--root", root)
    assert (r.exit_code, r.stdout) == (0, want)


PEAK = ("int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
        " * 1024")


@pytest.mark.slow
def test_sql_json_holds_a_batch_not_the_result(tmp_path: Path) -> None:
    """100,000 rows of about 600 bytes of JSON each: the CLI's peak RSS stays within
    160 MiB of the bare interpreter's (measured: 59 MiB; 292 MiB when it held the rows
    and their text)."""
    root = str(tmp_path / "log")
    pdm.open_log(root)
    child = ("import atexit, sys\n"
             f"atexit.register(lambda: sys.stderr.write('RSS ' + str({PEAK}) + '\\n'))\n"
             "from poimen_data.cli import app\napp(sys.argv[1:])\n")
    query = "select range as i, repeat('x', 500) as s from range(100000)"
    out = tmp_path / "out.json"
    with out.open("wb") as f:
        r = subprocess.run([sys.executable, "-c", child, "sql", "--json", query, "--root",
                            root], stdout=f, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    peak = int(r.stderr.split("RSS ")[-1])
    base = int(subprocess.run([sys.executable, "-c", f"import poimen_data.cli\nprint({PEAK})"],
                              capture_output=True, text=True, check=True).stdout)
    rows = json.loads(out.read_bytes())
    assert (len(rows), rows[-1]["i"], sum(r["i"] for r in rows)) == (100000, 99999,
                                                                      4999950000)
    assert {len(r["s"]) for r in rows} == {500}
    print(f"sql --json: {(peak - base) >> 20} MiB over the interpreter")
    assert peak - base < 160 << 20, ((peak - base) >> 20)
