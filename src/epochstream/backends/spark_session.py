"""One Spark session per driver process, with the project's jars (Delta Lake, S3A).

The Delta backend and the Delta sink commit from the job master, which runs in the
driver process of every deployment. The spark driver already has a session; the sim and
local drivers get a local one here, started lazily on the first Delta commit (start-up
takes seconds, so nothing starts it unless Delta is used).

The jars are not on PyPI: ``scripts/setup.sh`` fetches them from Maven Central with
``mvn`` (``jars/pom.xml``) into ``jars/lib``, and they reach Spark through ``spark.jars``
(no Ivy download at run time). ``EPOCHSTREAM_JARS`` points elsewhere if needed. The S3A
connector's jars (hadoop-aws and the AWS SDK bundle, ~650 MB) go on ``spark.jars`` only when
S3 is in play (``need_s3a``, or ``AWS_*`` settings in the environment): Spark copies every
jar of ``spark.jars`` into each session's temporary folder and each executor's work folder,
so a job on local tables should not carry them.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from ..runtime.errors import ConfigurationError

#: the Spark settings Delta Lake needs in a session (its SQL extension and catalog)
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}

#: settings for the small local session of the sim and local drivers: few partitions
#: (commits are small), no UI, no progress bars in job output
LOCAL_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "1g",
}

#: overrides ``spark.driver.memory`` of the local session (e.g. ``6g``): a MERGE or a restore of
#: a large operator state runs in this one JVM (``configure`` overrides it in code)
DRIVER_MEMORY_ENV = "EPOCHSTREAM_SPARK_DRIVER_MEMORY"

_lock = threading.Lock()
_extra_conf: dict[str, str] = {}

#: jar name prefixes of the S3A connector: hadoop-aws and what it pulls in from Maven
S3A_JARS = ("hadoop-aws-", "bundle-", "analyticsaccelerator-s3-")
#: environment variables that say this process talks to S3 (they configure boto3 and S3A alike)
_S3_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_PROFILE")
_s3a_needed = False
#: whether the session this module started has the S3A jars (None: it started none)
_own_session_s3a: bool | None = None


def need_s3a() -> None:
    """Say that a Delta table lives on S3, so the session (started later) needs the S3A jars.

    ``DeltaCheckpointStorage`` and ``DeltaSink`` call it for ``s3://`` locations when built.
    """
    global _s3a_needed
    _s3a_needed = True


def s3a_wanted() -> bool:
    return _s3a_needed or any(os.environ.get(k) for k in _S3_ENV)


def jars_dir() -> Path:
    """Where ``scripts/setup.sh`` puts the jars (``EPOCHSTREAM_JARS`` overrides)."""
    env = os.environ.get("EPOCHSTREAM_JARS")
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[3] / "jars" / "lib"


def spark_jars(s3a: bool | None = None) -> list[str]:
    """The jar files to put on ``spark.jars``; a clear error if setup has not fetched them.

    ``s3a``: include the S3A connector (default: ``s3a_wanted()``)."""
    folder = jars_dir()
    jars = sorted(str(p) for p in folder.glob("*.jar")) if folder.is_dir() else []
    if not any(Path(j).name.startswith("delta-spark_") for j in jars):
        raise ConfigurationError(
            f"the Delta Lake jars are missing from {folder}: run `bash scripts/setup.sh` (it fetches them from "
            f"Maven Central with mvn, see jars/pom.xml) or point EPOCHSTREAM_JARS at a folder holding them"
        )
    if s3a is None:
        s3a = s3a_wanted()
    if s3a:
        if not any(Path(j).name.startswith("hadoop-aws-") for j in jars):
            raise ConfigurationError(
                f"the S3A jars (hadoop-aws) are missing from {folder}: run `bash scripts/setup.sh` (see jars/pom.xml)")
        return jars
    return [j for j in jars if not Path(j).name.startswith(S3A_JARS)]


def configure(conf: dict[str, str]) -> None:
    """Extra settings for the session this module starts (e.g. S3A endpoint and keys).
    They apply to the next session started; set them before the first Delta commit."""
    with _lock:
        _extra_conf.update({k: str(v) for k, v in conf.items()})


def get_spark() -> Any:
    """The active Spark session if it has Delta, else a new local one with the project's jars.

    An active session without Delta's extension (a spark driver started without the jars)
    is an error, not something to paper over: Delta commits would fail later and less clearly.
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - pyspark is a declared dependency of the delta extra
        raise ConfigurationError("the Delta backend needs pyspark (pip install 'epochstream[delta]')") from exc
    global _own_session_s3a
    with _lock:
        active = SparkSession.getActiveSession()
        if active is not None:
            if not has_delta(active):
                raise ConfigurationError(
                    "the active Spark session has no Delta Lake support: start it with "
                    "epochstream.backends.spark_session.builder() (or set spark.jars to the jars of "
                    f"{jars_dir()} plus {DELTA_CONF})"
                )
            if _own_session_s3a is False and s3a_wanted():
                raise ConfigurationError(
                    "a Delta table on S3 is used, but this process's Spark session was started for local tables "
                    "without the S3A jars: call epochstream.backends.spark_session.stop() first, or "
                    "spark_session.need_s3a() before the first Delta commit"
                )
            return active
        s3a = s3a_wanted()
        _refuse_running_context_without("delta-spark_")
        _drop_jvm_without("delta-spark_", *(["hadoop-aws-"] if s3a else []))
        spark = builder(s3a=s3a).getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        _own_session_s3a = s3a
        return spark


def _refuse_running_context_without(jar: str) -> None:
    """A SparkContext that runs in this process without ``jar`` (active in another thread: a
    spark-driver job's, or one the user started) would be reused by ``getOrCreate`` with
    Delta's settings but not its classes, and fail later with a missing catalog class: say so
    now, with the way out."""
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        return
    if jar not in (sc.getConf().get("spark.jars") or ""):
        raise ConfigurationError(
            f"a Spark context without the Delta jars runs in this process (master {sc.master}): a running JVM "
            "cannot gain Delta's classes, so stop that session first (SparkSession.stop()), or start it with "
            "epochstream.backends.spark_session.builder()"
        )


def _drop_jvm_without(*jars: str) -> None:
    """End this process's idle Spark JVM if it was launched without one of ``jars`` (file name
    prefixes), whoever started it (``stop()`` ends only those of sessions started here; a spark
    driver's or another library's session may have launched it): the jars of a later session
    never reach a running JVM's classpath, so Delta's catalog or S3A would be missing."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None or SparkContext._active_spark_context is not None:
        return
    launched = gateway.jvm.java.lang.System.getProperty("spark.jars") or ""
    if any(jar not in launched for jar in jars):
        _end_jvm()


def s3a_conf() -> dict[str, str]:
    """S3A settings from the environment boto3 reads too, so ``s3://`` checkpoints (boto3) and
    ``s3a://`` Delta tables (Spark) reach the same store: a custom endpoint
    (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``: path-style, plain HTTP allowed, no SDK
    checksums, which stores other than AWS reject), keys and region. Delta's default log store
    for S3 (single driver) is what epochstream needs: one job master commits each table."""
    env = os.environ
    conf = {"spark.hadoop.fs.s3a.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem"}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        conf.update({
            "spark.hadoop.fs.s3a.endpoint": endpoint,
            "spark.hadoop.fs.s3a.path.style.access": "true",
            "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https")).lower(),
            "spark.hadoop.fs.s3a.checksum.validation": "false",
            "spark.hadoop.fs.s3a.checksum.generation": "false",
            "spark.hadoop.fs.s3a.change.detection.mode": "none",
        })
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        conf["spark.hadoop.fs.s3a.access.key"] = env["AWS_ACCESS_KEY_ID"]
        conf["spark.hadoop.fs.s3a.secret.key"] = env["AWS_SECRET_ACCESS_KEY"]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        conf["spark.hadoop.fs.s3a.endpoint.region"] = region
    return conf


def delta_conf() -> dict[str, str]:
    """The settings a session needs for Delta commits (jars, extension, S3A), for drivers
    that build their own session (the spark driver)."""
    return {"spark.jars": ",".join(spark_jars()), **DELTA_CONF, **s3a_conf(), **_extra_conf}


def uses_delta(pipeline: Any) -> bool:
    """Whether a job commits to Delta tables (state backend or a sink)."""
    return pipeline.checkpoint.state_backend == "delta" or any(
        getattr(s, "epoch_transactions", False) and getattr(s, "commits_with_spark", True)
        for s in pipeline.sinks.values())


def builder(master: str = "local[2]", app_name: str = "epochstream", s3a: bool | None = None) -> Any:
    """A SparkSession builder with the jars, Delta and S3A settings (the spark driver starts from it)."""
    from pyspark.sql import SparkSession

    b = SparkSession.builder.master(master).appName(app_name).config("spark.jars", ",".join(spark_jars(s3a)))
    memory = {"spark.driver.memory": os.environ[DRIVER_MEMORY_ENV]} if os.environ.get(DRIVER_MEMORY_ENV) else {}
    for k, v in {**DELTA_CONF, **LOCAL_CONF, **memory, **s3a_conf(), **_extra_conf}.items():
        b = b.config(k, v)
    return b


def has_delta(spark: Any) -> bool:
    exts = spark.conf.get("spark.sql.extensions", "") or ""
    return "DeltaSparkSessionExtension" in exts


def stop() -> None:
    """Stop the session this process holds (tests and benchmarks end with it)."""
    from pyspark.sql import SparkSession

    global _own_session_s3a
    with _lock:
        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
        # the JVM's classpath was fixed at its launch (perhaps without the S3A jars, by this module
        # or by the spark driver's session): the next session launches a JVM with its own spark.jars
        _end_jvm()
        _own_session_s3a = None


def _end_jvm() -> None:
    """End the JVM pyspark launched for this process (the next session launches a new one)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None or SparkContext._active_spark_context is not None:
        return
    SparkContext._gateway = None
    SparkContext._jvm = None
    try:
        gateway.shutdown()
    except Exception:  # noqa: BLE001 - a gateway already gone is what we want
        pass
    proc = getattr(gateway, "proc", None)
    if proc is not None:  # the JVM exits when its stdin closes (pyspark's launch_gateway)
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            proc.kill()
