"""The PySpark worker daemon of epochstream's sessions (``spark.python.daemon.module``).

Spark forks every Python worker of an executor from one daemon process. PySpark's own daemon
has imported only pyspark, so a worker that replaces one a failed barrier stage killed (the
survivor of a lost machine, a spare) pays for importing pyarrow, cloudpickle and epochstream
before its task can start. This daemon imports them first and then runs PySpark's daemon
loop: every forked worker starts warm. Without epochstream importable on the executor it
runs as PySpark's daemon (the barrier task then puts the driver's paths on ``sys.path``).
"""

from __future__ import annotations

try:
    import pyarrow.parquet  # noqa: F401

    import epochstream.deploy.spark  # noqa: F401  (and with it cloudpickle and the core)
except ImportError:  # not installed on this executor: the tasks import it themselves
    pass

if __name__ == "__main__":  # run by the executor as ``python -m epochstream.deploy.spark_daemon``
    from pyspark.daemon import manager

    manager()
