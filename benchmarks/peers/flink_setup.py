"""Flink settings of the PyFlink peer variants, and a standalone Flink cluster started from the wheel.

Pure configuration (``job_config``, ``cluster_config``, ``variant_label``) is kept apart from
pyflink so it can be tested in the main environment; ``StandaloneCluster`` only needs the
apache-flink wheel's jars (``pyflink/lib``, ``pyflink/opt``) and ``java`` on PATH, not the
``bin/`` scripts: it starts the JobManager and each TaskManager with ``java`` directly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

# The JDK 17 flags of the wheel's conf/config.yaml (env.java.opts.all): Flink's RPC and
# serialisers reflect into these packages.
JAVA_OPENS = [
    "--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED",
    *[f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in (
        "java.lang", "java.net", "java.io", "java.nio", "sun.nio.ch", "java.lang.reflect", "java.text",
        "java.time", "java.util", "java.util.concurrent", "java.util.concurrent.atomic",
        "java.util.concurrent.locks")],
]


def job_config(*, python_mode: str, checkpoint_dir: str, python_executable: str,
               bundle_size: Optional[int] = None, metrics: bool = True, unaligned: bool = False) -> Dict[str, str]:
    """The Flink options a PyFlink peer job sets, as strings (Configuration.set_string).

    ``bundle_size`` None keeps Flink's default (``python.fn-execution.bundle.size`` 1,000 in 2.3);
    ``metrics`` False sets ``python.metric.enabled`` false (no per-bundle metric reporting);
    ``unaligned`` turns on unaligned checkpoints (barriers overtake in-flight buffers).
    """
    if python_mode not in ("process", "loopback", "thread"):
        raise ValueError(f"python_mode must be process, loopback or thread, not {python_mode!r}")
    conf = {
        "execution.checkpointing.dir": Path(checkpoint_dir).as_uri(),
        "state.backend.type": "hashmap",
        "python.executable": python_executable,  # workers default to `python` on PATH
        "python.execution-mode": "thread" if python_mode == "thread" else "process",
        "restart-strategy.type": "none",  # fail fast instead of restarting forever
    }
    if bundle_size is not None:
        if bundle_size < 1:
            raise ValueError(f"bundle_size must be >= 1, not {bundle_size}")
        conf["python.fn-execution.bundle.size"] = str(bundle_size)
    if not metrics:
        conf["python.metric.enabled"] = "false"
    if unaligned:
        conf["execution.checkpointing.unaligned.enabled"] = "true"
    return conf


def kafka_sink_properties(transaction_timeout_ms: int, interval_s: float,
                          broker_max_timeout_ms: int = 900_000) -> Dict[str, str]:
    """Producer settings of the exactly-once ``KafkaSink``.

    Flink's sink asks for a 1 hour transaction timeout by default; a broker refuses any above its
    ``transaction.max.timeout.ms`` (Kafka's default 15 min) when the producer starts its first
    transaction, so the job would fail at its first checkpoint. The timeout must also outlast a
    checkpoint interval, or the broker aborts a transaction before the checkpoint commits it.
    """
    if transaction_timeout_ms > broker_max_timeout_ms:
        raise ValueError(f"transaction.timeout.ms {transaction_timeout_ms} is above the broker's "
                         f"transaction.max.timeout.ms {broker_max_timeout_ms}: the broker would refuse it")
    if transaction_timeout_ms <= interval_s * 1000:
        raise ValueError(f"transaction.timeout.ms {transaction_timeout_ms} does not outlast a checkpoint "
                         f"interval of {interval_s} s")
    return {"transaction.timeout.ms": str(transaction_timeout_ms)}


def kafka_table_ddl(name: str, *, bootstrap: str, topic: str, group: str, bounded: bool) -> str:
    """CREATE TABLE of Flink's Kafka source: the Kafka key and value as raw strings and the record's
    timestamp as metadata, from the earliest offsets; ``bounded`` stops at the end offsets found at
    start. PyFlink's DataStream ``KafkaSource`` offers only value deserializers, so the key is read
    through the SQL connector's table source (the same ``KafkaSource`` underneath). Offsets are
    committed to ``group`` at each completed checkpoint (the benchmark's sign that the job runs)."""
    for what, value in (("table name", name), ("topic", topic), ("group", group)):
        if not value or "'" in value or "`" in value:
            raise ValueError(f"{what} {value!r} cannot be quoted into the DDL")
    options = {
        "connector": "kafka",
        "topic": topic,
        "properties.bootstrap.servers": bootstrap,
        "properties.group.id": group,
        "scan.startup.mode": "earliest-offset",
        "key.format": "raw",
        "key.fields": "k",
        "value.format": "raw",
        "value.fields-include": "EXCEPT_KEY",
    }
    if bounded:
        options["scan.bounded.mode"] = "latest-offset"
    body = ",\n  ".join(f"'{k}' = '{v}'" for k, v in options.items())
    return (f"CREATE TABLE `{name}` (\n  k STRING,\n  v STRING,\n"
            f"  ts TIMESTAMP_LTZ(3) METADATA FROM 'timestamp' VIRTUAL\n) WITH (\n  {body}\n)")


# A TaskManager's memory, set piece by piece: bin/taskmanager.sh derives these from
# taskmanager.memory.process.size and passes them as -D options; TaskManagerRunner started
# with java directly insists on them. Managed memory also holds process mode's Python workers.
TM_MEMORY = {
    "taskmanager.memory.framework.heap.size": "128m",
    "taskmanager.memory.task.heap.size": "384m",
    "taskmanager.memory.framework.off-heap.size": "128m",
    "taskmanager.memory.task.off-heap.size": "0m",
    "taskmanager.memory.network.min": "128m",
    "taskmanager.memory.network.max": "128m",
    "taskmanager.memory.managed.size": "384m",
    "taskmanager.memory.jvm-metaspace.size": "256m",
    "taskmanager.memory.jvm-overhead.min": "192m",
    "taskmanager.memory.jvm-overhead.max": "192m",
    "taskmanager.cpu.cores": "1.0",
}
TM_JVM = ["-Xmx512m", "-Xms512m", "-XX:MaxDirectMemorySize=256m", "-XX:MaxMetaspaceSize=256m"]
JM_JVM = ["-Xmx512m", "-Xms512m", "-XX:MaxMetaspaceSize=256m"]


def cluster_config(*, rest_port: int, rpc_port: int, slots: int = 1) -> Dict[str, str]:
    """config.yaml of a one-machine standalone cluster: each TaskManager has ``slots`` slots."""
    return {
        **TM_MEMORY,
        "jobmanager.rpc.address": "localhost",
        "jobmanager.bind-host": "localhost",
        "jobmanager.rpc.port": str(rpc_port),
        "jobmanager.memory.process.size": "1024m",
        "taskmanager.bind-host": "localhost",
        "taskmanager.host": "localhost",
        "taskmanager.numberOfTaskSlots": str(slots),
        "rest.address": "localhost",
        "rest.bind-address": "localhost",
        "rest.port": str(rest_port),
        "jobstore.expiration-time": "3600",  # keep finished jobs' details for the REST checks
    }


def variant_label(*, python_mode: str, bundle_size: Optional[int], metrics: bool, unaligned: bool,
                  cluster: int, sql: bool = False) -> str:
    """A short honest label of a run's settings, e.g. ``process, bundle 100000, metrics off, unaligned``."""
    where = f"standalone {cluster} TM x 1 slot" if cluster else "local mini-cluster"
    if sql:
        return f"Flink SQL COUNT(*) GROUP BY, {where}"
    parts = [python_mode, f"bundle {bundle_size}" if bundle_size else "bundle default (1000)"]
    if not metrics:
        parts.append("metrics off")
    parts.append("unaligned" if unaligned else "aligned")
    return ", ".join(parts + [where])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux prctl),
    so a killed benchmark leaves no JVMs behind."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port: int = s.getsockname()[1]
        return port


def wheel_home() -> Path:
    """The pyflink package directory of the running interpreter (the wheel's FLINK_HOME)."""
    import pyflink  # only in the PyFlink venv

    return Path(pyflink.__file__).resolve().parent


class StandaloneCluster:
    """A JobManager and ``taskmanagers`` TaskManagers (``slots`` each) on this machine, in ``workdir``.

    Started with ``java -cp pyflink/lib/*:pyflink/opt/flink-python-*.jar`` (the Python operators
    need flink-python on the TaskManagers' class path); ``env`` is added to every JVM's
    environment (thread mode's embedded interpreter needs the venv on PYTHONPATH).
    """

    def __init__(self, workdir: Path, taskmanagers: int = 2, slots: int = 1,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.workdir, self.taskmanagers, self.slots = Path(workdir), taskmanagers, slots
        self.env = {**os.environ, **(env or {})}
        self.rest_port = _free_port()
        self.procs: List[subprocess.Popen[bytes]] = []

    @property
    def rest(self) -> str:
        return f"http://localhost:{self.rest_port}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.rest + path, timeout=10) as r:
            return json.load(r)

    def _java(self, main_class: str, name: str, home: Path, conf_dir: Path, jvm: List[str]) -> None:
        cp = os.pathsep.join([str(home / "lib" / "*"), *map(str, sorted((home / "opt").glob("flink-python-*.jar")))])
        log = self.workdir / "log" / f"{name}.log"
        cmd = ["java", *jvm, *JAVA_OPENS, f"-Dlog.file={log}",
               f"-Dlog4j.configurationFile=file:{home / 'conf' / 'log4j.properties'}",
               "-cp", cp, main_class, "--configDir", str(conf_dir)]
        out = open(self.workdir / "log" / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                           preexec_fn=_die_with_parent))

    def __enter__(self) -> "StandaloneCluster":
        home = wheel_home()
        conf_dir = self.workdir / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "log").mkdir(exist_ok=True)
        conf = cluster_config(rest_port=self.rest_port, rpc_port=_free_port(), slots=self.slots)
        (conf_dir / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in conf.items()))
        try:
            self._java("org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint", "jobmanager",
                       home, conf_dir, JM_JVM)
            for i in range(self.taskmanagers):
                self._java("org.apache.flink.runtime.taskexecutor.TaskManagerRunner", f"taskmanager-{i}",
                           home, conf_dir, TM_JVM)
            deadline = time.time() + 90
            while True:
                try:
                    if self.get("/overview")["taskmanagers"] >= self.taskmanagers:
                        break
                except OSError:
                    pass
                dead = [p for p in self.procs if p.poll() is not None]
                if dead or time.time() > deadline:
                    tails = "".join(f"\n--- {f.name}:\n" + f.read_text(errors="replace")[-6000:]
                                    for f in sorted((self.workdir / "log").glob("*")))
                    raise RuntimeError(f"standalone Flink cluster did not come up ({len(dead)} JVMs exited){tails}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def job_stats(self, job_id: str) -> Dict[str, Any]:
        """Completed checkpoints, their mean end-to-end ms, and records read/written per vertex of a job."""
        ck = self.get(f"/jobs/{job_id}/checkpoints")
        job = self.get(f"/jobs/{job_id}")
        avg = ck.get("summary", {}).get("end_to_end_duration", {}).get("avg")
        return {
            "checkpoints": ck["counts"]["completed"],
            "checkpoint_ms_mean": round(avg) if avg is not None else None,
            "vertices": [{"name": v["name"], "start": v["start-time"], "end": v["end-time"],
                          "read": v["metrics"]["read-records"], "write": v["metrics"]["write-records"]}
                         for v in job["vertices"]],
        }
