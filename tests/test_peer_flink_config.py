"""The PyFlink peer's settings (benchmarks/peers/flink_setup.py, run_peers.py): pure logic, no Flink started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers.flink_setup import cluster_config, job_config, variant_label  # noqa: E402
from benchmarks.peers.run_peers import PYFLINK_VARIANTS, _flags  # noqa: E402


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
