"""Bad input gets a clear error naming what and where, and nothing is lost (DESIGN principle 7).

Damaged or foreign checkpoints, incompatible pipelines, impossible parallelism, state that
cannot be pickled, user functions that raise, and checkpoint directories used the wrong way.
Each test checks the error's type and that its message names the culprit (path, uid, state,
key, numbers), and where a job fails mid-way, that the last completed checkpoint is still
loadable and restorable with nothing lost.

Runs use the simulator and skip fsync (``pipelines.without_fsync``).
"""

from __future__ import annotations

import collections
import json
import pickle
import re
import threading
from pathlib import Path

import pytest

from epochstream import (
    CheckpointError,
    DiscardingSink,
    FileSink,
    KeyedProcessFunction,
    ParallelismError,
    Pipeline,
    ValueStateDescriptor,
)
from epochstream.backends.local import METADATA, LocalCheckpointStorage
from epochstream.deploy.failures import JobFailedError
from epochstream.runtime.errors import EpochStreamError, StateSerializationError, UserFunctionError
from pipelines import (
    SOURCE_RATE,
    RunningCount,
    check_running_counts,
    committed_output,
    input_records,
    make_pipeline,
    running_count,
    sim_run,
    without_fsync,
)

RATE = SOURCE_RATE
N = 200
KEYS = 7


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def completed_job(tmp_path: Path, seed: int = 1, **knobs):
    """A finished running_count job (ids 0..N-1) with several retained checkpoints."""
    out, chk = tmp_path / "out", tmp_path / "chk"
    knobs.setdefault("parallelism", 2)
    p = running_count(n=N, keys=KEYS, out=out, emit_ids=True, restart_attempts=2, **knobs)
    p.checkpoint.num_retained = 10
    result = sim_run(p, chk, seed=seed, source_rate=RATE)
    storage = LocalCheckpointStorage(chk)
    assert len(storage.list_checkpoints()) >= 2, "the scenario needs several checkpoints"
    return p, out, chk, storage, result


def restore_run(out: Path, chk: Path, restore: str | Path, seed: int = 2, pipeline=None, **kwargs):
    p = pipeline or running_count(n=N, keys=KEYS, out=out, emit_ids=True, restart_attempts=2)
    return sim_run(p, chk, seed=seed, source_rate=RATE, restore=str(restore), **kwargs)


def state_counts(storage: LocalCheckpointStorage, epoch: int | None = None, uid: str = "count") -> dict:
    """key -> running count in a checkpoint (newest by default), read with pickle only."""
    manifest, root = storage.latest() if epoch is None else storage.load_manifest(epoch)
    out = {}
    for _kg, kb, name, vb in storage.read_operator_rows(manifest, root, uid):
        if name == "count":
            if vb is None:
                out.pop(pickle.loads(kb), None)
            else:
                out[pickle.loads(kb)] = pickle.loads(vb)
    return out


def full_counts(n: int = N, keys: int = KEYS) -> dict:
    return dict(collections.Counter(f"k{i % keys}" for i in range(n)))


def manifest_path(storage: LocalCheckpointStorage, epoch: int) -> Path:
    return storage.checkpoint_dir(epoch) / METADATA


# ---------------------------------------------------------------- damaged manifests


def _truncate(text: str) -> str:
    return text[: len(text) // 2]


def _not_json(text: str) -> str:
    return "\x00\x01 this is not json"


def _empty(text: str) -> str:
    return ""


def _foreign_json(text: str) -> str:
    return json.dumps({"hello": "world"})


def _future_version(text: str) -> str:
    m = json.loads(text)
    m["format_version"] = 999
    return json.dumps(m)


def _lacks_operators(text: str) -> str:
    m = json.loads(text)
    del m["operators"]
    return json.dumps(m)


DAMAGES = {
    "truncated": (_truncate, "corrupt or truncated"),
    "not-json": (_not_json, "corrupt or truncated"),
    "empty": (_empty, "corrupt or truncated"),
    "foreign-json": (_foreign_json, "not an epochstream checkpoint manifest"),
    "future-version": (_future_version, "format version 999"),
    "lacks-operators": (_lacks_operators, "'operators'"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("form", ["folder", "metadata-file"])
def test_restore_from_a_damaged_manifest_names_the_path(tmp_path, damage, form):
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-1]
    path = manifest_path(storage, epoch)
    fn, words = DAMAGES[damage]
    path.write_text(fn(path.read_text()))
    target = path.parent if form == "folder" else path
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, tmp_path / "chk-new", target)
    msg = str(exc.value)
    assert str(path) in msg
    assert words in msg
    assert not (tmp_path / "chk-new").exists() or not any((tmp_path / "chk-new").iterdir())


@pytest.mark.parametrize("damage", ["truncated", "not-json", "foreign-json"])
def test_latest_skips_a_damaged_newest_manifest_when_loading(tmp_path, damage, caplog):
    """Storage level: latest() returns the previous checkpoint and logs why."""
    _p, _out, _chk, storage, _r = completed_job(tmp_path)
    *_, prev, newest = storage.list_checkpoints()
    path = manifest_path(storage, newest)
    path.write_text(DAMAGES[damage][0](path.read_text()))
    with caplog.at_level("WARNING"):
        manifest, _root = storage.latest()
    assert manifest["epoch"] == prev
    assert f"skipping checkpoint {newest}" in caplog.text


def test_restore_latest_skips_a_damaged_newest_manifest(tmp_path):
    _p, out, chk, storage, _r = completed_job(tmp_path)
    *_, prev, newest = storage.list_checkpoints()
    path = manifest_path(storage, newest)
    path.write_text(_truncate(path.read_text()))
    result = restore_run(out, chk, "latest")
    assert result.completed_epochs[0] == prev + 1  # restored prev, numbering continues from it
    assert state_counts(LocalCheckpointStorage(chk)) == full_counts()


def test_restore_latest_after_the_damaged_newest_is_moved_away(tmp_path):
    """The workaround for BUG-C, and the behaviour it should have: restore the previous
    checkpoint; the job finishes with every key's count complete and no id twice."""
    _p, out, chk, storage, _r = completed_job(tmp_path)
    *_, prev, newest = storage.list_checkpoints()
    storage.checkpoint_dir(newest).rename(tmp_path / "damaged-aside")
    result = restore_run(out, chk, "latest")
    assert result.completed_epochs[0] == prev + 1
    assert state_counts(LocalCheckpointStorage(chk)) == full_counts()


# ---------------------------------------------------------------- damaged or missing state files


def _first_state_file(storage: LocalCheckpointStorage, epoch: int) -> Path:
    manifest, root = storage.load_manifest(epoch)
    return root / manifest["operators"]["count"]["files"][0]["path"]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate_file(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _delete(path: Path) -> None:
    path.unlink()


STATE_DAMAGES = {
    "flipped": (_flip, "damaged"),
    "truncated": (_truncate_file, "damaged"),
    "missing": (_delete, "missing"),
}


def _error_chain(exc: BaseException) -> list[BaseException]:
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


@pytest.mark.parametrize("damage", sorted(STATE_DAMAGES))
def test_reading_a_damaged_state_file_names_it(tmp_path, damage):
    """Storage level: reading the checkpoint raises CheckpointError naming file and operator."""
    _p, _out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-1]
    f = _first_state_file(storage, epoch)
    STATE_DAMAGES[damage][0](f)
    manifest, root = storage.load_manifest(epoch)
    with pytest.raises(CheckpointError) as exc:
        list(storage.read_operator_rows(manifest, root, "count"))
    assert str(f) in str(exc.value) and "'count'" in str(exc.value)
    assert STATE_DAMAGES[damage][1] in str(exc.value)


@pytest.mark.parametrize("damage", sorted(STATE_DAMAGES))
def test_restore_with_a_damaged_state_file_fails_naming_it(tmp_path, damage):
    """Job level: the restore fails (whatever the wrapper) with the file's path in the message
    and a CheckpointError in the cause chain; nothing is committed on top."""
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-1]
    f = _first_state_file(storage, epoch)
    STATE_DAMAGES[damage][0](f)
    before = committed_output(out / "counts")
    with pytest.raises((CheckpointError, JobFailedError)) as exc:
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch))
    assert str(f) in str(exc.value)
    assert any(isinstance(e, CheckpointError) for e in _error_chain(exc.value))
    assert committed_output(out / "counts") == before


def test_restore_with_a_flipped_state_file_raises_checkpoint_error(tmp_path):
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-1]
    f = _first_state_file(storage, epoch)
    _flip(f)
    with pytest.raises(CheckpointError, match=re.escape(str(f))):
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch))


# ---------------------------------------------------------------- not a checkpoint


def _empty_dir(tmp: Path) -> Path:
    d = tmp / "empty"
    d.mkdir()
    return d


def _dir_with_files(tmp: Path) -> Path:
    d = tmp / "random"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("hello")
    (d / "sub" / "x.bin").write_bytes(b"\x00" * 10)
    return d


def _nonexistent(tmp: Path) -> Path:
    return tmp / "does-not-exist"


def _a_text_file(tmp: Path) -> Path:
    f = tmp / "file.json"
    f.write_text("[1, 2, 3]")
    return f


NOT_CHECKPOINTS = {"empty-dir": _empty_dir, "dir-with-files": _dir_with_files, "nonexistent": _nonexistent,
                   "text-file": _a_text_file}


@pytest.mark.parametrize("what", sorted(NOT_CHECKPOINTS))
def test_restore_from_something_that_is_not_a_checkpoint(tmp_path, what):
    target = NOT_CHECKPOINTS[what](tmp_path)
    with pytest.raises(CheckpointError) as exc:
        restore_run(tmp_path / "out", tmp_path / "chk", target)
    assert str(target.resolve()) in str(exc.value)


def test_restore_from_a_checkpoint_root_says_to_pick_a_chk_folder(tmp_path):
    """A checkpoint *dir* (holding chk-N folders) is not a checkpoint: the error says what is."""
    _p, out, chk, _storage, _r = completed_job(tmp_path)
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, tmp_path / "chk-new", chk)
    assert str(chk) in str(exc.value)
    assert "chk-N" in str(exc.value) and "latest" in str(exc.value)


def test_checkpoint_dir_that_is_a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        sim_run(running_count(n=N, out=tmp_path / "out"), f, seed=1, source_rate=RATE)


def test_restore_latest_from_an_empty_dir_starts_fresh(tmp_path):
    """restore='latest' with nothing to restore is a fresh start (as Flink's resume-or-start)."""
    p = running_count(n=N, keys=KEYS, out=tmp_path / "out", emit_ids=True)
    result = sim_run(p, tmp_path / "chk", seed=1, source_rate=RATE, restore="latest")
    assert result.completed_epochs[0] == 1
    assert check_running_counts(committed_output(tmp_path / "out" / "counts"), set(range(N))) == []


# ---------------------------------------------------------------- incompatible pipelines


def _renamed_count_pipeline(out: Path, uid: str) -> Pipeline:
    p = make_pipeline("running-count", parallelism=2, restart_attempts=2)
    (
        p.from_collection(input_records(N, KEYS), uid="src")
        .key_by(lambda r: r[0])
        .process(RunningCount(emit_ids=True), uid=uid)
        .sink(FileSink(out / "counts"), uid="counts")
    )
    return p


def test_restore_into_a_pipeline_without_the_operator_uid(tmp_path):
    _p, out, chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-2]
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch),
                    pipeline=_renamed_count_pipeline(out, "count-v2"))
    msg = str(exc.value)
    assert "'count'" in msg
    assert "allow_non_restored_state" in msg
    assert str(storage.checkpoint_dir(epoch)) in msg


def test_allow_non_restored_state_drops_the_unknown_operator(tmp_path):
    """With allow_non_restored_state the job runs: sources resume at the checkpoint's offsets,
    the renamed operator starts empty (so its counts cover only the remaining input)."""
    _p, out, chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-2]
    manifest, _ = storage.load_manifest(epoch)
    consumed = sum(int(v) for v in manifest["sources"]["src"]["offsets"].values())
    assert 0 < consumed < N
    new_chk = tmp_path / "chk-new"
    result = restore_run(out, new_chk, storage.checkpoint_dir(epoch),
                         pipeline=_renamed_count_pipeline(out, "count-v2"),
                         allow_non_restored_state=True)
    assert result.completed_epochs[0] == epoch + 1
    new = LocalCheckpointStorage(new_chk)
    counts = state_counts(new, uid="count-v2")
    assert sum(counts.values()) == N - consumed
    assert "count" not in new.latest()[0]["operators"]


def test_restore_with_another_max_parallelism(tmp_path):
    _p, out, _chk, storage, _r = completed_job(tmp_path)  # default max_parallelism 128
    epoch = storage.list_checkpoints()[-1]
    p = running_count(n=N, keys=KEYS, out=out, emit_ids=True, restart_attempts=2, max_parallelism=64)
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch), pipeline=p)
    msg = str(exc.value)
    assert "max_parallelism" in msg and "128" in msg and "64" in msg


def test_restore_a_checkpoint_of_another_job(tmp_path):
    """Another job's checkpoint: refused, naming the operator uids this pipeline lacks and the job
    the checkpoint came from; nothing is written."""
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-1]
    p = _renamed_count_pipeline(out, "totals")
    p.name = "some-other-job"
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch), pipeline=p)
    msg = str(exc.value)
    assert "'running-count'" in msg and "'some-other-job'" in msg and "['count']" in msg
    assert not (tmp_path / "chk-new").exists() or not any((tmp_path / "chk-new").iterdir())


def test_a_renamed_job_takes_over_its_checkpoint_by_uid(tmp_path):
    """Flink's rule: state maps to operators by uid, not by job name. A job renamed with the same
    uids restores and finishes with every key's count complete."""
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-2]
    p = running_count(n=N, keys=KEYS, out=out, emit_ids=True, restart_attempts=2)
    p.name = "running-count-v2"
    restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch), pipeline=p)
    assert state_counts(LocalCheckpointStorage(tmp_path / "chk-new")) == full_counts()


def test_an_operator_uid_of_another_kind_is_refused(tmp_path):
    """A uid that held keyed state in the checkpoint but names a source now cannot take it over,
    even with allow_non_restored_state."""
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    epoch = storage.list_checkpoints()[-1]
    p = make_pipeline("running-count")
    p.from_collection(input_records(N, KEYS), uid="count").key_by(lambda r: r[0]).process(
        RunningCount(emit_ids=True), uid="src2").sink(FileSink(out / "counts"), uid="counts")
    with pytest.raises(CheckpointError, match=r"'count' \(process in the checkpoint, source in the pipeline\)"):
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch), pipeline=p,
                    allow_non_restored_state=True)


def test_restore_with_another_explicit_split_count(tmp_path):
    """Offsets are kept per split: a source built with an explicit, different split count is
    refused (an elastic source, built without splits=, adopts the checkpoint's count instead)."""
    _p, out, _chk, storage, _r = completed_job(tmp_path, parallelism=3)  # 3 splits
    epoch = storage.list_checkpoints()[-1]
    p = make_pipeline("running-count", parallelism=2)
    p.from_collection(input_records(N, KEYS), splits=2, uid="src").key_by(lambda r: r[0]).process(
        RunningCount(emit_ids=True), uid="count").sink(FileSink(out / "counts"), uid="counts")
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(epoch), pipeline=p)
    assert "'src'" in str(exc.value) and "3 splits" in str(exc.value)


def test_an_elastic_source_adopts_the_checkpoints_splits(tmp_path):
    """Restoring a p=3 checkpoint at p=2: the default (elastic) source keeps its 3 splits and
    their offsets, dealt to 2 subtasks; the job finishes with nothing lost or doubled."""
    _p, out, _chk, storage, _r = completed_job(tmp_path, parallelism=3)
    epoch = storage.list_checkpoints()[-2]
    consumed = sum(storage.load_manifest(epoch)[0]["sources"]["src"]["offsets"].values())
    out2 = tmp_path / "out2"
    p = running_count(n=N, keys=KEYS, out=out2, emit_ids=True, restart_attempts=2, parallelism=2)
    restore_run(out2, tmp_path / "chk-new", storage.checkpoint_dir(epoch), pipeline=p)
    assert p.sources["src"].num_splits == 3
    new = LocalCheckpointStorage(tmp_path / "chk-new")
    assert new.latest()[0]["sources"]["src"]["splits"] == 3
    assert state_counts(new) == full_counts()
    ids = collections.Counter(r[2] for r in committed_output(out2 / "counts"))
    assert set(ids.values()) == {1} and len(ids) == N - consumed


# ---------------------------------------------------------------- parallelism


@pytest.mark.parametrize("parallelism, max_parallelism", [(200, 128), (129, 128), (5, 4)])
def test_parallelism_above_max_parallelism(tmp_path, parallelism, max_parallelism):
    p = Pipeline("too-wide", parallelism=parallelism, max_parallelism=max_parallelism)
    p.from_collection([("a", 1)], uid="src").key_by(lambda r: r[0]).process(RunningCount(), uid="count")
    with pytest.raises(ParallelismError) as exc:
        p.plan()
    assert str(parallelism) in str(exc.value) and str(max_parallelism) in str(exc.value)
    with pytest.raises(ParallelismError) as exc:
        sim_run(p, tmp_path / "chk", seed=1)
    assert str(parallelism) in str(exc.value) and str(max_parallelism) in str(exc.value)
    assert isinstance(exc.value, ValueError)
    assert not (tmp_path / "chk").exists()


@pytest.mark.parametrize("parallelism, max_parallelism, words", [
    (0, None, "parallelism"),
    (-1, 128, "parallelism"),
    (2, -3, "max_parallelism"),
    (2, 40_000, "40000"),
])
def test_impossible_parallelism_values(parallelism, max_parallelism, words):
    p = Pipeline("bad", parallelism=parallelism, max_parallelism=max_parallelism)
    p.from_collection([1], splits=1, uid="src").map(lambda x: x)
    with pytest.raises(ParallelismError, match=words):
        p.plan()


def test_max_parallelism_zero_is_rejected():
    p = Pipeline("bad", parallelism=2, max_parallelism=0)
    p.from_collection([1], uid="src").map(lambda x: x)
    with pytest.raises(ParallelismError, match="max_parallelism"):
        p.plan()


# ---------------------------------------------------------------- unpicklable state


class StoresBadValue(KeyedProcessFunction):
    """Running count, plus for key ``bad_key`` and ids above ``after`` a value pickle refuses."""

    def __init__(self, make_bad, bad_key: str = "k3", after: int = 150) -> None:
        self.make_bad = make_bad
        self.bad_key = bad_key
        self.after = after

    def open(self, ctx) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))
        self.payload = ctx.state(ValueStateDescriptor("payload"))

    def process(self, value, ctx):
        n = self.count.value() + 1
        self.count.update(n)
        if self.make_bad is not None and ctx.key == self.bad_key and value[1] > self.after:
            self.payload.update(self.make_bad())
        else:
            self.payload.update(value[1])
        return ((ctx.key, n, value[1]),)


def _bad_value_pipeline(out: Path, make_bad) -> Pipeline:
    p = make_pipeline("bad-state", parallelism=2, restart_attempts=2)
    (
        p.from_collection(input_records(N, KEYS), uid="src")
        .key_by(lambda r: r[0])
        .process(StoresBadValue(make_bad), uid="with-payload")
        .sink(FileSink(out / "counts"), uid="counts")
    )
    return p


BAD_VALUES = {
    "lambda": lambda: (lambda: None),
    "lock": lambda: threading.Lock(),
    "generator": lambda: (i for i in range(3)),
}


@pytest.mark.parametrize("what", sorted(BAD_VALUES))
def test_unpicklable_state_value_fails_naming_operator_state_and_key(tmp_path, what):
    out, chk = tmp_path / "out", tmp_path / "chk"
    p = _bad_value_pipeline(out, BAD_VALUES[what])
    with pytest.raises(JobFailedError) as exc:
        sim_run(p, chk, seed=1, source_rate=RATE)
    msg = str(exc.value)
    assert "'with-payload'" in msg, msg
    assert "'payload'" in msg, msg
    assert "'k3'" in msg, msg
    assert "gave up after 2 restarts" in msg
    assert any(isinstance(e, StateSerializationError) for e in _error_chain(exc.value))

    # the last completed checkpoint (taken before the bad value appeared) is intact ...
    storage = LocalCheckpointStorage(chk)
    assert storage.list_checkpoints(), "the scenario needs an epoch completed before the bad value"
    manifest, root = storage.latest()
    rows = list(storage.read_operator_rows(manifest, root, "with-payload"))
    assert rows
    # ... and restorable: the fixed job finishes from it with nothing lost and nothing doubled
    fixed = _bad_value_pipeline(out, None)
    result = sim_run(fixed, chk, seed=2, source_rate=RATE, restore="latest")
    assert result.completed_epochs[0] == manifest["epoch"] + 1
    assert check_running_counts(committed_output(out / "counts"), set(range(N))) == []


# ---------------------------------------------------------------- checkpoint dirs used the wrong way


def test_fresh_run_into_a_dir_with_checkpoints_suggests_restore_latest(tmp_path):
    _p, out, chk, storage, _r = completed_job(tmp_path)
    before = storage.list_checkpoints()
    p = running_count(n=N, keys=KEYS, out=out, emit_ids=True)
    with pytest.raises(CheckpointError) as exc:
        sim_run(p, chk, seed=1, source_rate=RATE)
    assert "restore='latest'" in str(exc.value)
    assert str(chk) in str(exc.value)
    assert storage.list_checkpoints() == before  # nothing touched


def test_restore_an_older_checkpoint_into_the_dir_holding_newer_ones(tmp_path):
    _p, out, chk, storage, _r = completed_job(tmp_path)
    cps = storage.list_checkpoints()
    old = cps[0]
    newest_manifest = manifest_path(storage, cps[-1]).read_bytes()
    with pytest.raises(CheckpointError) as exc:
        restore_run(out, chk, storage.checkpoint_dir(old))
    msg = str(exc.value)
    assert f"chk-{old}" in msg and "newer" in msg
    assert storage.list_checkpoints() == cps
    assert manifest_path(storage, cps[-1]).read_bytes() == newest_manifest


def test_restore_an_older_checkpoint_into_a_new_dir_works(tmp_path):
    """What the error above suggests: restore the old checkpoint into a new checkpoint dir
    (same sink: its output of later epochs is produced again, as with any older checkpoint)."""
    _p, out, _chk, storage, _r = completed_job(tmp_path)
    old = storage.list_checkpoints()[0]
    result = restore_run(out, tmp_path / "chk-new", storage.checkpoint_dir(old))
    assert result.completed_epochs[0] == old + 1
    assert state_counts(LocalCheckpointStorage(tmp_path / "chk-new")) == full_counts()


def test_restore_into_a_new_sink_folder(tmp_path):
    _p, _out, _chk, storage, _r = completed_job(tmp_path)
    old = storage.list_checkpoints()[0]
    new_out = tmp_path / "out-new"
    try:
        restore_run(new_out, tmp_path / "chk-new", storage.checkpoint_dir(old),
                    pipeline=running_count(n=N, keys=KEYS, out=new_out, emit_ids=True))
    except EpochStreamError:
        pass  # a clear refusal naming the sink would be fine too
    else:
        assert state_counts(LocalCheckpointStorage(tmp_path / "chk-new")) == full_counts()


# ---------------------------------------------------------------- user functions that raise


class Boom(ValueError):
    pass


def _raise_on(rid: int):
    def check(record):
        if record[1] == rid:
            raise Boom(f"boom at id {rid}")
        return record

    return check


class ProcessRaises(KeyedProcessFunction):
    def open(self, ctx) -> None:
        self.count = ctx.state(ValueStateDescriptor("count", default=0))

    def process(self, value, ctx):
        if value[1] == 120:
            raise Boom("boom at id 120")
        self.count.update(self.count.value() + 1)
        return (value,)


class OpenRaises(KeyedProcessFunction):
    def open(self, ctx) -> None:
        raise Boom("boom in open")

    def process(self, value, ctx):
        return (value,)


def _user_error_pipeline(out: Path, where: str, restart_attempts: int) -> Pipeline:
    p = make_pipeline("user-error", parallelism=2, restart_attempts=restart_attempts)
    s = p.from_collection(input_records(N, KEYS), uid="src")
    if where == "map":
        s = s.map(_raise_on(120), name="my-map")
    elif where == "filter":
        s = s.filter(lambda r: _raise_on(120)(r) is not None, name="my-filter")
    elif where == "flat_map":
        s = s.flat_map(lambda r: [_raise_on(120)(r)], name="my-flat-map")
    if where == "key_by":
        keyed = s.key_by(lambda r: _raise_on(120)(r)[0])
    else:
        keyed = s.key_by(lambda r: r[0])
    fn = ProcessRaises() if where == "process" else OpenRaises() if where == "open" else RunningCount()
    keyed.process(fn, uid="my-process").sink(FileSink(out / "counts"), uid="counts")
    return p


USER_ERRORS = {
    "map": ("my-map", "boom at id 120"),
    "filter": ("my-filter", "boom at id 120"),
    "flat_map": ("my-flat-map", "boom at id 120"),
    "key_by": ("key_by", "boom at id 120"),
    "process": ("my-process", "boom at id 120"),
    "open": ("my-process", "boom in open"),
}


@pytest.mark.parametrize("where", sorted(USER_ERRORS))
@pytest.mark.parametrize("restart_attempts", [0, 3])
def test_user_function_that_raises(tmp_path, where, restart_attempts):
    op, words = USER_ERRORS[where]
    with pytest.raises(JobFailedError) as exc:
        sim_run(_user_error_pipeline(tmp_path / "out", where, restart_attempts), tmp_path / "chk", seed=1,
                source_rate=RATE)
    msg = str(exc.value)
    assert op in msg, msg
    assert words in msg, msg
    assert f"gave up after {restart_attempts} restarts" in msg
    chain = _error_chain(exc.value)
    assert any(isinstance(e, UserFunctionError) for e in chain)
    assert any(isinstance(e, Boom) for e in chain), "the original exception is lost from the cause chain"


def test_user_function_failure_leaves_the_last_checkpoint_restorable(tmp_path):
    """The process function raises at id 120 on every attempt; what completed before is intact
    and a fixed job restores it and finishes with every id once."""
    out, chk = tmp_path / "out", tmp_path / "chk"
    with pytest.raises(JobFailedError):
        sim_run(_user_error_pipeline(out, "process", 2), chk, seed=1, source_rate=RATE)
    storage = LocalCheckpointStorage(chk)
    assert storage.list_checkpoints(), "the scenario needs an epoch completed before the failure"
    manifest, _root = storage.latest()
    fixed = make_pipeline("user-error", parallelism=2)
    (
        fixed.from_collection(input_records(N, KEYS), uid="src")
        .key_by(lambda r: r[0])
        .process(RunningCount(emit_ids=True), uid="my-process")
        .sink(FileSink(out / "counts"), uid="counts")
    )
    # the failing version emitted raw records (key, id), the fixed one (key, n, id): the ids
    # committed before the failure plus those after the restore are each exactly once
    result = sim_run(fixed, chk, seed=2, source_rate=RATE, restore="latest")
    assert result.completed_epochs[0] == manifest["epoch"] + 1
    ids = collections.Counter(r[-1] for r in committed_output(out / "counts"))
    assert set(ids) == set(range(N)) and max(ids.values()) == 1


# ---------------------------------------------------------------- configuration mistakes


@pytest.mark.parametrize("kwargs, words", [
    ({"mode": "exactly-once"}, "mode"),
    ({"checkpoint_interval": 0}, "interval"),
    ({"checkpoint_interval": -1.0}, "interval"),
    ({"restart_attempts": -1}, "restart_attempts"),
])
def test_bad_pipeline_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Pipeline("bad", **kwargs)


def test_unknown_deployment(tmp_path):
    p = running_count(n=N, out=tmp_path / "out")
    with pytest.raises(ValueError, match="deployment"):
        p.run(deployment="cloud", checkpoint_dir=str(tmp_path / "chk"))


def test_duplicate_uid_is_rejected():
    p = Pipeline("dup", parallelism=1)
    p.from_collection([("a", 1)], uid="x").key_by(lambda r: r[0]).process(RunningCount(), uid="x")
    with pytest.raises(ValueError, match="'x'"):
        p.plan()


def test_process_without_key_by_is_rejected():
    p = Pipeline("nokey", parallelism=1)
    with pytest.raises(TypeError, match="key_by"):
        p.from_collection([1], uid="src").process(RunningCount(), uid="c")


# ---------------------------------------------------------------- the CLI refuses what cannot work (issue 18)


@pytest.mark.parametrize("argv, words", [
    (["-p", "0"], "argument --parallelism/-p: '0' is out of range: must be >= 1"),
    (["-p", "-2"], "argument --parallelism/-p: '-2' is out of range: must be >= 1"),
    (["--max-parallelism", "0"], "argument --max-parallelism: '0' is out of range: must be >= 1 and <= 32768"),
    (["--max-parallelism", "40000"], "'40000' is out of range: must be >= 1 and <= 32768"),
    (["-p", "4", "--max-parallelism", "2"], "argument --max-parallelism: 2 is below --parallelism 4"),
    (["--interval", "-1"], "argument --interval: '-1' is out of range: must be >= 0"),
    (["--interval", "nan"], "argument --interval: 'nan' is not a finite number"),
    (["--duration", "0"], "argument --duration: '0' is out of range: must be > 0"),
    (["-p", "two"], "argument --parallelism/-p: 'two' is not an integer"),
])
def test_cli_ranges_are_checked_at_parse_time(tmp_path, capsys, argv, words):
    """On main ``-p 0`` and ``--max-parallelism 0`` were silently ignored."""
    from epochstream.cli import main

    job = tmp_path / "job.py"
    job.write_text("raise SystemExit('the job file must not even be imported')\n")
    with pytest.raises(SystemExit) as exc:
        main(["run", f"{job}:build", "--deployment", "sim", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    print(err.splitlines()[-1])
    assert words in err and "usage:" in err


@pytest.mark.parametrize("body, shown", [
    ("return None", "returned NoneType None, not a Pipeline"),
    ("return [1, 2]", "returned list [1, 2], not a Pipeline"),
    ("return 'x' * 500", "returned str 'xxxxxxxx"),
])
def test_cli_job_function_that_does_not_return_a_pipeline(tmp_path, capsys, body, shown):
    """On main: a Python traceback and exit 1."""
    from epochstream.cli import main

    job = tmp_path / "job.py"
    job.write_text(f"def build():\n    {body}\n")
    assert main(["run", f"{job}:build", "--deployment", "sim", "--checkpoint-dir", str(tmp_path / "chk")]) == 2
    err = capsys.readouterr().err.strip()
    print(err)
    assert len(err.splitlines()) == 1 and f"{job}:build {shown}" in err and "Traceback" not in err
    assert len(err) < 300


# ---------------------------------------------------------------- NaN keys and standard JSON (issue 18)


def test_nan_keys_form_one_key_and_one_stable_key_group():
    from epochstream.graph.keygroups import NAN_KEY, assign_to_key_group, canonical_key, key_bytes

    nans = [float("nan"), float("-nan"), float("inf") - float("inf"), struct_nan(0x7FF8000000000001)]
    assert {key_bytes(k) for k in nans} == {b"fnan"}
    assert len({assign_to_key_group(k, 128) for k in nans}) == 1
    assert len({assign_to_key_group(("a", k), 128) for k in nans}) == 1
    assert all(canonical_key(k) is NAN_KEY for k in nans)
    assert assign_to_key_group(-0.0, 128) == assign_to_key_group(0.0, 128) == assign_to_key_group(0, 128)


def struct_nan(bits: int) -> float:
    import struct

    return struct.unpack("<d", struct.pack("<Q", bits))[0]


class FloatCount(RunningCount):
    def process(self, value, ctx):
        n = self.count.value() + 1
        self.count.update(n)
        return ((None if ctx.key != ctx.key else ctx.key, n, value[1]),)


@pytest.mark.parametrize("mode", ["aligned", "tracker"])
def test_ten_nan_keys_count_to_ten_rows(tmp_path, mode):
    """On main: ten records with key NaN counted ten 1s (Spark's grouping gives one group of 10).
    The job fails once mid-way, so the NaN key's state also goes through a restore."""
    from epochstream.deploy.sim import FailureSchedule

    records = [(float("nan") if i % 3 == 0 else float(i % 2), i) for i in range(60)]
    p = make_pipeline("nan-keys", mode=mode, parallelism=2)
    p.from_collection(records, uid="src").key_by(lambda r: r[0]).process(FloatCount(), uid="count") \
        .sink(FileSink(tmp_path / "out"), uid="out")
    result = sim_run(p, tmp_path / "chk", seed=3, failures=FailureSchedule(kill_times=[0.002]))
    assert result.restarts == 1, "the NaN key goes through a failover and restore"
    out = committed_output(tmp_path / "out")
    nan_counts = sorted(n for k, n, _ in out if k is None)
    assert nan_counts == list(range(1, 21)), nan_counts  # one key, counted 1..20
    assert sorted(r[2] for r in out) == list(range(60))


def test_nan_keys_of_a_column_form_one_key_across_batches(tmp_path):
    import pyarrow as pa

    from epochstream import KeyedBatchFunction

    class Count(KeyedBatchFunction):
        def open(self, ctx):
            self.count = ctx.state(ValueStateDescriptor("count", default=0))

        def process_batch(self, key, batch, ctx):
            c = self.count.value() + batch.num_rows
            self.count.update(c)
            return pa.record_batch({"key": pa.array([key], pa.float64()), "n": pa.array([c], pa.int64())})

    keys = [float("nan") if i % 2 else 1.0 for i in range(40)]
    table = pa.table({"key": pa.array(keys, pa.float64()), "id": pa.array(range(40), pa.int64())})
    p = make_pipeline("nan-columns", parallelism=2, batch_size=4)
    p.from_arrow(table, uid="src").key_by("key").process_batches(Count(), uid="count") \
        .sink(FileSink(tmp_path / "out"), uid="out")
    sim_run(p, tmp_path / "chk", seed=1)
    out = committed_output(tmp_path / "out")
    assert max(r["n"] for r in out if r["key"] is None) == 20  # NaN written as null, counted as one key
    assert max(r["n"] for r in out if r["key"] == 1.0) == 20


def test_filesink_writes_standard_json(tmp_path):
    """On main FileSink wrote ``NaN``, which strict JSON readers reject."""
    sink = FileSink(tmp_path / "out")
    staged = sink.pre_commit("out", 0, 1, "a", [{"x": float("nan"), "y": [float("inf"), -float("inf"), 1.5]},
                                                 (1, float("nan"))])
    sink.commit([staged])
    text = "".join(p.read_text() for p in (tmp_path / "out").glob("part-*"))
    assert text.splitlines() == ['{"x":null,"y":[null,null,1.5]}', "[1,null]"]

    def strict(token):
        raise ValueError(f"not standard JSON: {token}")

    assert [json.loads(line, parse_constant=strict) for line in text.splitlines()]


# ---------------------------------------------------------------- errors that say where (issue 18)


def _where_of(p, record) -> tuple[int, int]:
    """(split, offset) of ``record`` in source "src" of pipeline ``p``."""
    src = p.sources["src"]
    for split in range(src.num_splits):
        rows = src.read(split, 0, 10**6)
        if record in rows:
            return split, rows.index(record)
    raise AssertionError(f"{record} is not in the source")


def test_a_map_failure_names_operator_subtask_record_split_and_offset(tmp_path):
    """On main: "map 'my-map' failed: Boom('boom at id 120')", nothing about where."""
    p = _user_error_pipeline(tmp_path / "out", "map", 0)
    with pytest.raises(JobFailedError) as exc:
        sim_run(p, tmp_path / "chk", seed=1, source_rate=RATE)
    msg = str(exc.value)
    print(msg)
    split, offset = _where_of(p, ("k1", 120))
    assert re.search(rf"map 'my-map' failed \(subtask {split % 2}, record \('k1', 120\), read from source 'src' "
                     rf"split {split} offset {offset}\): Boom\('boom at id 120'\)", msg), msg


def test_a_process_failure_names_key_and_record(tmp_path):
    with pytest.raises(JobFailedError) as exc:
        sim_run(_user_error_pipeline(tmp_path / "out", "process", 0), tmp_path / "chk", seed=1, source_rate=RATE)
    msg = str(exc.value)
    print(msg)
    assert re.search(r"process 'my-process' failed \(subtask [01], key 'k1', record \('k1', 120\)\): "
                     r"Boom\('boom at id 120'\)", msg), msg


def test_a_long_record_is_truncated_in_the_message(tmp_path):
    p = make_pipeline("long-record", parallelism=1, restart_attempts=0)
    p.from_collection([("k", "x" * 5000)], uid="src").map(lambda r: 1 / 0, name="div") \
        .sink(DiscardingSink(), uid="out")
    with pytest.raises(JobFailedError) as exc:
        sim_run(p, tmp_path / "chk", seed=1)
    msg = str(exc.value)
    assert "record ('k', 'xxxx" in msg and "... (5009 chars)" in msg and "split 0 offset 0" in msg
    assert len(msg) < 1200, msg


class BrokenSource:
    """A source whose split 1 fails to read from offset 3 on."""

    def __new__(cls):
        from epochstream.runtime.sources import Source

        class _Broken(Source):
            num_splits = 2

            def read(self, split, offset, count):
                if split == 1 and offset + count > 3:
                    if offset >= 3:
                        raise ConnectionError("broker went away")
                    count = 3 - offset
                return [(f"k{split}", split * 100 + i) for i in range(offset, min(offset + count, 10))]

            def split_length(self, split):
                return 10

        return _Broken()


def test_a_source_failure_names_the_source_uid_and_split(tmp_path):
    """On main the failing source was not named by its uid."""
    from epochstream.runtime.errors import SourceError

    p = make_pipeline("broken-source", parallelism=2, restart_attempts=1, batch_size=2)
    p.from_source(BrokenSource(), uid="orders").key_by(lambda r: r[0]).process(RunningCount(), uid="count") \
        .sink(DiscardingSink(), uid="out")
    with pytest.raises(JobFailedError) as exc:
        sim_run(p, tmp_path / "chk", seed=1)
    msg = str(exc.value)
    print(msg)
    assert "source 'orders' split 1 failed to read at offset 3: ConnectionError('broker went away')" in msg
    assert any(isinstance(e, SourceError) for e in _error_chain(exc.value))


FAIL_ONCE = [True]


def _fail_once(record):
    if FAIL_ONCE[0] and record[1] == 120:
        FAIL_ONCE[0] = False
        raise Boom("boom at id 120")
    return record


def test_the_same_text_reaches_the_jobresult(tmp_path, caplog):
    FAIL_ONCE[0] = True
    p = make_pipeline("fails-once", parallelism=2, restart_attempts=2)
    p.from_collection(input_records(N, KEYS), uid="src").map(_fail_once, name="once") \
        .key_by(lambda r: r[0]).process(RunningCount(emit_ids=True), uid="count") \
        .sink(FileSink(tmp_path / "out"), uid="out")
    result = sim_run(p, tmp_path / "chk", seed=1, source_rate=RATE)
    reason = result.metrics["failovers"][0]["reason"]
    assert re.search(r"map 'once' failed \(subtask [01], record \('k1', 120\), read from source 'src' split \d+ "
                     r"offset \d+\): Boom", reason), reason
    assert any(reason.splitlines()[0] in r.getMessage() for r in caplog.records)
    assert check_running_counts(committed_output(tmp_path / "out"), range(N)) == []


# ---------------------------------------------------------------- housekeeping (issue 18)


def test_list_tells_dead_jobs_from_live_and_prunes_them(tmp_path, monkeypatch, capsys):
    """On main a killed job stayed in the registry as if it ran."""
    import os
    import subprocess
    import sys

    from epochstream.backends import open_storage
    from epochstream.cli import main
    from epochstream.deploy import jobs
    from epochstream.deploy.lease import Lease

    monkeypatch.setenv("EPOCHSTREAM_HOME", str(tmp_path / "home"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    live_chk = tmp_path / "live-chk"
    lease = Lease(open_storage(str(live_chk)), "live", "1" * 32).acquire()
    try:
        jobs.register({"id": "1" * 32, "name": "live", "pid": os.getpid(), "endpoint": "http://127.0.0.1:1",
                       "checkpoint_dir": str(live_chk), "started_at": 1})
        jobs.register({"id": "2" * 32, "name": "killed", "pid": dead_pid, "endpoint": "http://127.0.0.1:2",
                       "checkpoint_dir": str(tmp_path / "dead-chk"), "started_at": 2})
        jobs.register({"id": "3" * 32, "name": "lost-lease", "pid": os.getpid(), "endpoint": "http://127.0.0.1:3",
                       "checkpoint_dir": str(tmp_path / "other-chk"), "started_at": 3})
        assert main(["list", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert {j["name"]: j["status"] for j in doc["jobs"]} == {"live": "running", "killed": "dead",
                                                                 "lost-lease": "orphaned"}
        assert main(["list"]) == 0
        text = capsys.readouterr().out
        print(text)
        assert "1 dead job(s): their processes are gone; epochstream list --prune removes them" in text
        assert main(["list", "--prune"]) == 0
        text = capsys.readouterr().out
        assert f"pruned dead job 'killed' ({'2' * 32}, pid {dead_pid})" in text
        assert {j["name"] for j in jobs.listed()} == {"live", "lost-lease"}
    finally:
        lease.release()


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    from epochstream.backends.local import LocalObjects

    store = LocalObjects(tmp_path)
    with pytest.raises(TypeError):
        store.put(tmp_path / "chk-1" / "x", "not bytes")  # fails after the temporary file was created
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_the_next_start_removes_temporary_files_a_killed_writer_left(tmp_path, caplog):
    """On main the ``.tmp`` files of a killed or failed write stayed for ever."""
    p, out, chk, storage, _result = completed_job(tmp_path)
    latest = storage.list_checkpoints()[-1]
    strays = [storage.checkpoint_dir(latest + 1) / f".{METADATA}.tmp-4242",
              chk / "shared" / "count" / "0" / ".e99-aX.parquet.tmp-4242"]
    for s in strays:
        s.parent.mkdir(parents=True, exist_ok=True)
        s.write_bytes(b"half")
    restore_run(tmp_path / "out2", chk, "latest")
    assert not any(s.exists() for s in strays)
    assert any("removed 2 temporary files" in r.getMessage() for r in caplog.records)


def test_a_failed_savepoint_leaves_nothing_behind(tmp_path):
    """A savepoint whose source checkpoint has a damaged state file fails half-way: the
    savepoint folder, its state files and temporary files are gone (on main they stayed)."""
    from epochstream.backends.savepoint import write_savepoint

    p, out, chk, storage, _result = completed_job(tmp_path)
    manifest, root = storage.latest()
    files = manifest["operators"]["count"]["files"]
    assert len({f["subtask"] for f in files}) == 2
    last = [f for f in files if f["subtask"] == 1][-1]
    (chk / last["path"]).write_bytes(b"damaged")
    target = tmp_path / "savepoints"
    with pytest.raises(CheckpointError, match="is damaged"):
        write_savepoint(storage, manifest, root, target, "f" * 32)
    assert not target.exists() or [x for x in target.rglob("*")] == []
