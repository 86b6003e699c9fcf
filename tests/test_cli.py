"""The ``epochstream`` command line, end to end (slow suite: ``pytest -m slow``).

Every test runs the CLI in a subprocess on a small job file written into ``tmp_path``.
Exit codes are the CLI's contract (cli.py): 0 pass, 1 exactly-once violation, 2 bad input,
3 job failed.

Entry points: commands that never touch Parquet (``--help``, bad input rejected before a
run) go through ``python -m epochstream.cli`` and the ``epochstream`` console script. Commands
that run jobs go through ``epochstream.cli.main`` in a subprocess that leaves with
``os._exit`` after flushing (``REAL_EXIT=False`` below): pyarrow's thread pools sometimes
abort the interpreter at teardown ("terminate called without an active exception", exit
-6/134) after the command has finished and printed its result, which would make every test
here flaky; ``test_cli_exit_code_survives_interpreter_teardown`` pins that bug separately.
Apart from the teardown, the wrapper behaves like ``sys.exit(main())``.
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "epochstream.cli"]
#: ``sys.exit(main())`` without the interpreter teardown (see the module docstring)
_NO_TEARDOWN = textwrap.dedent("""
    import os, sys
    from epochstream.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:  # what the interpreter does with SystemExit
        code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
""")
CLI_NO_TEARDOWN = [sys.executable, "-c", _NO_TEARDOWN]
EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_FAILED = 0, 1, 2, 3
EXIT_NOT_INJECTED = 4

#: records of the small job: 500 ids over 5 keys
SMALL_N, SMALL_KEYS = 500, 5

JOB = textwrap.dedent('''
    """A job file for the CLI tests: functions that return a Pipeline."""
    from pathlib import Path

    from epochstream import CheckpointConfig, FileSink, KeyedProcessFunction, Pipeline, ValueStateDescriptor

    OUT = Path({out!r})
    NOT_A_FUNCTION = 3


    class Count(KeyedProcessFunction):
        def open(self, ctx):
            self.count = ctx.state(ValueStateDescriptor("count", default=0))

        def process(self, value, ctx):
            n = self.count.value() + 1
            self.count.update(n)
            return ((ctx.key, n),)


    class Raises(Count):
        def process(self, value, ctx):
            if value[1] == 250:
                raise ValueError("boom at id 250")
            return super().process(value, ctx)


    def _job(name, n, keys, fn, interval, out):
        p = Pipeline(name, parallelism=2, checkpoint=CheckpointConfig(interval=interval), batch_size=8,
                     restart_attempts=2, restart_delay=0.05)
        (
            p.from_collection([(f"k{{i % keys}}", i) for i in range(n)], uid="src")
            .key_by(lambda r: r[0])
            .process(fn, uid="count")
            .sink(FileSink(OUT / out), uid="counts")
        )
        return p


    def small():
        # sim: 500 records take a few virtual ms, so a 1 ms interval gives several epochs
        return _job("cli-small", {small_n}, {small_keys}, Count(), 0.001, "small")


    def medium():
        return _job("cli-medium", 5_000, {small_keys}, Count(), 0.001, "medium")


    def large():
        # local: ~1 s of real work, so that kills land mid-run
        return _job("cli-large", 120_000, 7, Count(), 0.05, "large")


    def failing():
        return _job("cli-failing", {small_n}, {small_keys}, Raises(), 0.001, "failing")
''')


def cli(*args: str, cwd: Path, timeout: float = 120, real_exit: bool = False) -> subprocess.CompletedProcess:
    """Run the CLI; ``real_exit=True``: ``python -m epochstream.cli`` with the normal interpreter exit."""
    cmd = CLI if real_exit else CLI_NO_TEARDOWN
    return subprocess.run([*cmd, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def workdir_flag(command: str, tmp_path: Path) -> list:
    """``chaos`` keeps its runs in a new temporary folder unless told where: keep it in tmp_path."""
    return ["--workdir", tmp_path / "chaos-work"] if command == "chaos" else []


def as_json(proc: subprocess.CompletedProcess) -> dict:
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"stdout is not one JSON document ({exc}):\n{proc.stdout}\nstderr:\n{proc.stderr}") from exc


@pytest.fixture
def job(tmp_path) -> Path:
    """A job file whose sinks write under tmp_path/out."""
    path = tmp_path / "job.py"
    path.write_text(JOB.format(out=str(tmp_path / "out"), small_n=SMALL_N, small_keys=SMALL_KEYS))
    return path


def sink_lines(folder: Path) -> list:
    out = []
    for f in sorted(folder.glob("part-*.jsonl")):
        out.extend(json.loads(line) for line in f.read_text().splitlines() if line.strip())
    return out


def assert_running_counts(records: list, n: int, keys: int) -> None:
    """(key, count) records of the small job: every key's counts are exactly 1..ids of that key."""
    per_key = collections.defaultdict(list)
    for key, count in records:
        per_key[key].append(count)
    want = collections.Counter(f"k{i % keys}" for i in range(n))
    assert set(per_key) == set(want)
    for key, counts in per_key.items():
        assert sorted(counts) == list(range(1, want[key] + 1)), key


def run_small(job: Path, chk: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = cli("run", f"{job}:small", "--deployment", "sim", "--checkpoint-dir", chk, "--json", *extra, cwd=job.parent)
    assert proc.returncode == EXIT_OK, proc.stderr
    return proc, as_json(proc)


def list_checkpoints(chk: Path, cwd: Path) -> dict:
    proc = cli("checkpoints", "list", "--checkpoint-dir", chk, "--json", cwd=cwd)
    assert proc.returncode == EXIT_OK, proc.stderr
    return as_json(proc)


# ---------------------------------------------------------------- run


def test_run_sim_json_reports_and_commits_output(job, tmp_path):
    chk = tmp_path / "chk"
    _proc, doc = run_small(job, chk)
    for key in ("job", "checkpoint_dir", "completed_epochs", "latest_checkpoint", "restarts", "records_in",
                "sinks", "metrics"):
        assert key in doc, key
    assert doc["job"] == "cli-small"
    assert Path(doc["checkpoint_dir"]) == chk.resolve()
    assert doc["completed_epochs"] and doc["completed_epochs"] == sorted(doc["completed_epochs"])
    assert len(doc["completed_epochs"]) >= 2, "the interval should give several epochs"
    assert Path(doc["latest_checkpoint"]).is_dir()
    assert doc["restarts"] == 0 and doc["records_in"] == SMALL_N
    assert doc["metrics"]["deployment"] == "sim"
    sink = Path(doc["sinks"]["counts"])
    assert sink == (tmp_path / "out" / "small").resolve()
    files = sorted(sink.glob("part-*.jsonl"))
    assert files, f"no committed files in {sink}"
    records = sink_lines(sink)
    assert len(records) == SMALL_N
    assert_running_counts(records, SMALL_N, SMALL_KEYS)


def test_run_text_output(job, tmp_path):
    proc = cli("run", f"{job}:small", "--deployment", "sim", "--checkpoint-dir", tmp_path / "chk", cwd=tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "cli-small" in proc.stdout
    assert str(tmp_path / "chk") in proc.stdout
    assert str(tmp_path / "out" / "small") in proc.stdout


def test_run_flags_override_the_pipeline_and_show_in_the_manifest(job, tmp_path):
    chk = tmp_path / "chk"
    _proc, doc = run_small(job, chk, "-p", "3", "--max-parallelism", "64", "--interval", "0.0005",
                           "--mode", "at-least-once")
    assert doc["metrics"]["parallelism"] == 3
    assert doc["metrics"]["mode"] == "at-least-once"
    listing = list_checkpoints(chk, tmp_path)
    rows = listing["checkpoints"]
    assert rows
    for row in rows:
        assert row["status"] == "completed", row
        assert row["parallelism"] == 3, row
        assert row["max_parallelism"] == 64, row
        assert row["mode"] == "at-least-once", row
    records = sink_lines(Path(doc["sinks"]["counts"]))
    assert len(records) == SMALL_N  # no failures: at-least-once commits each record once too
    assert_running_counts(records, SMALL_N, SMALL_KEYS)


def test_batch_flags_override_the_pipeline(job, tmp_path):
    """``--batch-rows`` and ``--batch-linger`` set the batching policy; the output is the same."""
    _proc, doc = run_small(job, tmp_path / "chk", "--batch-rows", "64", "--batch-linger", "0.0002")
    assert (doc["metrics"]["batch_rows"], doc["metrics"]["batch_linger"]) == (64, 0.0002)
    records = sink_lines(Path(doc["sinks"]["counts"]))
    assert len(records) == SMALL_N
    assert_running_counts(records, SMALL_N, SMALL_KEYS)


@pytest.mark.parametrize("flag, value, words", [
    ("--batch-rows", "0", ["--batch-rows", ">= 1"]),
    ("--batch-rows", "1.5", ["--batch-rows", "'1.5'"]),
    ("--batch-linger", "-0.1", ["--batch-linger", ">= 0"]),
    ("--batch-linger", "soon", ["--batch-linger", "'soon'"]),
    ("--batch-linger", "inf", ["--batch-linger", "finite"]),
])
def test_batch_flags_out_of_range_exit_2(job, tmp_path, flag, value, words):
    proc = cli("run", f"{job}:small", "--deployment", "sim", "--checkpoint-dir", tmp_path / "chk", flag, value,
               cwd=tmp_path, real_exit=True)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "chk").exists()


def test_interval_flag_changes_the_number_of_epochs(job, tmp_path):
    """``--interval 0``: only the final epoch; a short interval: several epochs."""
    docs = {}
    for interval in ("0", "0.0005"):
        chk = tmp_path / f"chk-{interval}"
        proc = cli("run", f"{job}:medium", "--deployment", "sim", "--checkpoint-dir", chk, "--json",
                   "--interval", interval, cwd=tmp_path)
        assert proc.returncode == EXIT_OK, proc.stderr
        docs[interval] = as_json(proc)
        assert len(sink_lines(Path(docs[interval]["sinks"]["counts"]))) == 5_000
        shutil.rmtree(tmp_path / "out" / "medium")
    assert len(docs["0"]["completed_epochs"]) == 1
    assert len(docs["0.0005"]["completed_epochs"]) >= 3
    rows = list_checkpoints(tmp_path / "chk-0", tmp_path)["checkpoints"]
    assert [r["kind"] for r in rows] == ["final"]


def test_run_restore_latest_of_a_finished_job_commits_nothing_twice(job, tmp_path):
    chk = tmp_path / "chk"
    _p, first = run_small(job, chk)
    before = sink_lines(Path(first["sinks"]["counts"]))
    _p, again = run_small(job, chk, "--restore", "latest")
    assert again["completed_epochs"][0] == first["completed_epochs"][-1] + 1
    assert sink_lines(Path(again["sinks"]["counts"])) == before


def test_run_local_deployment(job, tmp_path):
    proc = cli("run", f"{job}:small", "--deployment", "local", "--checkpoint-dir", tmp_path / "chk", "--json",
               "--interval", "0.05", cwd=tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr
    doc = as_json(proc)
    assert doc["metrics"]["deployment"] == "local"
    assert doc["completed_epochs"]
    records = sink_lines(Path(doc["sinks"]["counts"]))
    assert len(records) == SMALL_N
    assert_running_counts(records, SMALL_N, SMALL_KEYS)


def test_run_job_whose_user_code_fails_exits_3_naming_the_operator(job, tmp_path):
    proc = cli("run", f"{job}:failing", "--deployment", "sim", "--checkpoint-dir", tmp_path / "chk", cwd=tmp_path)
    assert proc.returncode == EXIT_FAILED, (proc.returncode, proc.stderr)
    assert "'count'" in proc.stderr and "boom at id 250" in proc.stderr, proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr.split("\n", 1)[0]


# ---------------------------------------------------------------- checkpoints list


def test_checkpoints_list_in_epoch_order(job, tmp_path):
    chk = tmp_path / "chk"
    _p, doc = run_small(job, chk)
    listing = list_checkpoints(chk, tmp_path)
    assert Path(listing["checkpoint_dir"]) == chk.resolve()
    rows = listing["checkpoints"]
    epochs = [r["epoch"] for r in rows]
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)
    assert epochs[-1] == doc["completed_epochs"][-1]
    assert set(epochs) <= set(doc["completed_epochs"])
    assert all(r["status"] == "completed" for r in rows), rows
    assert rows[-1]["kind"] == "final"
    assert Path(rows[-1]["path"]) == Path(doc["latest_checkpoint"])
    for r in rows:
        assert Path(r["path"]).is_dir()
        assert r["job"] == "cli-small" and r["parallelism"] == 2
        assert r["state_files"] >= 1 and r["state_bytes"] > 0
    # the final epoch names the end of the input
    assert sum(rows[-1]["sources"]["src"].values()) == SMALL_N
    # offsets only grow from epoch to epoch
    totals = [sum(r["sources"]["src"].values()) for r in rows]
    assert totals == sorted(totals)
    # text form
    proc = cli("checkpoints", "list", "--checkpoint-dir", chk, cwd=tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout.count("completed") == len(rows)


@pytest.mark.parametrize("damage", ["truncated", "not-json", "binary", "wrong-format", "empty"])
def test_checkpoints_list_shows_a_damaged_manifest(job, tmp_path, damage):
    chk = tmp_path / "chk"
    run_small(job, chk)
    rows = list_checkpoints(chk, tmp_path)["checkpoints"]
    assert len(rows) >= 2
    victim = rows[0]["epoch"]
    meta = chk / f"chk-{victim}" / "_metadata.json"
    text = meta.read_bytes()
    meta.write_bytes({
        "truncated": text[: len(text) // 2],
        "not-json": b"this is not json",
        "binary": b"\xff\xfe\x00garbage",
        "wrong-format": json.dumps({"format": "something-else"}).encode(),
        "empty": b"",
    }[damage])
    listing = list_checkpoints(chk, tmp_path)
    by_epoch = {r["epoch"]: r for r in listing["checkpoints"]}
    assert set(by_epoch) == {r["epoch"] for r in rows}
    bad = by_epoch[victim]
    assert bad["status"] == "damaged", bad
    assert str(meta) in bad["error"], bad
    assert all(r["status"] == "completed" for e, r in by_epoch.items() if e != victim)
    proc = cli("checkpoints", "list", "--checkpoint-dir", chk, cwd=tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "damaged" in proc.stdout
    assert "Traceback" not in proc.stderr


def _drop_file_bytes(m: dict) -> None:
    del next(iter(m["operators"].values()))["files"][0]["bytes"]


def _drop_staged(m: dict) -> None:
    del next(iter(m["sinks"].values()))["staged"]


def _drop_offsets(m: dict) -> None:
    del next(iter(m["sources"].values()))["offsets"]


def _operators_as_list(m: dict) -> None:
    m["operators"] = []


@pytest.mark.parametrize("damage", [_drop_file_bytes, _drop_staged, _drop_offsets, _operators_as_list],
                         ids=["file-without-bytes", "sink-without-staged", "source-without-offsets",
                              "operators-list"])
def test_checkpoints_list_shows_a_structurally_damaged_manifest(job, tmp_path, damage):
    chk = tmp_path / "chk"
    run_small(job, chk)
    victim = list_checkpoints(chk, tmp_path)["checkpoints"][-1]["epoch"]
    meta = chk / f"chk-{victim}" / "_metadata.json"
    manifest = json.loads(meta.read_text())
    damage(manifest)
    meta.write_text(json.dumps(manifest))
    proc = cli("checkpoints", "list", "--checkpoint-dir", chk, "--json", cwd=tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr
    row = {r["epoch"]: r for r in as_json(proc)["checkpoints"]}[victim]
    assert row["status"] == "damaged" and str(meta) in row["error"], row


def test_checkpoints_list_of_a_missing_dir_exits_2(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    for extra in ((), ("--json",)):
        proc = cli("checkpoints", "list", "--checkpoint-dir", missing, *extra, cwd=tmp_path, real_exit=True)
        assert proc.returncode == EXIT_USAGE, proc
        assert str(missing) in proc.stderr and "does not exist" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert proc.stdout == ""


def test_checkpoints_list_of_an_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    listing = list_checkpoints(tmp_path / "empty", tmp_path)
    assert listing["checkpoints"] == []
    proc = cli("checkpoints", "list", "--checkpoint-dir", tmp_path / "empty", cwd=tmp_path)
    assert proc.returncode == EXIT_OK and "no checkpoints" in proc.stdout


# ---------------------------------------------------------------- chaos


def chaos(job: Path, tmp_path: Path, function: str, *args: str, timeout: float = 300) -> dict:
    work = tmp_path / "chaos-work"
    proc = cli("chaos", f"{job}:{function}", "--json", "--workdir", work, *args, cwd=tmp_path, timeout=timeout)
    assert proc.returncode == EXIT_OK, (proc.returncode, proc.stdout, proc.stderr)
    doc = as_json(proc)
    assert doc["ok"] is True, doc
    assert Path(doc["workdir"]) == work
    assert (work / "reference" / "chk").is_dir() and (work / "chaos" / "chk").is_dir()
    return doc


@pytest.mark.parametrize("mode", [None, "aligned", "tracker", "unaligned", "aligned-timeout"])
def test_chaos_sim_exactly_once(job, tmp_path, mode):
    flags = ["--mode", "aligned", "--aligned-timeout", "0"] if mode == "aligned-timeout" else \
        ["--mode", mode] if mode else []
    doc = chaos(job, tmp_path, "small", "--deployment", "sim", "--kills", "3", "--seed", "1", *flags)
    assert doc["mode"] == "exactly-once"
    assert doc["deployment"] == "sim" and doc["seed"] == 1 and doc["kills_requested"] == 3
    assert doc["failures_injected"] >= 1 and doc["restarts"] >= 1, doc
    assert doc["lost"] == doc["duplicated"] == doc["mismatched_state"] == doc["mismatched_epoch_output"] == 0
    assert doc["epochs_checked"] >= 1
    assert doc["records_committed"] == doc["records_expected"] == SMALL_N
    assert doc["failures"]["requested"] == doc["failures"]["landed"] == doc["failures_injected"] == 3, doc["failures"]


def test_chaos_sim_at_least_once_loses_nothing(job, tmp_path):
    doc = chaos(job, tmp_path, "small", "--deployment", "sim", "--kills", "3", "--seed", "2",
                "--mode", "at-least-once")
    assert doc["mode"] == "at-least-once"
    assert doc["lost"] == 0
    assert doc["records_committed"] >= doc["records_expected"] == SMALL_N


def test_chaos_text_output(job, tmp_path):
    work = tmp_path / "w"
    proc = cli("chaos", f"{job}:small", "--deployment", "sim", "--kills", "2", "--seed", "4", "--workdir", work,
               cwd=tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "chaos PASS" in proc.stdout and str(work) in proc.stdout


def test_chaos_local_with_five_real_kills(job, tmp_path):
    doc = chaos(job, tmp_path, "large", "--deployment", "local", "--kills", "5", "--seed", "3")
    assert doc["deployment"] == "local"
    assert doc["failures_injected"] >= 5, doc
    assert doc["failures"]["kinds"] == [{"kind": "worker/now", "requested": 5, "landed": 5}], doc["failures"]
    assert doc["restarts"] >= 1 and len(doc["failovers"]) == doc["restarts"], doc
    assert doc["lost"] == doc["duplicated"] == doc["mismatched_state"] == doc["mismatched_epoch_output"] == 0
    assert doc["records_committed"] == doc["records_expected"] == 120_000


@pytest.mark.parametrize("deployment", ["sim", "local"])
def test_chaos_whose_kills_cannot_land_fails(job, tmp_path, deployment):
    """A planted run: every kill is due after the job has ended. The oracle finds nothing
    wrong, and chaos must still fail, naming the kills that did not land."""
    work = tmp_path / "late"
    proc = cli("chaos", f"{job}:small", "--deployment", deployment, "--kills", "2", "--seed", "1",
               "--kill-window", "5,6", "--json", "--workdir", work, cwd=tmp_path, timeout=300)
    assert proc.returncode == EXIT_NOT_INJECTED, (proc.returncode, proc.stdout, proc.stderr)
    doc = as_json(proc)
    assert doc["exactly_once"] is True and doc["ok"] is False
    failures = doc["failures"]
    assert failures["requested"] == 2 and failures["landed"] < 2, failures
    assert any("did not land" in problem for problem in failures["problems"]), failures
    assert "did not land" in proc.stderr


def test_chaos_kill_window_is_checked(job, tmp_path):
    proc = cli("chaos", f"{job}:small", "--deployment", "sim", "--kill-window", "0.9,0.1", cwd=tmp_path)
    assert proc.returncode == EXIT_USAGE and "START < END" in proc.stderr


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("command", ["run", "chaos"])
@pytest.mark.parametrize("args, words", [
    (("{job}",), ["FILE.py:FUNCTION", "{job}"]),
    (("{dir}/missing.py:small",), ["no such file", "{dir}/missing.py"]),
    (("{job}:nope",), ["no function 'nope'"]),
    (("{job}:NOT_A_FUNCTION",), ["no function 'NOT_A_FUNCTION'"]),
    (("{job}:small", "--mode", "exactly-twice"), ["--mode", "at-least-once", "exactly-twice"]),
    (("{job}:small", "--mode", "tracker", "--aligned-timeout", "1"), ["--aligned-timeout", "tracker"]),
], ids=["no-function", "missing-file", "missing-function", "not-callable", "bad-mode", "timeout-in-tracker-mode"])
def test_bad_input_exits_2_with_a_message(job, tmp_path, command, args, words):
    """A one-line message naming the culprit and exit code 2 (bad input). Regression: these
    exited 1 through SystemExit(message), and for ``chaos`` 1 means 'exactly-once violation'."""
    args = [a.format(job=job, dir=tmp_path) for a in args]
    proc = cli(command, *args, "--deployment", "sim", "--checkpoint-dir", tmp_path / "chk",
               *workdir_flag(command, tmp_path), cwd=tmp_path, real_exit=True)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    for w in words:
        assert w.format(job=job, dir=tmp_path) in proc.stderr, (w, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""
    # nothing ran: no checkpoints, no output
    assert not (tmp_path / "chk").exists() or not any((tmp_path / "chk").iterdir())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["/not/a/checkpoint", "{dir}/somefile.txt", "{dir}/emptydir"])
def test_run_restore_from_something_that_is_not_a_checkpoint(job, tmp_path, target):
    (tmp_path / "somefile.txt").write_text("hello")
    (tmp_path / "emptydir").mkdir()
    target = target.format(dir=tmp_path)
    proc = cli("run", f"{job}:small", "--deployment", "sim", "--checkpoint-dir", tmp_path / "chk",
               "--restore", target, cwd=tmp_path, real_exit=True)
    assert proc.returncode not in (EXIT_OK, EXIT_VIOLATION), proc
    assert str(Path(target).resolve()) in proc.stderr or target in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "small").exists() or not list((tmp_path / "out" / "small").glob("part-*"))


def test_run_into_a_dir_with_checkpoints_suggests_restore_latest(job, tmp_path):
    chk = tmp_path / "chk"
    run_small(job, chk)
    proc = cli("run", f"{job}:small", "--deployment", "sim", "--checkpoint-dir", chk, cwd=tmp_path)
    assert proc.returncode not in (EXIT_OK, EXIT_VIOLATION)
    assert "--restore latest" in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", ["run", "chaos"])
def test_parallelism_above_max_parallelism_exits_2(job, tmp_path, command):
    proc = cli(command, f"{job}:small", "--deployment", "sim", "-p", "300", "--max-parallelism", "128",
               "--checkpoint-dir", tmp_path / "chk", *workdir_flag(command, tmp_path), cwd=tmp_path,
               real_exit=True)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    assert re.search(r"\b300\b", proc.stderr) and re.search(r"\b128\b", proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- help


HELP_FLAGS = {
    ("run",): ["--deployment", "sim", "local", "--mode", "-p", "--parallelism", "--max-parallelism",
               "--checkpoint-dir", "--interval", "--restore", "--allow-non-restored-state", "--seed", "--duration",
               "--batch-rows", "--batch-linger", "--aligned-timeout", "--json", "FILE.py:FUNCTION"],
    ("checkpoints", "list"): ["--checkpoint-dir", "--json"],
    ("chaos",): ["--deployment", "sim", "local", "--kills", "--seed", "--json", "--workdir", "--mode", "-p",
                 "--interval", "--duration", "FILE.py:FUNCTION"],
}


@pytest.mark.parametrize("command", sorted(HELP_FLAGS), ids=" ".join)
def test_help_mentions_every_flag(tmp_path, command):
    proc = cli(*command, "--help", cwd=tmp_path, real_exit=True)
    assert proc.returncode == EXIT_OK, proc.stderr
    for flag in HELP_FLAGS[command]:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", proc.stdout), (flag, proc.stdout)


@pytest.mark.parametrize("command", ["run", "chaos"])
def test_help_lists_every_mode(tmp_path, command):
    from epochstream.api.pipeline import MODES

    proc = cli(command, "--help", cwd=tmp_path, real_exit=True)
    assert proc.returncode == EXIT_OK, proc.stderr
    mode_help = " ".join(proc.stdout.split("--mode MODE", 2)[-1].split("--parallelism")[0].split())
    for mode in MODES:
        assert mode in mode_help, (mode, mode_help)


def test_console_script_is_installed(tmp_path):
    exe = shutil.which("epochstream")
    if exe is None:
        pytest.skip("the epochstream console script is not on PATH")
    proc = subprocess.run([exe, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_OK, proc.stderr
    for sub in ("run", "checkpoints", "chaos"):
        assert sub in proc.stdout


# ---------------------------------------------------------------- known bugs


TEARDOWN_ABORT = "terminate called without an active exception"


TEARDOWN_RUNS = 25


def test_cli_exit_code_survives_interpreter_teardown(job, tmp_path):
    """Regression: the real entry point (``python -m epochstream.cli``, which ends through
    ``cli.entry``: flush, then ``os._exit``) run TEARDOWN_RUNS times must exit 0 every time.
    pyarrow's teardown abort (apache/arrow#34314) hit 2-8% of runs under load before the
    entry point stopped running interpreter teardown."""
    for i in range(TEARDOWN_RUNS):
        work = tmp_path / f"w{i}"
        proc = cli("chaos", f"{job}:small", "--deployment", "sim", "--kills", "3", "--seed", str(i), "--json",
                   "--workdir", work, cwd=tmp_path, real_exit=True)
        if proc.returncode != EXIT_OK:
            doc = as_json(proc)  # the work was done and reported before the abort
            assert doc["ok"] is True
            assert TEARDOWN_ABORT in proc.stderr, (i, proc.returncode, proc.stderr)
        assert proc.returncode == EXIT_OK, f"run {i}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1]}"
        shutil.rmtree(work, ignore_errors=True)
