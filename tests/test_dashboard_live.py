"""A running job's ``/metrics`` and dashboard (slow: real worker processes of the local driver).

- ``/metrics`` scraped while the job runs only grows, and once the job stopped (over REST,
  with the token the CLI reads from the job registry) its counters equal the ``JobResult``
  (local driver in both modes, spark driver in tracker mode), the per-task rows in and out
  of every task too (sources, and the keyed stage and sink: the committed output's rows);
- a deliberately slow stage (a map that sleeps) shows its upstream backpressured (HIGH) and
  itself busy, and the same pipeline with a slow source instead shows every task OK;
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
from pipelines import committed_output, histogram, paced

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def live_job(tmp_path, mode: str, deployment: str = "local", pipeline=None, **options):
    """A job (local driver unless told) in a thread; yields (endpoint, job id, outcome dict with "result").
    Its generated input never ends first (10^9 records, made as read): the test stops it over REST."""
    p = pipeline or histogram(n=10**9, keys=7, out=tmp_path / "out", parallelism=2, max_parallelism=16, mode=mode,
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
        # every task's rows, live from the workers' heartbeats: the keyed stage's as well as the sources'
        wait_for(lambda: (seen.append(scrape(endpoint)) or seen[-1].get("epochstream_task_numRecordsIn{task=1.0}", 0)
                          > 0), "the keyed stage's rows in /metrics", every=0.2)
        for key in [k for k in seen[-1] if k.startswith(("epochstream_task_numRecordsIn{",
                                                          "epochstream_task_numRecordsOut{"))]:
            values = [s[key] for s in seen if key in s]
            assert values == sorted(values), (key, values)
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
    # per task: the workers' final counts (sent with Stopped), against the JobResult and the output
    per_task = {name: {k.split("=")[1][:-1]: v for k, v in final.items() if k.startswith(f"epochstream_task_{name}{{")}
                for name in ("numRecordsIn", "numRecordsOut")}
    assert set(per_task["numRecordsIn"]) == set(r.metrics["tasks"]) == {"0.0", "0.1", "1.0", "1.1"}
    for name, key in (("numRecordsIn", "records_in"), ("numRecordsOut", "records_out")):
        assert per_task[name] == {t: m[key] for t, m in r.metrics["tasks"].items()}
    sources, stage = ("0.0", "0.1"), ("1.0", "1.1")
    assert sum(per_task["numRecordsIn"][t] for t in sources) == r.records_in
    assert sum(per_task["numRecordsOut"][t] for t in sources) == r.records_in  # generate -> key_by: one row each
    # the keyed stage took every row the completed epochs cover, and at most what was read (rows read after
    # the final epoch's trigger may still be on their way when the workers stop); one histogram row per row
    # into the sink, of which the completed epochs' are committed
    stage_in = sum(per_task["numRecordsIn"][t] for t in stage)
    assert len(committed_output(tmp_path / "out" / "hist")) == committed <= stage_in <= r.records_in
    assert sum(per_task["numRecordsOut"][t] for t in stage) == stage_in
    by_kind = r.metrics["service_traffic"]["by_kind"]
    assert {k.split("=")[1][:-1]: v for k, v in final.items() if k.startswith("epochstream_serviceMessages_total{")} \
        == {k: t["messages"] for k, t in by_kind.items()}
    if mode == "tracker":
        assert final["epochstream_tracker_reports_total"] == by_kind["report"]["messages"] > 0
        assert final["epochstream_tracker_neoss_total"] == by_kind.get("neoss", {}).get("messages", 0)
        assert any(k.startswith("epochstream_tracker_holdTime{") for k in final)
    else:
        assert any(k.startswith("epochstream_checkpointAlignmentTime{") for k in final)


@pytest.mark.parametrize("slow", ["sink", "source"])
def test_a_slow_stage_backpressures_its_upstream(tmp_path, monkeypatch, slow):
    """generate -> key_by -> map "slow" -> sink at p=2. A map sleeping 2 ms per record holds
    the sources back: they show HIGH backpressure and the map's chain is busy; with the sleep in
    the source instead, nothing waits on output and every task is OK. Judged by the shares of
    time and Flink's levels (never by time values), from the REST JSON and /metrics."""
    monkeypatch.setenv("EPOCHSTREAM_HOME", str(tmp_path / "home"))
    p = paced(out=tmp_path / "out", parallelism=2, interval=0.5, sink_delay=0.002 if slow == "sink" else 0.0,
              source_delay=0.001 if slow == "source" else 0.0)
    with live_job(tmp_path, "aligned", pipeline=p) as (endpoint, job_id, outcome):
        client = RestClient(endpoint)

        def windows():  # every task's metrics once each has a window of 3 s or more
            tasks = client.call("GET", f"/jobs/{job_id}")["task-metrics"]
            ok = len(tasks) == 4 and all((m["window_seconds"] or 0) >= 3.0 for m in tasks.values())
            return tasks if ok else None

        tasks = wait_for(windows, "three seconds of every task's counters", every=0.5)
        scraped = scrape(endpoint)
        RestClient(endpoint, token=jobs.token_for(endpoint)).call("POST", f"/jobs/{job_id}/stop",
                                                                   {"savepoint": False})
    assert "error" not in outcome, outcome.get("error")
    sources, stage = ("0.0", "0.1"), ("1.0", "1.1")
    for t, m in tasks.items():  # Flink's shares: they add up to a second
        shares = (m["busy_ms_per_second"], m["backpressured_ms_per_second"], m["idle_ms_per_second"])
        assert sum(shares) == pytest.approx(1000.0) and min(shares) >= 0, (t, m)
        level = scraped[f"epochstream_task_backPressureLevel{{task={t}}}"]
        assert level == ["OK", "LOW", "HIGH"].index(m["backpressure"])
    if slow == "sink":
        assert [tasks[t]["backpressure"] for t in sources] == ["HIGH", "HIGH"], tasks
        assert [tasks[t]["backpressure"] for t in stage] == ["OK", "OK"], tasks  # a sink waits on nobody
        assert all(tasks[t]["busy_ms_per_second"] > tasks[t]["backpressured_ms_per_second"] for t in stage)
        assert max(tasks[t]["busy_ms_per_second"] for t in stage) > 500, tasks  # the bottleneck works
        assert all(tasks[t]["backpressured_ms_per_second"] > tasks[t]["busy_ms_per_second"] for t in sources)
    else:
        assert {m["backpressure"] for m in tasks.values()} == {"OK"}, tasks
        assert all(tasks[t]["busy_ms_per_second"] > tasks[t]["idle_ms_per_second"] for t in sources), tasks
        assert all(tasks[t]["idle_ms_per_second"] > tasks[t]["busy_ms_per_second"] for t in stage), tasks
    for t in sources + stage:
        assert scraped[f"epochstream_task_numRecordsOutPerSecond{{task={t}}}"] > 0


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


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
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
        per_task = d.execute_script(  # task -> [records in, records out, backpressure], read in one script
            "return Object.fromEntries([...document.querySelectorAll('#tasks tr')].slice(1).map((r) => "
            "[r.cells[0].textContent, [Number(r.cells[2].textContent), Number(r.cells[3].textContent), "
            "r.cells[9].textContent]]))")
        after = client.call("GET", f"/jobs/{job_id}")
        assert before["completed-epochs"] <= on_page["completed_epochs"] <= after["completed-epochs"]
        assert on_page["restarts"] == before["restarts"] == after["restarts"] == 0
        assert on_page["parallelism"] == after["parallelism"] == 2
        # every task's rows on the page lie between the REST JSON's before and after (counters only grow)
        assert set(per_task) == set(after["task-metrics"]) == {"0.0", "0.1", "1.0", "1.1"}
        for t, (rows_in, rows_out, level) in per_task.items():
            was, now = before["task-metrics"].get(t, {}), after["task-metrics"][t]
            assert was.get("records_in", 0) <= rows_in <= now["records_in"], (t, rows_in, was, now)
            assert was.get("records_out", 0) <= rows_out <= now["records_out"], (t, rows_out, was, now)
            assert level in ("OK", "LOW", "HIGH")
        assert per_task["1.0"][0] > 0  # the keyed stage's throughput, not only the sources'
        committed = client.call("GET", f"/jobs/{job_id}/checkpoints")["checkpoints"]
        shown = first_column(d, "checkpoints")  # tables are rebuilt every refresh: read them in one script
        assert shown and {int(e) for e in shown} <= \
            {c["epoch"] for c in committed} | set(range(1, after["completed-epochs"] + 1))
        assert len(d.find_elements("css selector", "#graph .chain")) == 2
        headers = d.execute_script("return [...document.querySelectorAll('#epochs th')].map((h) => h.textContent)")
        assert "channel state (records)" in headers, headers
        assert len(d.find_elements("css selector", ".uplot")) == 8  # every chart drawn
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
