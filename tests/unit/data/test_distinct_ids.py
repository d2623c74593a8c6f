"""Distinct ids per sparse feature: the HyperLogLog sketch against np.unique, the manifest field convert
writes, old manifests without it, and bad values in it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hugeembed import _native
from hugeembed.data import ShardSet, SyntheticConfig, convert, load_schema, write_criteo_tsv
from hugeembed.data._distinct import hll_estimate, hll_registers
from hugeembed.errors import InputError


def _ids(n: int, pattern: str, seed: int) -> np.ndarray:
    """n distinct ids (small consecutive ints, a stride, or random 40-bit ones), some repeated, shuffled."""
    rng = np.random.default_rng(seed)
    if pattern == "consecutive":
        base = np.arange(n, dtype=np.int64)
    elif pattern == "stride":
        base = np.arange(n, dtype=np.int64) * 4096 + 7
    else:
        base = rng.choice(1 << 40, n, replace=False).astype(np.int64)
    ids = np.concatenate([base, base[rng.integers(0, n, n // 2)]])
    return ids[rng.permutation(ids.size)]


@pytest.mark.parametrize("pattern", ["consecutive", "stride", "random"])
@pytest.mark.parametrize("n", [1, 10, 100, 1000, 5000, 10_240, 12_000, 30_000, 100_000,
                               pytest.param(1_000_000, marks=pytest.mark.slow)])
def test_estimate_is_within_5_percent_of_the_distinct_count(n, pattern):
    ids = _ids(n, pattern, seed=n)
    exact = len(np.unique(ids))  # the oracle
    assert abs(hll_estimate(hll_registers(ids)[0]) - exact) <= 0.05 * exact


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, (1 << 63) - 1), max_size=3000), st.integers(1, 4))
def test_estimate_of_any_ids_with_duplicates_and_empties(values, repeat):
    ids = np.array(values * repeat, dtype=np.int64)
    exact = len(np.unique(ids))
    registers = hll_registers(ids)[0]
    # ids that land in one register are one to the sketch (two ids: 1 in 4096): not an error to count
    shared = exact - int(np.count_nonzero(registers)) if exact < 300 else 0
    assert abs(hll_estimate(registers) - exact) <= max(0.05 * exact, 0.5) + shared


def test_registers_merge_by_max_and_columns_are_independent():
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 1 << 30, (5000, 3)), rng.integers(0, 1 << 30, (7000, 3))
    whole = hll_registers(np.concatenate([a, b]), 3)
    assert np.array_equal(np.maximum(hll_registers(a, 3), hll_registers(b, 3)), whole)
    for j in range(3):  # column j of a matrix: the sketch of that column alone
        assert np.array_equal(whole[j], hll_registers(np.concatenate([a[:, j], b[:, j]]))[0])


def _exact_per_feature(shards: ShardSet) -> dict[str, int]:
    block = shards.read_all()
    singles = [s.name for s in shards.schema.sparse if not s.is_bag]
    bags = iter(block.bags)
    return {s.name: len(np.unique(next(bags).values if s.is_bag else block.cats[:, singles.index(s.name)]))
            for s in shards.schema.sparse}


def test_convert_writes_the_estimates_over_every_shard(tmp_path):
    write_criteo_tsv(tmp_path / "a.txt", 6000, config=SyntheticConfig(seed=2, max_cardinality=50_000))
    convert(tmp_path / "a.txt", tmp_path / "out", rows_per_shard=2500, chunk_bytes=100_000)
    shards = ShardSet(tmp_path / "out")
    got, exact = shards.distinct_ids(), _exact_per_feature(shards)
    assert set(got) == set(exact) == {f"C{j}" for j in range(1, 27)}
    for name in exact:
        assert abs(got[name] - exact[name]) <= 0.05 * exact[name], name


def test_bag_features_count_their_values(tmp_path):
    (tmp_path / "s.toml").write_text('format = "csv"\nheader = true\n[label]\ncolumn = "y"\n[sparse.user]\n'
                                     '[sparse.tags]\nseparator = "|"\n')
    lines = ["y,user,tags"] + [f"{i % 2},{i % 700},{'|'.join(str(i * 7 + j) for j in range(i % 5))}"
                               for i in range(3000)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    convert(tmp_path / "d.csv", tmp_path / "out", schema=load_schema(tmp_path / "s.toml"), chunk_bytes=4096)
    shards = ShardSet(tmp_path / "out")
    got, exact = shards.distinct_ids(), _exact_per_feature(shards)
    for name in ("user", "tags"):
        assert abs(got[name] - exact[name]) <= 0.05 * exact[name], name


@pytest.fixture
def converted(tmp_path):
    write_criteo_tsv(tmp_path / "a.txt", 50, config=SyntheticConfig(seed=1, max_cardinality=100))
    convert(tmp_path / "a.txt", tmp_path / "out")
    return tmp_path / "out" / "manifest.json"


def _rewrite(path, change) -> None:
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def test_a_manifest_without_the_field_loads_with_no_hint(converted):
    _rewrite(converted, lambda m: m.pop("distinct_ids"))
    shards = ShardSet(converted)
    assert shards.distinct_ids() is None and shards.read_all().cats.shape == (50, 26)


@pytest.mark.parametrize("value, shown", [(-3, "-3"), (2.5, "2.5"), ("12", "'12'"), (True, "True"), (None, "None")])
def test_a_bad_estimate_is_refused_naming_the_feature(converted, value, shown):
    _rewrite(converted, lambda m: m["distinct_ids"].__setitem__("C7", value))
    with pytest.raises(InputError) as e:
        ShardSet(converted)
    assert str(e.value) == f"{converted}: distinct_ids.C7 must be a non-negative integer, got {shown}"


def test_an_estimate_of_no_such_feature_or_not_a_mapping_is_refused(converted):
    _rewrite(converted, lambda m: m["distinct_ids"].__setitem__("C99", 4))
    with pytest.raises(InputError, match=r"distinct_ids must be keyed by the schema's sparse features .*got 'C99'"):
        ShardSet(converted)
    _rewrite(converted, lambda m: m.__setitem__("distinct_ids", [1, 2]))
    with pytest.raises(InputError, match=r"distinct_ids must be a mapping of sparse feature -> distinct ids"):
        ShardSet(converted)


def test_the_numpy_hash_gives_the_native_kernels_registers(monkeypatch):
    from hugeembed import _native

    ids = _ids(20_000, "random", seed=5)
    native = hll_registers(ids)
    monkeypatch.setattr(_native, "available", lambda: False)
    assert np.array_equal(hll_registers(ids), native)


def _oracle_registers(ids: np.ndarray, columns: int) -> np.ndarray:
    """The registers by the definition, id by id in Python ints: splitmix64's finaliser of id ^ salt, the
    top 12 bits pick the register, the low 32 bits' leading zeros + 1 (33 for 0) are its candidate."""
    m = (1 << 64) - 1
    out = np.zeros((columns, 4096), np.uint8)
    for row in ids.reshape(-1, columns).tolist():
        for c, v in enumerate(row):
            x = (v & m) ^ 0x3C6EF372FE94F82B
            x ^= x >> 33
            x = (x * 0xFF51AFD7ED558CCD) & m
            x ^= x >> 33
            x = (x * 0xC4CEB9FE1A85EC53) & m
            x ^= x >> 33
            rank = 33 - (x & 0xFFFFFFFF).bit_length()
            out[c, x >> 52] = max(out[c, x >> 52], rank)
    return out


needs_native = pytest.mark.skipif(not _native.available(), reason="native kernels not built")
_ID = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 5), st.integers(0, 1 << 20))


@needs_native
@settings(max_examples=60, deadline=None)
@given(columns=st.integers(1, 4), data=st.data())
def test_native_registers_equal_numpy_and_the_definition_bit_for_bit(columns, data):
    rows = data.draw(st.lists(st.lists(_ID, min_size=columns, max_size=columns), max_size=40))
    dups = data.draw(st.integers(0, 3))  # whole rows repeated: duplicates must not move a register
    ids = np.array(rows * (1 + dups), np.int64).reshape(-1, columns)
    native = hll_registers(ids, columns, native=True)
    assert native.shape == (columns, 4096) and native.dtype == np.uint8
    assert np.array_equal(native, hll_registers(ids, columns, native=False))
    assert np.array_equal(native, _oracle_registers(ids, columns))


@needs_native
def test_native_registers_of_a_strided_block_and_many_ids():
    """A column slice (not contiguous) and 10^5 ids x 3 columns: the kernel equals the NumPy path."""
    wide = np.random.default_rng(3).integers(-(2**40), 2**40, size=(100_000, 5))
    block = wide[:, 1:4]
    assert np.array_equal(hll_registers(block, 3, native=True), hll_registers(block, 3, native=False))


@needs_native
def test_native_registers_of_wide_rows():
    """4100 columns (registers 4100 x 4096 bytes): every column's registers apart."""
    ids = np.random.default_rng(4).integers(-(2**62), 2**62, size=(3, 4100))
    assert np.array_equal(hll_registers(ids, 4100, native=True), hll_registers(ids, 4100, native=False))
