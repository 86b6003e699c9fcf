"""The dashboard's document, its pages and ``/metrics``, from a finished job's checkpoint folder
(fast: simulator runs, the HTTP server on 127.0.0.1 in-process).

- ``ui.model``: per-task input rates from source offsets and manifest times;
- ``runtime.meters``: a loop's wall time split into busy / backpressured / idle per task, the
  driver's run totals and window, and ``task_metrics`` (rates, ms/s, Flink's OK/LOW/HIGH), on
  ``/metrics`` with Flink's task IO names; rows (not batches) counted in and out, in the simulator;
- offline (``epochstream ui``): the data the page plots equals what the manifests hold, in
  both modes; the page and its vendored uPlot are served, nothing outside the asset list is;
- ``/metrics`` parses as Prometheus text and its counters equal the manifests';
- a finished job's server refuses every POST and changes nothing.

The live job, the metrics scraped during a run and the browser are in ``test_dashboard_live.py`` (slow).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from importlib import resources

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.rest import offline_server
from epochstream.runtime.meters import LoopTimes, RunMeters, WorkerSample
from epochstream.ui.app import Dashboard
from epochstream.ui.model import backpressure_level, dashboard, task_metrics, task_rates
from pipelines import histogram, running_count, sim_run, without_fsync


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def metrics(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_task_rates_from_offsets_and_times():
    rows = [
        {"state": "completed", "time": 100.0, "tasks": {"0.0": {"source_offset": 10}, "1.0": {"source_offset": 0}}},
        {"state": "aborted"},
        {"state": "completed", "time": 102.0, "tasks": {"0.0": {"source_offset": 50}, "1.0": {"source_offset": 0}}},
        {"state": "completed", "time": 103.0, "tasks": {"0.0": {"source_offset": 51}}},
    ]
    assert task_rates(rows) == {"0.0": [None, 20.0, 1.0]}  # 1.0 reads no source


def test_dashboard_document_of_a_status():
    status = {"jid": "j", "name": "n", "state": "RUNNING", "mode": "tracker", "restarts": 1,
              "failovers": [{"time": 1.5, "reason": "worker 0 died"}], "recovery-seconds": [0.25],
              "epochs": [{"epoch": 1, "state": "aborted", "reason": "declined"},
                         {"epoch": 2, "state": "completed", "created_at": "2026-01-01T00:00:00+00:00", "records": 7,
                          "prepare_seconds": 0.5, "trigger_to_manifest_seconds": 0.75, "commit_seconds": 0.1,
                          "trigger_to_commit_seconds": 0.9, "bytes": 10, "tasks": {}}],
              "traffic": {"report": {"messages": 3, "bytes": 30, "entries": 3}}}
    d = dashboard(status, None, [])
    assert d["job"]["completed_epochs"] == 1 and d["job"]["aborted_epochs"] == 1
    assert d["job"]["last_epoch"] == 2 and d["job"]["last_epoch_seconds"] == 0.9 and d["job"]["committed_records"] == 7
    assert d["epochs"][1]["manifest_seconds"] == 0.25
    assert d["restarts"] == [{"time": 1.5, "reason": "worker 0 died", "recovery_seconds": 0.25}]


def test_loop_time_is_split_into_busy_backpressured_and_idle():
    src, down, other = (0, 0), (1, 0), (2, 0)
    t = LoopTimes([src, down, other], now=10.0, downstream={src: frozenset({down})})
    # round 1: the source works 1 s, its consumer 3 s, while the source still has input: the
    # consumer's 3 s are the source's backpressure, the unrelated task is idle the whole round
    t.worked(src, 1.0)
    t.worked(down, 3.0)
    t.round_end(14.0, blocked=frozenset(), pending={src})
    assert (t.busy[src], t.backpressured[src], t.idle[src]) == (1.0, 3.0, 0.0)
    assert (t.busy[down], t.backpressured[down], t.idle[down]) == (3.0, 0.0, 1.0)
    assert (t.busy[other], t.backpressured[other], t.idle[other]) == (0.0, 0.0, 4.0)
    # round 2: throttled (blocked) for a whole 2 s round; no input left for the consumer: idle
    t.round_end(16.0, blocked={src})
    assert (t.backpressured[src], t.idle[down]) == (5.0, 3.0)
    # round 3: pending but the consumer did not run: the wait is idle, not backpressure
    t.worked(src, 0.5)
    t.round_end(17.0, blocked=frozenset(), pending={src})
    assert (t.busy[src], t.backpressured[src], t.idle[src]) == (1.5, 5.0, 0.5)
    for task in (src, down, other):  # the invariant: the shares add up to the wall time
        assert t.busy[task] + t.backpressured[task] + t.idle[task] == pytest.approx(7.0)


def test_run_meters_keep_run_totals_and_a_window_and_rate_it_like_flink():
    m = RunMeters(window=5.0)
    m.sample(0, WorkerSample(100.0, {"0.0": (0, 0, 0.0, 0.0, 0.0, 0, 0)}))
    assert task_metrics(m.as_dict())["0.0"]["records_in_per_second"] is None  # one report: no window yet
    for i in range(1, 11):  # 100 rows/s in, 50 out; 0.2 s busy, 0.7 s backpressured, 0.1 s idle per second
        m.sample(0, WorkerSample(100.0 + i, {"0.0": (100 * i, 50 * i, 0.2 * i, 0.7 * i, 0.1 * i, 0, 0)}))
    row = task_metrics(m.as_dict())["0.0"]
    assert (row["records_in"], row["records_out"]) == (1000, 500)
    assert 5.0 <= row["window_seconds"] <= 6.0 and row["records_in_per_second"] == pytest.approx(100.0)
    assert row["records_out_per_second"] == pytest.approx(50.0)
    assert (row["busy_ms_per_second"], row["backpressured_ms_per_second"], row["idle_ms_per_second"]) == \
        pytest.approx((200.0, 700.0, 100.0))
    assert row["backpressure"] == "HIGH"
    m.new_attempt()  # a failover: the next attempt's workers count from 0, the run's totals do not go back
    m.sample(0, WorkerSample(3.0, {"0.0": (7, 7, 0.0, 0.0, 1.0, 0, 0)}))
    assert m.as_dict()["0.0"]["records_in"] == 1007 and "window" not in m.as_dict()["0.0"]
    assert [backpressure_level(r) for r in (0.0, 0.1, 0.11, 0.5, 0.51, 1.0)] == ["OK", "OK", "LOW", "LOW", "HIGH",
                                                                                  "HIGH"]


def test_task_io_metrics_have_flinks_names():
    meters = RunMeters()
    meters.sample(1, WorkerSample(0.0, {"1.1": (0, 0, 0.0, 0.0, 0.0, 0, 0)}))
    meters.sample(1, WorkerSample(2.0, {"1.1": (40, 20, 1.9, 0.0, 0.1, 0, 0)}))
    status = {"state": "RUNNING", "mode": "aligned", "epochs": [], "task-metrics": task_metrics(meters.as_dict())}
    doc = dashboard(status, None, [])
    assert doc["task_metrics"]["1.1"]["busy_ms_per_second"] == pytest.approx(950.0)
    m = metrics(Dashboard(lambda: doc).page(["metrics"])[2].decode())
    task = (("task", "1.1"),)
    assert m[("epochstream_task_numRecordsIn", task)] == 40 and m[("epochstream_task_numRecordsOut", task)] == 20
    assert m[("epochstream_task_numRecordsInPerSecond", task)] == 20.0
    assert m[("epochstream_task_numRecordsOutPerSecond", task)] == 10.0
    assert m[("epochstream_task_busyTimeMsPerSecond", task)] == pytest.approx(950.0)
    assert m[("epochstream_task_backPressuredTimeMsPerSecond", task)] == 0.0
    assert m[("epochstream_task_idleTimeMsPerSecond", task)] == pytest.approx(50.0)
    assert m[("epochstream_task_backPressureLevel", task)] == 0.0  # OK


def test_rows_not_batches_are_counted_in_the_simulator(tmp_path):
    # columnar: blocks of 16 rows go out as Arrow batches; each row counts, in and out, per task
    p = histogram(n=400, keys=5, out=tmp_path / "out", parallelism=2, columnar=True)
    r = sim_run(p, tmp_path / "chk", seed=1)
    tasks = r.metrics["tasks"]
    sources = {k: v for k, v in tasks.items() if k.startswith("0.")}
    rest = {k: v for k, v in tasks.items() if not k.startswith("0.")}
    assert len(sources) == len(rest) == 2
    assert sum(v["records_in"] for v in sources.values()) == sum(v["records_out"] for v in sources.values()) \
        == r.records_in == 400
    # the histogram emits one row per row into its sink (numRecordsOut of a sink task: rows it took)
    assert sum(v["records_in"] for v in rest.values()) == sum(v["records_out"] for v in rest.values()) == 400


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
def test_offline_dashboard_equals_the_manifests(tmp_path, mode):
    p = running_count(n=400, keys=5, out=tmp_path / "out", parallelism=2, max_parallelism=8, mode=mode)
    r = sim_run(p, tmp_path / "chk", seed=3)
    storage = LocalCheckpointStorage(tmp_path / "chk")
    manifests = [storage.load_manifest(e)[0] for e in storage.list_checkpoints()]
    assert len(manifests) >= 2 and manifests[-1]["epoch"] == r.completed_epochs[-1]
    server = offline_server(str(tmp_path / "chk"))
    try:
        base = server.endpoint
        code, ctype, body = get(f"{base}/ui/data")
        doc = json.loads(body)
        assert code == 200 and ctype == "application/json" and doc["live"] is False
        assert doc["job"]["state"] == "FINISHED" and doc["job"]["mode"] == mode
        assert [e["epoch"] for e in doc["epochs"]] == [m["epoch"] for m in manifests]
        assert [e["bytes"] for e in doc["epochs"]] == [m["metrics"]["bytes"] for m in manifests]
        assert [e["channel_state_bytes"] for e in doc["epochs"]] == \
            [m["metrics"]["channel_state_bytes"] for m in manifests]
        assert (mode == "unaligned") == any(e["channel_state_bytes"] for e in doc["epochs"])  # the markers overtook
        assert [c["epoch"] for c in doc["checkpoints"]] == [m["epoch"] for m in manifests]
        assert doc["epochs"][-1]["tasks"].keys() == manifests[-1]["metrics"]["tasks"].keys()
        sources = [c for c in doc["graph"]["chains"] if c["source"]]
        assert [o["uid"] for c in sources for o in c["operators"]] == ["src"] and doc["graph"]["edges"]
        # records between retained epochs: the difference of the manifests' offset sums
        totals = [sum(int(o) for s in m["sources"].values() for o in s["offsets"].values()) for m in manifests]
        assert [e["records"] for e in doc["epochs"][1:]] == [b - a for a, b in zip(totals, totals[1:], strict=False)]

        code, _, text = get(f"{base}/metrics")
        m = metrics(text.decode())
        assert m[("epochstream_numberOfCompletedCheckpoints", ())] == len(manifests)
        assert m[("epochstream_lastCompletedCheckpointId", ())] == manifests[-1]["epoch"]
        assert m[("epochstream_lastCheckpointSize", ())] == manifests[-1]["metrics"]["bytes"]
        assert m[("epochstream_lastCheckpointPersistedData", ())] == manifests[-1]["metrics"]["channel_state_bytes"]
        hold = "epochstream_tracker_holdTime" if mode == "tracker" else "epochstream_checkpointAlignmentTime"
        assert {dict(k[1])["task"] for k in m if k[0] == hold} == set(manifests[-1]["metrics"]["tasks"])

        code, ctype, page = get(f"{base}/")
        assert code == 200 and ctype.startswith("text/html") and b"/ui/uPlot.iife.min.js" in page
        code, _, js = get(f"{base}/ui/uPlot.iife.min.js")
        vendored = resources.files("epochstream.ui").joinpath("static", "vendor", "uPlot.iife.min.js").read_bytes()
        assert code == 200 and js == vendored and js.startswith(b"/*! https://github.com/leeoniya/uPlot")
        for bad in ("/ui/..%2Fapp.py", "/ui/../offline.py", "/ui/vendor/uPlot.min.css", "/ui/nope.js"):
            assert get(base + bad)[0] == 404, bad

        req = urllib.request.Request(f"{base}/jobs/{doc['job']['id']}/stop", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 401  # no token can be had for a finished job
    finally:
        server.close()
    assert [storage.load_manifest(e)[0] for e in storage.list_checkpoints()] == manifests  # nothing changed


def test_offline_dashboard_of_an_empty_folder_says_so(tmp_path):
    (tmp_path / "chk").mkdir()
    with pytest.raises(Exception, match="no readable checkpoint manifest"):
        offline_server(str(tmp_path / "chk"))
