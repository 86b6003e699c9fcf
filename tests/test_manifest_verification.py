"""Verified manifests (issue 18 item 2): a manifest that is wrong restores nothing.

A job fails mid-way (a map raises at id ``FAIL_AT``), leaving completed checkpoints and
their committed output. Each case copies that folder, damages the newest manifest, and
restores it by path with the fixed job: the restore is either a clear ``CheckpointError``
that changes nothing, or it finishes with every input id committed exactly once and every
key's counts 1..n. Never a duplicate, never a silent replay from the wrong offset.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epochstream import CheckpointError, FileSink
from epochstream.backends.local import METADATA, LocalCheckpointStorage
from epochstream.deploy.failures import JobFailedError
from epochstream.snapshot.manifest import FORMAT_VERSION, content_checksum
from pipelines import (
    RunningCount,
    _key,
    check_running_counts,
    committed_output,
    input_records,
    make_pipeline,
    sim_run,
    without_fsync,
)

N, KEYS, FAIL_AT = 600, 5, 520
FAIL = [True]


@pytest.fixture(scope="module", autouse=True)
def _no_fsync():
    with without_fsync():
        yield


def _fail_at(record):
    if FAIL[0] and record[1] == FAIL_AT:
        raise RuntimeError(f"boom at id {FAIL_AT}")
    return record


def job(out: Path, source_uid: str = "src"):
    p = make_pipeline("verified", parallelism=2, restart_attempts=0)
    p.checkpoint.num_retained = 20
    p.from_collection(input_records(N, KEYS), uid=source_uid).map(_fail_at, name="fail-at") \
        .key_by(_key).process(RunningCount(emit_ids=True), uid="count").sink(FileSink(out / "counts"), uid="counts")
    return p


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory):
    """chk/ and out/ of a job that failed after committing several epochs."""
    base = tmp_path_factory.mktemp("failed")
    FAIL[0] = True
    try:
        with pytest.raises(JobFailedError):
            sim_run(job(base / "out"), base / "chk", seed=1)
    finally:
        FAIL[0] = False
    epochs = LocalCheckpointStorage(base / "chk").list_checkpoints()
    assert len(epochs) >= 2, "the scenario needs several completed epochs"
    assert committed_output(base / "out" / "counts"), "and committed output"
    return base


def restore_copy(base: Path, where: Path, damage) -> tuple[str, object]:
    """Copy the failed job, damage its newest manifest, restore it: ("refused", error) or ("ran", records)."""
    shutil.copytree(base, where)
    storage = LocalCheckpointStorage(where / "chk")
    epochs = storage.list_checkpoints()
    newest = storage.checkpoint_dir(epochs[-1]) / METADATA
    newest.write_bytes(damage(newest.read_bytes(), storage, epochs))
    before = sorted((p.name, p.read_bytes()) for p in (where / "out" / "counts").glob("part-*"))
    try:
        sim_run(job(where / "out"), where / "chk", seed=2, restore=str(newest.parent))
    except CheckpointError as exc:
        after = sorted((p.name, p.read_bytes()) for p in (where / "out" / "counts").glob("part-*"))
        assert after == before, "a refused restore changed the committed output"
        return "refused", exc
    return "ran", committed_output(where / "out" / "counts")


def assert_exact(records) -> None:
    assert check_running_counts(records, range(N)) == [], "duplicated, lost or replayed output"


# ---------------------------------------------------------------- damages


def flip_digit(i: int):
    def damage(data: bytes, storage, epochs) -> bytes:
        text = data.decode()
        digits = [m.start() for m in re.finditer(r"\d", text)]
        pos = digits[i % len(digits)]
        return (text[:pos] + str((int(text[pos]) + 1) % 10) + text[pos + 1:]).encode()
    return damage


def truncate(frac: float):
    return lambda data, storage, epochs: data[: int(len(data) * frac)]


def edit(path: tuple[str, ...], how: str):
    """Drop the key at ``path`` or empty its value (keeping the old checksum)."""
    def damage(data: bytes, storage, epochs) -> bytes:
        m = json.loads(data)
        node = m
        for part in path[:-1]:
            node = node[part] if part in node else node[next(iter(node))]  # "*": the first entry
        key = path[-1] if path[-1] in node else next(iter(node))
        if how == "drop":
            del node[key]
        else:
            node[key] = type(node[key])()
        return json.dumps(m, indent=1, sort_keys=True).encode()
    return damage


def swap(data: bytes, storage, epochs) -> bytes:
    return (storage.checkpoint_dir(epochs[-2]) / METADATA).read_bytes()


KEY_PATHS = [("sources",), ("sources", "src", "offsets"), ("operators",), ("operators", "count", "files"),
             ("sinks",), ("sinks", "counts", "staged"), ("epoch",), ("checksum",), ("format_version",),
             ("max_parallelism",)]

damages = st.one_of(
    st.integers(0, 10_000).map(flip_digit),
    st.floats(0.0, 0.999).map(truncate),
    st.tuples(st.sampled_from(KEY_PATHS), st.sampled_from(["drop", "empty"])).map(lambda a: edit(*a)),
    st.just(swap),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=damages)
def test_a_damaged_manifest_restores_exactly_or_is_refused(failed_job, tmp_path_factory, damage):
    outcome, value = restore_copy(failed_job, tmp_path_factory.mktemp("case") / "job", damage)
    if outcome == "refused":
        assert "nothing is restored" in str(value) or "corrupt or truncated" in str(value) \
            or "damaged" in str(value) or "not an epochstream" in str(value), value
    else:
        assert_exact(value)


# ---------------------------------------------------------------- the findings, one by one


def test_one_digit_of_a_source_offset_changed_is_refused(failed_job, tmp_path):
    """On main this restored silently and replayed input from the wrong place."""
    def damage(data, storage, epochs):
        m = json.loads(data)
        offsets = m["sources"]["src"]["offsets"]
        split = next(iter(offsets))
        offsets[split] -= 10
        return json.dumps(m, indent=1, sort_keys=True).encode()

    outcome, exc = restore_copy(failed_job, tmp_path / "job", damage)
    assert outcome == "refused"
    print(exc)
    assert "manifest checksum does not match its content" in str(exc) and "chk-" in str(exc)


def test_empty_sources_in_a_manifest_is_refused(failed_job, tmp_path):
    """``"sources": {}`` (checksum recomputed, as a hand edit that knows the format would):
    the source would start from the beginning into sinks that hold its output: refused."""
    def damage(data, storage, epochs):
        m = json.loads(data)
        m["sources"] = {}
        m["checksum"] = content_checksum(m)
        return json.dumps(m).encode()

    outcome, exc = restore_copy(failed_job, tmp_path / "job", damage)
    assert outcome == "refused"
    print(exc)
    assert "source(s) ['src'] have no offsets in the checkpoint" in str(exc)
    assert "--allow-sources-from-start" in str(exc)


def test_swapped_manifests_are_refused(failed_job, tmp_path):
    outcome, exc = restore_copy(failed_job, tmp_path / "job", swap)
    assert outcome == "refused"
    assert re.search(r"is the manifest of epoch \d+, not of epoch \d+ \(moved, copied or swapped", str(exc)), exc


def test_an_undamaged_copy_restores_exactly(failed_job, tmp_path):
    outcome, records = restore_copy(failed_job, tmp_path / "job", lambda data, storage, epochs: data)
    assert outcome == "ran"
    assert_exact(records)


def test_a_renamed_source_uid_with_n_is_refused_then_allowed_explicitly(failed_job, tmp_path, caplog):
    """``-n`` after a source's uid was renamed: on main the source started from the beginning
    without a word; now the restore names what it drops and refuses the replay."""
    shutil.copytree(failed_job, tmp_path / "job")
    out, chk = tmp_path / "job" / "out", tmp_path / "job" / "chk"
    with pytest.raises(CheckpointError) as exc:
        sim_run(job(out, source_uid="src-v2"), chk, seed=2, restore="latest", allow_non_restored_state=True)
    assert "source(s) ['src-v2'] have no offsets" in str(exc.value) and "it has ['src']" in str(exc.value)
    assert "give it back its old uid" in str(exc.value)
    caplog.clear()
    sim_run(job(out, source_uid="src-v2"), chk, seed=2, restore="latest", allow_non_restored_state=True,
            allow_sources_from_start=True)
    notes = [r.getMessage() for r in caplog.records if "restore from" in r.getMessage()]
    assert any("dropping source offsets of operator 'src'" in n for n in notes), notes
    assert any("source 'src-v2' has no offsets in the checkpoint: it starts from the beginning" in n
               for n in notes), notes


def test_an_old_manifest_without_checksum_is_read_with_a_warning(failed_job, tmp_path, caplog):
    """Manifests written before checksums (format 1 and 2) are accepted unverified, with a
    warning; a current-format manifest without its checksum is refused (a dropped key)."""
    shutil.copytree(failed_job, tmp_path / "job")
    storage = LocalCheckpointStorage(tmp_path / "job" / "chk")
    path = storage.checkpoint_dir(storage.list_checkpoints()[-1]) / METADATA
    m = json.loads(path.read_bytes())
    del m["checksum"]
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=f"format version {FORMAT_VERSION}\\) lacks its checksum"):
        storage.load_manifest(path)
    m["format_version"] = 2
    path.write_text(json.dumps(m))
    storage.load_manifest(path)
    assert any("predates manifest checksums: read unverified" in r.getMessage() for r in caplog.records)
