"""Key -> key group -> subtask, as pure functions (Flink's KeyGroupRangeAssignment).

A key group is the unit of keyed state that moves when a job is rescaled. Keys map to
one of ``max_parallelism`` key groups through a *stable* hash (never Python's salted
``hash()``, which differs between processes); key groups map to subtasks in
contiguous ranges, so restoring at another parallelism only re-slices ranges.

Checks happen in the entry points (``check_parallelism``, ``key_group_range``); the
per-record functions are single expressions.

Columnar keys (``distinct_keys``, ``key_groups``) get the *same* key group as the Python
value of each row (``Array.to_pylist``), so state written by a row job and a columnar job
lands in the same key groups and rescaling works across both: each distinct key of a batch
is hashed once with ``assign_to_key_group`` and the result is spread over the rows with
one Arrow ``take``. Cost: one Python call per distinct key, not per row.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Sequence
from typing import Any

#: Flink caps max parallelism at Short.MAX_VALUE + 1 because key groups are stored as
#: shorts; we keep the same cap so savepoints stay comparable.
UPPER_BOUND_MAX_PARALLELISM = 1 << 15
DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 1 << 7

_MASK32 = 0xFFFFFFFF


class ParallelismError(ValueError):
    """A parallelism / max parallelism pair that cannot be used."""


def default_max_parallelism(parallelism: int) -> int:
    """Flink's default: ``min(max(roundUpToPowerOfTwo(p + p/2), 128), 32768)``."""
    wanted = parallelism + parallelism // 2
    rounded = 1 << max(wanted - 1, 0).bit_length()
    return min(max(rounded, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Raise a ParallelismError naming the bad value; call once per job, not per record."""
    if not isinstance(parallelism, int) or parallelism < 1:
        raise ParallelismError(f"parallelism must be a positive integer, got {parallelism!r}")
    if not isinstance(max_parallelism, int) or not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ParallelismError(
            f"max_parallelism must be in [1, {UPPER_BOUND_MAX_PARALLELISM}], got {max_parallelism!r}"
        )
    if parallelism > max_parallelism:
        raise ParallelismError(
            f"parallelism {parallelism} is above max_parallelism {max_parallelism}: every subtask needs at "
            f"least one key group; lower the parallelism or start the job with a larger max_parallelism "
            f"(max_parallelism cannot change once state exists)"
        )


#: the one NaN every NaN key becomes (``canonical_key``): dicts find a key by identity first
NAN_KEY = float("nan")
#: key types ``canonical_key`` may change (others are returned as they are)
CANONICAL_TYPES = frozenset({float, tuple})


def canonical_key(key: Any) -> Any:
    """The key as keyed state stores it: every float NaN (also inside a tuple) becomes ``NAN_KEY``.

    ``NaN != NaN``, so a dict would give every NaN record a key of its own (ten records with
    key NaN summed by ``reduce``: ten 1s). Spark's grouping and pandas' ``groupby(dropna=False)``
    treat all NaNs as one value; so do we: ``NAN_KEY`` is one object, which a dict finds by
    identity. ``-0.0`` and ``0.0`` are already one key (equal, equal hash). ``None`` is a key
    like any other (Spark's null group).

    >>> canonical_key(float("nan")) is canonical_key(float("-nan")) is NAN_KEY
    True
    >>> canonical_key(("a", float("nan")))[1] is NAN_KEY
    True
    """
    t = type(key)
    if t is float:
        return NAN_KEY if key != key else key
    if t is tuple and any(type(k) in CANONICAL_TYPES for k in key):
        return tuple(canonical_key(k) for k in key)
    return key


def key_bytes(key: Any) -> bytes:
    """Canonical bytes of a key: equal keys give equal bytes in every process and run.

    str, bytes, int, float, bool and None have fixed encodings (numbers that compare equal
    encode equal, as they share a dict slot); tuples and frozensets encode their items;
    other values fall back to pickle protocol 4, which is deterministic for plain data.
    """
    t = type(key)
    if t is str:
        text: str = key
        return b"s" + text.encode("utf-8")
    if t is bool or (t is float and key.is_integer()):
        key, t = int(key), int  # 1 == 1.0 == True share a dict slot, so they share a key group too
    if t is int:
        number: int = key
        return b"i" + number.to_bytes((number.bit_length() + 8) // 8 or 1, "little", signed=True)
    if t is bytes:
        raw: bytes = key
        return b"b" + raw
    if key is None:
        return b"n"
    if t is float:  # every NaN (any sign or payload) encodes alike: one key group, stable across runs
        return b"fnan" if key != key else b"f" + struct.pack("<d", key)
    if t is tuple:
        return b"t" + b"".join(len(p).to_bytes(4, "little") + p for p in map(key_bytes, key))
    if t is frozenset:  # iteration order follows the salted hash: sort the encoded items
        return b"z" + b"".join(len(p).to_bytes(4, "little") + p for p in sorted(map(key_bytes, key)))
    return b"p" + pickle.dumps(key, protocol=4)


def murmur_mix(code: int) -> int:
    """Flink's MathUtils.murmurHash(int): one murmur3 round plus finalizer, non-negative."""
    code = (code * 0xCC9E2D51) & _MASK32
    code = ((code << 15) | (code >> 17)) & _MASK32
    code = (code * 0x1B873593) & _MASK32
    code = ((code << 13) | (code >> 19)) & _MASK32
    code = (code * 5 + 0xE6546B64) & _MASK32
    code ^= 4
    code ^= code >> 16
    code = (code * 0x85EBCA6B) & _MASK32
    code ^= code >> 13
    code = (code * 0xC2B2AE35) & _MASK32
    code ^= code >> 16
    # Java: if (code >= 0) code else if (code != MIN_VALUE) -code else 0
    if code >= 0x80000000:
        code = 0 if code == 0x80000000 else (0x100000000 - code)
    return code


def stable_hash(key: Any) -> int:
    """32-bit stable hash of a key (crc32 of its canonical bytes)."""
    return zlib.crc32(key_bytes(key))


def key_group_for_hash(key_hash: int, max_parallelism: int) -> int:
    """``0 <= result < max_parallelism``."""
    return murmur_mix(key_hash) % max_parallelism


def assign_to_key_group(key: Any, max_parallelism: int) -> int:
    """The key group of a key: ``0 <= result < max_parallelism``."""
    return murmur_mix(zlib.crc32(key_bytes(key))) % max_parallelism


class KeyGroupOf:
    """``assign_to_key_group`` for one max parallelism, as a callable (one key) with ``many``
    (a batch of keys: the murmur step runs vectorised). Picklable, unlike a lambda."""

    __slots__ = ("max_parallelism",)

    def __init__(self, max_parallelism: int) -> None:
        self.max_parallelism = max_parallelism

    def __call__(self, key: Any) -> int:
        return murmur_mix(zlib.crc32(key_bytes(key))) % self.max_parallelism

    def many(self, keys: Sequence[Any]) -> list[int]:
        return key_groups_of(keys, self.max_parallelism)


#: below this many keys ``key_groups_of`` hashes one by one (numpy's per-call cost is larger)
_VECTOR_MIN = 32


def key_groups_of(keys: Sequence[Any], max_parallelism: int) -> list[int]:
    """``assign_to_key_group`` of every key, equal result for equal input. Why: murmur in
    Python was 1.8 us of the 2.4 us a key cost, so a capture of 500K keys spent 1.2 s on key
    groups; here crc32 of the key bytes runs per key and the murmur round once per batch."""
    n = len(keys)
    if n < _VECTOR_MIN:
        return [murmur_mix(zlib.crc32(key_bytes(k))) % max_parallelism for k in keys]
    import numpy as np

    codes = _int_codes(keys) if all(type(k) is int for k in keys) else None
    if codes is None:
        crc, kb = zlib.crc32, key_bytes
        codes = np.fromiter((crc(kb(k)) for k in keys), dtype=np.uint64, count=n)
    result: list[int] = (murmur_mix_array(codes) % np.uint64(max_parallelism)).tolist()
    return result


_CRC_TABLE: Any = None


def _int_codes(keys: Sequence[int]) -> Any:
    """``crc32(key_bytes(k))`` of int keys in (-2**63, 2**63), vectorised (numpy uint64), or
    None when a key is outside. ``key_bytes`` of an int is ``b"i"`` and its shortest signed
    little-endian bytes (``(bit_length + 8) // 8`` of them): the table-driven CRC-32 runs over
    those bytes, one byte position at a time for every key at once."""
    import numpy as np

    global _CRC_TABLE
    try:
        arr = np.fromiter(keys, dtype=np.int64, count=len(keys))
    except OverflowError:
        return None
    if (arr == np.iinfo(np.int64).min).any():
        return None
    if _CRC_TABLE is None:
        table = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
            table.append(c)
        _CRC_TABLE = np.array(table, dtype=np.uint64)
    t = _CRC_TABLE
    mag = np.abs(arr)
    length = np.ones(len(arr), dtype=np.int64)
    for j in range(1, 8):  # bit_length(|k|) >= 8j adds a byte
        length += mag >= (1 << (8 * j - 1))
    crc = np.full(len(arr), 0xFFFFFFFF, dtype=np.uint64)
    crc = t[(crc ^ np.uint64(ord("i"))) & np.uint64(0xFF)] ^ (crc >> np.uint64(8))
    u = arr.view(np.uint64)  # two's complement bytes
    for j in range(8):
        byte = (u >> np.uint64(8 * j)) & np.uint64(0xFF)
        crc = np.where(length > j, t[(crc ^ byte) & np.uint64(0xFF)] ^ (crc >> np.uint64(8)), crc)
    return crc ^ np.uint64(0xFFFFFFFF)


def murmur_mix_array(codes: Any) -> Any:
    """``murmur_mix`` of a numpy uint64 array of 32-bit codes (same results, element-wise)."""
    import numpy as np

    u = np.uint64
    mask = u(_MASK32)
    c = (codes * u(0xCC9E2D51)) & mask
    c = ((c << u(15)) | (c >> u(17))) & mask
    c = (c * u(0x1B873593)) & mask
    c = ((c << u(13)) | (c >> u(19))) & mask
    c = (c * u(5) + u(0xE6546B64)) & mask
    c ^= u(4)
    c ^= c >> u(16)
    c = (c * u(0x85EBCA6B)) & mask
    c ^= c >> u(13)
    c = (c * u(0xC2B2AE35)) & mask
    c ^= c >> u(16)
    neg = c >= u(0x80000000)
    return np.where(neg, np.where(c == u(0x80000000), u(0), u(0x100000000) - c), c)


def operator_index_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """Subtask owning ``key_group`` (``0 <= key_group < max_parallelism``)."""
    return key_group * parallelism // max_parallelism


def assign_key_to_operator(key: Any, max_parallelism: int, parallelism: int) -> int:
    return assign_to_key_group(key, max_parallelism) * parallelism // max_parallelism


def key_group_range(max_parallelism: int, parallelism: int, operator_index: int) -> tuple[int, int]:
    """Inclusive key-group range ``(start, end)`` of a subtask; agrees with operator_index_for_key_group.

    start = ceil(i * M / p), end = floor(((i + 1) * M - 1) / p).
    """
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= operator_index < parallelism:
        raise ParallelismError(f"operator index {operator_index} outside [0, {parallelism})")
    start = (operator_index * max_parallelism + parallelism - 1) // parallelism
    end = ((operator_index + 1) * max_parallelism - 1) // parallelism
    return start, end


def key_group_table(max_parallelism: int, parallelism: int) -> list[int]:
    """Subtask of every key group, precomputed so routing is one list lookup per record."""
    check_parallelism(parallelism, max_parallelism)
    return [kg * parallelism // max_parallelism for kg in range(max_parallelism)]


# ---------------------------------------------------------------- columnar keys (pyarrow, imported lazily)


def distinct_keys(columns: "list[Any]", as_tuple: bool = False) -> "tuple[Any, list[Any]]":
    """Dense codes of the keys of a batch, and the Python key of each code.

    ``columns``: one pyarrow Array or ChunkedArray per key column, all of one length. Returns
    ``(codes, keys)``: ``codes`` an Int32Array with one code per row, ``0 <= code < len(keys)``,
    numbered in order of first appearance; ``keys[c]`` the key of code ``c`` as ``to_pylist``
    gives it (one column: the value itself, None for null; several, or ``as_tuple``: the tuple
    of values).

    >>> import pyarrow as pa
    >>> codes, keys = distinct_keys([pa.array(["a", "b", "a"])])
    >>> codes.to_pylist(), keys
    ([0, 1, 0], ['a', 'b'])
    >>> codes, keys = distinct_keys([pa.array(["a", "a", "a"]), pa.array([1, 2, 1])])
    >>> codes.to_pylist(), keys
    ([0, 1, 0], [('a', 1), ('a', 2)])
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if not columns:
        raise ValueError("distinct_keys needs at least one key column")
    codes, keys = _encode(columns[0])
    if len(columns) == 1:
        return codes, ([(k,) for k in keys] if as_tuple else keys)
    tuples = [(k,) for k in keys]
    for col in columns[1:]:
        c2, k2 = _encode(col)
        n2 = len(k2)
        # pair code a * n2 + b < rows * rows: no overflow in int64 for any batch that fits in memory
        pair = pc.add(pc.multiply(codes.cast(pa.int64()), n2), c2.cast(pa.int64()))
        enc = pc.dictionary_encode(pair)
        codes = enc.indices
        tuples = [tuples[v // n2] + (k2[v % n2],) for v in enc.dictionary.to_pylist()]
    return codes, tuples


def _encode(column: Any) -> "tuple[Any, list[Any]]":
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if isinstance(column.type, pa.DictionaryType):  # already encoded: decode, codes may repeat values
        column = column.dictionary_decode()
    enc = pc.dictionary_encode(column, null_encoding="encode")
    return enc.indices, enc.dictionary.to_pylist()


def key_groups(columns: "list[Any]", max_parallelism: int, memo: dict[Any, int] | None = None,
               as_tuple: bool = False) -> Any:
    """Key group of every row of a batch keyed by ``columns`` (see ``distinct_keys``): an
    Int32Array with, row by row, ``assign_to_key_group(key, max_parallelism)`` of the row's
    Python key; ``0 <= result < max_parallelism``.

    ``memo`` (key -> key group), if given, is read and filled, so a caller that sees the same
    keys batch after batch hashes each once per job; the caller bounds its size.
    """
    import pyarrow as pa

    codes, keys = distinct_keys(columns, as_tuple)
    if memo is None:
        groups = [assign_to_key_group(k, max_parallelism) for k in keys]
    else:
        groups = []
        for k in keys:
            kg = memo.get(k)
            if kg is None:
                kg = memo[k] = assign_to_key_group(k, max_parallelism)
            groups.append(kg)
    return pa.array(groups, pa.int32()).take(codes)
