"""``poimen view`` in a real browser: Debian's headless Chromium driven by Selenium through
chromium-driver, against the viewer served by uvicorn on 127.0.0.1 (port 0) in a thread.

With ``POIMEN_SCREENSHOTS=1`` the tests also write ``docs/screenshots/*.png`` (the README's
pictures); otherwise they leave the repository alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from view_demo import PAYLOADS, REWOUND, REWOUND_COUNTS, TOTAL_RUNS, XSS, build, xss_lsn

import poimen_data as pdm
from poimen_data.testing import CountingBlobStore
from poimen_data.view import Server, create_app

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
WAIT_S = 60

pytestmark = [
    pytest.mark.browser, pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs /usr/bin/chromium"),
]

#: Installed before any script of a page runs: a dialog is recorded instead of shown.
RECORD_DIALOGS = """
window.__dialogs = [];
for (const name of ['alert', 'confirm', 'prompt']) {
  window[name] = (...args) => { window.__dialogs.push([name, String(args[0])]); };
}
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("view-browser") / "log"
    build(root)
    log = pdm.open_log(root, create=False, read_only=True)
    counting = CountingBlobStore(log.blobs)
    with Server(create_app(log, blobs=counting)) as server:
        yield {"url": server.url, "blobs": counting, "log": log}


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must never download
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--window-size=1280,1000",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_DIALOGS})
    d.set_page_load_timeout(WAIT_S)
    try:
        yield d
    finally:
        d.quit()


def wait(d: Any, cond: Any) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(d, WAIT_S).until(cond)


def shot(d: Any, name: str) -> None:
    if os.environ.get("POIMEN_SCREENSHOTS") == "1":
        SHOTS.mkdir(parents=True, exist_ok=True)
        d.save_screenshot(str(SHOTS / f"{name}.png"))


def count_sql(log: pdm.EventLog, query: str) -> int:
    con = pdm.connect(log)
    try:
        return int(con.execute(query).fetchall()[0][0])
    finally:
        con.close()


def assert_clean(d: Any) -> None:
    """No payload ran or left markup: no dialog, no flag set, no image, no javascript:
    link, and the only script on the page is the viewer's own."""
    assert d.execute_script("return window.__dialogs") == []
    assert d.execute_script("return typeof window.__pwned") == "undefined"
    assert d.execute_script("return document.images.length") == 0
    assert d.execute_script(
        "return Array.from(document.querySelectorAll('[href],[src],[action]')).filter("
        "e => /^\\s*javascript:/i.test(e.getAttribute('href') || e.getAttribute('src') || "
        "e.getAttribute('action') || '')).length") == 0
    assert d.execute_script(
        "return Array.from(document.querySelectorAll('*')).filter(e => Array.from("
        "e.attributes).some(a => a.name.startsWith('on'))).length") == 0
    assert d.execute_script(
        "return Array.from(document.scripts).filter(s => !s.textContent.includes("
        "\"the server's own escaped HTML\")).length") == 0


def test_runs_page_lists_and_filters(driver, site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(site["url"])
    assert driver.find_element(By.ID, "total").text == str(TOTAL_RUNS)
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.run")) == TOTAL_RUNS
    driver.get(site["url"] + f"?at_lsn={xss_lsn(site['log']) - 1}")  # before the XSS runs
    assert len(driver.find_elements(By.CSS_SELECTOR, "tr.run")) == TOTAL_RUNS - 2
    shot(driver, "runs")
    driver.get(site["url"])
    failed = count_sql(site["log"], "select count(*) from runs where state = 'failed'")
    assert 0 < failed < TOTAL_RUNS
    Select(driver.find_element(By.NAME, "state")).select_by_value("failed")
    driver.find_element(By.ID, "apply").click()
    wait(driver, lambda d: "state=failed" in d.current_url)
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.run")
    assert len(rows) == failed == int(driver.find_element(By.ID, "total").text)
    assert {r.find_element(By.CSS_SELECTOR, ".state").text for r in rows} == {"failed"}
    box = driver.find_element(By.NAME, "q")
    box.clear()
    box.send_keys("lost worker")
    Select(driver.find_element(By.NAME, "state")).select_by_value("")
    driver.find_element(By.ID, "apply").click()
    wait(driver, lambda d: "q=lost+worker" in d.current_url)
    assert [r.get_attribute("data-run") for r in
            driver.find_elements(By.CSS_SELECTOR, "tr.run")] == [REWOUND]
    assert_clean(driver)


def test_episode_of_the_run_rewound_twice(driver, site) -> None:
    from selenium.webdriver.common.by import By

    driver.get(site["url"] + "runs/" + REWOUND)
    sections = driver.find_elements(By.CSS_SELECTOR, "section.branch")
    assert [(s.get_attribute("data-branch"), s.get_attribute("data-status"))
            for s in sections] == [("0", "abandoned"), ("1", "abandoned"), ("2", "live")]
    counts = {}
    for s in sections:
        counts[int(s.get_attribute("data-branch"))] = {
            c.get_attribute("data-state"): int(c.text.split()[-1])
            for c in s.find_elements(By.CSS_SELECTOR, ".count")}
    assert counts == REWOUND_COUNTS
    assert driver.find_element(By.ID, "live-branch").text == "2"
    assert len(driver.find_elements(By.CSS_SELECTOR, "svg circle.dot")) == 10
    shot(driver, "episode")
    assert_clean(driver)


def test_opening_an_attempt_reads_its_bodies_only_then(driver, site) -> None:
    from selenium.webdriver.common.by import By

    blobs = site["blobs"]
    driver.get(site["url"] + "runs/" + REWOUND)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "section.branch"))
    before = blobs.gets
    driver.execute_script("window.scrollTo(0, 0)")
    sel = ("section[data-branch='1'] details.attempt[data-src*='step=code'][data-src*='n=2']")
    details = driver.find_element(By.CSS_SELECTOR, sel)
    assert blobs.gets == before  # the page load read no body
    assert details.find_element(By.CSS_SELECTOR, ".lazy").text == ""  # closed: not shown
    details.find_element(By.TAG_NAME, "summary").click()
    pre = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, sel + " .body-prompt pre"))
    assert "context: the failing test log" in pre[0].text
    assert blobs.gets == before + 2  # its prompt and its output, nothing else
    diff = details.find_element(By.CSS_SELECTOR, "details.diff")
    diff.find_element(By.TAG_NAME, "summary").click()
    added = wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, sel + " .diff .add"))
    assert [a.text for a in added] == ["+context: the failing test log"]
    assert blobs.gets == before + 4
    driver.execute_script("arguments[0].scrollIntoView()", details)
    shot(driver, "attempt")
    assert_clean(driver)


def test_xss_payloads_stay_text(driver, site) -> None:
    from selenium.webdriver.common.by import By

    pages = [site["url"], site["url"] + "?q=xss", site["url"] + "runs/" + XSS,
             site["url"] + "runs/" + XSS + "/attempt?branch=0&n=1&step=" + quote(PAYLOADS[0]),
             site["url"] + "sql?q=" + quote(f"select error from attempts where run_id = '{XSS}'")]
    for url in pages:
        driver.get(url)
        assert_clean(driver)
    driver.get(site["url"] + "runs/" + XSS)
    for d in driver.find_elements(By.CSS_SELECTOR, "details.attempt"):
        d.find_element(By.TAG_NAME, "summary").click()
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".body-output pre"))
    text = driver.find_element(By.TAG_NAME, "body").text
    for p in PAYLOADS:
        assert p in text  # shown as text, never run
    assert_clean(driver)


def test_sql_page_refuses_copy_to(driver, site, tmp_path) -> None:
    from selenium.webdriver.common.by import By

    target = tmp_path / "stolen.csv"
    driver.get(site["url"] + "sql")
    box = driver.find_element(By.ID, "query")
    box.send_keys("select state, count(*) as runs from runs group by state order by runs desc")
    driver.find_element(By.ID, "run").click()
    wait(driver, lambda d: d.find_elements(By.ID, "result"))
    shot(driver, "sql")
    box = driver.find_element(By.ID, "query")
    box.clear()
    box.send_keys(f"COPY (select * from runs) TO '{target}'")
    driver.find_element(By.ID, "run").click()
    err = wait(driver, lambda d: d.find_elements(By.ID, "error"))
    assert err[0].text == ("read-only: COPY statements are refused (only SELECT and EXPLAIN "
                           "run here)")
    assert not target.exists()
    assert_clean(driver)
