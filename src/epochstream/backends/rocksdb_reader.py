"""Stream the entries of RocksDB folders to stdout, in a process of its own.

RocksDB starts process-wide background threads the first time a process opens a DB, and a
process forked after that (the local driver forks its workers from the job master) inherits
their bookkeeping but not the threads: its first flush waits forever. So a process that has
not used RocksDB yet (a job master writing a savepoint, a state query, the oracle) reads an
incremental RocksDB checkpoint through this script instead of opening it itself
(``rocksdb_checkpoint.read_rows``), one long-lived reader per process. Imports only
rocksdict: runnable as a plain script.

    python rocksdb_reader.py            (requests on stdin, one per line)

A request is ``FOLDER<TAB>FIRST_KEY_HEX<TAB>LAST_KEY_GROUP``. The answer: frames
``len(key) (4 bytes) | key | len(value) (4 bytes) | value``, from the first key >= FIRST_KEY_HEX
while the key's first two bytes (its key group) are <= LAST_KEY_GROUP, then ``FF FF FF FF``,
``len(error) (4 bytes)`` and the error text (empty: the read succeeded).
"""

from __future__ import annotations

import sys
from typing import Any

END = b"\xff\xff\xff\xff"


def open_read_only(rd: Any, folder: str) -> Any:
    """A checkpoint's DB, read-only, raw bytes, with a small block cache (also used in-process:
    ``rocksdb_checkpoint._entries_here``)."""
    opts = rd.Options(raw_mode=True)
    table = rd.BlockBasedOptions()
    table.set_block_cache(rd.Cache(8 << 20))
    opts.set_block_based_table_factory(table)
    return rd.Rdict(folder, opts, access_type=rd.AccessType.read_only())


def answer(rd: Any, out: Any, folder: str, first: bytes, last: int) -> str:
    db: Any
    try:
        db = open_read_only(rd, folder)
    except Exception as exc:
        return f"cannot open {folder}: {exc}"
    try:
        for key, value in db.items(from_key=first):
            if int.from_bytes(key[:2], "big") > last:
                break
            out.write(len(key).to_bytes(4, "big") + key + len(value).to_bytes(4, "big") + value)
    finally:
        db.close()
    return ""


def main() -> int:
    import rocksdict as rd

    out = sys.stdout.buffer
    for line in sys.stdin:
        folder, first, last = line.rstrip("\n").split("\t")
        try:
            err = answer(rd, out, folder, bytes.fromhex(first), int(last))
        except Exception as exc:  # report, and serve the next request
            err = f"{type(exc).__name__}: {exc}"
        data = err.encode()
        out.write(END + len(data).to_bytes(4, "big") + data)
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
