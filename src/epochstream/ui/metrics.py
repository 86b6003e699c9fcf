"""``/metrics``: the job in Prometheus' text format, through ``prometheus_client``.

Names follow Flink's checkpointing and IO metrics where Flink has one (same meaning, same
unit: durations in milliseconds, sizes in bytes), prefixed ``epochstream_``; the trAcker's
own (hold time, reports, promises, NEOSS) are under ``epochstream_tracker_``. Every value
is read from the dashboard document at scrape time (``Collector.collect``), so the page,
the metrics and the REST status never disagree.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..runtime.modes import SnapshotMode
from ..tracker.traffic import NEOSS_KIND, PROMISE, REPORT
from .model import BACKPRESSURE_LEVELS

#: backpressure levels in the order of their gauge's values
LEVELS = [level for _bound, level in BACKPRESSURE_LEVELS]

P = "epochstream_"
#: the content type Prometheus expects for the text format
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _ms(seconds: Any) -> float:
    return 1000.0 * float(seconds or 0.0)


class JobCollector(Collector):
    """Metric families of one job, from ``doc()`` (a ``model.dashboard`` document)."""

    def __init__(self, doc: Callable[[], dict[str, Any]]) -> None:
        self.doc = doc

    def collect(self) -> Iterator[Metric]:
        d = self.doc()
        job = d["job"]
        done = [r for r in d["epochs"] if r["state"] == "completed"]
        last = done[-1] if done else None
        info = GaugeMetricFamily(P + "job_info", "The job (always 1; its identity in labels)",
                                 labels=["job_id", "job_name", "mode", "deployment", "state"])
        info.add_metric([str(job["id"]), str(job["name"]), str(job["mode"]), str(job["deployment"]),
                         str(job["state"])], 1)
        yield info
        ended = job["state"] in ("FINISHED", "FAILED", "CANCELED") and job["records_in"] is not None
        gauges = [
            ("numberOfCompletedCheckpoints", "Completed epochs (checkpoints and savepoints) of this run",
             job["completed_epochs"]),
            ("numberOfFailedCheckpoints", "Epochs aborted (declined, timed out, failed) in this run",
             job["aborted_epochs"]),
            ("totalNumberOfCheckpoints", "Epochs completed or aborted in this run",
             (job["completed_epochs"] or 0) + job["aborted_epochs"]),
            ("lastCompletedCheckpointId", "Epoch number of the last completed epoch", job["last_epoch"] or 0),
            ("lastCheckpointDuration", "Milliseconds from the last completed epoch's trigger to its commit",
             _ms(job["last_epoch_seconds"])),
            ("lastCheckpointSize", "Bytes of state files the last completed epoch wrote", job["last_epoch_bytes"] or 0),
            ("lastCheckpointPersistedData", "Bytes of in-flight records (channel state) the last completed epoch "
             "wrote: unaligned mode, 0 otherwise", job["last_epoch_channel_state_bytes"] or 0),
            ("numRestarts", "Failovers (restarts) of this run", job["restarts"]),
            ("uptime", "Milliseconds since the run began", _ms(job["duration_seconds"])),
            ("numRecordsIn", "Records the sources read: those completed epochs cover while the job runs, the "
             "workers' own count once it ended", job["records_in"] if ended else job["committed_records"]),
            ("numRecordsInCommitted", "Records of input that completed epochs cover", job["committed_records"]),
            ("numRecordsInPerSecond", "Records/s the sources read between the last two completed epochs",
             job["records_per_second"] or 0.0),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(P + name, doc, value=float(value or 0))
        tracker = job["mode"] == SnapshotMode.TRACKER
        per_task: list[tuple[str, str, str, Callable[[Any], float], bool]] = [
            ("checkpointAlignmentTime", "Milliseconds the task aligned barriers for the last completed epoch",
             "alignment_seconds", _ms, not tracker),
            ("tracker_holdTime", "Milliseconds the task held output for the trAcker's bound in the last epoch",
             "alignment_seconds", _ms, tracker),
            ("checkpointStartDelay", "Milliseconds from the last epoch's trigger to the task's ack",
             "ack_seconds", _ms, True),
            ("heldRecords", "Records the task held back during the last completed epoch", "held_records", float, True),
            ("checkpointedSize", "Bytes of state the task wrote for the last completed epoch", "bytes", float, True),
        ]
        for name, doc, key, conv, wanted in per_task:
            if not wanted:
                continue
            fam = GaugeMetricFamily(P + name, doc, labels=["task"])
            for task, t in sorted((last or {}).get("tasks", {}).items()):
                fam.add_metric([task], conv(t.get(key, 0)))
            yield fam
        yield from self._task_io(d)
        traffic = d["traffic"]
        msgs = CounterMetricFamily(P + "serviceMessages", "Service messages by kind (markers, reports, NEOSS, ...)",
                                   labels=["kind"])
        nbytes = CounterMetricFamily(P + "serviceBytes", "Bytes of service messages by kind", labels=["kind"])
        for kind, t in sorted(traffic.items()):
            msgs.add_metric([kind], t.get("messages", 0))
            nbytes.add_metric([kind], t.get("bytes", 0))
        yield msgs
        yield nbytes
        for kind, name in ((REPORT, "reports"), (PROMISE, "promises"), (NEOSS_KIND, "neoss")):
            yield CounterMetricFamily(P + "tracker_" + name, f"trAcker {kind} messages of this run",
                                      value=traffic.get(kind, {}).get("messages", 0))


    @staticmethod
    def _task_io(d: dict[str, Any]) -> Iterator[Metric]:
        """Flink's task IO metrics (its reporter's ``task`` scope), from the workers' counters;
        where they have no rate yet (offline, or before a task's second heartbeat), a source
        task's ``numRecordsInPerSecond`` is its input rate between the last two epochs."""
        live = d.get("task_metrics") or {}
        families: list[tuple[str, str, str]] = [
            ("numRecordsIn", "Rows the task took in (read from its source or received) over the run", "records_in"),
            ("numRecordsOut", "Rows the task put out (to its output channels and its sinks) over the run",
             "records_out"),
            ("numRecordsInPerSecond", "Rows/s the task took in over the last window", "records_in_per_second"),
            ("numRecordsOutPerSecond", "Rows/s the task put out over the last window", "records_out_per_second"),
            ("busyTimeMsPerSecond", "Milliseconds per second the task was working", "busy_ms_per_second"),
            ("backPressuredTimeMsPerSecond", "Milliseconds per second the task could not put out its output "
             "(throttled, or waiting for a link's credit)", "backpressured_ms_per_second"),
            ("idleTimeMsPerSecond", "Milliseconds per second the task had nothing to do", "idle_ms_per_second"),
            ("numLateRecordsDropped", "Records the task's source dropped as late (behind its split's watermark, "
             "max_out_of_orderness) over the run", "late_records_dropped"),
            ("numDeadLetters", "Records the task's from_json sent to its dead-letter output (they do not decode) "
             "over the run", "dead_letters"),
        ]
        between_epochs = {task: series[-1] for task, series in d["task_rates"].items()
                          if series and series[-1] is not None}
        for name, doc, key in families:
            fam = GaugeMetricFamily(P + "task_" + name, doc, labels=["task"])
            values = {task: m[key] for task, m in live.items() if m.get(key) is not None}
            if name == "numRecordsInPerSecond":  # before a task's second heartbeat: its source's rate, if any
                values = {**between_epochs, **values}
            for task, value in sorted(values.items()):
                fam.add_metric([task], float(value))
            yield fam
        level = GaugeMetricFamily(P + "task_backPressureLevel",
                                  "Flink's backpressure level of the task: 0 OK (<= 10% of the time backpressured), "
                                  "1 LOW (<= 50%), 2 HIGH", labels=["task"])
        for task, m in live.items():
            if m.get("backpressure") is not None:
                level.add_metric([task], float(LEVELS.index(m["backpressure"])))
        yield level


def registry_for(doc: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry of its own per job (never the process-global one: tests run several jobs)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(doc))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
