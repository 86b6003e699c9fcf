"""Shared pytest set-up.

pyarrow 26 can abort with "terminate called without an active exception" while the
interpreter tears down after forking worker processes (apache/arrow#34314; seen here in a
few percent of runs under load). The tests' outcome is known by then, so after pytest has
reported we end the process with its exit status instead of running that teardown.
"""

from __future__ import annotations

import os
import sys

import pytest

_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


def pytest_unconfigure(config):
    if _status and "pyarrow" in sys.modules and not os.environ.get("EPOCHSTREAM_NO_HARD_EXIT"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])

@pytest.fixture(scope="module", autouse=True)
def _no_spark_context_outlives_its_module():
    """A module that ran a spark-driver job without a session fixture of its own leaves that
    job's SparkContext running (the driver keeps it warm). The next module's ``getOrCreate``
    would reuse it, with another master and without the jars it asks for (Delta's catalog
    class missing): end it with the module that started it."""
    yield
    if "pyspark" in sys.modules:
        from pyspark import SparkContext

        left = SparkContext._active_spark_context
        if left is not None:
            left.stop()


# the S3 fixtures (moto's HTTP server, a fault-injecting proxy) for every test module
from s3server import fault_proxy, moto_s3, moto_s3_process, s3_env, s3_url  # noqa: E402,F401


@pytest.fixture(scope="module")
def spark():
    """A local Spark session with Delta for one test module, stopped after it (missing jars
    make it, and so every test using it, fail: no skip). Modules with other needs (a spark
    driver's master, S3A) define their own ``spark``."""
    from pyspark import SparkContext

    from epochstream.backends import spark_session

    left = SparkContext._active_spark_context
    if left is not None and "delta-spark_" not in (left.getConf().get("spark.jars") or ""):
        left.stop()  # another module's (a spark-driver job's) context without the Delta jars
    s = spark_session.get_spark()
    yield s
    spark_session.stop()

# the Kafka broker fixtures (a real KRaft broker from jars/kafka/lib)
from kafkaserver import kafka, kafka3  # noqa: E402,F401
