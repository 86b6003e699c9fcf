"""Stream the entries of a RocksDB folder to stdout, in a process of its own.

RocksDB starts process-wide background threads the first time a process opens a DB, and a
process forked after that (the local driver forks its workers from the job master) inherits
their bookkeeping but not the threads: its first flush waits forever. So a process that has
not used RocksDB yet (a job master writing a savepoint, a state query, the oracle) reads an
incremental RocksDB checkpoint through this script instead of opening it itself
(``rocksdb_checkpoint.read_rows``). Imports only rocksdict: runnable as a plain script.

    python rocksdb_reader.py FOLDER FIRST_KEY_HEX LAST_KEY_GROUP

Output: frames ``len(key) (4 bytes) | key | len(value) (4 bytes) | value``, from the first key
>= FIRST_KEY_HEX while the key's first two bytes (its key group) are <= LAST_KEY_GROUP.
"""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str]) -> int:
    import rocksdict as rd

    folder, first, last = argv[0], bytes.fromhex(argv[1]), int(argv[2])
    opts = rd.Options(raw_mode=True)
    table = rd.BlockBasedOptions()
    table.set_block_cache(rd.Cache(8 << 20))
    opts.set_block_based_table_factory(table)
    db: Any
    try:
        db = rd.Rdict(folder, opts, access_type=rd.AccessType.read_only())
    except Exception as exc:
        print(f"cannot open {folder}: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout.buffer
    try:
        for key, value in db.items(from_key=first):
            if int.from_bytes(key[:2], "big") > last:
                break
            out.write(len(key).to_bytes(4, "big") + key + len(value).to_bytes(4, "big") + value)
    finally:
        db.close()
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
