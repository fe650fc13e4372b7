"""What a hostile or careless CLI user met (issue 16, I and J, and ``poimen sql``'s
stance): one ``error:`` line and a non-zero exit instead of a traceback; an export that
never replaces a special file nor creates a directory, and whose killed temp file is
removed by the next export; SQL closed to files, URLs and extensions by default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import poimen_data as pdm
from poimen_data import cli
from poimen_data.storage import _dest
from poimen_data.testing import record_run

runner = CliRunner()
STEPS = [("plan", ["succeeded"]), ("code", ["failed", "succeeded"])]


def poimen(*args: str):
    return runner.invoke(cli.app, list(args), catch_exceptions=False)


def _one_error_line(r, fragment: str, code: int = 1) -> None:
    assert r.exit_code == code, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert fragment in lines[0], r.output


def three_runs(folder: Path) -> pdm.EventLog:
    log = pdm.open_log(str(folder / "log"))
    for i in range(3):
        record_run(log, f"run-{i}", STEPS)
    return log


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return three_runs(tmp_path_factory.mktemp("hardening")).root


# --- I: no tracebacks --------------------------------------------------------------------

@pytest.mark.parametrize("args", [["sql", "--root", "s3://", "select 1"],
                                  ["log", "--root", "s3:///"],
                                  ["export", "--out", "s3://"]])
def test_an_s3_url_without_a_bucket_is_one_line(args: list[str], root: str) -> None:
    if args[0] == "export":
        args = [*args, "--root", root]
    _one_error_line(poimen(*args), "names no path (e.g. s3://bucket/prefix)")


def _no_credentials_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env.update(AWS_EC2_METADATA_DISABLED="true",  # never the metadata address
               AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               # loopback, nothing listens: signing fails before any connection anyway
               FSSPEC_S3_ENDPOINT_URL="http://127.0.0.1:9", HOME=str(tmp_path))
    return env


@pytest.mark.parametrize("which", ["root", "out"])
def test_s3_without_credentials_is_one_line(which: str, root: str, tmp_path: Path) -> None:
    args = ["sql", "--root", "s3://poimen-test/nowhere", "select 1"] if which == "root" \
        else ["export", "--root", root, "--out", "s3://poimen-test/live.jsonl"]
    p = subprocess.run([sys.executable, "-m", "poimen_data.cli", *args], capture_output=True,
                       text=True, env=_no_credentials_env(tmp_path), timeout=300)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == "error: storage: NoCredentialsError: Unable to locate " \
                               "credentials", p.stderr


def test_bad_verifier_specs_are_one_line(root: str, tmp_path: Path) -> None:
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    _one_error_line(poimen("grade", "--root", root, "--verifier", ".foo:bar"),
                    "--verifier '.foo:bar': a relative module name")
    _one_error_line(poimen("grade", "--root", root, "--verifier", f"{tmp_path}/syntax.py:f"),
                    f"syntax error in {tmp_path}/syntax.py line 1")
    _one_error_line(poimen("grade", "--root", root, "--verifier", f"{tmp_path}/raises.py:f"),
                    "raised RuntimeError: boom at import")


# --- J: export destinations --------------------------------------------------------------

def test_export_never_replaces_a_symlink_or_a_fifo(root: str, tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_bytes(b"keep me")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    _one_error_line(poimen("export", "--root", root, "--out", str(link)),
                    f"export: {link} is a symlink; refusing to replace it")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"keep me"
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    _one_error_line(poimen("export", "--root", root, "--out", str(fifo)),
                    f"export: {fifo} is a FIFO; refusing to replace it")
    assert fifo.is_fifo()
    # a chained URL over the same files: its file system is not the one checked
    folder = tmp_path / "dir.jsonl"
    folder.mkdir()
    for dest in (link, fifo, folder):
        _one_error_line(poimen("export", "--root", root, "--out", f"simplecache::file://{dest}"),
                        "is a chained URL; name the destination itself")
    assert link.is_symlink() and target.read_bytes() == b"keep me" and fifo.is_fifo()
    assert list(folder.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.jsonl", "fifo.jsonl",
                                                          "link.jsonl", "precious.txt"]


def test_export_into_a_missing_directory_is_an_error(root: str, tmp_path: Path) -> None:
    dest = tmp_path / "missing" / "live.jsonl"
    _one_error_line(poimen("export", "--root", root, "--out", str(dest)),
                    f"export: directory {tmp_path / 'missing'} does not exist")
    assert not (tmp_path / "missing").exists()


CHILD = """
import sys
import poimen_data as pdm

def stop(progress):
    sys.stdout.write("writing\\n")
    sys.stdout.flush()
    sys.stdin.read()  # parked until killed

pdm.export_live(sys.argv[1], sys.argv[2], progress=stop, batch_size=1)
"""


def test_a_killed_exports_temp_file_is_removed_by_the_next_export(root: str,
                                                                   tmp_path: Path) -> None:
    dest = tmp_path / "live.jsonl"
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, str(dest)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"writing\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".live.jsonl.")]
    assert len(left) == 1 and left[0].name.endswith(".tmp") and not dest.exists()
    # young (it might be a live export's between creating and locking its file): kept
    assert pdm.export_live(root, str(dest)).records > 0
    assert left[0].exists()
    old = time.time() - _dest.STALE_TEMP_S - 1
    os.utime(left[0], (old, old))
    report = pdm.export_live(root, str(dest))
    assert not left[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.jsonl"]
    assert report.records > 0


def test_a_live_exports_temp_file_is_kept(tmp_path: Path) -> None:
    import fcntl

    dest = str(tmp_path / "out.jsonl")
    f, tmp = _dest.open_temp(dest)  # locked by this (live) process
    try:
        old = time.time() - _dest.STALE_TEMP_S - 1
        os.utime(tmp, (old, old))
        assert _dest.sweep_stale(dest) == [] and os.path.exists(tmp)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)  # as if its process died
        assert _dest.sweep_stale(dest) == [tmp] and not os.path.exists(tmp)
    finally:
        f.close()


# --- poimen sql is read-only towards the outside by default ------------------------------

@pytest.mark.parametrize("query", [
    "select * from read_csv('{secret}')",
    "select * from read_text('{secret}')",
    "copy (select 1 as x) to '{out}'",
    "attach '{out}' as other",
    "install httpfs",
    "load httpfs",
    "set enable_external_access = true",
    "set lock_configuration = false",
])
def test_sql_cannot_reach_files_or_extensions_by_default(query: str, root: str,
                                                          tmp_path: Path) -> None:
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    out = tmp_path / "written.csv"
    r = poimen("sql", "--root", root, query.format(secret=secret, out=out))
    assert r.exit_code == 1, r.output
    assert r.output.startswith("error: SQL: "), r.output
    assert "a,b" not in r.output and "1" not in r.output.split("error: SQL: ")[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.csv"]


@pytest.fixture(scope="module")
def materialized(tmp_path_factory: pytest.TempPathFactory) -> str:
    log = three_runs(tmp_path_factory.mktemp("hardening-state"))
    pdm.materialize(log)
    return log.root


def _state_files(root: str) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in Path(root, "state").rglob("*") if p.is_file()}


@pytest.mark.parametrize("query", [
    "copy (select 1 as x) to '{file}' (use_tmp_file false)",
    "copy (select 1 as x) to '{file}' (format csv, use_tmp_file false, overwrite true)",
    "prepare p as copy (select 1 as x) to '{file}' (use_tmp_file false)",
    "attach '{file}' as other",
    "select 1; copy (select 1 as x) to '{file}' (use_tmp_file false)",
    # EXPLAIN ANALYZE runs what it explains, wrapped in options and comments too
    "explain analyze copy (select 1 as x) to '{file}' (use_tmp_file false)",
    "EXPLAIN /* a */ ANALYSE -- b\n (FORMAT json) COPY (select 1 as x) TO '{file}' "
    "(use_tmp_file false)",
    "explain (analyze) copy (select 1 as x) to '{file}' (use_tmp_file false)",
    # the tokenizer counts UTF-8 bytes: characters of two bytes once shifted the slice into
    # the string literal, which read as a SELECT
    "EXPLAIN ANALYZE /*éééééééééééééé*/ COPY (SELECT 'SELECT 1 --' AS x) TO '{file}' "
    "(FORMAT parquet, USE_TMP_FILE false)",
])
def test_sql_cannot_write_the_state_files_its_views_read(query: str, materialized: str) -> None:
    """DuckDB itself may open exactly the state files (``allowed_paths``), and it lets SQL
    write what it may read: the statement check refuses COPY, PREPARE and ATTACH first."""
    before = _state_files(materialized)
    file = next(Path(materialized, "state", "runs").glob("*.parquet"))
    r = poimen("sql", "--root", materialized, query.format(file=file))
    _one_error_line(r, "reach outside the log; rerun with --allow-external")
    assert _state_files(materialized) == before
    r = poimen("sql", "--root", materialized, "--json", "select count(*) as n, "
               "getvariable('poimen_source') as source from runs")
    assert r.exit_code == 0 and '"n": 3' in r.output and '"source": "state"' in r.output, \
        r.output


def test_sql_over_the_state_reads_no_other_file(materialized: str, tmp_path: Path) -> None:
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    r = poimen("sql", "--root", materialized, f"select * from read_csv('{secret}')")
    assert r.exit_code == 1 and r.output.startswith("error: SQL: "), r.output
    assert "1" not in r.output.split("error: SQL: ")[0]


def test_sql_views_and_blob_text_still_work_and_allow_external_opens_files(
        root: str, tmp_path: Path) -> None:
    r = poimen("sql", "--root", root, "--json",
               "select count(*) as n, count(blob_text(prompt)) as bodies from attempts")
    assert r.exit_code == 0, r.output
    assert '"n": 9' in r.output and '"bodies": 9' in r.output
    secret = tmp_path / "x.csv"
    secret.write_text("a,b\n1,2\n")
    for flag in ("--allow-external", "--unsafe"):
        r = poimen("sql", "--root", root, flag, "--json", f"select * from read_csv('{secret}')")
        assert r.exit_code == 0, r.output
        assert '"a": 1' in r.output and '"b": 2' in r.output


# --- values from the log are printed as they are ------------------------------------------

MARKUP = "[red]hidden[/red] text [/usr/bin/python3] [bold]"


@pytest.fixture(scope="module")
def markup_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    from poimen_data import events as ev

    log = pdm.open_log(str(tmp_path_factory.mktemp("markup") / "log"))
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "run-1", "v[1]"))
        tx.append(ev.AttemptDispatched("acme", "run-1", 0, "[step]", 0, 1,
                                       context=ev.ContextPartition(("kb/1", "[x]"), (), ("[d]",))))
        tx.append(ev.AttemptFinished("acme", "run-1", 0, "[step]", 1, "failed",
                                     error=MARKUP))
    return log.root


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables as wide as they need: no cell folded over lines."""
    monkeypatch.setattr(cli.out, "width", 400)


@pytest.mark.usefixtures("wide")
def test_show_prints_the_log_s_text_as_it_is_never_as_markup(markup_root: str) -> None:
    """A value holding rich markup (or what looks like it, a path in brackets) is shown
    verbatim: it once raised ``MarkupError`` (a traceback) or hid what it wrapped."""
    r = poimen("show", "run-1", "--root", markup_root)
    assert r.exit_code == 0, r.output
    assert MARKUP in r.output and "[step]" in r.output and "v[1]" in r.output
    assert "[d]" in r.output  # the context it dropped


@pytest.mark.usefixtures("wide")
def test_sql_prints_values_lists_and_names_as_they_are(markup_root: str) -> None:
    r = poimen("sql", "--root", markup_root, "select error as \"[b]e[/b]\", context, "
               "['/usr/bin'] as l from attempts where error is not null")
    assert r.exit_code == 0, r.output
    assert "[b]e[/b]" in r.output and MARKUP in r.output
    assert "packed=[kb/1, [x]]" in r.output and "[/usr/bin]" in r.output


def test_export_to_a_path_with_brackets_prints_its_one_line(markup_root: str,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "ex[/a]" / "o.jsonl"
    out.parent.mkdir(parents=True)
    r = poimen("export", "--root", markup_root, "--out", str(out), "--format", "jsonl")
    assert r.exit_code == 0, r.output
    assert f"wrote {out}: " in "".join(r.output.splitlines())


def test_sql_json_gives_iso_dates_times_and_names_non_finite_floats(markup_root: str) -> None:
    import json

    r = poimen("sql", "--root", markup_root, "--json",
               "select date '2024-02-03' as d, time '12:00:01' as t, interval 90 second as i, "
               "'nan'::double as n, 'inf'::double as p, 1.5::double as x")
    assert r.exit_code == 0, r.output
    # an interval as Arrow's (months, days, nanoseconds)
    assert json.loads(r.output) == [{"d": "2024-02-03", "t": "12:00:01", "i": [0, 0, 90 * 10**9],
                                     "n": "nan", "p": "inf", "x": 1.5}]


def test_view_that_cannot_listen_exits_1(root: str) -> None:
    """uvicorn exits 3 when it cannot bind (and says why); the CLI's codes are 0, 1, 2."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = poimen("view", "--root", root, "--port", str(taken.getsockname()[1]), "--no-open")
    assert r.exit_code == 1, r.output
