"""The native cell encoder (csrc/encode.cpp) against plain Python: hash_text per value, str.split per cell."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hugeembed.data import Schema, TableReader, hash_text
from hugeembed.data._cells import hash_cells, native_cells, split_hash

pa = pytest.importorskip("pyarrow")
pytestmark = pytest.mark.skipif(not native_cells(), reason="native kernels not built")

MISSING = 2**32 + 7
WORDS = ["", "a", "196", "ünïcødé", "Action", "x" * 37, "a b", "é|è", "aa", "aaa", "::", "tab\there"]


def _cells(rng: random.Random, n: int) -> list[str | None]:
    """Cells of every length from 0 to 40 (the four-lane loop's common part and its tails), nulls, unicode."""
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(None if r < 0.05 else rng.choice(WORDS) if r < 0.4 else
                   "".join(rng.choice("ab01é|: ") for _ in range(rng.randint(0, 40))))
    return out


def _want_single(cells):
    return [MISSING if not c else hash_text(c) for c in cells]


def _want_bags(cells, sep: str, max_length: int | None):
    rows = []
    for c in cells:
        items = [hash_text(x) for x in (c or "").split(sep) if x]  # str.split cuts left to right, as pyarrow
        if max_length:
            items = items[-max_length:]
        rows.append(items or [MISSING])
    return rows


@pytest.mark.parametrize("string_type", ["string", "large_string"])
def test_hash_cells_is_hash_text(string_type):
    rng = random.Random(1)
    cells = _cells(rng, 1003)  # not a multiple of four
    arr = pa.array(cells, getattr(pa, string_type)())
    assert hash_cells(arr, MISSING).tolist() == _want_single(cells)
    part = arr.slice(13, 500)  # a slice: offsets that do not start at 0, a validity bitmap with an offset
    assert hash_cells(part, MISSING).tolist() == _want_single(cells[13:513])
    assert hash_cells(pa.array([], pa.string()), MISSING).tolist() == []


def test_hash_cells_writes_one_column_of_a_matrix():
    cells = ["a", "", "b", None, "c"]
    out = np.full((5, 3), -1, np.int64)
    col = hash_cells(pa.array(cells), MISSING, out, 2)
    assert out[:, 2].tolist() == _want_single(cells) and col.tolist() == _want_single(cells)
    assert (out[:, :2] == -1).all()  # the other columns untouched
    with pytest.raises(ValueError, match="C-contiguous int64"):
        hash_cells(pa.array(cells), MISSING, out[:, :2], 0)


@pytest.mark.parametrize("sep,max_length", [("|", None), ("|", 2), (" ", 3), ("::", None), ("aa", 1), ("é", None)])
def test_split_hash_is_str_split(sep, max_length):
    rng = random.Random(2)
    cells = _cells(rng, 801) + ["aaaa", "aaa", "|a||b|", "::a:::b", "a a  b "]
    bag = split_hash(pa.array(cells), sep, max_length, MISSING)
    got = [bag.values[bag.offsets[i]:bag.offsets[i + 1]].tolist() for i in range(len(bag))]
    assert got == _want_bags(cells, sep, max_length)
    part = split_hash(pa.array(cells).slice(5, 300), sep, max_length, MISSING)
    assert part.values.tolist() == [x for row in _want_bags(cells[5:305], sep, max_length) for x in row]


def test_native_and_numpy_encoders_agree_with_nulls_and_numbers(tmp_path):
    """Parquet cells may be null (a missing id, like an empty cell) and integer columns hash as their digits:
    both encoders give the same block."""
    import pyarrow.parquet as pq

    rng = random.Random(3)
    n = 900
    table = pa.table({"y": pa.array([rng.randint(0, 1) for _ in range(n)]),
                      "user": pa.array(_cells(rng, n)),
                      "item": pa.array([None if rng.random() < 0.1 else rng.randint(-5, 10**12) for _ in range(n)]),
                      "tags": pa.array(_cells(rng, n))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=250)
    schema = Schema.from_dict({"format": "parquet", "label": {"column": "y"},
                               "sparse": {"user": {}, "item": {}, "tags": {"separator": "|", "max_length": 3}}})
    native = TableReader(tmp_path / "d.parquet", schema, native=True).read_all()
    numpy = TableReader(tmp_path / "d.parquet", schema, native=False).read_all()
    assert native.equals(numpy)
    users = table.column("user").to_pylist()
    assert native.cats[:, 0].tolist() == [2**32 if not u else hash_text(u) for u in users]
    items = table.column("item").to_pylist()
    assert native.cats[:, 1].tolist() == [2**32 + 1 if i is None else hash_text(i) for i in items]
