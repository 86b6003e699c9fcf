"""An S3 outage longer than the retry budget in the middle of a commit (issue 14, item 5).

moto's S3 server runs as a real HTTP server in a child process; the tests' fault proxy
(``s3server.FaultProxy``) sits in front of it. When the job's request at the chosen moment
arrives (the PUT of an epoch's manifest, after every task's pre-commit; or the copy of the
second part file of an epoch's sink commit, after its manifest), S3 goes down: that request
and every later one has its connection closed without an answer, until the test ends the
outage. The job must fail with a clear error once tenacity's retries are used up, leave the
last completed checkpoint intact, and a restart once S3 is back must be exact under the
oracle (recorded order), in both modes.
"""

from __future__ import annotations

import time

import pytest

from epochstream.backends import open_storage
from epochstream.deploy.failures import JobFailedError
from epochstream.oracle import check_exactly_once
from pipelines import running_count, sim_run
from s3server import FAKE_KEY, FAKE_SECRET, REGION, Fault, FaultProxy

pytestmark = pytest.mark.slow

N, ATTEMPTS = 200, 3
#: where the outage starts: (request method, path regex, matching requests let through first)
MOMENTS = {
    "before-manifest": ("PUT", r"/chaos/chk/chk-\d+/_metadata", 1),  # epoch 2's manifest: pre-committed, not yet one
    "mid-sink-commit": ("PUT", r"/chaos/out/counts/part-", 1),  # epoch 1: manifest written, one part moved
}


@pytest.fixture
def s3_proxy(moto_s3_process, monkeypatch):
    proxy = FaultProxy(moto_s3_process.port)
    env = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "AWS_DEFAULT_REGION": REGION,
           "AWS_ENDPOINT_URL": proxy.url, "EPOCHSTREAM_S3_MAX_ATTEMPTS": str(ATTEMPTS)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    yield proxy
    proxy.stop()


# both modes and both moments, in two runs (each costs ~30 s of S3 round trips on a loaded machine)
@pytest.mark.parametrize(("mode", "moment"), [("aligned", "before-manifest"), ("tracker", "mid-sink-commit")])
def test_s3_outage_mid_commit_fails_clearly_keeps_the_checkpoint_and_resumes_exactly(
        mode, moment, moto_s3_process, s3_proxy, request):
    bucket = moto_s3_process.new_bucket(request.node.name)
    method, path, skip = MOMENTS[moment]
    seen: dict = {}

    def build():
        p = running_count(n=N, parallelism=2, mode=mode, interval=0.0015)
        p.restart_attempts = 0  # the outage outlasts any restart: the job must fail, naming it
        return p

    def run(p, chk, failing):
        if not failing:
            return sim_run(p, chk, seed=3)
        s3_proxy.add(Fault(method, path, "outage", times=1, skip=skip))
        started = time.monotonic()
        with pytest.raises(JobFailedError) as failed:
            sim_run(p, chk, seed=3)
        seen["error"], seen["failed_after"] = str(failed.value), time.monotonic() - started
        assert s3_proxy.down()  # still down when the job gave up: longer than the retry budget
        s3_proxy.end_outage()
        storage = open_storage(chk)
        found = storage.latest()
        assert found is not None, "no completed checkpoint survived the outage"
        manifest, root = found
        for uid in manifest["operators"]:  # every state file there and matching its checksum
            list(storage.read_operator_rows(manifest, root, uid))
        seen["latest"] = int(manifest["epoch"])
        return sim_run(p, chk, seed=3, restore="latest")

    report = check_exactly_once(build, run, f"s3://{bucket}/run")
    assert report.ok, report.to_json()
    assert report.lost == report.duplicated == 0 and report.records_committed == N
    assert f"failed after {ATTEMPTS} attempts" in seen["error"], seen["error"]
    assert ("_metadata" if moment == "before-manifest" else "part-") in seen["error"], seen["error"]
    assert seen["latest"] >= 1
    (start, end), = s3_proxy.outages
    assert s3_proxy.count(method, path, "outage") >= ATTEMPTS
    print(f"\n{mode} {moment}: job failed {seen['failed_after']:.2f} s after start; outage lasted "
          f"{end - start:.2f} s; restored epoch {seen['latest']}; lost {report.lost}, duplicated "
          f"{report.duplicated}, ok {report.ok}; error: {seen['error'][:400]}")
