"""The Delta backend's parts that need no Spark: the state table's schema, paths, the commit log
read from ``_delta_log``, and the per-writer table cache (``backends/delta/tables.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epochstream.backends.delta import schema, tables
from epochstream.backends.delta.tables import DeltaTables, history, version_of_epoch
from epochstream.backends.objects import STATE_SCHEMA
from epochstream.runtime.types import TypeInformation


def test_the_state_table_schema_is_defined_once():
    assert schema.NAMES == ("key_group", "key", "state", "value", "epoch")
    assert schema.arrow_schema(schema.ROW_NAMES).equals(STATE_SCHEMA)  # a row is what a state file holds
    assert schema.DDL == "key_group INT NOT NULL, key BINARY NOT NULL, state STRING NOT NULL, value BINARY, " \
                         "epoch BIGINT NOT NULL"
    assert set(schema.ROW_KEY) < set(schema.ROW_NAMES)


@pytest.mark.parametrize("path, remote", [
    ("/data/chk", False), ("relative/dir", False), ("file:///data/chk", False), ("file:/data/chk", False),
    ("s3://bucket/t", True), ("s3a://bucket/t", True),
])
def test_remote_paths_are_told_by_their_scheme(path, remote):
    assert tables.is_remote(path) is remote


def test_spark_reaches_s3_through_s3a_and_local_paths_absolutely(tmp_path, monkeypatch):
    assert tables.spark_uri("s3://b/t") == "s3a://b/t"
    assert tables.spark_uri("s3a://b/t") == "s3a://b/t"
    monkeypatch.chdir(tmp_path)
    assert tables.spark_uri("t") == str(tmp_path.resolve() / "t")


def test_staged_sink_output_alone_does_not_make_a_folder_foreign(tmp_path):
    (tmp_path / tables.STAGING).mkdir()
    assert not tables.path_has_files(str(tmp_path))
    (tmp_path / "other.parquet").write_bytes(b"")
    assert tables.path_has_files(str(tmp_path))
    assert not tables.path_has_files("s3://bucket/t")


def _commit(log: Path, version: int, operation: str, meta: Any) -> None:
    info: dict[str, Any] = {"operation": operation}
    if meta is not None:
        info["userMetadata"] = meta if isinstance(meta, str) else json.dumps(meta)
    lines = [json.dumps({"protocol": {}}), json.dumps({"commitInfo": info})]
    (log / f"{version:020d}.json").write_text("\n".join(lines) + "\n")


def test_local_history_is_read_from_the_delta_log_newest_first(tmp_path):
    log = tmp_path / "_delta_log"
    log.mkdir()
    _commit(log, 0, "CREATE TABLE", {"epochstream": "app", "epoch": 0})
    _commit(log, 1, "MERGE", {"epochstream": "app", "epoch": 3})
    _commit(log, 2, "WRITE", "not json")
    _commit(log, 3, "WRITE", None)
    hist = history(str(tmp_path))
    assert [(h["version"], h["operation"]) for h in hist] == [(3, "WRITE"), (2, "WRITE"), (1, "MERGE"),
                                                              (0, "CREATE TABLE")]
    assert hist[0]["meta"] is None and hist[1]["meta"] is None
    assert version_of_epoch(str(tmp_path), "app", 3) == 1
    assert version_of_epoch(f"file:{tmp_path}", "app", 3) == 1
    assert version_of_epoch(str(tmp_path), "app", 2) is None
    assert version_of_epoch(str(tmp_path), "other", 3) is None


def test_typed_columns_are_cached_per_table_version_and_per_writer(tmp_path, monkeypatch):
    """Typed columns come from the table's schema (read by delta-rs) once per version and writer."""
    import pyarrow as pa
    from deltalake import write_deltalake

    table = str(tmp_path / "tbl")
    tables.create(table, pa.schema([("key_group", pa.int32()), ("typed_count", pa.int64())]),
                  {tables.FORMAT_PROPERTY: tables.STATE_FORMAT}, "app")  # versions 0 (CREATE) and 1 (properties)
    reads = []
    real = tables.open_table

    def counting(path, version=None):
        reads.append(version)
        return real(path, version)

    monkeypatch.setattr(tables, "open_table", counting)
    t = DeltaTables()
    bigint = TypeInformation.from_json("BIGINT")
    assert t.typed_columns(table, 1) == {"typed_count": bigint}
    assert t.typed_columns(table, 1) == {"typed_count": bigint} and len(reads) == 1
    t.keep_columns(table, 1, 2)  # our commit 2 kept the schema: no read for it
    assert t.typed_columns(table, 2) == {"typed_count": bigint} and len(reads) == 1
    write_deltalake(table, pa.table({"key_group": pa.array([1], pa.int32()), "typed_count": [1], "typed_sum": [2.0]}),
                    mode="append", schema_mode="merge")  # version 2 evolves the schema (someone else's commit)
    t2 = DeltaTables()
    assert set(t2.typed_columns(table, 2)) == {"typed_count", "typed_sum"} and len(reads) == 2
    assert t2.typed_columns(table, 2)["typed_sum"] == TypeInformation.from_json("DOUBLE")
    assert DeltaTables().typed_columns(table, 1) == {"typed_count": bigint}  # nothing shared between writers
