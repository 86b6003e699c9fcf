"""Per-epoch metrics: every driver fills them, in the run result and in the manifest (and so
in ``epochstream checkpoints list --json``). The simulator shows it here (fast); the slow
suites check the local and spark drivers the same way (``check_epoch_metrics``)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from epochstream.cli import main
from pipelines import running_count, sim_run

TASK_KEYS = {"alignment_seconds", "write_seconds", "ack_seconds", "bytes", "held_records", "source_offset",
             "channel_state_records", "channel_state_bytes"}


def check_epoch_metrics(result, checkpoint_dir, mode: str) -> None:
    """Completed epochs in ``result`` and the manifests of ``checkpoint_dir`` carry the metrics."""
    epochs = [e for e in result.metrics["epochs"] if e["state"] == "completed"]
    assert epochs and [e["epoch"] for e in epochs] == result.completed_epochs
    par = result.metrics["parallelism"]
    tasks = set(epochs[0]["tasks"])  # "chain.subtask": every task of the plan, each epoch
    assert len(tasks) >= 2 * par and len(tasks) % par == 0, tasks
    for e in epochs:
        assert set(e["tasks"]) == tasks
        for t in e["tasks"].values():
            assert set(t) == TASK_KEYS
            assert t["ack_seconds"] >= 0 and t["write_seconds"] >= 0 and t["alignment_seconds"] >= 0
        assert 0 <= e["prepare_seconds"] <= e["trigger_to_commit_seconds"]
        assert e["commit_seconds"] >= 0
        assert e["bytes"] == sum(t["bytes"] for t in e["tasks"].values())
        for what in ("channel_state_records", "channel_state_bytes"):  # unaligned mode; 0 in the others
            assert e[what] == sum(t[what] for t in e["tasks"].values())
            assert mode == "unaligned" or e[what] == 0
        msgs = e["service_messages"]
        assert msgs["acks"] == len(tasks) and msgs["triggers"] >= 1
        assert ("tracker" in msgs) == (mode == "tracker") and ("markers" in msgs) == (mode != "tracker")
        assert e["service_messages_total"] == sum(msgs.values())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["checkpoints", "list", "--checkpoint-dir", str(checkpoint_dir), "--json"]) == 0
    rows = {r["epoch"]: r for r in json.loads(out.getvalue())["checkpoints"]}
    by_epoch = {e["epoch"]: e for e in epochs}
    for epoch, row in rows.items():
        m = row["metrics"]
        assert m["tasks"] == by_epoch[epoch]["tasks"]
        assert m["service_messages"] == by_epoch[epoch]["service_messages"]
        assert m["prepare_seconds"] == pytest.approx(by_epoch[epoch]["prepare_seconds"], abs=1e-5)


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
def test_sim_fills_epoch_metrics(tmp_path, mode):
    result = sim_run(running_count(n=400, mode=mode, out=tmp_path / "out"), tmp_path / "chk", seed=2)
    assert len(result.completed_epochs) >= 2
    check_epoch_metrics(result, tmp_path / "chk", mode)
    if mode == "aligned":  # one marker per channel and epoch: 2x2 hash channels
        assert {e["service_messages"]["markers"] for e in result.metrics["epochs"] if "tasks" in e} == {4}
    if mode == "unaligned":  # the markers overtook queued records: per-task channel state in the epoch log
        assert any(t["channel_state_records"] for e in result.metrics["epochs"] if "tasks" in e
                   for t in e["tasks"].values())
