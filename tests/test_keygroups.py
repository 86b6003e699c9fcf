"""Key -> key group -> subtask (graph/keygroups.py), checked against Flink's formulas.

The Flink reference values are recomputed here from the Java source with an independent
int32 implementation, never by calling the function under test.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochstream.graph.keygroups import (
    UPPER_BOUND_MAX_PARALLELISM,
    ParallelismError,
    assign_key_to_operator,
    assign_to_key_group,
    check_parallelism,
    default_max_parallelism,
    key_group_for_hash,
    key_group_range,
    key_group_table,
    murmur_mix,
    operator_index_for_key_group,
    stable_hash,
)

M_MAX = 1 << 15


# ---------------------------------------------------------------- independent Java reference


def _i32(x: int) -> int:
    return ctypes.c_int32(x).value


def _java_murmur_hash(code: int) -> int:
    """org.apache.flink.util.MathUtils.murmurHash(int), line by line with int32 wrap-around."""

    def rotl(x: int, r: int) -> int:
        u = x & 0xFFFFFFFF
        return _i32((u << r) | (u >> (32 - r)))

    def ushr(x: int, r: int) -> int:  # Java >>>
        return (x & 0xFFFFFFFF) >> r

    code = _i32(code)
    code = _i32(code * _i32(0xCC9E2D51))
    code = rotl(code, 15)
    code = _i32(code * _i32(0x1B873593))
    code = rotl(code, 13)
    code = _i32(code * 5 + _i32(0xE6546B64))
    code = _i32(code ^ 4)
    # bitMix
    code = _i32(code ^ ushr(code, 16))
    code = _i32(code * _i32(0x85EBCA6B))
    code = _i32(code ^ ushr(code, 13))
    code = _i32(code * _i32(0xC2B2AE35))
    code = _i32(code ^ ushr(code, 16))
    if code >= 0:
        return code
    if code != -(1 << 31):
        return -code
    return 0


def _java_round_up_to_power_of_two(x: int) -> int:
    x = _i32(x - 1)
    for s in (1, 2, 4, 8, 16):
        x = _i32(x | (x >> s))
    return _i32(x + 1)


def _java_default_max_parallelism(p: int) -> int:
    return min(max(_java_round_up_to_power_of_two(p + p // 2), 128), 32768)


# ---------------------------------------------------------------- murmur


@pytest.mark.parametrize(
    "code, expected",
    [
        # computed by hand from the Java source (and cross-checked by _java_murmur_hash below)
        (0, 593689054),
        (1, 68075478),
        (2, 1085422463),
        (42, 1134849565),
        (-1, 1982413648),
        (2**31 - 1, 1653689534),
        (-(2**31), 1718298732),
    ],
)
def test_murmur_mix_matches_flink_known_values(code, expected):
    assert _java_murmur_hash(code) == expected  # the reference itself
    assert murmur_mix(code & 0xFFFFFFFF) == expected


@given(st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_murmur_mix_matches_java_reference_on_all_int32(code):
    got = murmur_mix(code & 0xFFFFFFFF)
    assert got == _java_murmur_hash(code)
    assert 0 <= got < 2**31


# ---------------------------------------------------------------- default max parallelism


@pytest.mark.parametrize(
    "p, expected",
    [
        (1, 128),  # 1 -> pow2 1 -> floor 128
        (2, 128),  # 3 -> 4
        (85, 128),  # 85 + 42 = 127 -> 128
        (86, 256),  # 86 + 43 = 129 -> 256
        (100, 256),  # 150 -> 256
        (171, 256),  # 171 + 85 = 256 -> 256 (exact power of two stays)
        (172, 512),  # 172 + 86 = 258 -> 512
        (1000, 2048),  # 1500 -> 2048
        (1365, 2048),  # 1365 + 682 = 2047 -> 2048
        (1366, 4096),  # 1366 + 683 = 2049 -> 4096
        (21845, 32768),  # 21845 + 10922 = 32767 -> 32768
        (21846, 32768),  # 32769 -> 65536, capped
        (30000, 32768),  # 45000 -> 65536, capped
        (32768, 32768),
    ],
)
def test_default_max_parallelism_table(p, expected):
    assert _java_default_max_parallelism(p) == expected
    assert default_max_parallelism(p) == expected


@given(st.integers(min_value=1, max_value=M_MAX))
def test_default_max_parallelism_matches_java_formula(p):
    m = default_max_parallelism(p)
    assert m == _java_default_max_parallelism(p)
    check_parallelism(p, m)  # the default is always usable


# ---------------------------------------------------------------- ranges and indices


@st.composite
def layouts(draw, max_m=M_MAX):
    m = draw(st.integers(min_value=1, max_value=max_m))
    p = draw(st.integers(min_value=1, max_value=m))
    return m, p


@given(layouts(), st.data())
def test_range_and_index_agree(layout, data):
    m, p = layout
    kg = data.draw(st.integers(min_value=0, max_value=m - 1), label="key_group")
    i = operator_index_for_key_group(m, p, kg)
    assert 0 <= i < p
    lo, hi = key_group_range(m, p, i)
    assert lo <= kg <= hi
    # and kg is in no neighbour's range
    if i > 0:
        assert key_group_range(m, p, i - 1)[1] < kg
    if i < p - 1:
        assert key_group_range(m, p, i + 1)[0] > kg


@settings(max_examples=60)
@given(layouts(max_m=4096))
def test_ranges_partition_key_groups_contiguously(layout):
    m, p = layout
    ranges = [key_group_range(m, p, i) for i in range(p)]
    assert ranges[0][0] == 0
    assert ranges[-1][1] == m - 1
    for (lo, hi), (nlo, _nhi) in zip(ranges, ranges[1:], strict=False):  # neighbours
        assert lo <= hi  # p <= m: every subtask owns at least one key group
        assert nlo == hi + 1
    sizes = [hi - lo + 1 for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1  # balanced
    table = key_group_table(m, p)
    for i, (lo, hi) in enumerate(ranges):
        assert table[lo : hi + 1] == [i] * (hi - lo + 1)


@pytest.mark.parametrize("m, p", [(M_MAX, 1), (M_MAX, M_MAX), (M_MAX, M_MAX - 1), (M_MAX, 3), (1, 1), (128, 127)])
def test_ranges_partition_edge_layouts(m, p):
    ranges = [key_group_range(m, p, i) for i in range(p)]
    covered = [kg for lo, hi in ranges for kg in range(lo, hi + 1)]
    assert covered == list(range(m))
    assert [operator_index_for_key_group(m, p, kg) for kg in range(m)] == key_group_table(m, p)


def test_key_group_range_rejects_index_outside_parallelism():
    with pytest.raises(ParallelismError, match="operator index 4"):
        key_group_range(128, 4, 4)
    with pytest.raises(ParallelismError):
        key_group_range(128, 4, -1)


# ---------------------------------------------------------------- check_parallelism


def test_check_parallelism_names_both_numbers():
    with pytest.raises(ParallelismError) as ei:
        check_parallelism(200, 128)
    msg = str(ei.value)
    assert "200" in msg and "128" in msg


@pytest.mark.parametrize("p", [0, -1, -100])
def test_check_parallelism_rejects_non_positive(p):
    with pytest.raises(ParallelismError, match=str(p)):
        check_parallelism(p, 128)


@pytest.mark.parametrize("m", [0, -5, M_MAX + 1, 1 << 20])
def test_check_parallelism_rejects_bad_max_parallelism(m):
    with pytest.raises(ParallelismError, match=str(m)):
        check_parallelism(1, m)


def test_check_parallelism_rejects_parallelism_above_upper_bound():
    with pytest.raises(ParallelismError):
        check_parallelism(M_MAX + 1, M_MAX)
    check_parallelism(M_MAX, M_MAX)  # the bound itself is fine
    assert UPPER_BOUND_MAX_PARALLELISM == M_MAX


def test_key_group_range_validates_like_check_parallelism():
    with pytest.raises(ParallelismError, match="200"):
        key_group_range(128, 200, 0)


# ---------------------------------------------------------------- keys


keys = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(),
        st.binary(),
    ),
    lambda inner: st.tuples(inner) | st.tuples(inner, inner) | st.tuples(inner, inner, inner),
    max_leaves=6,
)


@given(keys, layouts())
def test_key_assignment_composes(key, layout):
    m, p = layout
    kg = assign_to_key_group(key, m)
    assert 0 <= kg < m
    assert kg == key_group_for_hash(stable_hash(key), m)
    assert kg == murmur_mix(stable_hash(key)) % m
    op = assign_key_to_operator(key, m, p)
    assert op == operator_index_for_key_group(m, p, kg)
    lo, hi = key_group_range(m, p, op)
    assert lo <= kg <= hi


@given(keys)
def test_stable_hash_is_32_bit_and_deterministic(key):
    h = stable_hash(key)
    assert 0 <= h < 2**32
    assert stable_hash(key) == h


def test_distinct_tuple_shapes_do_not_collide_trivially():
    # tuple encoding is length-prefixed: ("ab", "c") and ("a", "bc") are different keys
    assert stable_hash(("ab", "c")) != stable_hash(("a", "bc"))
    assert stable_hash(("a",)) != stable_hash("a")
    assert stable_hash(b"a") != stable_hash("a")


#: Python source of the keys, evaluated here and in the subprocesses
_SUBPROCESS_KEYS_SRC = (
    '["hello", "", "\\u00fcn\\u00efc\\u00f6de", 0, -1, 7, 2**70, -(2**70), '
    '(1, "a"), ("x", (2, 3)), ("user", 42, "eu"), b"raw", None, True, 1.5]'
)


def _hashes_in_subprocess(hash_seed: str, keys_src: str) -> list[list[int]]:
    code = (
        "import json\n"
        "from epochstream.graph.keygroups import assign_to_key_group, stable_hash\n"
        f"keys = {keys_src}\n"
        "print(json.dumps([[stable_hash(k), assign_to_key_group(k, 128), assign_to_key_group(k, 32768)]"
        " for k in keys]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_key_groups_do_not_depend_on_python_hash_seed():
    """Never the salted builtin hash(): another process must route keys identically."""
    keys_ = eval(_SUBPROCESS_KEYS_SRC)  # same literal the subprocesses evaluate
    here = [[stable_hash(k), assign_to_key_group(k, 128), assign_to_key_group(k, 32768)] for k in keys_]
    for seed in ("0", "12345"):
        assert _hashes_in_subprocess(seed, _SUBPROCESS_KEYS_SRC) == here, f"PYTHONHASHSEED={seed}"


def test_frozenset_keys_do_not_depend_on_python_hash_seed():
    src = '[frozenset({"a", "b", "c", "d", "e", "f", "g", "h"})]'
    results = {json.dumps(_hashes_in_subprocess(seed, src)) for seed in ("1", "2")}
    assert len(results) == 1


def test_equal_keys_share_a_key_group():
    for a, b in [(1, 1.0), (1, True), (0, False), (0.0, -0.0), ((1, "x"), (1.0, "x"))]:
        assert a == b and hash(a) == hash(b)
        assert assign_to_key_group(a, 32768) == assign_to_key_group(b, 32768), (a, b)


# ---------------------------------------------------------------- columnar keys: the same key group as the row's value

import pyarrow as pa  # noqa: E402

from epochstream.graph.keygroups import distinct_keys, key_groups  # noqa: E402

#: Arrow types and the Python values hypothesis draws for them (None: a null)
COLUMN_VALUES = {
    "string": (pa.string(), st.text(max_size=6)),
    "int64": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "int32": (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    "small int": (pa.int64(), st.integers(-3, 3)),  # many repeats: few distinct keys per batch
    "float64": (pa.float64(), st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 1.0, 2.5])),
    "bool": (pa.bool_(), st.booleans()),
}


def _column(kind: str):
    typ, values = COLUMN_VALUES[kind]
    return st.lists(st.none() | values, max_size=40).map(lambda vs: pa.array(vs, typ))


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(COLUMN_VALUES)), data=st.data(),
       m=st.sampled_from([1, 2, 7, 128, 4096, M_MAX]), chunked=st.booleans())
def test_key_groups_of_a_column_equal_the_scalar_function_row_by_row(kind, data, m, chunked):
    col = data.draw(_column(kind))
    if chunked and len(col) > 1:
        col = pa.chunked_array([col.slice(0, len(col) // 2), col.slice(len(col) // 2)])
    got = key_groups([col], m)
    assert got.type == pa.int32()
    assert got.to_pylist() == [assign_to_key_group(v, m) for v in col.to_pylist()]
    memo: dict = {}
    assert key_groups([col], m, memo).to_pylist() == got.to_pylist()
    assert key_groups([col], m, memo).to_pylist() == got.to_pylist()  # served from the memo


@settings(max_examples=100, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(COLUMN_VALUES)), min_size=2, max_size=3), data=st.data(),
       m=st.sampled_from([2, 128, M_MAX]))
def test_key_groups_of_several_columns_equal_those_of_the_tuple(kinds, data, m):
    n = data.draw(st.integers(0, 30))
    cols = []
    for kind in kinds:
        typ, values = COLUMN_VALUES[kind]
        cols.append(pa.array(data.draw(st.lists(st.none() | values, min_size=n, max_size=n)), typ))
    tuples = list(zip(*(c.to_pylist() for c in cols), strict=True))
    assert key_groups(cols, m).to_pylist() == [assign_to_key_group(t, m) for t in tuples]
    codes, keys = distinct_keys(cols)
    assert [keys[c] for c in codes.to_pylist()] == tuples
    # Arrow's distinct values: 0.0 and -0.0 are two keys there, one in Python (and one key group)
    assert len(set(tuples)) <= len(keys) <= len(tuples)


def test_distinct_keys_number_keys_in_order_of_first_appearance():
    codes, keys = distinct_keys([pa.array(["b", None, "a", "b", None])])
    assert codes.to_pylist() == [0, 1, 2, 0, 1]
    assert keys == ["b", None, "a"]
    codes, keys = distinct_keys([pa.array(["x", "x", "y"]).dictionary_encode()])
    assert (codes.to_pylist(), keys) == ([0, 0, 1], ["x", "y"])
    codes, keys = distinct_keys([pa.array([1, 1])], as_tuple=True)
    assert keys == [(1,)] and key_groups([pa.array([1])], 128, as_tuple=True).to_pylist() == [
        assign_to_key_group((1,), 128)]
    with pytest.raises(ValueError, match="at least one"):
        distinct_keys([])


# ---------------------------------------------------------------- routing records by key (runtime.chain)

_KEYS = st.one_of(
    st.sampled_from([1, 1.0, True, 0, 0.0, -0.0, False, float("nan"), "1", b"1", 2 ** 70, -3, (1, "a"), (1.0, "a"),
                     None]),
    st.text(max_size=3), st.integers(-5, 5), st.floats(allow_nan=True), st.binary(max_size=2),
    st.tuples(st.integers(0, 2), st.text(max_size=1)),
    st.tuples(st.sampled_from([1, 1.0, True, 0.0, -0.0, None, float("nan"), "a", b"a"])),
    st.tuples(st.sampled_from([1, 1.0]), st.lists(st.integers(), max_size=1).map(tuple)),
)


@given(st.lists(_KEYS, min_size=1, max_size=60), st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_records_reach_the_subtask_of_their_key_group_whatever_the_route_cache_holds(keys, cache):
    """The hash router caches routes of value keys (equal values, one key group); with a cache
    that fills and starts again every few keys, every record still lands on the subtask that
    owns ``assign_to_key_group(key)`` (1, 1.0 and True alike, also inside tuples; NaNs; tuples
    of value keys and None cached, other tuples not)."""
    import tempfile

    from epochstream import FileSink, KeyedProcessFunction
    from epochstream.runtime import chain

    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from pipelines import committed_output, make_pipeline, sim_run

    class Where(KeyedProcessFunction):
        def process(self, value, ctx):
            return ({"i": value["i"], "subtask": ctx.subtask_index},)

    saved, chain.ROUTE_CACHE = chain.ROUTE_CACHE, cache
    try:
        with tempfile.TemporaryDirectory() as tmp:
            p = make_pipeline("route", parallelism=3, max_parallelism=16)
            (p.from_collection([{"i": i, "k": k} for i, k in enumerate(keys)], uid="src")
             .key_by(lambda r: r["k"])
             .process(Where(), uid="where")
             .sink(FileSink(os.path.join(tmp, "out")), uid="out"))
            sim_run(p, os.path.join(tmp, "chk"), seed=1)
            got = {r["i"]: r["subtask"] for r in committed_output(os.path.join(tmp, "out"))}
    finally:
        chain.ROUTE_CACHE = saved
    table = key_group_table(16, 3)
    assert got == {i: table[assign_to_key_group(k, 16)] for i, k in enumerate(keys)}


# ---------------------------------------------------------------- batches of keys (captures, routers)

_EDGE_INTS = [0, 1, -1, 127, 128, -128, -129, 255, 256, 2**15, -(2**15) - 1, 2**31, -(2**31), 2**55 - 1,
              2**63 - 1, -(2**63) + 1, -(2**63), 2**63, 2**64 + 5, -(2**80)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**64), 2**64), min_size=0, max_size=120), st.sampled_from([1, 7, 128, 32768]))
def test_key_groups_of_ints_equal_the_scalar_function(keys, m):
    """The vectorised path (CRC-32 and murmur in numpy) gives every int key the key group
    ``assign_to_key_group`` gives it, also past int64 (where it falls back per key)."""
    from epochstream.graph.keygroups import key_groups_of

    keys = keys + _EDGE_INTS
    assert key_groups_of(keys, m) == [assign_to_key_group(k, m) for k in keys]
    small = [k for k in keys if -(2**63) < k < 2**63]
    assert key_groups_of(small, m) == [assign_to_key_group(k, m) for k in small]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.integers(-1000, 1000), st.text(max_size=4), st.floats(allow_nan=True), st.booleans(),
                          st.none(), st.tuples(st.integers(0, 3), st.text(max_size=2))), max_size=80))
def test_key_groups_of_mixed_keys_equal_the_scalar_function(keys):
    from epochstream.graph.keygroups import KeyGroupOf, key_groups_of

    assert key_groups_of(keys, 128) == [assign_to_key_group(k, 128) for k in keys]
    assert KeyGroupOf(128).many(keys) == [KeyGroupOf(128)(k) for k in keys]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200))
def test_murmur_mix_array_equals_murmur_mix(codes):
    import numpy as np

    from epochstream.graph.keygroups import murmur_mix_array

    arr = np.array(codes + [0, 0x80000000, 0xFFFFFFFF], dtype=np.uint64)
    assert murmur_mix_array(arr).tolist() == [murmur_mix(c) for c in codes + [0, 0x80000000, 0xFFFFFFFF]]
