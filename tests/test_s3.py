"""S3 checkpoint storage and the S3 FileSink (backends/s3.py) against moto's real HTTP server.

Every request goes over HTTP through boto3 to ``ThreadedMotoServer`` (tests/s3server.py);
faults come from a proxy in front of it that answers 500/503, drops connections, delays
requests or their responses. Nothing is stubbed: retries, timeouts, error parsing and the
conditional manifest PUT are the production code paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from epochstream import FileSink
from epochstream.backends import location, open_objects, open_storage
from epochstream.backends.objects import (
    METADATA,
    ObjectExistsError,
    ObjectMissingError,
    StorageAccessError,
    StorageError,
)
from epochstream.backends.s3 import S3CheckpointStorage, S3Objects, S3Options, S3Path
from epochstream.backends.sinks import STAGING
from epochstream.snapshot.manifest import FORMAT, FORMAT_VERSION, CheckpointError
from pipelines import check_running_counts, running_count, sim_run
from s3server import Fault, wait_for

ROWS = [(1, b"k1", "count", b"\x80\x04K\x01."), (7, b"k2", "count", None)]
JOB = {"job": "s3-test", "parallelism": 1, "max_parallelism": 128, "mode": "aligned", "deployment": "sim"}
#: a job of a few epochs (every request goes over HTTP: keep them few)
N, INTERVAL = 200, 0.0015
#: fast retries for fault tests: the policy's shape, not its patience, is under test
FAST = dict(max_attempts=4, backoff_initial=0.01, backoff_max=0.05)


def manifest(epoch: int, refs=(), **extra) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **JOB, "epoch": epoch, "kind": "checkpoint",
            "operators": {"op": {"kind": "process", "states": {"count": "value"},
                                 "files": [r.to_json() for r in refs]}} if refs else {},
            "sources": {}, "sinks": {}, **extra}


def objects(moto_s3, url: str) -> dict[str, bytes]:
    """Every object under an s3:// URL, read with a separate plain boto3 client."""
    loc = S3Path.parse(url)
    c = moto_s3.client()
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.key + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(loc.key) + 1:]] = c.get_object(Bucket=loc.bucket, Key=o["Key"])["Body"].read()
    return out


def via(proxy, url: str, **options) -> S3CheckpointStorage:
    return S3CheckpointStorage(url, S3Options(endpoint_url=proxy.url, **{**FAST, **options}))


# ---------------------------------------------------------------- URLs and layout


def test_urls_select_s3_everywhere(s3_url):
    assert isinstance(open_storage(s3_url), S3CheckpointStorage)
    assert isinstance(open_storage(s3_url.replace("s3://", "s3a://")), S3CheckpointStorage)
    assert isinstance(open_objects(s3_url), S3Objects)
    loc = location(s3_url)
    assert loc == S3Path.parse(s3_url) and str(loc / "chk-3" / METADATA) == f"{s3_url}/chk-3/{METADATA}"
    assert (loc / "chk-3").parent == loc and (loc / "chk-3").name == "chk-3"
    with pytest.raises(ValueError, match="needs a bucket"):
        S3Path.parse("s3:///prefix")
    with pytest.raises(ValueError, match="known schemes"):
        open_storage("gs://bucket/x")


def test_state_objects_round_trip_with_the_local_layout(s3_url, moto_s3):
    storage = open_storage(s3_url)
    ref = storage.pre_commit("count/op", 2, 5, "r1.0", ROWS, (0, 63), False)
    assert ref.path == "shared/count%2Fop/2/e5-ar1.0.parquet"
    assert set(objects(moto_s3, s3_url)) == {ref.path}
    m = manifest(5, [ref])
    m["operators"] = {"count/op": m.pop("operators")["op"]}
    folder = storage.commit(m)
    assert folder == storage.checkpoint_dir(5) and str(folder) == f"{s3_url}/chk-5"
    assert storage.list_checkpoints() == [5]
    for where in (5, str(folder), f"{folder}/{METADATA}"):
        loaded, root = storage.load_manifest(where)
        assert {k: v for k, v in loaded.items() if k != "checksum"} == m and root == storage.root
    assert list(storage.read_operator_rows(m, storage.root, "count/op")) == ROWS
    assert list(storage.read_operator_rows(m, storage.root, "count/op", (5, 10))) == ROWS[1:]


def test_manifest_commit_never_overwrites_a_completed_checkpoint(s3_url, moto_s3):
    storage = open_storage(s3_url)
    first = manifest(3, created_at="first")
    storage.commit(first)
    storage.commit(first)  # a re-issued identical commit is fine
    with pytest.raises(ObjectExistsError) as ei:
        storage.commit(manifest(3, created_at="second"))
    assert f"{s3_url}/chk-3" in str(ei.value) and "never overwritten" in str(ei.value)
    assert json.loads(objects(moto_s3, s3_url)[f"chk-3/{METADATA}"])["created_at"] == "first"


def test_retention_garbage_collection_and_orphans(s3_url, moto_s3):
    storage = open_storage(s3_url)
    refs = {e: storage.pre_commit("op", 0, e, "a", ROWS, (0, 127), True) for e in (1, 2, 3, 4)}
    for e in (1, 2):
        storage.commit(manifest(e, [refs[e]]))
    storage.discard(1)
    assert storage.list_checkpoints() == [2]
    assert storage.collect_garbage([manifest(2, [refs[2]])], keep_after=2) == 1  # e1 goes, e3/e4 may be needed
    assert set(objects(moto_s3, s3_url)) == {f"chk-2/{METADATA}", refs[2].path, refs[3].path, refs[4].path}
    storage.recover(2)  # at restart: captures of epochs that never completed are garbage
    assert set(objects(moto_s3, s3_url)) == {f"chk-2/{METADATA}", refs[2].path}


# ---------------------------------------------------------------- bad input: clear errors, nothing lost


def _job(tmp_path, s3_url, **knobs):
    out = f"{s3_url}/out"
    p = running_count(n=N, parallelism=2, interval=INTERVAL, out=out, incremental=False, emit_ids=True, **knobs)
    result = sim_run(p, f"{s3_url}/chk", seed=3)
    assert len(result.completed_epochs) >= 3
    return p, out, open_storage(f"{s3_url}/chk"), result


def _restore(s3_url, target, label="again"):
    p = running_count(n=N, parallelism=2, interval=INTERVAL, out=f"{s3_url}/out-{label}", incremental=False)
    return sim_run(p, f"{s3_url}/chk-{label}", seed=4, restore=str(target))


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_damaged_state_object_is_named_and_a_repaired_one_restores(tmp_path, s3_url, moto_s3, damage):
    _p, out, storage, _r = _job(tmp_path, s3_url)
    epoch = storage.list_checkpoints()[-1]
    m, _root = storage.load_manifest(epoch)
    ref = m["operators"]["count"]["files"][0]
    loc = storage.root / ref["path"]
    c = moto_s3.client()
    good = c.get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read()
    if damage == "missing":
        c.delete_object(Bucket=loc.bucket, Key=loc.key)
    else:
        bad = good[:40] + bytes([good[40] ^ 1]) + good[41:]
        c.put_object(Bucket=loc.bucket, Key=loc.key, Body=bad)
    with pytest.raises(CheckpointError) as ei:
        _restore(s3_url, storage.checkpoint_dir(epoch))
    assert str(loc) in str(ei.value)
    assert ("missing" if damage == "missing" else "damaged") in str(ei.value)
    # nothing lost: with the object put back, the same checkpoint restores and the job completes
    c.put_object(Bucket=loc.bucket, Key=loc.key, Body=good)
    result = _restore(s3_url, storage.checkpoint_dir(epoch), "repaired")
    assert result.restarts == 0


@pytest.mark.parametrize("damage", ["truncated", "older-version"])
def test_damaged_or_older_manifest_on_s3(tmp_path, s3_url, moto_s3, damage):
    _p, out, storage, _r = _job(tmp_path, s3_url)
    *_, prev, newest = storage.list_checkpoints()
    loc = storage.checkpoint_dir(newest) / METADATA
    c = moto_s3.client()
    text = c.get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read().decode()
    if damage == "truncated":
        text = text[: len(text) // 2]
    else:
        text = json.dumps({**json.loads(text), "format_version": 0})
    c.put_object(Bucket=loc.bucket, Key=loc.key, Body=text.encode())
    with pytest.raises(CheckpointError) as ei:
        storage.load_manifest(newest)
    assert str(loc) in str(ei.value)
    if damage == "older-version":
        assert "format version 0 is not supported" in str(ei.value)
    # latest skips it, and resuming rewrites the epoch after setting the damaged one aside
    assert storage.latest()[0]["epoch"] == prev
    p = running_count(n=N, parallelism=2, interval=INTERVAL, out=out, incremental=False, emit_ids=True)
    result = sim_run(p, f"{s3_url}/chk", seed=5, restore="latest")
    assert result.completed_epochs[0] == prev + 1
    aside = [k for k in objects(moto_s3, f"{s3_url}/chk") if k.startswith(f"chk-{newest}.damaged-")]
    assert aside, "the damaged manifest is kept aside, not deleted"
    assert check_running_counts(FileSink(f"{out}/counts").read(), range(N)) == []


def test_wrong_credentials_fail_at_once_naming_bucket_and_key(s3_url, moto_s3, fault_proxy, monkeypatch):
    """moto with authentication on: a key it does not know, then a wrong secret."""
    iam = moto_s3.iam()
    iam.create_user(UserName="writer")
    iam.put_user_policy(UserName="writer", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="writer")["AccessKey"]
    bucket = S3Path.parse(s3_url).bucket
    moto_s3.require_auth(True)
    try:
        for key_id, secret, code in (("AKIAUNKNOWN000000000", "x" * 40, "InvalidAccessKeyId"),
                                     (key["AccessKeyId"], "wrong" * 8, "SignatureDoesNotMatch")):
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
            storage = via(fault_proxy, s3_url, max_attempts=5)
            before = len(fault_proxy.log)
            with pytest.raises(StorageAccessError) as ei:
                storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)
            msg = str(ei.value)
            assert code in msg and repr(bucket) in msg and "shared/op/0/e1-aa.parquet" in msg, msg
            assert "credentials" in msg
            assert len(fault_proxy.log) - before == 1  # refused requests are not retried
            # a whole job fails at once too, without restarts, and writes nothing
            p = running_count(n=50, parallelism=1, out=f"{s3_url}/out")
            p.restart_attempts = 3
            with pytest.raises(StorageAccessError):
                sim_run(p, f"{s3_url}/chk", seed=1)
        # the right key works against the same authenticating server (PUT and GET only: moto
        # 5.2's signature check rejects every signed ListObjectsV2, so no whole job here)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        storage = via(fault_proxy, s3_url)
        ref = storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)
        assert storage.read_state(ref).num_rows == len(ROWS)
    finally:
        moto_s3.require_auth(False)


def test_missing_bucket_is_a_clear_error(s3_env):
    storage = open_storage("s3://no-such-bucket-anywhere/chk")
    assert storage.exists() is False
    with pytest.raises(StorageAccessError, match="bucket 'no-such-bucket-anywhere' does not exist"):
        storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)


# ---------------------------------------------------------------- faults: retried, then a clear error


@pytest.mark.parametrize("method,path,status,code", [
    ("PUT", r"/shared/", 503, "SlowDown"),
    ("PUT", r"/shared/", 500, "InternalError"),
    ("GET", r"/shared/", 503, "ServiceUnavailable"),
    ("PUT", r"/_metadata", 503, "SlowDown"),
    ("GET", r"^/es-[^/]+$", 500, "InternalError"),  # LIST
])
def test_throttling_and_server_errors_are_retried(s3_url, fault_proxy, method, path, status, code):
    storage = via(fault_proxy, s3_url)
    fault_proxy.add(Fault(method, path, "error", status, code, times=3))
    ref = storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)
    storage.commit(manifest(1, [ref]))
    assert storage.list_checkpoints() == [1]
    assert list(storage.read_operator_rows(storage.load_manifest(1)[0], storage.root, "op")) == ROWS
    assert fault_proxy.count(method, path, "error") == 3
    assert fault_proxy.count(method, path, "forward") >= 1


def test_dropped_connections_are_retried(s3_url, fault_proxy):
    storage = via(fault_proxy, s3_url)
    fault_proxy.add(Fault("PUT", r"/shared/", "reset", times=2))
    ref = storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)
    assert storage.read_state(ref).num_rows == 2
    assert fault_proxy.count("PUT", r"/shared/", "reset") == 2


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (500, "InternalError")])
def test_retries_run_out_with_a_clear_error(s3_url, fault_proxy, status, code):
    storage = via(fault_proxy, s3_url)
    fault_proxy.add(Fault("PUT", r"/_metadata", "error", status, code, times=None))
    with pytest.raises(StorageError) as ei:
        storage.commit(manifest(1))
    msg = str(ei.value)
    assert "after 4 attempts" in msg and code in msg and f"{s3_url}/chk-1/{METADATA}" in msg
    assert not isinstance(ei.value, StorageAccessError)
    assert fault_proxy.count("PUT", r"/_metadata", "error") == 4
    fault_proxy.clear()
    assert storage.list_checkpoints() == []  # nothing half-written


def test_slow_put_is_abandoned_and_retried(s3_url, fault_proxy):
    """A PUT slower than the read timeout is given up and sent again."""
    storage = via(fault_proxy, s3_url, read_timeout=0.5)
    fault_proxy.add(Fault("PUT", r"/shared/", "delay", seconds=1.5, times=1))
    ref = storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)
    assert storage.read_state(ref).num_rows == 2
    assert wait_for(lambda: fault_proxy.count("PUT", r"/shared/") == 2)  # the slow one is logged last


def test_manifest_put_whose_response_is_lost_commits_exactly_once(s3_url, fault_proxy, moto_s3):
    """The conditional PUT succeeds on the server but its response is late: the retry meets
    412 Precondition Failed, reads the object back, finds its own bytes, and is done."""
    storage = via(fault_proxy, s3_url, read_timeout=0.5)
    fault_proxy.add(Fault("PUT", r"/_metadata", "delay_response", seconds=1.5, times=1))
    m = manifest(7, created_at="once")
    storage.commit(m)
    assert wait_for(lambda: fault_proxy.count("PUT", "_metadata") == 2)
    assert sorted(s for meth, p, s, _a in fault_proxy.log if meth == "PUT" and "_metadata" in p) == [200, 412]
    assert {k: v for k, v in storage.load_manifest(7)[0].items() if k != "checksum"} == m


def test_files_stream_whole_and_a_dropped_transfer_starts_again(s3_url, fault_proxy, tmp_path):
    """``put_file``/``get_file`` (RocksDB's SST files, streamed rather than held in memory): a file
    of several read chunks goes up and comes back whole, a dropped PUT or GET is sent again from
    the file's start, and a missing object is named."""
    store = S3Objects(s3_url, S3Options(endpoint_url=fault_proxy.url, **FAST))
    src = tmp_path / "big.sst"
    src.write_bytes(os.urandom(3 << 20))
    fault_proxy.add(Fault("PUT", r"/big\.sst$", "reset", times=1))
    fault_proxy.add(Fault("GET", r"/big\.sst$", "reset", times=1))
    loc = store.root / "files" / "big.sst"
    store.put_file(loc, src)
    back = tmp_path / "back.sst"
    back.write_bytes(b"stale bytes a retry must not keep")
    store.get_file(loc, back)
    assert back.read_bytes() == src.read_bytes()
    assert fault_proxy.count("PUT", r"/big\.sst$", "reset") == 1
    assert fault_proxy.count("GET", r"/big\.sst$", "reset") == 1
    with pytest.raises(ObjectMissingError, match="none.sst does not exist"):
        store.get_file(store.root / "files" / "none.sst", tmp_path / "none.sst")


def test_missing_object_is_not_retried(s3_url, fault_proxy):
    storage = via(fault_proxy, s3_url, max_attempts=5)
    ref = storage.pre_commit("op", 0, 1, "a", ROWS, (0, 127), True)
    storage.store.delete(storage.root / ref.path)
    before = fault_proxy.count("GET", r"/shared/")
    with pytest.raises(CheckpointError, match="is missing"):
        storage.read_state(ref)
    assert fault_proxy.count("GET", r"/shared/") - before == 1


# ---------------------------------------------------------------- the S3 FileSink


def test_s3_sink_stages_commits_idempotently_and_recovers(s3_url, moto_s3):
    sink = FileSink(f"{s3_url}/out")
    a = sink.pre_commit("out", 0, 1, "x", [1, 2])
    b = sink.pre_commit("out", 1, 1, "x", [3])
    later = sink.pre_commit("out", 0, 2, "x", [4])
    assert sink.read() == []
    assert sink.commit([a]) == 1
    assert sink.read() == [1, 2]
    # a crash between the copy and the delete of a move: the staged object is still there
    loc = S3Path.parse(f"{s3_url}/out")
    c = moto_s3.client()
    c.copy_object(Bucket=loc.bucket, Key=f"{loc.key}/{sink.final_name(b)}",
                  CopySource={"Bucket": loc.bucket, "Key": f"{loc.key}/{b}"})
    sink.recover("out", [a, b])  # re-issued commit of the restored epoch; epoch 2 is dropped
    assert sink.read() == [1, 2, 3]
    assert not any(k.startswith(STAGING) for k in objects(moto_s3, f"{s3_url}/out"))
    assert sink.commit([a, b]) == 0
    with pytest.raises(FileNotFoundError, match="never committed"):
        sink.commit([later])


# ---------------------------------------------------------------- CLI


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "epochstream.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_cli_lists_checkpoints_on_s3(tmp_path, s3_url, s3_env):
    _job(tmp_path, s3_url)
    proc = _cli("checkpoints", "list", "--checkpoint-dir", f"{s3_url}/chk", "--json", env=s3_env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["checkpoint_dir"] == f"{s3_url}/chk"
    assert [r["status"] for r in doc["checkpoints"]] == ["completed"] * len(doc["checkpoints"])
    assert doc["checkpoints"][-1]["path"].startswith(f"{s3_url}/chk/chk-")
    missing = _cli("checkpoints", "list", "--checkpoint-dir", "s3://no-such-bucket-x/chk", env=s3_env)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_job_with_failures_exhausting_retries_fails_over_and_finishes(tmp_path, s3_url, fault_proxy, monkeypatch):
    """Manifest PUTs that keep failing abort epochs; the job fails over and, once S3 is back,
    finishes with every count exact."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    monkeypatch.setenv("EPOCHSTREAM_S3_MAX_ATTEMPTS", "2")
    fault_proxy.add(Fault("PUT", r"/chk-\d+/_metadata", "error", 503, "SlowDown", times=3))
    out = f"{s3_url}/out"
    p = running_count(n=N, parallelism=2, interval=INTERVAL, out=out, tolerable_failed=0, emit_ids=True)
    p.restart_attempts = 5
    result = sim_run(p, f"{s3_url}/chk", seed=3)
    assert result.restarts >= 1
    assert any("SlowDown" in f["reason"] for f in result.metrics["failovers"])
    assert check_running_counts(FileSink(f"{out}/counts").read(), range(N)) == []


def test_restore_across_schemes_is_refused_by_name(s3_url, tmp_path):
    with pytest.raises(CheckpointError, match="is not an S3 URL"):
        open_storage(s3_url).load_manifest(str(tmp_path / "chk-1"))
    with pytest.raises(CheckpointError, match="is not a local path"):
        open_storage(str(tmp_path)).load_manifest(f"{s3_url}/chk-1")
