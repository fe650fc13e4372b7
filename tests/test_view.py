"""``poimen view`` without a browser: every page's handler through Starlette's TestClient,
against a demo root (a synthetic workload, a run rewound twice, a run of XSS payloads)."""

from __future__ import annotations

import csv
import html
import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest
from markupsafe import escape
from starlette.testclient import TestClient
from view_demo import JS_LINK, PAYLOADS, REWOUND, REWOUND_COUNTS, TOTAL_RUNS, XSS, build

import poimen_data as pdm
from poimen_data.testing import CountingBlobStore
from poimen_data.view import Server, create_app
from poimen_data.view import _sql as sq


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("view") / "log"
    build(r)
    return r


@pytest.fixture(scope="module")
def log(root: Path) -> pdm.EventLog:
    return pdm.open_log(root, create=False, read_only=True)


@pytest.fixture
def counting(log: pdm.EventLog) -> CountingBlobStore:
    return CountingBlobStore(log.blobs)


@pytest.fixture
def client(log: pdm.EventLog, counting: CountingBlobStore) -> Iterator[TestClient]:
    with TestClient(create_app(log, blobs=counting), base_url="http://127.0.0.1") as c:
        yield c


def sql(log: pdm.EventLog, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    con = pdm.connect(log)
    try:
        return con.execute(query, params or []).fetchall()
    finally:
        con.close()


def run_ids(page: str) -> list[str]:
    return [html.unescape(r) for r in re.findall(r'<tr class="run" data-run="([^"]*)"', page)]


def total(page: str) -> int:
    m = re.search(r'<span id="total">(\d+)</span>', page)
    assert m, page[:400]
    return int(m.group(1))


def error_line(r: Any) -> str:
    assert "Traceback" not in r.text and 'File "' not in r.text
    (msg,) = re.findall(r'<p class="error" id="error">([^<]*)</p>', r.text)
    assert "\n" not in msg
    return html.unescape(msg)


# --- runs page -------------------------------------------------------------------------


def test_runs_page_lists_every_run_newest_first_and_paginates(client, log) -> None:
    expected = [r for (r,) in sql(log, "select run_id from runs order by started_at desc "
                                       "nulls last, run_id desc")]
    assert len(expected) == TOTAL_RUNS
    r = client.get("/")
    assert r.status_code == 200
    assert total(r.text) == TOTAL_RUNS
    assert run_ids(r.text) == expected  # 27 runs fit the default page of 50
    seen = []
    for page in (1, 2):
        p = client.get("/", params={"limit": 25, "page": page})
        assert p.status_code == 200 and total(p.text) == TOTAL_RUNS
        assert ("page 1 of 2" if page == 1 else "page 2 of 2") in p.text
        seen += run_ids(p.text)
    assert seen == expected
    by_cost = client.get("/", params={"sort": "cost_usd", "dir": "asc"})
    assert run_ids(by_cost.text) == [r for (r,) in sql(
        log, "select run_id from runs order by cost_usd asc nulls last, run_id asc")]


@pytest.mark.parametrize(("params", "where", "args"), [
    ({"state": "failed"}, "state = ?", ["failed"]),
    ({"tenant": "acme"}, "tenant = ?", ["acme"]),
    ({"workflow_version": "codefix@v9"}, "workflow_version = ?", ["codefix@v9"]),
    ({"min_branches": "3"}, "n_branches >= 3", []),
    ({"min_attempts": "5"}, "n_attempts >= 5", []),
    ({"min_failed": "2"}, "n_failed_attempts >= 2", []),
    ({"min_cost": "0.05", "max_cost": "0.2"}, "cost_usd between 0.05 and 0.2", []),
    ({"verdict": "exit_code@1:passed"},
     "run_id in (select run_id from verdicts where verifier = 'exit_code@1' and passed)", []),
    ({"verdict": "<script>window.__pwned=5</script>@1:failed"},
     "run_id in (select run_id from verdicts where not passed)", []),
    ({"verdict": "none"}, "run_id not in (select run_id from verdicts)", []),
    ({"started_from": "2025-01-06T13:09:30", "started_to": "2025-01-07"},
     "started_at >= '2025-01-06 13:09:30+00'::timestamptz and "
     "started_at < '2025-01-07 00:00+00'::timestamptz", []),
    ({"ended_from": "2000-01-01"}, "ended_at >= '2000-01-01'::timestamptz", []),
    ({"q": "LOST WORKER"}, "run_id in (select run_id from attempts where error ilike "
                           "'%lost worker%')", []),
    ({"q": "twice"}, "run_id ilike '%twice%'", []),
])
def test_each_filter_matches_the_same_sql(client, log, params, where, args) -> None:
    expected = sorted(r for (r,) in sql(log, f"select run_id from runs where {where}", args))
    assert expected, "a filter that matches nothing proves nothing"
    r = client.get("/", params={**params, "limit": 200})
    assert r.status_code == 200
    assert total(r.text) == len(expected)
    assert sorted(run_ids(r.text)) == expected
    assert len(expected) < TOTAL_RUNS or params.get("verdict") == "none"


def test_facet_counts_leave_out_their_own_filter(client, log) -> None:
    r = client.get("/", params={"state": "failed", "tenant": "acme"})
    facet = re.search(r'data-facet="state">(.*?)</div>', r.text, re.S)
    assert facet
    shown = dict(re.findall(r'>([a-z_]+)</a><span class="muted">(\d+)</span>', facet.group(1)))
    expected = dict(sql(log, "select state, count(*) from runs where tenant = 'acme' "
                             "group by state"))
    assert {k: int(v) for k, v in shown.items()} == expected


def test_charts_are_server_side_svg(client, log) -> None:
    r = client.get("/")
    assert r.text.count("<svg") == 2
    assert 'aria-label="failure rate by step and workflow version"' in r.text
    assert 'aria-label="cost of runs by start time"' in r.text
    bars = re.findall(r"<title>[^<]*: (\d+) runs, \$([0-9.]+)</title></rect>", r.text)
    (n, cost), = sql(log, "select count(*), sum(cost_usd) from runs "
                          "where started_at is not null")
    assert sum(int(b) for b, _ in bars) == n
    assert abs(sum(float(c) for _, c in bars) - float(cost)) < 1e-3
    cells = re.findall(r"<title>(\S+) (\S+): (\d+) of (\d+) attempts failed", r.text)
    expected = sql(log, "select step_id, workflow_version, count(*) filter (where state in "
                        "('failed', 'timed_out')), count(*) from attempts where "
                        "workflow_version like '%@%' group by all")
    assert {(s_, v.split("@")[1], int(f), int(a)) for s_, v, f, a in expected} <= {
        (s_, v, int(f), int(a)) for s_, v, f, a in cells}
    failed = client.get("/", params={"state": "failed"})
    assert sum(int(b) for b in re.findall(r": (\d+) runs, \$", failed.text)) == total(
        failed.text)


@pytest.mark.parametrize(("params", "message"), [
    ({"page": "abc"}, "page must be a whole number, got 'abc'"),
    ({"sort": "run_id; drop table x"}, "sort must be one of"),
    ({"limit": "7"}, "limit must be one of 25, 50, 100, 200"),
    ({"min_cost": "lots"}, "min_cost must be a number, got 'lots'"),
    ({"started_from": "yesterday"}, "started_from must be a date or time"),
    ({"verdict": "nonsense"}, "verdict must be VERIFIER:passed"),
    ({"at_lsn": "x"}, "at_lsn must be a whole number, got 'x'"),
    ({"at_lsn": "-1"}, "at_lsn -1 is outside 0.."),
    ({"at_lsn": "999999999"}, "at_lsn 999999999 is outside 0.."),
])
def test_bad_parameters_give_a_one_line_400(client, params, message) -> None:
    r = client.get("/", params=params)
    assert r.status_code == 400
    assert error_line(r).startswith(message)


def test_runs_page_travels_in_time(client, log) -> None:
    (lsn,) = sql(log, "select min(lsn) from events where run_id = ?", [REWOUND])[0]
    r = client.get("/", params={"at_lsn": lsn - 1})
    assert total(r.text) == TOTAL_RUNS - 3
    assert REWOUND not in run_ids(r.text)
    assert f"read at LSN {lsn - 1} of {log.head}" in r.text


def test_runs_page_summaries_follow_the_head_and_stay_at_an_old_lsn(tmp_path) -> None:
    """Facets and charts are kept per (LSN, filter): a new commit shows at the head at
    once, the page of an older LSN keeps its own counts, and pages share one summary."""
    from poimen_data.testing import record_run

    log = pdm.open_log(tmp_path / "log")
    for i in range(3):
        record_run(log, f"r{i}", [("plan", ["succeeded"]), ("code", ["failed", "failed"])])
    pdm.materialize(log)
    old = log.head
    with TestClient(create_app(log), base_url="http://127.0.0.1") as c:
        first = c.get("/", params={"limit": 25})
        assert total(first.text) == 3
        record_run(log, "r3", [("plan", ["succeeded"])])
        now = c.get("/", params={"limit": 25})
        assert total(now.text) == 4 and set(run_ids(now.text)) == {"r0", "r1", "r2", "r3"}
        then = c.get("/", params={"limit": 25, "at_lsn": old})
        assert total(then.text) == 3 and set(run_ids(then.text)) == {"r0", "r1", "r2"}
        assert total(c.get("/", params={"limit": 25, "sort": "run_id"}).text) == 4


# --- episode page ----------------------------------------------------------------------


def branch_sections(page: str) -> dict[int, tuple[str, dict[str, int]]]:
    out = {}
    for bid, status, body in re.findall(
            r'<section class="branch panel" id="branch-\d+" data-branch="(\d+)" '
            r'data-status="(\w+)">(.*?)</section>', page, re.S):
        counts = re.findall(r'<span class="count" data-state="(\w+)">'
                            r'<span class="state st-\w+">\w+</span> (\d+)</span>', body)
        out[int(bid)] = (status, {s: int(n) for s, n in counts})
    return out


def test_episode_of_a_run_rewound_twice(client, counting) -> None:
    r = client.get(f"/runs/{REWOUND}")
    assert r.status_code == 200
    sections = branch_sections(r.text)
    assert {b: s for b, (s, _) in sections.items()} == {
        0: "abandoned", 1: "abandoned", 2: "live"}
    assert {b: c for b, (_, c) in sections.items()} == REWOUND_COUNTS
    assert 'id="live-branch">2</b>' in r.text
    # branch 2's trajectory: plan (from 0), code (from 1), then its own test and report
    sec2 = r.text[r.text.index('data-branch="2"'):]
    names = re.findall(r'<div class="name"><b>(\w+)</b> <span class="muted small">#(\d+)'
                       r'(?: from branch (\d+))?', sec2)
    assert names == [("plan", "0", "0"), ("code", "1", "1"), ("test", "2", ""),
                     ("report", "3", "")]
    assert r.text.count('<circle') == 10  # the branch tree: one dot per own attempt
    assert counting.gets == 0


def test_a_step_index_far_out_gives_a_column_per_step_there(tmp_path) -> None:
    """The branch tree has a column per step index that is there, not one per index up to
    the largest (2**62, which the value limits allow, ran the server out of memory)."""
    from poimen_data import events as ev

    log = pdm.open_log(tmp_path / "log", durable=False)
    with log.transaction() as tx:
        tx.append(ev.RunStarted("acme", "far", "wf@1"))
        for i, step in ((0, "plan"), (2**62, "far")):
            tx.append(ev.AttemptDispatched("acme", "far", 0, step, i, 1))
            tx.append(ev.AttemptFinished("acme", "far", 0, step, 1, "succeeded"))
    with TestClient(create_app(log), base_url="http://127.0.0.1") as c:
        r = c.get("/runs/far")
    assert r.status_code == 200
    tree = r.text[r.text.index("branch tree of far"):]
    tree = tree[:tree.index("</svg>")]
    assert tree.count("<circle") == 2
    xs = [int(v) for v in re.findall(r'<circle cx="(\d+)"', tree)]
    assert xs[1] - xs[0] == 64  # next to each other: one column width apart


@pytest.mark.parametrize(("query", "message"), [
    ({"page": str(2**62)}, "page must be between 0 and 1,000,000,000,000"),
    ({"min_attempts": "99999999999999999999"}, "min_attempts must be between 0 and"),
    ({"max_cost": "-1e30"}, "max_cost must be within -999999999.999999999 .. "),
    ({"min_cost": "123456789012345678901234567890"}, "min_cost must be within "),
])
def test_runs_page_refuses_numbers_past_what_its_columns_hold(client, query, message) -> None:
    r = client.get("/", params=query)
    assert r.status_code == 400 and error_line(r).startswith(message), r.text[-400:]


@pytest.mark.parametrize(("path", "query", "message"), [
    ("/sql", "select 'infinity'::timestamp as t", "the result holds a value this page "
                                                  "cannot show: "),
    ("/sql", "select '-infinity'::date as d", "the result holds a value this page cannot "
                                              "show: "),
    ("/sql/download", "select interval 1 day as i", "the result holds a value csv cannot "
                                                    "carry here: "),
])
def test_sql_page_refuses_a_value_it_cannot_show(client, path, query, message) -> None:
    r = client.get(path, params={"q": query, "format": "csv"})
    assert r.status_code == 400 and error_line(r).startswith(message), r.text[-400:]


def test_episode_page_travels_in_time(client, log) -> None:
    (recovery,) = sql(log, "select max(lsn) from events where run_id = ?", [REWOUND])[0]
    r = client.get(f"/runs/{REWOUND}", params={"at_lsn": recovery - 1})
    assert branch_sections(r.text)[2][1] == {"succeeded": 1, "dispatched": 2}
    (fork2,) = sql(log, "select lsn from events where run_id = ? and kind = 'branch_forked' "
                        "and branch_id = 2", [REWOUND])[0]
    r = client.get(f"/runs/{REWOUND}", params={"at_lsn": fork2 - 1})
    assert {b: s for b, (s, _) in branch_sections(r.text).items()} == {
        0: "abandoned", 1: "live"}


def test_episode_shows_verdicts_with_snapshot_lsn(client, log) -> None:
    ((verifier, snap, passed),) = sql(
        log, "select verifier, snapshot_lsn, passed from verdicts where run_id = 'run-000004'")
    r = client.get("/runs/run-000004")
    row = re.search(r'<table id="verdicts">.*?</table>', r.text, re.S)
    assert row
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", row.group(0))
    assert cells[:4] == [verifier, "0", str(snap), "passed" if passed else "failed"]


@pytest.mark.parametrize(("url", "status", "message"), [
    ("/runs/no-such-run", 404, "no run 'no-such-run' in the log at lsn"),
    ("/runs/bad%3Cid", 400, "view: field 'run_id' must match"),
    (f"/runs/{REWOUND}?at_lsn=soon", 400, "at_lsn must be a whole number"),
    (f"/runs/{REWOUND}/attempt?branch=9&step=code&n=1", 404, "no attempt code#1 on branch 9"),
    (f"/runs/{REWOUND}/attempt?branch=x&step=code&n=1", 400, "branch and n must be whole"),
    (f"/runs/{REWOUND}/diff?branch=0&step=plan&n=1", 404, "plan#1 on branch 0 is not a retry"),
    ("/nowhere", 404, "no page /nowhere"),
])
def test_error_pages_are_one_line(client, url, status, message) -> None:
    r = client.get(url)
    assert r.status_code == status
    assert error_line(r).startswith(message)


# --- attempts: bodies only when opened ---------------------------------------------------


def test_opening_an_attempt_reads_exactly_its_bodies(client, counting) -> None:
    assert client.get(f"/runs/{REWOUND}").status_code == 200
    assert counting.gets == 0
    r = client.get(f"/runs/{REWOUND}/attempt",
                   params={"branch": 1, "step": "code", "n": 2, "part": 1})
    assert r.status_code == 200
    assert counting.gets == 2
    assert "context: the failing test log" in r.text
    assert "code #2 on branch 1: succeeded" in r.text
    assert '<span class="dropped">history/3</span>' in r.text
    assert "Diff of this prompt against attempt #1 (timed_out)" in r.text
    d = client.get(f"/runs/{REWOUND}/diff", params={"branch": 1, "step": "code", "n": 2,
                                                     "part": 1})
    assert counting.gets == 4
    assert re.findall(r'<div class="(add|del)">([^<]*)</div>', d.text) == [
        ("add", "+context: the failing test log")]


def test_an_attempt_never_captured_and_a_dispatched_one(client, counting) -> None:
    r = client.get(f"/runs/{REWOUND}/attempt",
                   params={"branch": 2, "step": "report", "n": 1})
    assert r.status_code == 200
    assert counting.gets == 1  # the prompt; a dispatched attempt has no output yet
    assert "not captured" in r.text


def test_a_reduced_body_shows_its_summary_with_a_badge(tmp_path, counting) -> None:
    log = pdm.open_log(tmp_path / "log")
    from poimen_data.testing import record_run

    record_run(log, "r", [("plan", ["succeeded"])], prompt=b"a very long prompt " * 50)
    (a,) = pdm.episode(log, "r").branches[0].attempts
    assert a.prompt is not None
    pdm.reduce(log, [a.prompt], lambda body: b"SUMMARY of the prompt")
    with TestClient(create_app(tmp_path / "log"), base_url="http://127.0.0.1") as c:
        r = c.get("/runs/r/attempt", params={"branch": 0, "step": "plan", "n": 1})
    assert "SUMMARY of the prompt" in r.text and "reduced: summary shown" in r.text


# --- escaping ------------------------------------------------------------------------------


URL_ATTRS = ("href", "src", "action", "formaction", "xlink:href", "data-src")


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def assert_inert(text: str) -> None:
    """No payload survives as markup: every script is ours (it has the nonce), no image,
    no event-handler attribute, no javascript: URL in any attribute."""
    parser = Tags()
    parser.feed(text)
    for tag, attrs in parser.tags:
        assert tag not in ("img", "iframe", "object", "embed"), (tag, attrs)
        if tag == "script":
            assert set(attrs) == {"nonce"}, attrs
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, attrs)
            if name in URL_ATTRS:
                assert not (value or "").strip().lower().startswith("javascript:"), attrs
    assert "window.__pwned=1;alert(1)</script>" not in text


@pytest.mark.parametrize("url", [
    "/", "/?q=xss", f"/?workflow_version={PAYLOADS[1]}", f"/runs/{XSS}", f"/runs/{JS_LINK}",
    f"/runs/{XSS}/attempt?branch=0&n=1&step={PAYLOADS[0]}",
    f"/runs/{XSS}/attempt?branch=0&n=1&part=1&step={PAYLOADS[0]}",
    "/sql?q=select error, detail, verifier from attempts, verdicts "
    f"where attempts.run_id = '{XSS}' and verdicts.run_id = '{XSS}'",
    "/sql?q=select '<script>window.__pwned=1;alert(1)</script>' as x",
    f"/runs/{XSS}/attempt?branch=0&n=1&step=<script>", f"/runs/{XSS}/labels",
])
def test_payloads_from_the_log_are_escaped(client, url) -> None:
    r = client.get(url)
    assert r.status_code in (200, 404)
    assert_inert(r.text)


def test_the_payloads_are_on_the_pages_as_text(client) -> None:
    page = client.get(f"/runs/{XSS}").text
    assert str(escape(PAYLOADS[0])) in page                    # the step name
    labels = client.get(f"/runs/{XSS}/labels").text
    assert f"<code>note={escape(PAYLOADS[0])}</code>" in labels
    assert "&lt;script&gt;window.__pwned=5&lt;/script&gt;@1" in page  # the verifier
    part = client.get(f"/runs/{XSS}/attempt",
                      params={"branch": 0, "n": 1, "step": PAYLOADS[0], "part": 1}).text
    for p in PAYLOADS:
        assert str(escape(p)) in part
    assert "javascript:alert(4)" in part   # the tool call, as text
    runs = client.get("/").text
    assert str(escape(PAYLOADS[1])) in runs                    # the workflow version
    assert html.escape(PAYLOADS[1][:30], quote=True) in runs   # and the chart (SVG text)


def test_every_page_sends_a_nonce_csp(client) -> None:
    r = client.get(f"/runs/{REWOUND}")
    csp = r.headers["content-security-policy"]
    (nonce,) = re.findall(r'<script nonce="([^"]+)">', r.text)
    assert f"script-src 'nonce-{nonce}'" in csp and "default-src 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"


def test_other_host_headers_are_refused(client) -> None:
    r = client.get("/", headers={"host": "evil.example"})
    assert r.status_code == 400


# --- SQL page ------------------------------------------------------------------------------


def test_sql_page_runs_a_select_and_shows_the_row_limit(client, log) -> None:
    r = client.get("/sql", params={"q": "select state, count(*) as n from runs group by state "
                                        "order by state"})
    assert r.status_code == 200
    cells = re.findall(r"<td>([^<]*)</td>", r.text)
    expected = sql(log, "select state, count(*) from runs group by state order by state")
    assert cells == [str(x) for row in expected for x in row]
    assert f"{len(expected)} rows" in r.text
    big = client.get("/sql", params={"q": "select * from range(1234)"})
    assert f"showing the first {sq.SHOW_ROWS} rows (there are more)" in big.text
    assert big.text.count("<tr>") == sq.SHOW_ROWS + 1


def test_sql_downloads_csv_and_parquet_built_in_memory(client, log) -> None:
    q = "select run_id, n_attempts, cost_usd from runs order by run_id"
    expected = sql(log, q)
    r = client.get("/sql/download", params={"q": q, "format": "csv"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.reader(io.StringIO(r.text)))
    assert rows[0] == ["run_id", "n_attempts", "cost_usd"]
    assert [row[0] for row in rows[1:]] == [e[0] for e in expected]
    p = client.get("/sql/download", params={"q": q, "format": "parquet"})
    t = pq.read_table(io.BytesIO(p.content))
    assert t.column("run_id").to_pylist() == [e[0] for e in expected]
    assert t.column("cost_usd").to_pylist() == [e[2] for e in expected]
    nested = client.get("/sql/download", params={"q": "select context from attempts limit 2",
                                                  "format": "csv"})
    assert nested.status_code == 200 and "packed" in nested.text


@pytest.mark.parametrize(("query", "message"), [
    ("COPY (select * from runs) TO '/tmp/poimen-view-copy.csv'", "read-only: COPY"),
    ("ATTACH '/tmp/poimen-view.db' AS x", "read-only: ATTACH"),
    ("INSTALL httpfs", "read-only: "),
    ("LOAD httpfs", "read-only: LOAD"),
    ("select * from read_csv('/etc/passwd')", "SQL: Permission Error"),
    ("select * from glob('/*')", "SQL: Permission Error"),
    ("select 1; select 2", "one statement at a time, got 2"),
    ("create table t as select 1", "read-only: CREATE"),
    ("SET enable_external_access = true", "read-only: SET"),
    ("select * from no_such_table", "SQL: Catalog Error"),
    ("selec 1", "SQL: Parser Error"),
])
def test_sql_page_refuses_everything_but_reading(client, query, message) -> None:
    r = client.get("/sql", params={"q": query})
    assert r.status_code == 400
    assert error_line(r).startswith(message)
    assert not os.path.exists("/tmp/poimen-view-copy.csv")
    d = client.get("/sql/download", params={"q": query, "format": "csv"})
    assert d.status_code == 400


@pytest.mark.parametrize("statement", [
    "COPY (select 1) TO '{tmp}/x.csv'", "ATTACH '{tmp}/x.db' AS x", "INSTALL httpfs",
    "LOAD httpfs", "select * from read_csv('/etc/passwd')", "EXPORT DATABASE '{tmp}/e'",
    "SET enable_external_access = true", "SET python_enable_replacements = true",
])
def test_the_sandbox_connection_itself_refuses(log, tmp_path, statement) -> None:
    """Below the statement check: DuckDB's own settings refuse file access, locked."""
    con = sq.sandbox(log, log.head)
    try:
        with pytest.raises(duckdb.Error):
            con.execute(statement.format(tmp=tmp_path))
        assert con.execute("select count(*) from runs").fetchall() == [(TOTAL_RUNS,)]
    finally:
        con.close()
    assert list(tmp_path.iterdir()) == []


def test_sql_page_cannot_write_the_state_files_through_explain_analyze(tmp_path) -> None:
    """DuckDB may open the state files the views read (``allowed_paths``) and lets SQL
    write what it may read; EXPLAIN ANALYZE runs the statement it explains, so an EXPLAIN
    is judged by that statement: only an EXPLAIN of a SELECT runs."""
    import hashlib

    from poimen_data.testing import record_run

    log = pdm.open_log(tmp_path / "log")
    record_run(log, "r0", [("plan", ["succeeded"])])
    pdm.materialize(log)

    def state() -> dict[str, str]:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((tmp_path / "log" / "state").rglob("*")) if p.is_file()}

    before = state()
    file = next((tmp_path / "log" / "state" / "runs").glob("*.parquet"))
    with TestClient(create_app(log), base_url="http://127.0.0.1") as c:
        for q in (f"EXPLAIN ANALYZE COPY (select 1 as x) TO '{file}' (use_tmp_file false)",
                  f"explain /* a */ analyse (format json) copy (select 1 as x) to '{file}' "
                  "(use_tmp_file false)",
                  "EXPLAIN ANALYZE /*éééééééééééééé*/ COPY (SELECT 'SELECT 1 --' AS x) TO "
                  f"'{file}' (FORMAT parquet, USE_TMP_FILE false)"):
            r = c.get("/sql", params={"q": q})
            assert r.status_code == 400, r.text[:300]
            assert error_line(r) == "read-only: EXPLAIN of a SELECT only, got EXPLAIN of COPY"
            d = c.get("/sql/download", params={"q": q, "format": "csv"})
            assert d.status_code == 400, d.text[:300]
        assert state() == before
        for q in ("explain analyze select count(*) from runs",
                  "EXPLAIN ANALYZE /* café */ SELECT 42", "EXPLAIN (SELECT 1)"):
            ok = c.get("/sql", params={"q": q})
            assert ok.status_code == 200, (q, ok.text[-300:])
    assert state() == before


# --- read-only, CLI, server ------------------------------------------------------------------


def test_browsing_never_writes_to_the_log(root) -> None:
    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in root.rglob("*")}

    before = snapshot()
    with TestClient(create_app(root), base_url="http://127.0.0.1") as c:
        for url in ("/", f"/runs/{REWOUND}", "/sql?q=select blob_text(prompt) from attempts",
                    f"/runs/{REWOUND}/attempt?branch=1&step=code&n=2"):
            assert c.get(url).status_code == 200
    assert snapshot() == before


def test_opening_a_connection_blocks_no_other_request(log, monkeypatch) -> None:
    """A connection being opened at one LSN (a fold of the tail, seconds on a big log)
    holds up no request at another LSN, and a request at the same LSN waits for it and
    then shares it; an opener that fails fails its waiters too, and the next request
    opens again."""
    import threading

    from poimen_data.view import _app

    real, release, opening = _app.connect, threading.Event(), threading.Event()
    slow = {"lsn": 1, "fail": False}

    def connect(log_: Any, *, at_lsn: int) -> Any:
        if at_lsn == slow["lsn"]:
            opening.set()
            assert release.wait(60), "never released"
            if slow["fail"]:
                raise pdm.PoimenError("could not open")
        return real(log_, at_lsn=at_lsn)

    monkeypatch.setattr(_app, "connect", connect)
    viewer = _app.Viewer(log)
    head = log.head
    with viewer.con(head) as con:
        con.execute("select 1")  # cached before the slow one starts
    got: dict[str, Any] = {}

    def at(lsn: int, key: str) -> threading.Thread:
        def run() -> None:
            try:
                with viewer.con(lsn) as c:
                    got[key] = c.execute("select count(*) from runs").fetchall()[0][0]
            except BaseException as exc:  # noqa: BLE001 - asserted below
                got[key] = repr(exc)

        t = threading.Thread(target=run)
        t.start()
        return t

    first = at(1, "first")
    assert opening.wait(60)
    with viewer.con(head) as con:  # while the other one is still opening
        assert con.execute("select count(*) from runs").fetchall() == [(TOTAL_RUNS,)]
    threads = [first, at(1, "second")]
    release.set()
    for t in threads:
        t.join(60)
    assert got == {"first": 1, "second": 1}  # one run at LSN 1

    slow.update(lsn=2, fail=True)
    opening.clear()
    release.clear()
    threads = [at(2, "failed")]
    assert opening.wait(60)
    threads.append(at(2, "waiter"))
    release.set()
    for t in threads:
        t.join(60)
    assert got["failed"] == got["waiter"] == "PoimenError('could not open')"
    slow["lsn"] = -1
    with viewer.con(2) as con:  # a failed opening is not cached: opened again
        assert con.execute("select count(*) from runs").fetchall() == [(1,)]
    viewer.close()


def test_server_on_a_thread_serves_on_loopback(log) -> None:
    import urllib.request

    with Server(create_app(log)) as s:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", s.url)
        with urllib.request.urlopen(s.url + "runs/" + REWOUND) as resp:  # noqa: S310
            assert resp.status == 200
            assert b'id="live-branch">2</b>' in resp.read()


def test_cli_view_prints_its_url_and_serves(root) -> None:
    import urllib.request

    exe = Path(sys.executable).with_name("poimen")
    p = subprocess.Popen([str(exe), "view", "--root", str(root), "--no-open"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()  # the rendezvous: printed once it listens
        m = re.match(r"poimen view: (http://127\.0\.0\.1:\d+/) ", line)
        assert m, line
        with urllib.request.urlopen(m.group(1)) as resp:  # noqa: S310
            assert resp.status == 200
    finally:
        p.terminate()
        p.wait(30)


def test_cli_view_of_a_missing_root_is_one_line(tmp_path) -> None:
    exe = Path(sys.executable).with_name("poimen")
    p = subprocess.run([str(exe), "view", "--root", str(tmp_path / "none"), "--no-open"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip().startswith("error: no poimen log at")
    assert len(p.stderr.strip().splitlines()) == 1
