"""A running job's ``/metrics`` and dashboard (slow: real worker processes of the local driver).

- ``/metrics`` scraped while the job runs only grows, and once the job stopped (over REST,
  with the token the CLI reads from the job registry) its counters equal the ``JobResult``
  (local driver in both modes, spark driver in tracker mode);
- a real headless Chromium (Debian's ``chromium`` through its ``chromedriver``; scripts/setup.sh)
  opens the dashboard of a running job in each mode, waits for epochs, checks the numbers on
  the page against the REST JSON fetched around the page's own refresh, switches between the
  alignment and trAcker views, opens the finished job's dashboard offline, and saves
  screenshots (into ``$EPOCHSTREAM_SCREENSHOTS`` when set: docs/img holds one run's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epochstream.deploy import jobs
from epochstream.deploy.rest import RestClient, offline_server
from pipelines import histogram

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def live_job(tmp_path, mode: str, deployment: str = "local", **options):
    """A job (local driver unless told) in a thread; yields (endpoint, job id, outcome dict with "result").
    Its generated input never ends first (10^9 records, made as read): the test stops it over REST."""
    p = histogram(n=10**9, keys=7, out=tmp_path / "out", parallelism=2, max_parallelism=16, mode=mode,
                  interval=0.15)
    started = threading.Event()
    info: dict = {}
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = p.run(deployment=deployment, checkpoint_dir=str(tmp_path / "chk"),
                                      on_start=lambda i: (info.update(i), started.set()), **options)
        except BaseException as exc:  # surfaced by the test
            outcome["error"] = exc
            started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(300), "the job's HTTP API did not come up"
    assert "error" not in outcome, outcome.get("error")
    try:
        yield info["endpoint"], info["id"], outcome
    finally:
        t.join(300)


def scrape(endpoint: str) -> dict[str, float]:
    text = urllib.request.urlopen(endpoint + "/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def wait_for(pred, what: str, timeout: float = 120.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def stop_and_scrape(endpoint: str, job_id: str) -> tuple[dict[str, float], dict]:
    """Stop the job without a savepoint, scrape /metrics once it is FINISHED (the server stays
    until the stop's outcome has been read), then read that outcome."""
    client = RestClient(endpoint, token=jobs.token_for(endpoint))
    assert client.token, "the job registry holds the job's token"
    rid = client.call("POST", f"/jobs/{job_id}/stop", {"savepoint": False})["request-id"]
    wait_for(lambda: client.call("GET", f"/jobs/{job_id}")["state"] == "FINISHED", "the job to finish")
    final = scrape(endpoint)
    outcome = client.call("GET", f"/jobs/{job_id}/savepoints/{rid}")
    return final, outcome


@pytest.mark.parametrize("deployment, mode", [("local", "aligned"), ("local", "tracker"), ("spark", "tracker")])
def test_metrics_during_a_run_match_the_job_result(tmp_path, monkeypatch, deployment, mode):
    monkeypatch.setenv("EPOCHSTREAM_HOME", str(tmp_path / "home"))
    options = {"master": "local[2]"} if deployment == "spark" else {}  # a plain session: no Delta jars to load
    with live_job(tmp_path, mode, deployment=deployment, **options) as (endpoint, job_id, outcome):
        seen = []
        wait_for(lambda: (seen.append(scrape(endpoint)) or seen[-1]["epochstream_numberOfCompletedCheckpoints"] >= 3),
                 "three completed epochs in /metrics", every=0.2)
        for key in ("epochstream_numberOfCompletedCheckpoints", "epochstream_numRecordsIn",
                    "epochstream_lastCompletedCheckpointId"):
            values = [s[key] for s in seen]
            assert values == sorted(values), (key, values)  # scraped while running: never goes back
        assert seen[-1]["epochstream_numRecordsIn"] > 0
        assert any(k.startswith("epochstream_task_numRecordsInPerSecond{") for k in seen[-1])
        final, stop = stop_and_scrape(endpoint, job_id)
        assert stop["status"]["id"] == "COMPLETED"
    assert "error" not in outcome, outcome.get("error")
    r = outcome["result"]
    assert f'epochstream_job_info{{deployment={deployment},job_id={job_id},job_name=histogram,mode={mode},' \
        f'state=FINISHED}}' in final
    assert final["epochstream_numberOfCompletedCheckpoints"] == len(r.completed_epochs)
    assert final["epochstream_lastCompletedCheckpointId"] == r.completed_epochs[-1]
    assert final["epochstream_numRestarts"] == r.restarts == 0
    assert final["epochstream_numRecordsIn"] == r.records_in
    committed = sum(e["records"] for e in r.metrics["epochs"] if e["state"] == "completed")
    assert final["epochstream_numRecordsInCommitted"] == committed <= r.records_in
    aborted = sum(1 for e in r.metrics["epochs"] if e["state"] == "aborted")
    assert final["epochstream_numberOfFailedCheckpoints"] == aborted
    last = [e for e in r.metrics["epochs"] if e["state"] == "completed"][-1]
    assert final["epochstream_lastCheckpointSize"] == last["bytes"]
    assert final["epochstream_lastCheckpointDuration"] == pytest.approx(1000 * last["trigger_to_commit_seconds"])
    by_kind = r.metrics["service_traffic"]["by_kind"]
    assert {k.split("=")[1][:-1]: v for k, v in final.items() if k.startswith("epochstream_serviceMessages_total{")} \
        == {k: t["messages"] for k, t in by_kind.items()}
    if mode == "tracker":
        assert final["epochstream_tracker_reports_total"] == by_kind["report"]["messages"] > 0
        assert final["epochstream_tracker_neoss_total"] == by_kind.get("neoss", {}).get("messages", 0)
        assert any(k.startswith("epochstream_tracker_holdTime{") for k in final)
    else:
        assert any(k.startswith("epochstream_checkpointAlignmentTime{") for k in final)


# ---------------------------------------------------------------- the browser

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are needed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2200", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def page_number(driver, key: str) -> float | None:
    text = driver.find_element("css selector", f'[data-k="{key}"]').text
    return None if text in ("-", "") else float(text)


def first_column(driver, table: str) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('#{table} tr')].slice(1).map((r) => r.cells[0].textContent)")


def fetches(driver) -> int:
    return int(driver.execute_script("return Number(document.body.dataset.fetches || 0)"))


def shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000  # a page, not a blank
    target = os.environ.get("EPOCHSTREAM_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / name)
    return path


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_dashboard_in_a_real_browser(tmp_path, monkeypatch, browser, mode):
    monkeypatch.setenv("EPOCHSTREAM_HOME", str(tmp_path / "home"))
    d = browser
    with live_job(tmp_path, mode) as (endpoint, job_id, outcome):
        d.get(endpoint + "/")
        wait_for(lambda: int(d.execute_script("return Number(document.body.dataset.epochs || 0)")) >= 4,
                 "four epochs on the page", every=0.25)
        assert d.find_element("id", "state").text == "RUNNING"
        assert d.find_element("id", "job-id").text == job_id
        # the page's numbers against the REST JSON read just before and just after its own refresh
        client = RestClient(endpoint)
        before = client.call("GET", f"/jobs/{job_id}")
        n = fetches(d)
        wait_for(lambda: fetches(d) >= n + 2, "the page to refresh twice")
        on_page = {k: page_number(d, k) for k in ("completed_epochs", "restarts", "parallelism")}
        after = client.call("GET", f"/jobs/{job_id}")
        assert before["completed-epochs"] <= on_page["completed_epochs"] <= after["completed-epochs"]
        assert on_page["restarts"] == before["restarts"] == after["restarts"] == 0
        assert on_page["parallelism"] == after["parallelism"] == 2
        committed = client.call("GET", f"/jobs/{job_id}/checkpoints")["checkpoints"]
        shown = first_column(d, "checkpoints")  # tables are rebuilt every refresh: read them in one script
        assert shown and {int(e) for e in shown} <= \
            {c["epoch"] for c in committed} | set(range(1, after["completed-epochs"] + 1))
        assert len(d.find_elements("css selector", "#graph .chain")) == 2
        assert len(d.find_elements("css selector", ".uplot")) == 6  # every chart drawn
        # the view of the job's own mode first, then the other, then back
        title = d.find_element("id", "t-per-task")
        own, other = ("tracker", "aligned") if mode == "tracker" else ("aligned", "tracker")
        assert d.execute_script("return document.body.dataset.view") == own
        shot(d, tmp_path, f"dashboard-{mode}.png")
        d.find_element("id", f"view-{other}").click()
        assert d.execute_script("return document.body.dataset.view") == other
        assert ("trAcker hold" in title.text) == (other == "tracker")
        d.find_element("id", "view-tracker").click()
        wait_for(lambda: "trAcker hold time" in d.find_element("id", "t-per-task").text, "the trAcker view")
        if mode == "tracker":
            wait_for(lambda: "report" in first_column(d, "traffic"), "the trAcker view's service traffic by kind")
        final_client = RestClient(endpoint, token=jobs.token_for(endpoint))
        final_client.call("POST", f"/jobs/{job_id}/stop", {"savepoint": False})
    assert "error" not in outcome, outcome.get("error")
    r = outcome["result"]
    # the finished job's dashboard, offline from its checkpoint folder
    server = offline_server(str(tmp_path / "chk"))
    try:
        d.get(server.endpoint + "/")
        wait_for(lambda: d.find_element("id", "state").text == "FINISHED", "the offline page")
        retained = json.loads(urllib.request.urlopen(server.endpoint + "/ui/data").read())["epochs"]
        assert int(d.execute_script("return Number(document.body.dataset.epochs)")) == len(retained) >= 1
        assert retained[-1]["epoch"] == r.completed_epochs[-1]
        assert "read from its manifests" in d.find_element("id", "updated").text
        shot(d, tmp_path, f"dashboard-{mode}-offline.png")
    finally:
        server.close()
