"""``ManifestView``: a validated manifest's fields, typed, read from the document unchanged."""

from __future__ import annotations

import json

import pytest

from epochstream.snapshot.manifest import StateFileRef, encode_manifest, validate_manifest
from epochstream.snapshot.manifest_view import ManifestView


def _manifest() -> dict:
    ref = StateFileRef("count", 1, 4, "count/f.parquet", (8, 15), False, 3, 120, "ab" * 32)
    m = {"format": "epochstream-checkpoint", "format_version": 3, "job": "j", "job_id": "id-1", "epoch": 4,
         "kind": "savepoint", "mode": "unaligned", "parallelism": 2, "max_parallelism": 16, "self_contained": True,
         "created_at": "2026-01-01T00:00:00Z",
         "operators": {"count": {"kind": "process", "states": {"n": {}, "a": {}}, "files": [ref.to_json()]}},
         "sources": {"src": {"offsets": {"0": 7, "1": 9}, "splits": 3, "max_timestamps": {"1": 2.5}}},
         "sinks": {"out": {"staged": ["out/p-1"]}},
         "metrics": {"channel_state_records": 2},
         "channel_state": {"2.0": {"records": 2, "bytes": 0, "data": ""}}}
    return validate_manifest(json.loads(encode_manifest(m)), "test")


def test_the_view_reads_every_field_typed():
    m = _manifest()
    v = ManifestView.of(m)
    assert (v.job, v.job_id, v.epoch, v.kind, v.mode, v.parallelism, v.max_parallelism) == \
        ("j", "id-1", 4, "savepoint", "unaligned", 2, 16)
    assert v.is_savepoint and v.self_contained and v.has_channel_state
    assert v.operators["count"].states == ("a", "n") and v.operators["count"].operator_states == ()
    assert v.state_files == (StateFileRef.from_json(m["operators"]["count"]["files"][0]),)
    src = v.sources["src"]
    assert dict(src.offsets) == {0: 7, 1: 9} and src.splits == 3 and dict(src.max_timestamps) == {1: 2.5}
    assert v.source_splits("src") == 3 and v.source_splits("other") is None
    assert v.staged == {"out": ("out/p-1",)} and v.metrics["channel_state_records"] == 2
    assert v.raw is m


def test_the_view_is_read_only_and_leaves_the_document_as_it_is():
    m = _manifest()
    before = encode_manifest(m)
    v = ManifestView.of(m)
    _ = v.operators, v.sources, v.staged, v.state_files
    with pytest.raises(AttributeError):
        v.raw = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        v.sources["src"] = None  # type: ignore[index]
    assert encode_manifest(m) == before


def test_split_count_defaults_to_the_splits_with_offsets():
    v = ManifestView.of({"sources": {"s": {"offsets": {"0": 1, "1": 2}}}})
    assert v.source_splits("s") == 2 and not v.self_contained and v.kind is None
