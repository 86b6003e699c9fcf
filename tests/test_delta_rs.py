"""Delta commits through delta-rs, no JVM: idempotent app transactions, one version per epoch,
retries and clear errors, S3's conditional-put commits on moto, and ``DeltaSink`` taking Arrow.

No Spark here: these tests show what the commit path does on its own. That Spark (delta-spark)
reads every table this path writes, with time travel per epoch, is shown in tests/test_delta.py
and tests/test_delta_s3.py.
"""

from __future__ import annotations

import pickle

import pyarrow as pa
import pytest

from epochstream.backends.delta import DeltaCheckpointStorage, DeltaConflictError, DeltaSink, history, state_at, tables
from epochstream.backends.delta.tables import DeltaCommitError, DeltaTables, open_table
from epochstream.runtime.errors import SchemaError
from pipelines import RunningCount, _key, input_records, make_pipeline, sim_run, without_fsync
from s3server import FAKE_KEY, FAKE_SECRET, REGION

SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64())])
APP = "epochstream/test/sink/out/ab12"


@pytest.fixture(autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def make_table(path) -> str:
    table = str(path)
    tables.create(table, SCHEMA, {tables.FORMAT_PROPERTY: tables.SINK_FORMAT}, APP)
    return table


def rows(n: int, start: int = 0) -> pa.Table:
    return pa.table({"key": [f"k{i}" for i in range(start, start + n)], "n": list(range(start, start + n))},
                    schema=SCHEMA)


def never(exc: BaseException) -> str:
    return f"conflict: {exc}"


# ---------------------------------------------------------------- app transactions


def test_an_append_is_one_version_per_epoch_and_a_reissue_adds_nothing(tmp_path):
    table = make_table(tmp_path / "t")
    for epoch in (1, 2):
        tables.append(rows(3, 3 * epoch), table, APP, epoch, never)
    before = open_table(table).version()
    tables.append(rows(3, 3), table, APP, 1, never)  # re-issued after a crash: Delta's txn says it is there
    tables.append(rows(3, 6), table, APP, 2, never)
    assert open_table(table).version() == before
    assert open_table(table).transaction_version(APP) == 2
    assert [tables.version_of_epoch(table, APP, e) for e in (1, 2)] == [before - 1, before]
    assert open_table(table).to_pyarrow_table().num_rows == 6


def test_an_epoch_that_changes_nothing_still_gets_its_version(tmp_path):
    """Time travel per epoch needs a version per epoch: an empty append (and a MERGE that
    changes nothing, which delta-rs would not commit) commits the transaction alone."""
    table = make_table(tmp_path / "t")
    tables.append(SCHEMA.empty_table(), table, APP, 1, never)
    tables.transact(table, APP, 2, lambda props: None, never)
    v1, v2 = (tables.version_of_epoch(table, APP, e) for e in (1, 2))
    assert v1 is not None and v2 == v1 + 1
    assert open_table(table).transaction_version(APP) == 2


def test_a_transient_fault_is_retried_and_a_lost_answer_does_not_commit_twice(tmp_path, monkeypatch):
    table = make_table(tmp_path / "t")
    calls = []

    def flaky(props):  # the commit lands, then the answer is lost: the retry must see it landed
        calls.append(1)
        from deltalake import write_deltalake

        write_deltalake(tables.table_uri(table), rows(2), mode="append", commit_properties=props)
        if len(calls) == 1:
            raise OSError("connection reset by peer")

    tables.transact(table, APP, 1, flaky, never)
    assert len(calls) == 1  # the retry read the transaction version and stopped there
    assert open_table(table).to_pyarrow_table().num_rows == 2
    attempts = []

    def fails_once(props):
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("timed out")
        tables.append(rows(1), table, APP, 2, never)

    tables.transact(table, APP, 2, fails_once, never)
    assert len(attempts) == 2 and open_table(table).to_pyarrow_table().num_rows == 3


def test_a_conflict_that_persists_and_a_hard_failure_are_clear_errors(tmp_path):
    from deltalake.exceptions import CommitFailedError

    table = make_table(tmp_path / "t")
    tries = []

    def conflicting(props):
        tries.append(1)
        raise CommitFailedError("Failed to commit transaction: 3")

    with pytest.raises(DeltaConflictError, match="conflict: Failed to commit"):
        tables.transact(table, APP, 1, conflicting, never)
    assert len(tries) == 4  # retried, then reported

    def broken(props):
        raise ValueError("Schema error: invalid data type for column n")

    with pytest.raises(DeltaCommitError, match=r"epoch 1 to .*t failed \(ValueError: Schema error"):
        tables.transact(table, APP, 1, broken, never)
    assert tables.version_of_epoch(table, APP, 1) is None  # nothing committed


def test_a_table_left_between_create_and_its_properties_is_finished_not_refused(tmp_path):
    """delta-rs refuses unknown properties at CREATE, so they come in a second commit; a crash
    in between leaves a table with only our CREATE: the next start sets them."""
    from deltalake import DeltaTable

    table = str(tmp_path / "t")
    DeltaTable.create(table, SCHEMA, commit_properties=tables.commit_properties(APP, 0))
    DeltaTables().check_owned(table, tables.SINK_FORMAT, {}, "Delta sink t", APP)
    assert tables.properties(table)[tables.FORMAT_PROPERTY] == tables.SINK_FORMAT
    other = str(tmp_path / "theirs")
    DeltaTable.create(other, SCHEMA)  # not ours: refused, untouched
    with pytest.raises(Exception, match="not created by epochstream"):
        DeltaTables().check_owned(other, tables.SINK_FORMAT, {}, "Delta sink theirs", APP)
    assert len(history(other)) == 1


# ---------------------------------------------------------------- DeltaSink takes Arrow


def test_delta_sink_takes_arrow_batches_whole_and_commits_once_per_epoch(tmp_path):
    sink = DeltaSink(tmp_path / "out", SCHEMA)
    sink.start("out", "job", None)
    w = sink.writer()
    # a batch with its columns in another order and a narrower int type: selected and cast
    w.write_batch(pa.record_batch({"n": pa.array([1, 2], pa.int32()), "key": ["a", "b"], "extra": [0, 0]}))
    w.write([("c", 3)])
    staged = sink.pre_commit("out", 0, 1, "x", w.take())
    assert staged is not None and sink.read() == []  # staged: invisible
    v = sink.commit_epoch("out", 1, [staged])
    assert sorted((r["key"], r["n"]) for r in sink.read()) == [("a", 1), ("b", 2), ("c", 3)]
    assert sink.commit_epoch("out", 1, [staged]) == v  # re-issued: the same version, nothing added
    assert sink.epochs() == [(1, v)]
    with pytest.raises(SchemaError, match="no column 'n'"):
        sink.writer().write_batch(pa.record_batch({"key": ["a"]}))
    with pytest.raises(SchemaError, match="column 'n' of type string does not convert"):
        sink.writer().write_batch(pa.record_batch({"key": ["a"], "n": ["x"]}))


# ---------------------------------------------------------------- S3 on moto


@pytest.fixture
def rs_s3_url(moto_s3_process, monkeypatch, request) -> str:
    """A fresh bucket on moto in a child process (delta-rs keeps the GIL in some calls, so an
    in-process server could not answer), with the AWS_* variables pointing at it."""
    env = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "AWS_DEFAULT_REGION": REGION,
           "AWS_ENDPOINT_URL": moto_s3_process.url}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    return f"s3://{moto_s3_process.new_bucket(request.node.name)}/run"


@pytest.mark.slow
def test_s3_commits_are_conditional_puts_so_a_second_writer_of_a_version_is_refused(rs_s3_url):
    """delta-rs 1.x commits version N by putting its log file with ``If-None-Match: *``; moto
    honours it, so two writers racing for one version cannot both write it (no locking
    provider, no AWS_S3_ALLOW_UNSAFE_RENAME). With retries the loser rebases onto N+1."""
    from deltalake import CommitProperties, write_deltalake
    from deltalake.exceptions import CommitFailedError

    table = make_table(f"{rs_s3_url}/race")
    a, b = open_table(table), open_table(table)  # both see the same newest version
    opts = tables.storage_options(table)
    assert opts is not None and "AWS_S3_ALLOW_UNSAFE_RENAME" not in opts and opts["AWS_ALLOW_HTTP"] == "true"
    write_deltalake(a, rows(2), mode="append")
    with pytest.raises(CommitFailedError):
        write_deltalake(b, rows(2, 10), mode="append", commit_properties=CommitProperties(max_commit_retries=0))
    write_deltalake(open_table(table), rows(2, 20), mode="append")
    assert open_table(table).to_pyarrow_table().num_rows == 4  # nothing overwritten, nothing lost


@pytest.mark.slow
def test_delta_state_and_sink_on_s3_without_spark(rs_s3_url):
    """The Delta backend and sink on moto's S3 commit through delta-rs alone: the job runs and
    its tables hold one transaction per completed epoch (no Spark session in this test)."""
    p = make_pipeline("delta-rs-s3", parallelism=2, interval=0.001)
    p.checkpoint.state_backend = "delta"
    p.checkpoint.delta_compact_every = 1  # a compaction writes its file to S3 and commits it there too
    (p.from_collection(input_records(60, 3), uid="src").key_by(_key).process(RunningCount(), uid="count")
     .sink(DeltaSink(f"{rs_s3_url}/out", SCHEMA), uid="counts"))
    result = sim_run(p, f"{rs_s3_url}/chk", seed=1)
    storage = DeltaCheckpointStorage(f"{rs_s3_url}/chk")
    table = storage.table_path("count")
    epochs = sorted(h["meta"]["epoch"] for h in history(table)
                    if h["meta"] and h["meta"]["epoch"] > 0 and not tables.is_compaction(h["meta"]))
    assert epochs == result.completed_epochs == storage.list_checkpoints()
    assert any(tables.is_compaction(h["meta"]) for h in history(table))
    state = state_at(table)  # the changelog folded at its newest epoch
    assert {pickle.loads(k): pickle.loads(v) for k, v in zip(state.column("key").to_pylist(),
                                                             state.column("value").to_pylist(), strict=True)} \
        == {"k0": 20, "k1": 20, "k2": 20}
    out = DeltaSink(f"{rs_s3_url}/out", SCHEMA).read()
    assert sorted((r["key"], r["n"]) for r in out) == sorted((f"k{k}", c) for k in range(3) for c in range(1, 21))


def test_damaged_staged_output_and_a_vanished_version_are_clear_errors(tmp_path):
    from epochstream import CheckpointError

    sink = DeltaSink(tmp_path / "out", SCHEMA)
    sink.start("out", "job", None)
    staged = sink.pre_commit("out", 0, 1, "x", [("a", 1)])
    (sink.path and (tmp_path / "out" / staged)).write_bytes(b"not parquet")
    with pytest.raises(CheckpointError, match=r"staged output .*e1-s0-ax-n1-b\d+\.parquet is damaged"):
        sink.commit_epoch("out", 1, [staged])
    assert sink.epochs() == []  # nothing appended
    with pytest.raises(CheckpointError, match="version 99 cannot be read"):
        tables.read_version(sink.path, 99)
