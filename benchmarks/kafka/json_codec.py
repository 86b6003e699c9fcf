"""JSON decoding and encoding of Arrow batches: ``from_json`` and ``encode_json`` against the
per-record ways (orjson, json) and pandas.

Decoding: batches of ``{"k": "k123", "v": 42, "ts": "...", "name": ..., "score": ..., "ok": ...}``
records (a Kafka ``value`` column of bytes) of 1,000 and 100,000 rows become typed columns
(``k string, v long, ts timestamp, name string, score double, ok boolean``):

- ``from_json``: ``runtime.jsoncodec.JsonDecoder.decode`` (the screen, one pyarrow JSON read,
  the output batch), with no bad record, and with 1 and 10 bad records per batch;
- ``orjson``: ``orjson.loads`` per record, then ``RecordBatch.from_pylist`` with the schema
  (timestamps left as strings: less work than ``from_json`` does; and with them cast afterwards);
- ``json``: ``json.loads`` per record, then ``RecordBatch.from_pylist`` likewise.

Encoding (100,000 rows of the decoded columns without the timestamp): ``encode_json`` against
pandas ``to_json(orient="records", lines=True)`` (one string for the batch), ``orjson.dumps`` per
row and ``json.dumps`` per row (the rows given as dicts, and made with ``to_pylist``).

Each figure is the best of ``--repeat`` runs (the machine is shared: the best run is the one
least disturbed), per record. Writes benchmarks/results/json_codec.csv. Not a test.

    python benchmarks/kafka/json_codec.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from benchmarks.harness import RESULTS  # noqa: E402
from epochstream.runtime.jsoncodec import JsonDecoder, encode_json  # noqa: E402

SCHEMA = "k string, v long, ts timestamp, name string, score double, ok boolean"


def records(n: int, bad: int = 0, seed: int = 0) -> list[bytes]:
    out = [json.dumps({"k": f"k{i % 1000}", "v": i, "ts": "2024-01-02T03:04:05.123Z", "name": f"user {i}",
                       "score": i * 0.25, "ok": i % 2 == 0}, separators=(",", ":")).encode() for i in range(n)]
    for j in random.Random(seed).sample(range(n), bad):
        out[j] = b'{"k":"x","v":"not a number"}'
    return out


def _with_ts(batch):
    """The timestamp strings cast to ``timestamp[us, UTC]``, as ``from_json`` gives them."""
    i = batch.schema.get_field_index("ts")
    return batch.set_column(i, "ts", batch.column(i).cast(pa.timestamp("us", "UTC")))


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    try:
        import orjson
    except ImportError:  # pragma: no cover - optional
        orjson = None
    decoder = JsonDecoder(SCHEMA)
    arrow_schema = pa.schema([f if f.name != "ts" else pa.field("ts", pa.string()) for f in decoder.schema])
    rows: list[dict] = []
    for n in (1_000, 100_000):
        for bad in (0, 1, 10):
            batch = pa.record_batch({"value": pa.array(records(n, bad), pa.binary())})
            good, dead = decoder.decode(batch)
            assert good.num_rows + len(dead) == n and len(dead) == bad
            rows.append({"what": "decode", "way": f"from_json ({bad} bad)", "rows": n,
                         "us_per_record": best(lambda b=batch: decoder.decode(b), args.repeat) / n * 1e6})
        values = records(n)
        if orjson is not None:
            rows.append({"what": "decode", "way": "orjson.loads + from_pylist", "rows": n,
                         "us_per_record": best(lambda v=values: pa.RecordBatch.from_pylist(
                             [orjson.loads(x) for x in v], schema=arrow_schema), args.repeat) / n * 1e6})
            rows.append({"what": "decode", "way": "orjson.loads + from_pylist + ts cast", "rows": n,
                         "us_per_record": best(lambda v=values: _with_ts(pa.RecordBatch.from_pylist(
                             [orjson.loads(x) for x in v], schema=arrow_schema)), args.repeat) / n * 1e6})
        rows.append({"what": "decode", "way": "json.loads + from_pylist", "rows": n,
                     "us_per_record": best(lambda v=values: pa.RecordBatch.from_pylist(
                         [json.loads(x) for x in v], schema=arrow_schema), args.repeat) / n * 1e6})
    n = 100_000
    batch, _ = decoder.decode(pa.record_batch({"value": pa.array(records(n), pa.binary())}))
    batch = batch.drop_columns(["ts"])
    dicts = batch.to_pylist()
    frame = batch.to_pandas()
    enc = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    assert encode_json(batch).to_pylist() == [enc(r).encode() for r in dicts]
    ways = [("encode_json", lambda: encode_json(batch)),
            ("pandas to_json(lines)", lambda: frame.to_json(orient="records", lines=True)),
            ("json.dumps per row (dicts given)", lambda: [enc(r) for r in dicts]),
            ("json.dumps per row (+ to_pylist)", lambda: [enc(r) for r in batch.to_pylist()])]
    if orjson is not None:
        ways += [("orjson.dumps per row (dicts given)", lambda: [orjson.dumps(r) for r in dicts]),
                 ("orjson.dumps per row (+ to_pylist)", lambda: [orjson.dumps(r) for r in batch.to_pylist()])]
    for way, fn in ways:
        rows.append({"what": "encode", "way": way, "rows": n, "us_per_record": best(fn, args.repeat) / n * 1e6})
    out = RESULTS / "json_codec.csv"
    out.parent.mkdir(exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["what", "way", "rows", "us_per_record"])
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['what']:7s} {r['rows']:>7,d} rows  {r['way']:40s} {r['us_per_record'] * 1000:9.0f} ns/record")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
