"""Real Apache Kafka brokers (KRaft mode, no ZooKeeper) started from the jars setup.sh fetched.

For the Kafka tests, benchmarks and demo: ``KafkaCluster(n)`` writes one ``server.properties``
per node into a temporary folder, formats each node's storage with ``kafka.tools.StorageTool``
and starts ``kafka.Kafka`` in its own JVM. Every node is both broker and controller (combined
mode), on free loopback ports. One node serves the tests; three (topic replication 3,
``min.insync.replicas`` 2) serve the fault tests, where ``kill(node)`` and ``restart(node)``
take a broker away and bring it back with its data.

The jars are in ``jars/kafka/lib`` (``scripts/setup.sh``); ``EPOCHSTREAM_KAFKA_JARS`` names
another folder.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ..runtime.errors import EpochStreamError


class KafkaBrokerError(EpochStreamError):
    """A broker could not be started (no jars, no Java, or it did not come up)."""


def kafka_jars() -> Path:
    """The folder of the broker's jars (``jars/kafka/lib`` of the source tree by default)."""
    env = os.environ.get("EPOCHSTREAM_KAFKA_JARS")
    here = Path(env) if env else Path(__file__).resolve().parents[3] / "jars" / "kafka" / "lib"
    if not any(here.glob("kafka_2.13-*.jar")):
        raise KafkaBrokerError(f"no Kafka broker jars in {here}: run scripts/setup.sh (it fetches "
                               f"org.apache.kafka:kafka_2.13 from Maven into jars/kafka/lib)")
    return here


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class KafkaCluster:
    """``n`` combined broker+controller nodes on loopback; ``bootstrap_servers`` to connect."""

    def __init__(self, n: int = 1, workdir: str | os.PathLike[str] | None = None,
                 settings: dict[str, Any] | None = None) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one node, got {n}")
        self.n = n
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="epochstream-kafka-"))
        self.settings = dict(settings or {})
        ports = _free_ports(2 * n)
        #: client port and controller port of each node (node ids are 1..n)
        self.ports = ports[:n]
        self.controller_ports = ports[n:]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        self._classpath = os.pathsep.join(str(p) for p in sorted(kafka_jars().glob("*.jar")))
        if shutil.which("java") is None:
            raise KafkaBrokerError("java is not on the PATH; the Kafka broker needs Java 17")

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _properties(self, node: int) -> Path:
        i = node - 1
        rf = min(3, self.n)
        voters = ",".join(f"{j + 1}@127.0.0.1:{self.controller_ports[j]}" for j in range(self.n))
        props = {
            "process.roles": "broker,controller",
            "node.id": node,
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{self.ports[i]},CONTROLLER://127.0.0.1:{self.controller_ports[i]}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.ports[i]}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.dir / f"node{node}" / "data"),
            "num.partitions": 1,
            "default.replication.factor": rf,
            "min.insync.replicas": 2 if self.n >= 3 else 1,
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": 3,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": 2 if self.n >= 3 else 1,
            "transaction.state.log.num.partitions": 3,
            "group.initial.rebalance.delay.ms": 0,
            "auto.create.topics.enable": "false",
            "log.flush.interval.messages": 1 << 30,
            "num.network.threads": 2,
            "num.io.threads": 2,
            "background.threads": 2,
            "log.cleaner.enable": "false",
            **self.settings,
        }
        path = self.dir / f"node{node}" / "server.properties"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _java(self, node: int, main: str, *args: str) -> list[str]:
        log_dir = self.dir / f"node{node}" / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        return ["java", "-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                "-Djava.awt.headless=true", f"-Dkafka.logs.dir={log_dir}", "-cp", self._classpath, main, *args]

    def start(self, timeout: float = 90.0) -> "KafkaCluster":
        """Format every node's storage (first start only) and start them; waits until the
        cluster answers metadata requests with every node."""
        for node in range(1, self.n + 1):
            props = self._properties(node)
            if not (self.dir / f"node{node}" / "data" / "meta.properties").exists():
                # --cluster-id=: an id may start with "-", which the tool would take for an option
                fmt = subprocess.run(self._java(node, "kafka.tools.StorageTool", "format",
                                                f"--cluster-id={self.cluster_id}", "-c", str(props)),
                                     capture_output=True, text=True)
                if fmt.returncode != 0:
                    raise KafkaBrokerError(f"formatting node {node}'s storage failed: {fmt.stdout}{fmt.stderr}")
            self._launch(node)
        self.wait_ready(timeout)
        return self

    def _launch(self, node: int) -> None:
        out = open(self.dir / f"node{node}" / "stdout.log", "ab")
        props = self.dir / f"node{node}" / "server.properties"
        self.procs[node] = subprocess.Popen(self._java(node, "kafka.Kafka", str(props)), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def wait_ready(self, timeout: float = 90.0, nodes: int | None = None) -> None:
        from confluent_kafka.admin import AdminClient

        want = self.n if nodes is None else nodes
        deadline = time.monotonic() + timeout
        last: Any = None
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        while time.monotonic() < deadline:
            for node, proc in self.procs.items():
                if proc.poll() is not None:
                    raise KafkaBrokerError(f"Kafka node {node} exited with code {proc.returncode}; see "
                                           f"{self.dir / f'node{node}' / 'stdout.log'}:\n{self.log_tail(node)}")
            try:
                md = admin.list_topics(timeout=2)
                if len(md.brokers) >= want:
                    return
                last = f"{len(md.brokers)} of {want} brokers up"
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.3)
        raise KafkaBrokerError(f"the Kafka cluster at {self.bootstrap_servers} did not come up in {timeout}s "
                               f"({last})")

    def log_tail(self, node: int, lines: int = 30) -> str:
        path = self.dir / f"node{node}" / "stdout.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def kill(self, node: int) -> None:
        """SIGKILL one node (a broker crash: no controlled shutdown)."""
        proc = self.procs.pop(node)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def restart(self, node: int, timeout: float = 90.0) -> None:
        """Start a killed node again with its data."""
        self._launch(node)
        self.wait_ready(timeout)

    def create_topic(self, name: str, partitions: int = 1, replication: int | None = None,
                     config: dict[str, str] | None = None) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        rf = replication if replication is not None else min(3, self.n)
        fut = admin.create_topics([NewTopic(name, partitions, rf, config=config or {})])[name]
        fut.result(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # wait until every partition has a leader
            md = admin.list_topics(name, timeout=5).topics.get(name)
            if md is not None and md.error is None and len(md.partitions) == partitions and all(
                    p.leader >= 0 for p in md.partitions.values()):
                return
            time.sleep(0.1)
        raise KafkaBrokerError(f"topic {name!r} has no leader for every partition after 30s")

    def stop(self) -> None:
        """Stop every node: SIGKILL when the cluster's folder is a temporary one (its data goes
        anyway, and a controlled shutdown of several nodes takes many seconds), else SIGTERM."""
        for node in list(self.procs):
            proc = self.procs.pop(node)
            try:
                os.killpg(proc.pid, signal.SIGKILL if self._own_dir else signal.SIGTERM)
                proc.wait(15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "KafkaCluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
