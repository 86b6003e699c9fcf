"""The dashboard's document, its pages and ``/metrics``, from a finished job's checkpoint folder
(fast: simulator runs, the HTTP server on 127.0.0.1 in-process).

- ``ui.model``: per-task input rates from source offsets and manifest times;
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
from epochstream.ui.model import dashboard, task_rates
from pipelines import running_count, sim_run, without_fsync


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


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
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
