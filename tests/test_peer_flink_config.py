"""The PyFlink peer's settings (benchmarks/peers/flink_setup.py, run_peers.py): pure logic, no Flink started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kafka.kafka import _pyflink_row  # noqa: E402
from benchmarks.peers.flink_setup import (  # noqa: E402
    cluster_config,
    job_config,
    kafka_sink_properties,
    kafka_table_ddl,
    variant_label,
)
from benchmarks.peers.run_peers import PYFLINK_VARIANTS, _flags, flink_error  # noqa: E402


def test_job_config_keeps_flink_defaults_unless_tuned(tmp_path):
    conf = job_config(python_mode="process", checkpoint_dir=str(tmp_path), python_executable="/venv/bin/python")
    assert conf["python.execution-mode"] == "process"
    assert conf["python.executable"] == "/venv/bin/python"
    assert conf["execution.checkpointing.dir"] == tmp_path.as_uri()
    assert "python.fn-execution.bundle.size" not in conf
    assert "python.metric.enabled" not in conf
    assert "execution.checkpointing.unaligned.enabled" not in conf


def test_job_config_tuned(tmp_path):
    conf = job_config(python_mode="thread", checkpoint_dir=str(tmp_path), python_executable="py",
                      bundle_size=100_000, metrics=False, unaligned=True)
    assert conf["python.execution-mode"] == "thread"
    assert conf["python.fn-execution.bundle.size"] == "100000"
    assert conf["python.metric.enabled"] == "false"
    assert conf["execution.checkpointing.unaligned.enabled"] == "true"
    # loopback is a client-side choice: the job itself runs in process mode
    assert job_config(python_mode="loopback", checkpoint_dir=str(tmp_path),
                      python_executable="py")["python.execution-mode"] == "process"


def test_job_config_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="python_mode"):
        job_config(python_mode="threads", checkpoint_dir=str(tmp_path), python_executable="py")
    with pytest.raises(ValueError, match="bundle_size"):
        job_config(python_mode="process", checkpoint_dir=str(tmp_path), python_executable="py", bundle_size=0)


def test_cluster_config_has_one_slot_and_every_memory_piece():
    conf = cluster_config(rest_port=18081, rpc_port=16123)
    assert conf["taskmanager.numberOfTaskSlots"] == "1"
    assert conf["rest.port"] == "18081" and conf["jobmanager.rpc.port"] == "16123"
    # TaskManagerRunner started without bin/taskmanager.sh needs each component set explicitly
    for key in ("framework.heap.size", "task.heap.size", "framework.off-heap.size", "task.off-heap.size",
                "network.min", "network.max", "managed.size", "jvm-metaspace.size", "jvm-overhead.min",
                "jvm-overhead.max"):
        assert f"taskmanager.memory.{key}" in conf
    assert "taskmanager.memory.process.size" not in conf


def test_variant_label_names_every_setting():
    assert variant_label(python_mode="process", bundle_size=None, metrics=True, unaligned=False,
                         cluster=0) == "process, bundle default (1000), aligned, local mini-cluster"
    assert variant_label(python_mode="thread", bundle_size=100_000, metrics=False, unaligned=True, cluster=2) == \
        "thread, bundle 100000, metrics off, unaligned, standalone 2 TM x 1 slot"
    assert variant_label(python_mode="process", bundle_size=None, metrics=True, unaligned=False, cluster=2,
                         sql=True) == "Flink SQL COUNT(*) GROUP BY, standalone 2 TM x 1 slot"


def test_variants_become_script_flags():
    assert _flags({"records": 5, "snapshot_interval": 1, "sql": True, "unaligned": False, "bundle_size": None}) == \
        ["--records", "5", "--snapshot-interval", "1", "--sql"]
    assert _flags(PYFLINK_VARIANTS["tuned"]) == \
        ["--python-mode", "process", "--bundle-size", "100000", "--no-metrics", "--unaligned"]
    assert _flags(PYFLINK_VARIANTS["thread"]) == ["--python-mode", "thread", "--cluster", "2", "--no-metrics"]
    assert _flags(PYFLINK_VARIANTS["sql"]) == ["--sql", "--cluster", "2"]


def test_kafka_sink_transaction_timeout_fits_the_broker_and_outlasts_a_checkpoint():
    assert kafka_sink_properties(300_000, 1.0) == {"transaction.timeout.ms": "300000"}
    # Flink's own default (1 h) is above Kafka's default transaction.max.timeout.ms (15 min)
    with pytest.raises(ValueError, match="transaction.max.timeout.ms"):
        kafka_sink_properties(3_600_000, 1.0)
    assert kafka_sink_properties(3_600_000, 1.0, broker_max_timeout_ms=3_600_000)
    with pytest.raises(ValueError, match="checkpoint"):
        kafka_sink_properties(1_000, 1.0)


def test_kafka_table_ddl_reads_key_and_timestamp_bounded_or_not():
    ddl = kafka_table_ddl("src", bootstrap="127.0.0.1:9092", topic="in-1", group="g", bounded=True)
    assert "'key.format' = 'raw'" in ddl and "'key.fields' = 'k'" in ddl
    assert "METADATA FROM 'timestamp'" in ddl
    assert "'scan.startup.mode' = 'earliest-offset'" in ddl
    assert "'scan.bounded.mode' = 'latest-offset'" in ddl
    assert "'properties.group.id' = 'g'" in ddl
    unbounded = kafka_table_ddl("src", bootstrap="127.0.0.1:9092", topic="in-1", group="g", bounded=False)
    assert "scan.bounded.mode" not in unbounded
    with pytest.raises(ValueError, match="topic"):
        kafka_table_ddl("src", bootstrap="b", topic="it's", group="g", bounded=False)


def test_flink_error_takes_the_innermost_cause():
    trace = """Traceback (most recent call last):
py4j.protocol.Py4JJavaError: An error occurred while calling o1.execute.
: org.apache.flink.runtime.client.JobExecutionException: Job execution failed.
\tat org.apache.flink.runtime.jobmaster.JobResult.toJobExecutionResult(JobResult.java:144)
Caused by: org.apache.flink.runtime.JobException: Recovery is suppressed by NoRestartBackoffTimeStrategy
\tat org.apache.flink.runtime.executiongraph.failover.ExecutionFailureHandler.handleFailure(X.java:1)
Caused by: java.lang.NoSuchMethodError: 'void org.apache.flink.Foo.bar()'
\t... 7 more
"""
    assert flink_error(trace) == "java.lang.NoSuchMethodError: 'void org.apache.flink.Foo.bar()'"
    assert flink_error("x\nValueError: bad\n  File \"a.py\", line 1") == "ValueError: bad"
    assert flink_error("") == "no output"


def test_pyflink_row_keeps_a_failure_and_flags_missing_outputs():
    failed = _pyflink_row({"error": "java.lang.NoSuchMethodError: x"}, 0.1, 1000, "process")
    assert failed["records_per_s"] == "" and failed["p99_ms"] == ""
    assert failed["note"] == "failed: java.lang.NoSuchMethodError: x"
    got = {"rps": 5000.4, "rps_total": 1500.2, "checkpoints": 7, "outputs": 990, "version": "2.3.0",
           "rate": 2500.0, "percentiles": (1200.0, 2400.5, 100), "expected_samples": 17500,
           "latency_checkpoints": 12, "latency_seconds": 30.2}
    row = _pyflink_row(got, 1.0, 1000, "thread")
    assert row["system"] == "pyflink-kafkasink-thread" and row["guarantee"] == "exactly-once"
    assert (row["records_per_s"], row["records_per_s_with_startup"], row["epochs"]) == (5000, 1500, 7)
    assert (row["p50_ms"], row["p99_ms"], row["latency_samples"]) == (1200.0, 2400.5, 100)
    assert "990 outputs read at read_committed for 1000 inputs" in row["note"]
    assert "only 100 of ~17500 outputs" in row["note"]
    assert "latency run: 12 checkpoints completed in 30 s" in row["note"]
    whole = _pyflink_row({**got, "outputs": 1000, "percentiles": (1.0, 2.0, 17500)}, 1.0, 1000, "process")
    assert "outputs" not in whole["note"] and "failed" not in whole["note"]
