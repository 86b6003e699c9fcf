"""Differential tests against Spark itself: the same StatefulProcessor class (or
applyInPandasWithState function) and the same input through Spark Structured Streaming
(micro-batch, RocksDB state store, file source) and through epochstream (sim, local and
spark drivers) give the same final output and the same final state.

Spark's state is read back with its own state data source (``format("statestore")``: value,
list and map state variables and registered timers), epochstream's from the latest
checkpoint. One SparkSession serves the module (``local[2]``, two shuffle partitions).

Making the runs comparable:

* **Row order per key.** Input goes to Spark as one JSON file per micro-batch
  (``maxFilesPerTrigger=1``): one file is one input partition, so each key's rows keep file
  order through the shuffle. epochstream reads the same rows from one split, so each key's
  rows arrive in the same order. Outputs are compared as multisets.
* **Grouping.** Spark calls ``handleInputRows`` once per key per micro-batch; epochstream
  once per key per runtime batch (smaller). The processors emit per input row, so the cut
  into calls does not show in the output.
* **Processing time.** Spark's batch timestamp is its wall clock. epochstream gets a
  controlled clock that moves 1 s forward on every read, so every batch and every epoch
  bound sees a later time than the one before, as every Spark micro-batch does. Timers
  are registered either in the past (expiry 1 ms: Spark fires it at the end of the same
  micro-batch, epochstream at the end of the same runtime batch) or far in the future
  (never fires in either), and only once per key where firing is involved, so both fire
  exactly the same set whatever the batch boundaries. TTL: a 1 ms TTL expires before the
  next micro-batch (Spark) and before the next read of the clock (epochstream), a one-hour
  TTL in neither.
* **Event time.** Timers are set a session gap after a key's last event; only the last
  input file advances the watermark past them, so neither engine closes a session early,
  and both fire every timer at or below the final watermark (max event time - delay).
  With a timestamped source epochstream's event time is job-wide (trAcker bounds or aligned
  watermarks); without one it is per subtask and that variant runs at parallelism 1.
  No input row is late there; late rows are compared batch for batch in
  test_late_rows_and_event_time_timers_match_spark_batch_for_batch (one epochstream run,
  so one epoch, per Spark micro-batch).
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import pytest
from pyspark.sql.streaming import StatefulProcessor
from pyspark.sql.streaming.state import GroupStateTimeout

from epochstream import CheckpointConfig, FileSink, Pipeline, TrackerConfig
from epochstream.backends.local import LocalCheckpointStorage
from epochstream.deploy.sim import SimConfig
from epochstream.oracle import committed_state
from pipelines import committed_output

pytestmark = pytest.mark.slow

DRIVERS = ("sim", "local", "spark")
#: the input as dict rows, or as Arrow batches (the wrappers' columnar path)
SOURCES = ("rows", "arrow")
FAR = 10**13
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


@pytest.fixture(scope="module")
def spark():
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    # Spark's Python workers cannot import this test module: ship its processors by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    s = (SparkSession.builder.master("local[2]").appName("epochstream-differential")
         .config("spark.sql.shuffle.partitions", "2")
         .config("spark.ui.enabled", "false")
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
         # a loaded machine (CI runs in parallel) can take more than the default 15 s to start a Python worker
         .config("spark.python.authenticate.socketTimeout", "300s")
         .getOrCreate())
    yield s
    s.stop()


class SteppingClock:
    """Each read is 1 s after the previous one (epoch ms)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.ms = start_ms

    def __call__(self) -> int:
        self.ms += 1_000
        return self.ms


# ---------------------------------------------------------------- processors


class Everything(StatefulProcessor):
    """Value, List and Map state, a 1 ms and a one-hour TTL, timers in the past and far ahead."""

    def init(self, handle):
        self.handle = handle
        self.count = handle.getValueState("count", "n long")
        self.ids = handle.getListState("ids", "id long")
        self.parity = handle.getMapState("parity", "p long", "n long")
        self.brief = handle.getValueState("brief", "id long", 1)
        self.kept = handle.getListState("kept", "id long", 3_600_000)
        self.fired = handle.getValueState("fired", "n long")

    def handleInputRows(self, key, rows, timerValues):
        out = []
        for pdf in rows:
            seen_brief = self.brief.exists()  # always expired from an earlier batch
            for i in pdf["id"]:
                n = (self.count.get() or (0,))[0] + 1
                self.count.update((n,))
                self.ids.appendValue((int(i),))
                p = (int(i) % 2,)
                self.parity.updateValue(p, ((self.parity.getValue(p) or (0,))[0] + 1,))
                if int(i) % 3 == 0:
                    self.kept.appendValue((int(i),))
                out.append((key[0], int(i), n, "row", int(seen_brief)))
            self.brief.update((int(pdf["id"].iloc[-1]),))
        self.handle.registerTimer(FAR)
        self.handle.registerTimer(FAR + 1)
        self.handle.deleteTimer(FAR + 1)
        if not self.fired.exists():
            self.fired.update((0,))
            self.handle.registerTimer(1)  # in the past: fires at the end of this batch
        yield pd.DataFrame(out, columns=["k", "id", "n", "kind", "x"])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        self.fired.update((1,))
        timers = sorted(self.handle.listTimers())
        yield pd.DataFrame([(key[0], expiredTimerInfo.getExpiryTimeInMs(), len(timers), "timer", timers[0])],
                           columns=["k", "id", "n", "kind", "x"])


EVERYTHING_OUT = "k string, id long, n long, kind string, x long"


class Sessions(StatefulProcessor):
    """Event-time sessions: a key's session ends 10 s of event time after its last event."""

    GAP = 10_000

    def init(self, handle):
        self.handle = handle
        self.count = handle.getValueState("count", "n long")
        self.last = handle.getValueState("last", "t long")
        self.all = handle.getMapState("all", "t long", "id long")

    def handleInputRows(self, key, rows, timerValues):
        for pdf in rows:
            for t, i in zip(pdf["t"], pdf["id"], strict=True):
                ms = int(pd.Timestamp(t).value // 1_000_000)
                self.count.update(((self.count.get() or (0,))[0] + 1,))
                self.all.updateValue((ms,), (int(i),))
                last = (self.last.get() or (0,))[0]
                if ms > last and key[0] != "z":  # z only moves event time: no session of its own
                    for old in list(self.handle.listTimers()):
                        self.handle.deleteTimer(old)
                    self.last.update((ms,))
                    self.handle.registerTimer(ms + self.GAP)
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        yield pd.DataFrame({"k": [key[0]], "n": [self.count.get()[0]], "end": [expiredTimerInfo.getExpiryTimeInMs()]})
        self.count.clear()
        self.last.clear()


SESSIONS_OUT = "k string, n long, end long"


def fives(key, pdf_iter, state):
    """applyInPandasWithState: per row a running count that restarts after 5; the state is
    removed when a count completes."""
    n = state.get[0] if state.exists else 0
    out = []
    for pdf in pdf_iter:
        for i in pdf["id"]:
            n += 1
            out.append((key[0], int(i), n))
            if n == 5:
                n = 0
    if n == 0:
        state.remove()
    else:
        state.update((n,))
    yield pd.DataFrame(out, columns=["k", "id", "n"])


FIVES_OUT = "k string, id long, n long"


# ---------------------------------------------------------------- inputs


def everything_input() -> list[list[dict]]:
    return [[{"k": "abcd"[i % 4], "id": b * 100 + i} for i in range(9)] for b in range(3)]


def sessions_input() -> list[list[dict]]:
    base = 1_700_000_000_000
    ts = lambda ms: pd.Timestamp(base + ms, unit="ms").isoformat()  # noqa: E731
    b1 = [{"k": "abc"[i % 3], "t": ts(1_000 + 100 * i), "id": i} for i in range(9)]
    b2 = [{"k": "abd"[i % 3], "t": ts(3_000 + 100 * i), "id": 100 + i} for i in range(9)]
    b3 = [{"k": "z", "t": ts(100_000), "id": 999}]  # moves the watermark past every session
    return [b1, b2, b3]


def fives_input() -> list[list[dict]]:
    return [[{"k": "ab"[i % 2], "id": b * 100 + i} for i in range(7)] for b in range(3)]


# ---------------------------------------------------------------- Spark side


def run_spark(spark, tmp: Path, batches, schema: str, build, processing_time: bool, tries: int = 2) -> list[dict]:
    """Write one JSON file per micro-batch, run ``build(df)`` to a json sink, return its rows.
    A query that fails because a Python worker did not connect back in time (a loaded
    machine) runs again from nothing, once."""
    import shutil

    src = tmp / "spark-in"
    if not src.exists():
        src.mkdir()
        for b, rows in enumerate(batches):
            f = src / f"b{b:03d}.json"
            f.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.utime(f, (1_700_000_000 + b, 1_700_000_000 + b))  # the file source takes oldest first
    try:
        return _run_spark_query(spark, tmp, src, batches, schema, build, processing_time)
    except Exception as exc:
        if tries <= 1 or "failed to connect back" not in str(exc):
            raise
        shutil.rmtree(tmp / "spark-out", ignore_errors=True)
        shutil.rmtree(tmp / "spark-chk", ignore_errors=True)
        return run_spark(spark, tmp, batches, schema, build, processing_time, tries - 1)


def _run_spark_query(spark, tmp: Path, src: Path, batches, schema: str, build, processing_time: bool) -> list[dict]:
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).json(str(src))
    out_df = build(df)
    writer = (out_df.writeStream.format("json").option("path", str(tmp / "spark-out"))
              .option("checkpointLocation", str(tmp / "spark-chk")))
    total = sum(len(b) for b in batches)
    if processing_time:
        # processing-time transformWithState runs no-data micro-batches forever (timers may be
        # due any time), so availableNow never ends: stop after the input and one more batch
        q = writer.trigger(processingTime="0 seconds").start()
        deadline = time.monotonic() + 240
        while sum(p["numInputRows"] for p in q.recentProgress) < total:
            assert time.monotonic() < deadline and q.isActive, q.exception()
            time.sleep(0.2)
        seen = len(q.recentProgress)
        while len(q.recentProgress) <= seen:
            assert time.monotonic() < deadline and q.isActive, q.exception()
            time.sleep(0.2)
        q.stop()
    else:
        q = writer.trigger(availableNow=True).start()
        q.awaitTermination(240)
        assert not q.isActive and q.exception() is None, q.exception()
    rows = spark.read.schema(out_df.schema).json(str(tmp / "spark-out")).collect()
    return [r.asDict() for r in rows]


def spark_state(spark, chk: Path, variables: dict[str, str], timers: bool, fmt: str = "statestore",
                **options: str) -> dict[str, dict]:
    """{variable: {key tuple: value}} from Spark's state data source (``fmt="epochstream-state"``:
    epochstream's, with the same options); lists sorted, maps as dicts."""
    from pyspark.sql import Row

    def plain(v) -> tuple:
        # a TTL'd entry reads back as (value row, expiration ms); these tests' values are flat rows
        v = tuple(v)
        return tuple(v[0]) if len(v) == 2 and isinstance(v[0], Row) else v

    out: dict[str, dict] = {}
    for name, kind in variables.items():
        df = spark.read.format(fmt).options(**options).option("stateVarName", name).load(str(chk))
        got: dict = {}
        for r in df.collect():
            key = tuple(r["key"])
            if kind == "value":
                got[key] = plain(r["value"])
            elif kind == "list":
                got.setdefault(key, []).append(plain(r["list_element"]))
            else:
                got.setdefault(key, {})[tuple(r["user_map_key"])] = plain(r["user_map_value"])
        out[name] = {k: sorted(v) if isinstance(v, list) else v for k, v in got.items()}
    if timers:
        df = spark.read.format(fmt).options(**options).option("readRegisteredTimers", "true").load(str(chk))
        got = {}
        for r in df.collect():
            got.setdefault(tuple(r["key"]), []).append(r["expiration_timestamp_ms"])
        out["$timers"] = {k: sorted(v) for k, v in got.items()}
    return out


# ---------------------------------------------------------------- epochstream side


def run_epochstream(tmp: Path, driver: str, batches, attach, uid: str = "op", convert=None,
                    parallelism: int = 2, mode: str = "aligned", timestamps: bool = False,
                    spark=None, source: str = "rows") -> tuple[list[dict], dict]:
    """``source``: ``"rows"`` (``from_collection``, dicts) or ``"arrow"`` (``from_arrow``: the
    wrappers get Arrow RecordBatches and group them with Arrow)."""
    rows = list(itertools.chain.from_iterable(batches))
    if convert is not None:
        rows = [convert(r) for r in rows]
    p = Pipeline("differential", parallelism=parallelism, max_parallelism=128, mode=mode,
                 checkpoint=CheckpointConfig(interval=0.002 if driver == "sim" else 0.05), batch_size=4,
                 restart_attempts=0, tracker=TrackerConfig(time_slack=1_000.0))
    # the source's timestamps (epoch ms) drive job-wide event time
    stamp = (lambda r: r["t"].replace(tzinfo=datetime.timezone.utc).timestamp() * 1000) if timestamps else None
    if source == "arrow":
        import pyarrow as pa

        stream = p.from_arrow(pa.Table.from_pylist(rows), num_splits=1, uid="input", timestamps=stamp)
    else:
        stream = p.from_collection(rows, splits=1, uid="input", timestamps=stamp)
    attach(stream).sink(FileSink(tmp / "es-out"), uid="out")
    options: dict = {"sim": SimConfig(source_rate=2_000.0)} if driver == "sim" else {}
    if driver == "spark":  # barrier-stage workers in the module's own SparkSession (local[2])
        options = {"spark": spark}
    p.run(deployment=driver, checkpoint_dir=str(tmp / "es-chk"), **options)
    storage = LocalCheckpointStorage(tmp / "es-chk")
    manifest, root = storage.latest()
    return committed_output(tmp / "es-out"), committed_state(storage, manifest, root)[uid]


def epochstream_state(raw: dict, variables: dict[str, str]) -> dict[str, dict]:
    """The wrapper's stored entries ((value, expiry) pairs) as Spark shows them."""
    out: dict[str, dict] = {}
    for name, kind in variables.items():
        got = {}
        for key, v in raw.get(name, {}).items():
            if kind == "value":
                got[key] = v[0]
            elif kind == "list":
                got[key] = sorted(x for x, _e in v)
            else:
                got[key] = {uk: x for uk, (x, _e) in v.items()}
        out[name] = got
    out["$timers"] = {k: sorted(v) for k, v in raw.get("$timers", {}).items()}
    return out


def canon(rows: list[dict]) -> collections.Counter:
    return collections.Counter(json.dumps(r, sort_keys=True) for r in rows)


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def everything_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-everything")
    rows = run_spark(spark, tmp, everything_input(), "k string, id long",
                     lambda df: df.groupBy("k").transformWithStateInPandas(Everything(), EVERYTHING_OUT, "Update",
                                                                           "ProcessingTime"),
                     processing_time=True)
    state = spark_state(spark, tmp / "spark-chk", EVERYTHING_VARS, timers=True)
    return rows, state


EVERYTHING_VARS = {"count": "value", "ids": "list", "parity": "map", "brief": "value", "kept": "list", "fired": "value"}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("driver", DRIVERS)
def test_value_list_map_state_ttl_and_processing_time_timers_match_spark(spark, everything_spark, tmp_path, driver,
                                                                        source):
    spark_rows, spark_st = everything_spark
    assert any(r["kind"] == "timer" for r in spark_rows) and spark_st["kept"] and not spark_st["brief"]
    rows, raw = run_epochstream(tmp_path, driver, everything_input(), lambda s: s.transform_with_state(
        Everything(), EVERYTHING_OUT, "ProcessingTime", key="k", clock=SteppingClock(), uid="op"), spark=spark,
        source=source)
    assert canon(rows) == canon(spark_rows)
    assert epochstream_state(raw, EVERYTHING_VARS) == spark_st


@pytest.mark.parametrize("progress", ["tracker", "aligned", "epoch-bound"])
@pytest.mark.parametrize("driver", DRIVERS)
def test_event_time_timers_match_spark(spark, tmp_path_factory, driver, progress, sessions_spark):
    """``tracker`` and ``aligned`` (parallelism 2): the source has timestamps, so timers fire
    from the job-wide event time (the trAcker's time bounds, or watermarks on the data
    channels). ``epoch-bound``: no timestamps on the source, so the watermark is per subtask
    (the maximum over its own keys, advanced at epoch bounds), which equals Spark's global
    one only at parallelism 1, so it runs there (docs/PYSPARK.md, "Event time")."""
    mode = "tracker" if progress == "tracker" else "aligned"
    spark_rows, spark_st = sessions_spark
    assert sorted(r["k"] for r in spark_rows) == ["a", "b", "c", "d"]
    tmp = tmp_path_factory.mktemp(f"es-sessions-{driver}-{progress}")
    # a Python source produces datetimes where Spark's JSON reader parses the strings
    rows, raw = run_epochstream(tmp, driver, sessions_input(), lambda s: s.transform_with_state(
        Sessions(), SESSIONS_OUT, "EventTime", key="k", event_time="t", input_schema="k string, t timestamp, id long",
        uid="op"), convert=lambda r: {**r, "t": datetime.datetime.fromisoformat(r["t"])},
        parallelism=1 if progress == "epoch-bound" else 2, mode=mode, timestamps=progress != "epoch-bound",
        spark=spark)
    assert canon(rows) == canon(spark_rows)
    assert epochstream_state(raw, SESSIONS_VARS) == spark_st


SESSIONS_VARS = {"count": "value", "last": "value", "all": "map"}


@pytest.fixture(scope="module")
def sessions_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-sessions")
    rows = run_spark(spark, tmp, sessions_input(), "k string, t timestamp, id long",
                     lambda df: df.withWatermark("t", "0 seconds").groupBy("k").transformWithStateInPandas(
                         Sessions(), SESSIONS_OUT, "Update", "EventTime"),
                     processing_time=False)
    return rows, spark_state(spark, tmp / "spark-chk", SESSIONS_VARS, timers=True)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("driver", DRIVERS)
def test_apply_in_pandas_with_state_matches_spark(spark, tmp_path_factory, driver, fives_spark, source):
    spark_rows, spark_st = fives_spark
    tmp = tmp_path_factory.mktemp(f"es-fives-{driver}-{source}")
    rows, raw = run_epochstream(tmp, driver, fives_input(), lambda s: s.apply_in_pandas_with_state(
        fives, FIVES_OUT, "n long", "Append", GroupStateTimeout.NoTimeout, key="k", uid="op"), spark=spark,
        source=source)
    assert canon(rows) == canon(spark_rows)
    mine = {k: v[0] for k, v in raw.get("$groupState", {}).items()}
    assert mine == spark_st


@pytest.fixture(scope="module")
def fives_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-fives")
    rows = run_spark(spark, tmp, fives_input(), "k string, id long",
                     lambda df: df.groupBy("k").applyInPandasWithState(
                         fives, FIVES_OUT, "n long", "Append", GroupStateTimeout.NoTimeout),
                     processing_time=False)
    df = spark.read.format("statestore").load(str(tmp / "spark-chk"))
    state = {}
    for r in df.collect():
        value = r["value"]
        state[tuple(r["key"])] = tuple(value["groupState"]) if "groupState" in value else tuple(value)
    return rows, state


# ---------------------------------------------------------------- conversions and initial state (issue 19)


class Shape(NamedTuple):
    x: int
    y: str


class Profile(StatefulProcessor):
    """Spark's conversions and initialState at once: a timestamp column (its pandas dtype and
    ns value), a NamedTuple written into a struct field and read back as a Row
    (``last.get()[1].x``), a map output column, and a seed per key from the initial state
    that every output row carries (keys seeded without input keep only state)."""

    def init(self, handle):
        self.last = handle.getValueState("last", "n long, p struct<x long, y string>")
        self.seed = handle.getValueState("seed", "s long")
        self.seen = handle.getListState("seen", "q struct<id long, tag struct<z string>>")

    def handleInitialState(self, key, initialState, timerValues):
        for s in initialState["s"]:
            self.seed.update((((self.seed.get() or (0,))[0]) + int(s),))

    def handleInputRows(self, key, rows, timerValues):
        out = []
        for pdf in rows:
            for t, i in zip(pdf["t"], pdf["id"], strict=True):
                n = ((self.last.get() or (0, None))[0]) + 1
                self.last.update((n, Shape(int(i), key[0])))
                self.seen.appendValue(({"id": int(i), "tag": (f"z{n}",)},))
                back = self.last.get()
                tags = [r[0].tag.z for r in self.seen.get()]
                out.append((key[0], int(i), back[1].x, back[1].y, (self.seed.get() or (-1,))[0], str(pdf["t"].dtype),
                            int(t.value), {"n": n, "tags": len(tags)}))
        yield pd.DataFrame(out, columns=["k", "id", "px", "py", "seed", "tdtype", "tns", "m"])


PROFILE_OUT = "k string, id long, px long, py string, seed long, tdtype string, tns long, m map<string, bigint>"
PROFILE_VARS = {"last": "value", "seed": "value", "seen": "list"}
PROFILE_SEEDS = pd.DataFrame({"k": ["a", "a", "b", "e"], "s": [10, 5, 20, 40]})


def profile_input() -> list[list[dict]]:
    base = 1_700_000_000_000
    ts = lambda ms: (pd.Timestamp(base + ms, unit="ms") + pd.Timedelta(microseconds=7)).isoformat()  # noqa: E731
    return [[{"k": "abc"[i % 3], "t": ts(100 * i + 1000 * b), "id": b * 100 + i} for i in range(6)] for b in range(2)]


@pytest.fixture(scope="module")
def profile_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-profile")
    seeds = spark.createDataFrame(PROFILE_SEEDS)
    rows = run_spark(spark, tmp, profile_input(), "k string, t timestamp, id long",
                     lambda df: df.groupBy("k").transformWithStateInPandas(
                         Profile(), PROFILE_OUT, "Update", "None", initialState=seeds.groupBy("k")),
                     processing_time=False)
    return rows, spark_state(spark, tmp / "spark-chk", PROFILE_VARS, timers=False)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("driver", DRIVERS)
def test_conversions_structs_maps_and_initial_state_match_spark(spark, profile_spark, tmp_path, driver, source):
    spark_rows, spark_st = profile_spark
    assert {r["tdtype"] for r in spark_rows} == {"datetime64[ns]"} and spark_st["seed"][("e",)] == (40,)
    # the spark driver takes the initial state as a Spark DataFrame, the others as pandas
    seeds = spark.createDataFrame(PROFILE_SEEDS) if driver == "spark" else PROFILE_SEEDS
    rows, raw = run_epochstream(tmp_path, driver, profile_input(), lambda s: s.transform_with_state(
        Profile(), PROFILE_OUT, "None", key="k", input_schema="k string, t timestamp, id long", uid="op",
        initial_state=seeds), convert=lambda r: {**r, "t": datetime.datetime.fromisoformat(r["t"])}, spark=spark,
        source=source)
    assert canon(rows) == canon(spark_rows)
    mine = epochstream_state(raw, PROFILE_VARS)
    mine.pop("$timers")
    assert mine == spark_st


@pytest.mark.parametrize("driver", DRIVERS)
def test_system_exit_in_user_code_fails_the_job_naming_the_operator(spark, tmp_path, driver):
    from epochstream.runtime.errors import EpochStreamError

    with pytest.raises(EpochStreamError) as info:
        run_epochstream(tmp_path, driver, fives_input(), lambda s: s.transform_with_state(
            Exits(), "k string", key="k", uid="exiting-op"), spark=spark)
    chain, e = [], info.value
    while e is not None:
        chain.append(repr(e))
        e = e.__cause__
    assert "exiting-op" in " ".join(chain) and "SystemExit" in " ".join(chain), chain


class Exits(StatefulProcessor):
    def init(self, handle):
        pass

    def handleInputRows(self, key, rows, timerValues):
        sys.exit(3)


# ---------------------------------------------------------------- Spark's state reader on epochstream checkpoints


@pytest.fixture(scope="module")
def everything_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("es-everything-state")
    _rows, raw = run_epochstream(tmp, "sim", everything_input(), lambda s: s.transform_with_state(
        Everything(), EVERYTHING_OUT, "ProcessingTime", key="k", clock=SteppingClock(), uid="op"))
    return tmp / "es-chk", raw


def test_the_epochstream_state_source_equals_epochstream_state_query(spark, everything_checkpoint):
    """``format("epochstream-state")`` reads what ``epochstream state query`` prints and what
    the oracle's reader sees, for every kind of state variable and the timers."""
    import subprocess

    from epochstream.pyspark.state_source import register

    register(spark)
    chk, raw = everything_checkpoint
    mine = spark_state(spark, chk, EVERYTHING_VARS, timers=True, fmt="epochstream-state", operatorUid="op")
    assert mine == epochstream_state(raw, EVERYTHING_VARS) and mine["count"] and mine["$timers"]
    cli = subprocess.run([sys.executable, "-m", "epochstream.cli", "state", "query", "--checkpoint-dir", str(chk),
                          "--operator", "op", "--state", "count", "--json"], capture_output=True, text=True,
                         check=True)
    counts = {tuple(r["key"]): tuple(r["value"][0]) for r in json.loads(cli.stdout)["rows"]}
    assert counts == mine["count"]


def test_the_epochstream_state_source_reads_a_checkpoint_as_spark_reads_its_own(spark, everything_spark,
                                                                                 everything_checkpoint):
    """The same reading code on both engines' checkpoints gives the same state."""
    from epochstream.pyspark.state_source import register

    register(spark)
    _spark_rows, spark_st = everything_spark
    chk, _raw = everything_checkpoint
    assert spark_state(spark, chk, EVERYTHING_VARS, timers=True, fmt="epochstream-state", operatorUid="op") == spark_st


# ---------------------------------------------------------------- late rows, batch for batch (issue 19, item 6)


class Lateness(StatefulProcessor):
    """Every row it is handed (with the watermark it is told), a count per key, and an
    event-time timer 3 s after each row; a timer reports its expiry and the watermark."""

    def init(self, handle):
        self.handle = handle
        self.count = handle.getValueState("count", "n long")
        self.fired = handle.getListState("fired", "t long")

    def handleInputRows(self, key, rows, timerValues):
        out = []
        for pdf in rows:
            for t, i in zip(pdf["t"], pdf["id"], strict=True):
                ms = int(pd.Timestamp(t).value // 1_000_000)
                self.count.update(((self.count.get() or (0,))[0] + 1,))
                self.handle.registerTimer(ms + 3_000)
                out.append((key[0], int(i), ms, timerValues.getCurrentWatermarkInMs(), "row"))
        yield pd.DataFrame(out, columns=["k", "id", "t", "wm", "kind"])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        ts = expiredTimerInfo.getExpiryTimeInMs()
        self.fired.appendValue((ts,))
        yield pd.DataFrame([(key[0], -1, ts, timerValues.getCurrentWatermarkInMs(), "timer")],
                           columns=["k", "id", "t", "wm", "kind"])


LATENESS_OUT = "k string, id long, t long, wm long, kind string"
LATENESS_VARS = {"count": "value", "fired": "list"}


def lateness_input() -> list[list[dict]]:
    """Five micro-batches; (key, id, event second). With a 0 s delay Spark drops a row of
    batch N at or below the max event time of batches <= N-2: id 7 (9 s <= 12 s) and id 12
    (19 s <= 20 s). Rows 4, 5, 8, 10, 11 are at or below the *current* watermark and kept.
    No key gets rows in the batch right after one of its timers became due, so where a
    timer fires relative to that batch's rows (docs/PYSPARK.md) does not show."""
    base = 1_700_000_000_000
    ts = lambda s: pd.Timestamp(base + s * 1_000, unit="ms").isoformat()  # noqa: E731
    files = [[("a", 1, 10), ("b", 2, 12)],
             [("a", 3, 20), ("b", 4, 5), ("a", 5, 11)],
             [("c", 6, 30), ("c", 7, 9), ("c", 8, 19), ("d", 9, 21)],
             [("e", 10, 25), ("e", 11, 28), ("e", 12, 19)],
             [("f", 13, 31)]]
    return [[{"k": k, "id": i, "t": ts(s)} for k, i, s in f] for f in files]


@pytest.fixture(scope="module")
def lateness_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-lateness")
    rows = run_spark(spark, tmp, lateness_input(), "k string, t timestamp, id long",
                     lambda df: df.withWatermark("t", "0 seconds").groupBy("k").transformWithStateInPandas(
                         Lateness(), LATENESS_OUT, "Append", "EventTime"),
                     processing_time=False)
    return rows, spark_state(spark, tmp / "spark-chk", LATENESS_VARS, timers=True)


def run_epochstream_per_batch(tmp: Path, driver: str, batches, attach, spark=None) -> tuple[list[dict], dict]:
    """One epochstream run per micro-batch: run k reads the source (the rows of batches
    0..k) from where run k-1's checkpoint left it, as its one epoch (no periodic epochs:
    the final epoch only), restoring its state. So each epoch holds exactly one Spark
    micro-batch, and every run after the first goes through a restore. (Within one run
    epochs are cut by the checkpoint interval, a time, and nothing ties a bound to a source
    offset, so a single run cannot be cut at the files' boundaries on every driver.)"""
    for k in range(len(batches)):
        rows = [{**r, "t": datetime.datetime.fromisoformat(r["t"])} for b in batches[:k + 1] for r in b]
        p = Pipeline("differential-per-batch", parallelism=1, max_parallelism=128,
                     checkpoint=CheckpointConfig(interval=None), batch_size=64, restart_attempts=0)
        attach(p.from_collection(rows, splits=1, uid="input")).sink(FileSink(tmp / "es-out"), uid="out")
        options: dict = {"spark": spark} if driver == "spark" else {}
        p.run(deployment=driver, checkpoint_dir=str(tmp / "es-chk"), restore="latest" if k else None, **options)
    storage = LocalCheckpointStorage(tmp / "es-chk")
    manifest, root = storage.latest()
    return committed_output(tmp / "es-out"), committed_state(storage, manifest, root)["op"]


@pytest.mark.parametrize("driver", DRIVERS)
def test_late_rows_and_event_time_timers_match_spark_batch_for_batch(spark, lateness_spark, tmp_path, driver):
    """The rows the processor is handed (so the rows dropped as late), the watermark it is
    told, the timers that fire and the final state, with one epoch per Spark micro-batch
    (epoch-bound watermark, parallelism 1: docs/PYSPARK.md, "Event time")."""
    spark_rows, spark_st = lateness_spark
    seen = sorted(r["id"] for r in spark_rows if r["kind"] == "row")
    assert seen == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 13], seen  # Spark dropped 7 and 12
    rows, raw = run_epochstream_per_batch(tmp_path, driver, lateness_input(), lambda s: s.transform_with_state(
        Lateness(), LATENESS_OUT, "EventTime", key="k", event_time="t", input_schema="k string, t timestamp, id long",
        uid="op"), spark=spark)
    assert canon(rows) == canon(spark_rows)
    assert epochstream_state(raw, LATENESS_VARS) == spark_st


# ---------------------------------------------------------------- handle lifecycle errors (issue 19, item 5)
#
# Spark 4.2's state server raises a wrong-phase operation, answers the Python client with the
# error and then stops serving that task (its loop ends and the handle is CLOSED): the client
# raises a PySparkRuntimeError the user code can catch, and the next call to the state server
# waits forever, so the query hangs. The processors therefore catch each error and record
# what they saw: through the output for the errors after which Spark goes on (a deleted
# state variable's object, answered "... is not initialized." without ending the server),
# and through a log file for the ones after which Spark hangs (then the query is stopped).


def caught(op: str, exc: BaseException) -> tuple:
    """(operation, exception class, Spark error class, message) as the user code sees them."""
    import re

    msg = str(exc)
    bracket = re.search(r"\[([A-Z_]+(?:\.[A-Z_]+)?)\]", msg)
    cond = exc.getCondition() if hasattr(exc, "getCondition") else None
    return op, type(exc).__name__, cond or (bracket.group(1) if bracket else ""), msg


class Deleted(StatefulProcessor):
    """Declares value, list and map state, deletes each in ``init`` and then uses every call
    of the deleted objects; also declares a variable twice."""

    CALLS = (
        ("v.exists", lambda s: s.v.exists()), ("v.get", lambda s: s.v.get()),
        ("v.update", lambda s: s.v.update((1,))), ("v.clear", lambda s: s.v.clear()),
        ("l.exists", lambda s: s.l.exists()), ("l.get", lambda s: list(s.l.get())),
        ("l.put", lambda s: s.l.put([(1,)])), ("l.appendValue", lambda s: s.l.appendValue((1,))),
        ("l.appendList", lambda s: s.l.appendList([(1,)])), ("l.clear", lambda s: s.l.clear()),
        ("m.exists", lambda s: s.m.exists()), ("m.getValue", lambda s: s.m.getValue((1,))),
        ("m.containsKey", lambda s: s.m.containsKey((1,))), ("m.updateValue", lambda s: s.m.updateValue((1,), (2,))),
        ("m.iterator", lambda s: list(s.m.iterator())), ("m.keys", lambda s: list(s.m.keys())),
        ("m.values", lambda s: list(s.m.values())), ("m.removeKey", lambda s: s.m.removeKey((1,))),
        ("m.clear", lambda s: s.m.clear()),
        ("kept.update", lambda s: s.kept.update((7,))), ("kept.get", lambda s: s.kept.get()),
    )

    def init(self, handle):
        self.seen = []
        self.v = handle.getValueState("v", "n long")
        self.l = handle.getListState("l", "n long")
        self.m = handle.getMapState("m", "u long", "n long")
        self.seen.append(attempt("init: getValueState twice", lambda: handle.getValueState("v", "n long")))
        for name in ("v", "l", "m"):
            handle.deleteIfExists(name)
        self.kept = handle.getValueState("kept", "n long")

    def handleInputRows(self, key, rows, timerValues):
        for _ in rows:
            pass
        out = self.seen + [attempt(op, lambda fn=fn: fn(self)) for op, fn in self.CALLS]
        self.seen = []
        yield pd.DataFrame([(key[0],) + o for o in out], columns=["k", "op", "cls", "cond", "msg"])


DELETED_OUT = "k string, op string, cls string, cond string, msg string"


def attempt(op: str, fn) -> tuple:
    """``caught`` for a raising call, else what it returned (a state variable object by the
    PySpark class it is an instance of: epochstream's are subclasses of them)."""
    from pyspark.sql.streaming.stateful_processor import ListState, MapState, ValueState

    try:
        r = fn()
    except Exception as exc:
        return caught(op, exc)
    kinds = [c.__name__ for c in (ValueState, ListState, MapState) if isinstance(r, c)]
    return op, "returned", "", kinds[0] if kinds else repr(r)


class WrongPhase(StatefulProcessor):
    """One wrong-phase handle operation (``case``), caught and logged to ``log`` (a folder)
    with whether the handle was Spark's driver-side one (PRE_INIT: Spark runs ``init`` and
    ``close`` once on the driver to learn the state schemas)."""

    def __init__(self, case: str, log: str) -> None:
        self.case, self.log = case, log

    def _try(self, op, fn) -> None:
        client = getattr(self.h, "_statefulProcessorApiClient", None)
        driver = getattr(getattr(client, "handle_state", None), "name", "") == "PRE_INIT"
        with open(os.path.join(self.log, f"{os.getpid()}-{id(self)}.jsonl"), "a") as f:
            f.write(json.dumps([driver, *attempt(op, fn)]) + "\n")

    def init(self, handle):
        self.h = handle
        if self.case == "init: registerTimer":
            self._try(self.case, lambda: handle.registerTimer(1))

    def handleInputRows(self, key, rows, timerValues):
        for _ in rows:
            pass
        if self.case == "handleInputRows: getValueState":
            self._try(self.case, lambda: self.h.getValueState("x", "n long"))
        elif self.case == "handleInputRows: registerTimer (time mode None)":
            self._try(self.case, lambda: self.h.registerTimer(1))
        elif self.case == "handleExpiredTimer: deleteIfExists":
            self.h.registerTimer(1)  # in the past: fires after this batch
        return iter([])

    def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
        if self.case == "handleExpiredTimer: deleteIfExists":
            self._try(self.case, lambda: self.h.deleteIfExists("x"))
        return iter([])

    def close(self):
        if self.case == "close: getListState":
            self._try(self.case, lambda: self.h.getListState("x", "n long"))


#: case -> time mode; each hangs Spark's task that meets it, so each gets a query of its own
WRONG_PHASE = {
    "init: registerTimer": "ProcessingTime",
    "handleInputRows: getValueState": "None",
    "handleInputRows: registerTimer (time mode None)": "None",
    "handleExpiredTimer: deleteIfExists": "ProcessingTime",
    "close: getListState": "None",
}
ONE_ROW = [[{"k": "a", "id": 1}]]


def logged(folder: Path) -> list[tuple]:
    return [tuple(json.loads(line)) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


@pytest.fixture(scope="module")
def handle_errors_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-deleted")
    deleted = run_spark(spark, tmp, ONE_ROW, "k string, id long",
                        lambda df: df.groupBy("k").transformWithStateInPandas(Deleted(), DELETED_OUT, "Append",
                                                                              "None"),
                        processing_time=False)
    phases = {case: spark_wrong_phase(spark, tmp_path_factory, case) for case in WRONG_PHASE}
    return deleted, phases


def spark_wrong_phase(spark, tmp_path_factory, case: str, tries: int = 2) -> list[tuple]:
    """Run ``WrongPhase(case)`` on Spark until its executor-side task has logged (then it
    hangs) and stop the query. A query that fails instead of hanging fails the test, except
    for a Python worker that did not connect back in time on a loaded machine (retried)."""
    tmp = tmp_path_factory.mktemp("spark-phase")
    (tmp / "in").mkdir()
    (tmp / "log").mkdir()
    (tmp / "in" / "b0.json").write_text(json.dumps(ONE_ROW[0][0]) + "\n")
    df = spark.readStream.schema("k string, id long").json(str(tmp / "in"))
    q = (df.groupBy("k").transformWithStateInPandas(WrongPhase(case, str(tmp / "log")), "k string", "Append",
                                                    WRONG_PHASE[case])
         .writeStream.format("noop").option("checkpointLocation", str(tmp / "chk")).start())
    deadline = time.monotonic() + 240
    try:
        while not any(not r[0] for r in logged(tmp / "log")):  # the executor's record
            if not q.isActive and tries > 1 and "failed to connect back" in str(q.exception()):
                return spark_wrong_phase(spark, tmp_path_factory, case, tries - 1)
            assert time.monotonic() < deadline and q.isActive, (case, q.exception())
            time.sleep(0.2)
        time.sleep(1)  # the other partition's task may log the same
        assert q.isActive, (case, q.exception())  # hung, not failed: the state server is gone
    finally:
        q.stop()
    return logged(tmp / "log")


def run_wrong_phase(tmp: Path, driver: str, case: str, spark=None) -> list[tuple]:
    (tmp / "log").mkdir()
    run_epochstream(tmp, driver, ONE_ROW, lambda s: s.transform_with_state(
        WrongPhase(case, str(tmp / "log")), "k string", WRONG_PHASE[case], key="k", clock=SteppingClock(), uid="op"),
        spark=spark)
    return logged(tmp / "log")


@pytest.mark.parametrize("driver", DRIVERS)
def test_deleted_state_variables_raise_what_spark_raises(spark, handle_errors_spark, tmp_path, driver):
    """Every call on a state variable deleted with ``deleteIfExists``: the same exception
    class and message, or the same return (Spark's client ends list and map iterators
    empty on the server's error); re-declaring a variable is accepted in both."""
    spark_rows, _phases = handle_errors_spark
    assert len(spark_rows) == len(Deleted.CALLS) + 1
    rows, _raw = run_epochstream(tmp_path, driver, ONE_ROW, lambda s: s.transform_with_state(
        Deleted(), DELETED_OUT, "None", key="k", uid="op"), spark=spark)
    assert canon(rows) == canon(spark_rows)


@pytest.mark.parametrize("driver", DRIVERS)
def test_wrong_phase_handle_operations_raise_what_spark_raises(spark, handle_errors_spark, tmp_path_factory, driver):
    """Each operation in a phase Spark refuses: the user code catches the same class and
    message (PySpark's client prefix, Spark's error class, the phase). Spark then hangs (its
    state server is gone); epochstream goes on. Spark also runs ``init``/``close`` once on the
    driver in phase PRE_INIT, where it refuses timers (recorded, not compared: epochstream
    has no driver-side call, docs/PYSPARK.md)."""
    _deleted, phases = handle_errors_spark
    for case in WRONG_PHASE:
        spark_seen = {r[1:] for r in phases[case] if not r[0]}
        assert spark_seen and all(r[1] == "PySparkRuntimeError" for r in spark_seen), (case, spark_seen)
        mine = {r[1:] for r in run_wrong_phase(tmp_path_factory.mktemp(f"es-{driver}"), driver, case, spark)}
        assert mine == spark_seen, case
    driver_side = {r[1:] for case in WRONG_PHASE for r in phases[case] if r[0]}
    assert ("init: registerTimer", "PySparkRuntimeError", "STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_"
            "HANDLE_STATE", "Error register timer: [STATEFUL_PROCESSOR_CANNOT_PERFORM_OPERATION_WITH_INVALID_HANDLE_"
            "STATE] Failed to perform stateful processor operation=register_timer with invalid handle state=PRE_INIT. "
            "SQLSTATE: 42802") in driver_side, driver_side


# ---------------------------------------------------------------- Row-mode initial state (issue 19, item 7)


class RowSeeds(StatefulProcessor):
    """``transformWithState`` (Row mode) with an ``initialState``: ``handleInitialState`` gets
    one ``Row`` per seed row, which it records (class, fields, values) and adds up."""

    def init(self, handle):
        self.seed = handle.getValueState("seed", "s long")
        self.got = handle.getListState("got", "r string")

    def handleInitialState(self, key, initialState, timerValues):
        self.got.appendValue((f"{type(initialState).__name__}{sorted(initialState.asDict().items())}",))
        self.seed.update((((self.seed.get() or (0,))[0]) + int(initialState.s),))

    def handleInputRows(self, key, rows, timerValues):
        from pyspark.sql import Row

        got = "|".join(sorted(r[0] for r in self.got.get()))
        for r in rows:
            yield Row(k=key[0], id=r.id, seed=(self.seed.get() or (-1,))[0], got=got, rowtype=type(r).__name__)


ROW_SEEDS_OUT = "k string, id long, seed long, got string, rowtype string"
ROW_SEEDS_VARS = {"seed": "value", "got": "list"}


@pytest.fixture(scope="module")
def row_seeds_spark(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spark-row-seeds")
    seeds = spark.createDataFrame(PROFILE_SEEDS)
    rows = run_spark(spark, tmp, fives_input(), "k string, id long",
                     lambda df: df.groupBy("k").transformWithState(
                         RowSeeds(), ROW_SEEDS_OUT, "Update", "None", initialState=seeds.groupBy("k")),
                     processing_time=False)
    return rows, spark_state(spark, tmp / "spark-chk", ROW_SEEDS_VARS, timers=False)


@pytest.mark.parametrize("driver", DRIVERS)
def test_row_mode_initial_state_matches_spark(spark, row_seeds_spark, tmp_path, driver):
    spark_rows, spark_st = row_seeds_spark
    assert spark_st["seed"] == {("a",): (15,), ("b",): (20,), ("e",): (40,)}, spark_st
    rows, raw = run_epochstream(tmp_path, driver, fives_input(), lambda s: s.transform_with_state(
        RowSeeds(), ROW_SEEDS_OUT, "None", key="k", rows="row", uid="op",
        initial_state=spark.createDataFrame(PROFILE_SEEDS) if driver == "spark" else PROFILE_SEEDS), spark=spark)
    assert canon(rows) == canon(spark_rows)
    mine = epochstream_state(raw, ROW_SEEDS_VARS)
    mine.pop("$timers")
    assert mine == spark_st


def late_counts(key, pdf_iter, state):
    """applyInPandasWithState with a watermark: every row it is handed, the watermark its
    GroupState reports, and a count per key."""
    n = state.get[0] if state.exists else 0
    out = []
    for pdf in pdf_iter:
        for t, i in zip(pdf["t"], pdf["id"], strict=True):
            n += 1
            out.append((key[0], int(i), int(pd.Timestamp(t).value // 1_000_000), state.getCurrentWatermarkMs(), "row"))
    state.update((n,))
    yield pd.DataFrame(out, columns=["k", "id", "t", "wm", "kind"])


@pytest.fixture(scope="module", params=["NoTimeout", "EventTimeTimeout"])
def late_counts_spark(spark, tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("spark-late-counts")
    timeout = getattr(GroupStateTimeout, request.param)
    rows = run_spark(spark, tmp, lateness_input(), "k string, t timestamp, id long",
                     lambda df: df.withWatermark("t", "0 seconds").groupBy("k").applyInPandasWithState(
                         late_counts, LATENESS_OUT, "n long", "Append", timeout),
                     processing_time=False)
    state = {}
    for r in spark.read.format("statestore").load(str(tmp / "spark-chk")).collect():
        value = r["value"]
        state[tuple(r["key"])] = tuple(value["groupState"]) if "groupState" in value else tuple(value)
    return timeout, rows, state


@pytest.mark.parametrize("driver", DRIVERS)
def test_late_rows_of_apply_in_pandas_with_state_match_spark_batch_for_batch(spark, late_counts_spark, tmp_path,
                                                                             driver):
    """Spark drops late rows before applyInPandasWithState only with EventTimeTimeout (with
    NoTimeout the watermark is reported but every row is handed over); the same here."""
    timeout, spark_rows, spark_st = late_counts_spark
    kept = [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 13] if timeout == GroupStateTimeout.EventTimeTimeout else list(range(1, 14))
    assert sorted(r["id"] for r in spark_rows) == kept
    rows, raw = run_epochstream_per_batch(tmp_path, driver, lateness_input(), lambda s: s.apply_in_pandas_with_state(
        late_counts, LATENESS_OUT, "n long", "Append", timeout, key="k", event_time="t",
        input_schema="k string, t timestamp, id long", uid="op"), spark=spark)
    assert canon(rows) == canon(spark_rows)
    assert {k: v[0][0] for k, v in raw.get("$groupState", {}).items()} == {k: v[0] for k, v in spark_st.items()}
