"""Barrier slots on a cluster that shrank (issue 18 item 7): Spark's message and the wait policy.

The Spark text below is what PySpark 4.2.0 raised on ``local[1]`` for a 2-task barrier stage
(``sc.parallelize(range(2), 2).barrier().mapPartitions(...).collect()`` with
``spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures=1``), cut after its first Java
frames; the same message is in ``BarrierJobAllocationFailed`` of spark-core_2.13-4.2.0.jar.
The slow test against a real standalone cluster is in ``test_spark_standalone.py``.
"""

from __future__ import annotations

import pytest

from epochstream import Pipeline
from epochstream.deploy.slots import SPARK_VERDICT_GRACE, SlotsUnavailableError, SlotWait, spark_slot_message
from epochstream.deploy.spark import _spark_reason

SPARK_SLOT_MESSAGE = (
    "[SPARK-24819]: Barrier execution mode does not allow run a barrier stage that requires more slots than the "
    "total number of slots in the cluster currently. Please init a new cluster with more resources(e.g. CPU, GPU) "
    "or repartition the input RDD(s) to reduce the number of slots required to run this barrier stage.")
PY4J_TEXT = (
    "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
    ": org.apache.spark.scheduler.BarrierJobSlotsNumberCheckFailed: " + SPARK_SLOT_MESSAGE + "\n"
    "\tat org.apache.spark.errors.SparkCoreErrors$.numPartitionsGreaterThanMaxNumConcurrentTasksError"
    "(SparkCoreErrors.scala:241)\n"
    "\tat org.apache.spark.scheduler.DAGScheduler.checkBarrierStageWithNumSlots(DAGScheduler.scala:635)\n")


class Py4JJavaError(Exception):
    """Stands in for py4j's class name only: the text is Spark's."""


def test_spark_reason_keeps_sparks_slot_message():
    reason = _spark_reason(Py4JJavaError(PY4J_TEXT))
    assert reason == SPARK_SLOT_MESSAGE  # was "Py4JJavaError: An error occurred while calling ..."


def test_spark_reason_still_reads_error_class_tags():
    text = "An error occurred\n: org.apache.spark.SparkException: [TASK_WRITE_FAILED] Task failed while writing rows"
    assert _spark_reason(Py4JJavaError(text)) == "[TASK_WRITE_FAILED] Task failed while writing rows"


def test_slot_message_is_recognised_only_in_a_slot_failure():
    assert spark_slot_message(PY4J_TEXT) == SPARK_SLOT_MESSAGE
    assert spark_slot_message(_spark_reason(Py4JJavaError(PY4J_TEXT))) == SPARK_SLOT_MESSAGE
    assert spark_slot_message("Job aborted due to stage failure: Could not recover from a failed barrier") is None


def test_a_shortage_is_reported_with_needed_available_and_sparks_message():
    w = SlotWait(needed=2, timeout=30.0, master="spark://127.0.0.1:7077")
    assert w.observe(2, 0.0) is None and not w.waiting
    line = w.observe(1, 1.0)
    assert line is not None and "needs 2 task slots at once, spark://127.0.0.1:7077 has 1" in line
    assert w.observe(1, 1.5) is None  # unchanged: logged once
    line = w.spark_failed(SPARK_SLOT_MESSAGE, 3.0)
    assert line.endswith("Spark: " + SPARK_SLOT_MESSAGE)
    status = w.status(4.0)
    assert status["needed"] == 2 and status["available"] == 1 and status["spark-message"] == SPARK_SLOT_MESSAGE
    assert status["waiting-seconds"] == 3.0 and status["timeout"] == 30.0
    assert not w.expired(30.9) and w.expired(31.0)
    err = w.error(31.0)
    assert isinstance(err, SlotsUnavailableError) and "--slot-wait-timeout" in str(err) and "giving up" in str(err)
    back = w.slots_back(32.0)
    assert back is not None and "after 31.0s" in back and not w.waiting
    assert w.history == [{"since": 1.0, "needed": 2, "available": 1, "spark_message": SPARK_SLOT_MESSAGE,
                          "seconds": 31.0}]


def test_fail_at_once_waits_only_for_sparks_verdict():
    w = SlotWait(needed=3, timeout=0.0, master="m")
    w.observe(2, 10.0)
    assert not w.expired(10.0 + SPARK_VERDICT_GRACE - 0.1)  # Spark's message is seconds away
    assert w.expired(10.0 + SPARK_VERDICT_GRACE)
    w2 = SlotWait(needed=3, timeout=0.0, master="m")
    w2.spark_failed(SPARK_SLOT_MESSAGE, 5.0)
    assert w2.expired(5.0)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "10", True])
def test_slot_wait_timeout_is_checked(bad):
    with pytest.raises(ValueError, match="slot_wait_timeout"):
        Pipeline("x", slot_wait_timeout=bad)
    assert Pipeline("x").slot_wait_timeout == 300.0


def test_cli_slot_wait_timeout_range_and_deployment(tmp_path, capsys):
    from epochstream.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["run", "x.py:build", "--slot-wait-timeout", "-1"])
    assert exc.value.code == 2
    job = tmp_path / "job.py"
    job.write_text("from epochstream import DiscardingSink, Pipeline\ndef build():\n    p = Pipeline('x')\n"
                   "    p.from_collection([1]).sink(DiscardingSink())\n    return p\n")
    assert main(["run", f"{job}:build", "--slot-wait-timeout", "5", "--checkpoint-dir", str(tmp_path / "c")]) == 2
    assert "--slot-wait-timeout need --deployment spark" in capsys.readouterr().err
