"""Savepoints, read-committed state queries and the job's HTTP API (fast: simulator, in-process).

- read-committed: while epoch n+1 is prepared (its state files written, its manifest not),
  a query returns exactly epoch n's state, never a mix; ``epoch=`` reads any retained epoch
  and equals the sequential reference at that epoch's offsets;
- the query API (pyarrow Table) and ``epochstream state query`` / ``savepoint list`` /
  ``savepoint dispose`` / ``run --from-savepoint`` through ``cli.main``;
- bad inputs: another job's savepoint, missing and corrupt savepoint objects, an older
  manifest format (readable) and one older than that (refused), parallelism above max
  parallelism, another max parallelism, an unusable savepoint target;
- the REST server and client over a real socket on 127.0.0.1, and the job registry.

The end-to-end run with real worker processes and the CLI is in ``test_savepoint_cli.py`` (slow).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import epochstream.state as state_api
from epochstream import CheckpointError, ParallelismError
from epochstream.backends.local import METADATA, LocalCheckpointStorage
from epochstream.backends.savepoint import dispose_savepoint, list_savepoints
from epochstream.cli import main as cli_main
from epochstream.deploy import jobs
from epochstream.deploy.control import COMPLETED, JobControl
from epochstream.deploy.rest import RestClient, RestError, RestServer
from epochstream.deploy.sim import SimDriver
from epochstream.oracle import Reference
from epochstream.snapshot.coordinator import EpochState
from epochstream.snapshot.manifest import FORMAT_VERSION
from pipelines import running_count, sim_run, without_fsync

N = 300
KEYS = 7


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def committed(storage: LocalCheckpointStorage, location) -> dict:
    """key -> count of the ``count`` state in one manifest, read with pickle only (not the query API)."""
    m, root = storage.load_manifest(location)
    out = {}
    for _kg, kb, name, vb in storage.read_operator_rows(m, root, "count"):
        if name != "count":
            continue
        if vb is None:
            out.pop(pickle.loads(kb), None)
        else:
            out[pickle.loads(kb)] = pickle.loads(vb)
    return out


def as_dict(table: pa.Table) -> dict:
    return {(r["state"], r["key"]): r["value"] for r in table.to_pylist()}


def with_savepoint(tmp_path: Path, parallelism: int = 2, **knobs):
    """A running_count job stopped half-way with a savepoint; returns (pipeline, result, savepoint path)."""
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out", parallelism=parallelism, max_parallelism=13, **knobs)
    r = sim_run(p, tmp_path / "chk", seed=2, duration=0.5 * N / (parallelism * 10_000.0), source_rate=10_000.0,
                savepoint_dir=str(tmp_path / "sp"), stop_with_savepoint=True)
    assert r.savepoints
    return p, r, Path(r.savepoints[-1])


# ---------------------------------------------------------------- read-committed


@pytest.mark.parametrize("mode", ["aligned", "tracker", "unaligned"])
def test_queries_read_the_last_completed_epoch_while_the_next_is_prepared(tmp_path, monkeypatch, mode):
    chk = tmp_path / "chk"
    storage = LocalCheckpointStorage(chk)
    seen = []
    real = SimDriver.fail_point

    def spy(self, name):
        if name == "before_manifest" and storage.list_checkpoints():
            prepared = [e for e, r in self.master.coordinator.epochs.items() if r.state is EpochState.PREPARED]
            assert len(prepared) == 1
            n = storage.list_checkpoints()[-1]
            table = state_api.query(chk, "count", state="count")
            # what epoch n+1 already wrote (prepared, not committed): its files exist on disk
            acks = self.master.coordinator.epochs[prepared[0]].acks.values()
            newer = {}
            for info in acks:
                for f in info.files:
                    path = chk / f.path
                    assert path.is_file()
                    t = pq.read_table(path).to_pylist()
                    newer.update({pickle.loads(r["key"]): pickle.loads(r["value"]) for r in t
                                  if r["state"] == "count" and r["value"] is not None})
            seen.append((n, prepared[0], table, newer))
        return real(self, name)

    monkeypatch.setattr(SimDriver, "fail_point", spy)
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out", parallelism=3, mode=mode)
    p.checkpoint.num_retained = 100
    # tracker epochs close on local-tracker flushes (every 5 ms): read slowly enough for several
    sim_run(p, chk, seed=11, source_rate=2_000.0 if mode == "tracker" else 20_000.0)
    assert len(seen) >= 2, "the run must prepare several epochs after a completed one"
    differs = 0
    for n, n1, table, newer in seen:
        assert n1 > n
        assert set(table.column("epoch").to_pylist()) <= {n}
        got = {k: v for (_s, k), v in as_dict(table).items()}
        assert got == committed(storage, n), f"query during prepare of {n1} is not epoch {n}"
        differs += any(got.get(k) != v for k, v in newer.items())
    assert differs, "no prepared epoch changed any value: the test could not tell epochs apart"


def test_any_retained_epoch_is_queryable_and_equals_the_reference(tmp_path):
    chk = tmp_path / "chk"
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out", parallelism=2)
    p.checkpoint.num_retained = 100
    sim_run(p, chk, seed=4)
    storage = LocalCheckpointStorage(chk)
    ref = Reference(p)
    epochs = storage.list_checkpoints()
    assert len(epochs) >= 3
    for e in epochs:
        m, _ = storage.load_manifest(e)
        ref.feed({u: {int(k): v for k, v in s["offsets"].items()} for u, s in m["sources"].items()})
        table = state_api.query(chk, "count", epoch=e)
        assert as_dict(table) == {("count", k): v for k, v in ref.state()["count"]["count"].items()}
        assert set(table.column("epoch").to_pylist()) <= {e}
    latest = state_api.query(chk, "count")
    assert set(latest.column("epoch").to_pylist()) == {epochs[-1]}


def test_query_table_shape_and_one_key(tmp_path):
    _p, _r, sp = with_savepoint(tmp_path)
    table = state_api.query(tmp_path / "chk", "count")
    assert table.column_names == ["epoch", "operator", "state", "key_group", "subtask", "key", "value",
                                  "key_pickle", "value_pickle"]
    assert table.schema.field("key").type == pa.string() and table.schema.field("value").type == pa.int64()
    rows = table.to_pylist()
    assert {r["key"] for r in rows} == {f"k{i}" for i in range(KEYS)}
    for r in rows:
        assert pickle.loads(r["key_pickle"]) == r["key"] and pickle.loads(r["value_pickle"]) == r["value"]
        assert r["subtask"] == r["key_group"] * 2 // 13
    one = state_api.query(tmp_path / "chk", "count", key="k3")
    assert one.num_rows == 1 and one.to_pylist()[0]["key"] == "k3"
    assert state_api.query(tmp_path / "chk", "count", key="no-such-key").num_rows == 0
    # a savepoint folder is queryable the same way, and holds the same state as its checkpoint
    assert as_dict(state_api.query(sp, "count")) == as_dict(table)


def test_query_bad_inputs(tmp_path):
    with_savepoint(tmp_path)
    chk = tmp_path / "chk"
    with pytest.raises(CheckpointError, match=r"operator uid 'nope' has no keyed state .*\['count'\]"):
        state_api.query(chk, "nope")
    with pytest.raises(CheckpointError, match=r"epoch 999 is not retained .*retained epochs"):
        state_api.query(chk, "count", epoch=999)
    with pytest.raises(CheckpointError, match="does not exist"):
        state_api.query(tmp_path / "missing", "count")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no completed checkpoint"):
        state_api.query(tmp_path / "empty", "count")


def test_values_arrow_cannot_type_come_back_as_json_text(tmp_path):
    from epochstream.state import _column

    assert _column([1, 2]).type == pa.int64()
    mixed = _column([1, "a", (1, 2)])
    assert mixed.type == pa.string() and mixed.to_pylist() == ["1", '"a"', "[1, 2]"]


# ---------------------------------------------------------------- CLI (in-process)


JOB = '''
from pathlib import Path
from epochstream import CheckpointConfig, FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

class Count(KeyedProcessFunction):
    def open(self, ctx):
        self.count = ctx.state(ValueStateDescriptor("count", default=0))
    def process(self, value, ctx):
        self.count.update(self.count.value() + 1)
        return ((ctx.key, self.count.value()),)

def job():
    p = Pipeline("cli-sp", parallelism=2, max_parallelism=13, checkpoint=CheckpointConfig(interval=0.0005))
    p.from_collection([(f"k{i % 5}", i) for i in range(400)], uid="src").key_by(lambda r: r[0]).process(
        Count(), uid="count").sink(FileSink(Path(__file__).parent / "out"), uid="out")
    return p
'''


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_savepoint_list_dispose_restore_and_query(tmp_path, capsys):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    code, out, err = run_cli(capsys, "run", f"{job}:job", "--deployment", "sim", "--checkpoint-dir", tmp_path / "chk",
                             "--savepoint-dir", tmp_path / "sp", "--stop-with-savepoint", "--json")
    assert code == 0, err
    sp = json.loads(out)["savepoints"][-1]
    code, out, err = run_cli(capsys, "savepoint", "list", tmp_path / "sp", "--json")
    assert code == 0 and [r["path"] for r in json.loads(out)["savepoints"]] == [sp]
    # restore at parallelism 3 (a fresh checkpoint dir), then query the result
    code, out, err = run_cli(capsys, "run", f"{job}:job", "--deployment", "sim", "-p", "3", "--from-savepoint", sp,
                             "--checkpoint-dir", tmp_path / "chk3", "--json")
    assert code == 0, err
    assert json.loads(out)["metrics"]["parallelism"] == 3
    code, out, err = run_cli(capsys, "state", "query", "--checkpoint-dir", tmp_path / "chk3", "--operator", "count",
                             "--key", "k1", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [(r["key"], r["value"]) for r in rows] == [("k1", 80)]
    code, out, err = run_cli(capsys, "state", "query", "--checkpoint-dir", tmp_path / "chk3", "--operator", "count")
    assert code == 0 and "k4" in out and "(epoch" in out
    # dispose refuses a checkpoint, removes a savepoint
    chk3 = LocalCheckpointStorage(tmp_path / "chk3")
    chk_n = chk3.checkpoint_dir(chk3.list_checkpoints()[-1])
    code, out, err = run_cli(capsys, "savepoint", "dispose", chk_n)
    assert code == 2 and "is not a savepoint" in err and chk_n.is_dir()
    code, out, err = run_cli(capsys, "savepoint", "dispose", sp)
    assert code == 0 and not Path(sp).exists()
    code, out, err = run_cli(capsys, "savepoint", "list", tmp_path / "sp")
    assert code == 0 and "no savepoints" in out
    code, out, err = run_cli(capsys, "state", "query", "--checkpoint-dir", tmp_path / "chk3", "--operator", "nope")
    assert code == 2 and "'nope'" in err
    code, out, err = run_cli(capsys, "savepoint", "no-such-job")
    assert code == 2 and "no running job 'no-such-job'" in err


def test_cli_key_parsing():
    from epochstream.cli import _parse_key

    assert _parse_key("k1") == "k1" and _parse_key("5") == 5 and _parse_key('"5"') == "5"
    assert _parse_key("[1, [2, \"a\"]]") == (1, (2, "a"))


# ---------------------------------------------------------------- bad inputs


def test_savepoint_of_another_job_is_refused(tmp_path):
    from pipelines import list_state

    _p, _r, sp = with_savepoint(tmp_path)
    other = list_state(n=N, keys=KEYS, out=tmp_path / "out2", parallelism=2, max_parallelism=13)
    with pytest.raises(CheckpointError) as exc:
        sim_run(other, tmp_path / "chk2", restore=str(sp))
    msg = str(exc.value)
    assert "savepoint" in msg and "['count']" in msg and "'running-count'" in msg and "'list-state'" in msg
    assert "--allow-non-restored-state" in msg
    assert LocalCheckpointStorage(tmp_path / "chk2").list_checkpoints() == []


def test_missing_and_corrupt_savepoint_objects(tmp_path):
    _p, _r, sp = with_savepoint(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(sp, broken)
    victim = sorted(broken.rglob("*.parquet"))[0]
    victim.unlink()
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out2", parallelism=3, max_parallelism=13)
    with pytest.raises(CheckpointError, match=f"{victim.name}.*is missing"):
        sim_run(p, tmp_path / "chk2", restore=str(broken))
    assert LocalCheckpointStorage(tmp_path / "chk2").list_checkpoints() == []
    shutil.rmtree(broken)
    shutil.copytree(sp, broken)
    victim = sorted(broken.rglob("*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    with pytest.raises(CheckpointError, match="damaged"):
        sim_run(p, tmp_path / "chk3", restore=str(broken))
    (broken / METADATA).write_text('{"format": "epochstream-checkpoint", "format_version": 2, "job": ')
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        sim_run(p, tmp_path / "chk4", restore=str(broken))
    # the original savepoint is untouched by all of it and still restores
    sim_run(p, tmp_path / "chk5", restore=str(sp))
    chk5 = LocalCheckpointStorage(tmp_path / "chk5")
    assert committed(chk5, chk5.list_checkpoints()[-1]) == {
        f"k{i}": sum(1 for j in range(N) if j % KEYS == i) for i in range(KEYS)}


def test_older_manifest_formats(tmp_path):
    """Format 1 (before operator state, split counts and job ids) is read and migrated; a format
    older than that is refused with the versions this epochstream reads, and left as it was."""
    _p, _r, sp = with_savepoint(tmp_path)
    v1 = tmp_path / "v1"
    shutil.copytree(sp, v1)
    m = json.loads((v1 / METADATA).read_text())
    m["format_version"] = 1
    del m["checksum"]  # format 1 had none: read unverified, with a warning
    for src in m["sources"].values():
        del src["splits"]
    del m["job_id"]
    for op in m["operators"].values():
        op.pop("operator_state", None)
    (v1 / METADATA).write_text(json.dumps(m))
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out2", parallelism=3, max_parallelism=13)
    sim_run(p, tmp_path / "chk2", restore=str(v1))
    new = LocalCheckpointStorage(tmp_path / "chk2")
    assert new.latest()[0]["format_version"] == FORMAT_VERSION
    assert committed(new, new.list_checkpoints()[-1]) == {f"k{i}": sum(1 for j in range(N) if j % KEYS == i)
                                                          for i in range(KEYS)}
    m["format_version"] = 0
    text = json.dumps(m)
    (v1 / METADATA).write_text(text)
    with pytest.raises(CheckpointError, match=r"format version 0 is not supported \(it is older than the oldest "
                                              rf"format .* reads versions 1 to {FORMAT_VERSION}\)"):
        sim_run(p, tmp_path / "chk3", restore=str(v1))
    assert (v1 / METADATA).read_text() == text


def test_parallelism_and_max_parallelism_on_restore(tmp_path):
    _p, _r, sp = with_savepoint(tmp_path)
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out2", parallelism=2, max_parallelism=13)
    with pytest.raises(ParallelismError, match="parallelism 14 is above max_parallelism 13"):
        sim_run(p, tmp_path / "chk2", restore=str(sp), parallelism=14)
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out2", parallelism=2, max_parallelism=16)
    with pytest.raises(CheckpointError, match=r"max_parallelism 13, the job now has 16.*--max-parallelism 13"):
        sim_run(p, tmp_path / "chk3", restore=str(sp))
    assert not (tmp_path / "chk2").exists() or not LocalCheckpointStorage(tmp_path / "chk2").list_checkpoints()


def test_an_unusable_savepoint_target_fails_the_savepoint_not_the_job(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the savepoint dir should be")
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out", parallelism=2)
    r = sim_run(p, tmp_path / "chk", seed=3, savepoint_dir=str(blocker), stop_with_savepoint=True)
    assert r.savepoints == []
    storage = LocalCheckpointStorage(tmp_path / "chk")
    assert committed(storage, storage.list_checkpoints()[-1]) == {
        f"k{i}": sum(1 for j in range(N) if j % KEYS == i) for i in range(KEYS)}


def test_dispose_and_list_refuse_what_is_not_a_savepoint(tmp_path):
    with_savepoint(tmp_path)
    with pytest.raises(CheckpointError, match="is not a savepoint"):
        dispose_savepoint(tmp_path / "chk" / f"chk-{LocalCheckpointStorage(tmp_path / 'chk').list_checkpoints()[0]}")
    with pytest.raises(CheckpointError, match="does not exist"):
        dispose_savepoint(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match="does not exist"):
        list_savepoints(tmp_path / "nothing-here")
    damaged = tmp_path / "sp" / "savepoint-000000-1"
    damaged.mkdir()
    (damaged / METADATA).write_text("{")
    rows = list_savepoints(tmp_path / "sp")
    assert [r["status"] for r in rows].count("damaged") == 1 and [r["status"] for r in rows].count("completed") == 1


# ---------------------------------------------------------------- REST API and registry


@pytest.fixture
def rest(tmp_path):
    control = JobControl()
    control.publish(state="RUNNING", name="demo")
    server = RestServer("0123abcd" * 4, control, lambda: {"counts": {"completed": 0}, "latest": None},
                        default_target=None, token="owner-token").start()
    done = threading.Event()

    def loop():  # what the driver loop does between steps
        while not done.is_set():
            for req in control.drain():
                req.epoch = 7
                if req.target and "fail" in req.target:
                    req.fail("writing the savepoint failed: disk full")
                else:
                    req.complete(f"{req.target}/savepoint-0123ab-7" if req.target else "chk-7")
            time.sleep(0.01)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield server, control
    done.set()
    t.join()
    server.close()


def test_rest_api(rest, tmp_path):
    server, control = rest
    client = RestClient(server.endpoint, token="owner-token")
    jid = client.job_id()
    assert jid == "0123abcd" * 4
    assert client.call("GET", f"/jobs/{jid}")["state"] == "RUNNING"
    assert client.call("GET", f"/jobs/{jid}/checkpoints")["counts"] == {"completed": 0}
    doc = client.savepoint(jid, str(tmp_path / "sp"))
    assert doc["status"]["id"] == COMPLETED and doc["operation"]["location"].endswith("savepoint-0123ab-7")
    failed = client.savepoint(jid, str(tmp_path / "fail"))
    assert failed["status"]["id"] == "FAILED" and "disk full" in failed["operation"]["failure-cause"]["stack-trace"]
    with pytest.raises(RestError, match="HTTP 400: no target directory"):
        client.savepoint(jid, None)
    with pytest.raises(RestError, match="HTTP 404"):
        client.call("GET", "/jobs/feedbeef/checkpoints")
    with pytest.raises(RestError, match="HTTP 404: no savepoint request nope"):
        client.call("GET", f"/jobs/{jid}/savepoints/nope")
    stop = client.savepoint(jid, None, stop=True, savepoint=False)
    assert stop["status"]["id"] == COMPLETED and stop["stop"] is True
    control.publish(state="FINISHED")
    with pytest.raises(RestError, match="HTTP 409"):
        client.savepoint(jid, str(tmp_path / "sp"))
    with pytest.raises(RestError, match="cannot reach the job"):
        RestClient("http://127.0.0.1:9", timeout=2).job_id()


def test_job_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("EPOCHSTREAM_HOME", str(tmp_path / "home"))
    jobs.register({"id": "aaaa1111", "name": "alpha", "endpoint": "http://127.0.0.1:1", "pid": os.getpid(),
                   "started_at": 1})
    jobs.register({"id": "bbbb2222", "name": "alpha", "endpoint": "http://127.0.0.1:2", "pid": os.getpid(),
                   "started_at": 2})
    jobs.register({"id": "cccc3333", "name": "gone", "endpoint": "http://127.0.0.1:3", "pid": 2**22 + 12345,
                   "started_at": 3})
    assert jobs.resolve("aaaa1111") == ("http://127.0.0.1:1", "aaaa1111")
    assert jobs.resolve("bbbb") == ("http://127.0.0.1:2", "bbbb2222")
    assert jobs.resolve("http://127.0.0.1:5/") == ("http://127.0.0.1:5", None)
    with pytest.raises(jobs.JobNotFoundError, match="names 2 running jobs"):
        jobs.resolve("alpha")
    with pytest.raises(jobs.JobNotFoundError, match="no running job 'gone'"):
        jobs.resolve("gone")  # its process is not alive: a stale file
    jobs.unregister("aaaa1111")
    assert jobs.resolve("alpha") == ("http://127.0.0.1:2", "bbbb2222")


def test_savepoints_and_queries_on_s3(tmp_path, s3_url):
    """Checkpoints and savepoints in S3 (moto's real HTTP server): the savepoint is written through
    the object store, listed, queried, restored at another parallelism into a local checkpoint dir,
    and disposed."""
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out", parallelism=2, max_parallelism=13)
    r = sim_run(p, f"{s3_url}/chk", seed=2, duration=0.5 * N / (2 * 10_000.0), source_rate=10_000.0,
                savepoint_dir=f"{s3_url}/sp", stop_with_savepoint=True)
    sp = r.savepoints[-1]
    assert sp.startswith("s3://") and "/sp/savepoint-" in sp
    assert [row["path"] for row in list_savepoints(f"{s3_url}/sp")] == [sp]
    assert as_dict(state_api.query(sp, "count")) == as_dict(state_api.query(f"{s3_url}/chk", "count"))
    p3 = running_count(n=N, keys=KEYS, out=tmp_path / "out3", parallelism=3, max_parallelism=13)
    sim_run(p3, tmp_path / "chk3", seed=3, restore=sp)
    got = {k: v for (_s, k), v in as_dict(state_api.query(tmp_path / "chk3", "count")).items()}
    assert got == {f"k{i}": sum(1 for j in range(N) if j % KEYS == i) for i in range(KEYS)}
    dispose_savepoint(sp)
    assert list_savepoints(f"{s3_url}/sp") == []
