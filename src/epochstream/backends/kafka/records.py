"""Kafka records in the two forms a source hands on: a dict per record (``records="dict"``) or
one Arrow RecordBatch per read (``records="arrow"``), built column by column from the messages
the client returned, with no dict per record.

Both forms hold the same values: ``key`` and ``value`` (bytes, or None), ``topic``,
``partition``, ``offset``, ``timestamp`` (milliseconds, None if the producer set none) and
``headers``. Headers differ in shape only: a dict's are a list of ``(key, value)`` tuples (empty
when the message has none, as confluent-kafka gives them), a batch's a ``list<struct<key,
value>>`` that is null where a message has none (its dict rows then show ``None``, and header
pairs as ``{"key": ..., "value": ...}``).
"""

from __future__ import annotations

from typing import Any, Sequence

#: the ``records=`` a Kafka source takes
RECORD_FORMATS = ("arrow", "dict")


#: made on first use (pyarrow is not imported before)
_SCHEMA: list[Any] = []


def kafka_schema() -> Any:
    """The Arrow schema of Kafka records read as batches (``runtime.jsoncodec`` types rows of
    them alike)."""
    if not _SCHEMA:
        import pyarrow as pa

        _SCHEMA.append(pa.schema([
            pa.field("key", pa.binary()), pa.field("value", pa.binary()), pa.field("topic", pa.string()),
            pa.field("partition", pa.int32()), pa.field("offset", pa.int64()), pa.field("timestamp", pa.int64()),
            pa.field("headers", pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))),
        ]))
    return _SCHEMA[0]


def records_format(records: str | None, key_deserializer: Any, value_deserializer: Any, what: str) -> str:
    """The ``records=`` of a source: given, or by default ``"arrow"`` unless a deserializer is
    given (a deserializer makes Python values per record: rows)."""
    deserialized = key_deserializer is not None or value_deserializer is not None
    if records is None:
        return "dict" if deserialized else "arrow"
    if records not in RECORD_FORMATS:
        raise ValueError(f"{what}: records must be one of {RECORD_FORMATS} (or None: arrow unless a deserializer "
                         f"is given), got {records!r}")
    if records == "arrow" and deserialized:
        raise ValueError(f"{what}: key_deserializer/value_deserializer make a Python value per record; they need "
                         f"records='dict' (with Arrow batches decode values in the pipeline, e.g. from_json)")
    return records


def columns_batch(topic: str, partition: int, keys: list[Any], values: list[Any], offsets: Sequence[int],
                  stamps: list[Any], headers: list[Any]) -> Any:
    """One RecordBatch of one partition's records, given per column (``stamps``: ms or None;
    ``headers``: lists of (key, value) or None). Columns of constants are made in Arrow."""
    import pyarrow as pa

    n = len(keys)
    schema = kafka_schema()
    htype = schema.field("headers").type
    if any(h is not None for h in headers):
        hcol = pa.array(headers, htype)
    else:  # no message of the read has headers: no Python container per record
        hcol = pa.nulls(n, htype)
    return pa.RecordBatch.from_arrays([
        pa.array(keys, pa.binary()), pa.array(values, pa.binary()),
        pa.repeat(pa.scalar(topic, pa.string()), n), pa.repeat(pa.scalar(partition, pa.int32()), n),
        pa.array(offsets, pa.int64()), pa.array(stamps, pa.int64()), hcol,
    ], schema=schema)


def messages_batch(msgs: Sequence[Any], topic: str, partition: int, offsets: Sequence[int]) -> Any:
    """confluent-kafka ``Message`` objects of one partition (no errors among them) as one
    RecordBatch: one method call per message and column, no dict per record."""
    stamps = []
    for ts_type, ts in [m.timestamp() for m in msgs]:
        stamps.append(ts if ts_type != 0 else None)  # TIMESTAMP_NOT_AVAILABLE
    return columns_batch(topic, partition, [m.key() for m in msgs], [m.value() for m in msgs], offsets, stamps,
                         [m.headers() for m in msgs])


def concat_reads(parts: list[Any]) -> Any:
    """The batches of several reads of one split as one (empty: a batch of no rows)."""
    import pyarrow as pa

    if not parts:
        return pa.RecordBatch.from_pylist([], schema=kafka_schema())
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)


def rows_of(records: Any) -> list[Any]:
    """Records of either form as dict rows (the oracle's and tests' view)."""
    if type(records) is list:
        return records
    from ...runtime.columns import to_rows

    return to_rows(records)
