"""A damaged segment under the jobs that fold through DuckDB is a ``CorruptionError``
naming the segment, as it is everywhere else: DuckDB hands an exception raised inside a
scan it reads on as its own ``InvalidInputException`` quoting the Python traceback, which
``materialize``, ``export_live`` and ``grade`` raised as it was (and the CLI printed as
"error: SQL: Invalid Input Error: ... Traceback (most recent call last):")."""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator

import duckdb
import pyarrow as pa
import pytest
from conftest import Root, snapshot_files
from starlette.testclient import TestClient
from typer.testing import CliRunner

import poimen_data as pdm
from poimen_data import cli
from poimen_data.errors import CorruptionError, raised_in_scan
from poimen_data.testing import record_run
from poimen_data.verifiers import exit_code
from poimen_data.view._app import create_app

OK = [("plan", ["succeeded"]), ("code", ["failed", "succeeded"])]


def _damaged(root: Root) -> tuple[pdm.EventLog, str]:
    """Three runs, one commit each; the second commit's segment with one byte flipped.
    Returns the log and the message a damaged segment's reader raises."""
    log = root.open()
    for run in ("a", "b", "c"):
        record_run(log, run, OK)
    log.flush()
    seg = log.read_manifest(2).segments[0].path
    data = bytearray(log.storage.read(seg))
    data[len(data) // 2] ^= 0xFF
    log.storage.write(seg, bytes(data))
    return log, f"{log.storage.url_of(seg)}: size or sha256 differs from its manifest"


def test_the_jobs_raise_a_damaged_segment_as_a_corruption_error(root: Root,
                                                                tmp_path: object) -> None:
    log, message = _damaged(root)
    before = snapshot_files(log)
    for job in (lambda: pdm.materialize(root.url, storage_options=root.storage_options),
                lambda: pdm.export_live(log, f"{tmp_path}/out.parquet"),
                lambda: pdm.grade(log, exit_code)):
        with pytest.raises(CorruptionError) as caught:
            job()
        assert str(caught.value) == message
    assert snapshot_files(log) == before  # nothing written, nothing removed


def test_check_of_a_state_made_before_the_damage_names_the_segment(root: Root) -> None:
    log = root.open()
    for run in ("a", "b", "c"):
        record_run(log, run, OK)
    pdm.materialize(log)
    _log, message = _damaged(root)  # three more runs; seq 2's segment damaged
    with pytest.raises(CorruptionError) as caught:
        pdm.check(root.url, storage_options=root.storage_options)
    assert str(caught.value) == message


def test_the_cli_prints_the_damaged_segment_in_one_line(tmp_path: object) -> None:
    root = Root(f"{tmp_path}/log", None, "local")
    _log, message = _damaged(root)
    runner = CliRunner()
    for args in (["materialize", "--root", root.url],
                 ["sql", "--root", root.url, "select count(*) from events"]):
        r = runner.invoke(cli.app, args, catch_exceptions=False)
        assert (r.exit_code, r.stdout, r.stderr) == (1, "", f"error: {message}\n"), args


def test_the_viewer_shows_the_damaged_segment_as_a_server_error(tmp_path: object) -> None:
    """Not DuckDB's text quoting the traceback, and not a 400 for the query on /sql."""
    root = Root(f"{tmp_path}/log", None, "local")
    _log, message = _damaged(root)
    with TestClient(create_app(root.url), base_url="http://127.0.0.1") as c:
        for path in ("/", "/sql?q=select+count(*)+from+runs"):
            r = c.get(path)
            assert r.status_code == 500, path
            assert html.escape(message) in r.text, path
            assert "Invalid Input" not in r.text and "Traceback" not in r.text, path


def _scan_error(scan: Callable[[], Iterator[pa.RecordBatch]]) -> duckdb.Error:
    con = duckdb.connect()
    con.register("t", pa.RecordBatchReader.from_batches(pa.schema([("x", pa.int64())]),
                                                        scan()))
    with pytest.raises(duckdb.Error) as caught:
        con.sql("select * from t").fetchall()
    return caught.value


def test_other_duckdb_errors_are_left_as_they_are() -> None:
    con = duckdb.connect()
    with pytest.raises(duckdb.Error) as caught:
        con.sql("select no_such_column")
    assert raised_in_scan(caught.value) is None
    # a DuckDB error quoting a value that holds a line like ours
    with pytest.raises(duckdb.Error) as caught:
        con.sql("select E'oops\\npoimen_data.errors.NotFound: no such run'::INTEGER"
                ).fetchall()
    assert "poimen_data.errors.NotFound: no such run" in str(caught.value)
    assert raised_in_scan(caught.value) is None

    def other() -> Iterator[pa.RecordBatch]:  # a scan raising an exception of another kind
        raise ValueError("poimen_data.errors.CorruptionError: looks like one")
        yield

    def while_handling() -> Iterator[pa.RecordBatch]:  # another raised while handling ours
        try:
            raise CorruptionError("seg.arrow: damaged")
        except CorruptionError:
            raise KeyError("a bug in the handler") from None
        yield

    def lines() -> Iterator[pa.RecordBatch]:  # ours, over two lines: not read half
        raise CorruptionError("/data/a\nb/segments/x.arrow: size or sha256 differs")
        yield

    for scan in (other, while_handling, lines):
        exc = _scan_error(scan)
        assert "Python exception" in str(exc), scan
        assert raised_in_scan(exc) is None, scan

    def ours() -> Iterator[pa.RecordBatch]:
        raise CorruptionError("seg.arrow: damaged")
        yield

    found = raised_in_scan(_scan_error(ours))
    assert type(found) is CorruptionError and str(found) == "seg.arrow: damaged"
