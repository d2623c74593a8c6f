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


def _exact(cells: list[str]):
    """A string array whose data buffer ends at its last cell's last byte (no padding after it)."""
    data = "".join(cells).encode()
    offsets = np.cumsum([0] + [len(c.encode()) for c in cells]).astype(np.int32)
    return pa.Array.from_buffers(pa.string(), len(cells), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)])


def test_cells_and_pieces_that_end_the_buffer():
    """A short cell is read eight bytes at a time where eight bytes remain, byte by byte at the buffer's end:
    every length from 0 to 12, as the last cell and as the last piece of a bag."""
    for k in range(13):
        for last in ("c" * k, "é" * (k // 2) + "z" * (k % 2)):
            cells = ["ab", "0123456789", last]
            assert hash_cells(_exact(cells), MISSING).tolist() == _want_single(cells)
            cells = ["x|yy", "a|" + last, "|" + last]
            bag = split_hash(_exact(cells), "|", None, MISSING)
            assert [bag.values[bag.offsets[i]:bag.offsets[i + 1]].tolist() for i in range(3)] == \
                _want_bags(cells, "|", None)


@pytest.mark.parametrize("sep,max_length", [("|", None), ("|", 2), ("::", 1)])
def test_columns_in_chunks_are_read_chunk_by_chunk(sep, max_length):
    """A column in chunks (pyarrow's blocks: empty ones, slices, one cell) gives the ids of the whole column,
    each chunk read where it lies."""
    rng = random.Random(4)
    cells = _cells(rng, 700)
    whole = pa.array(cells, pa.string())
    arr = pa.chunked_array([whole.slice(0, 0), whole.slice(0, 250), whole.slice(250, 1), pa.array([], pa.string()),
                            pa.array(cells[251:], pa.string())])
    out = np.full((700, 3), -1, np.int64)
    assert hash_cells(arr, MISSING, out, 1).tolist() == _want_single(cells)
    assert (out[:, [0, 2]] == -1).all()
    bag = split_hash(arr, sep, max_length, MISSING)
    assert [bag.values[bag.offsets[i]:bag.offsets[i + 1]].tolist() for i in range(700)] == \
        _want_bags(cells, sep, max_length)
    empty = split_hash(pa.chunked_array([], pa.string()), sep, max_length, MISSING)
    assert empty.values.size == 0 and empty.offsets.tolist() == [0]


# values that share their first 8 bytes or their length, short and long, unicode: the memo of distinct
# values (used from 4096 cells on) must tell them apart by their bytes
MEMO_WORDS = ["abcdefgh", "abcdefghi", "abcdefghj", "abcdefgh" + "é", "abcdefg", "abcdefgH", "a" * 16, "a" * 17,
              "a" * 15 + "b", "ünïcødé ünïcødé", "Mozilla/5.0 (X11; Linux x86_64) Chrome/120.0", "196", "x", ""]


def _memo_cells(rng: random.Random, n: int) -> list[str | None]:
    """Mostly repeated values, then a stretch of distinct ones (the memo turns itself off), then repeats."""
    third = n // 3
    repeated = [None if rng.random() < 0.03 else rng.choice(MEMO_WORDS) for _ in range(2 * third)]
    distinct = [f"u{i}-{rng.random()}"[: rng.randint(1, 24)] for i in range(n - 2 * third)]
    return repeated[:third] + distinct + repeated[third:]


@pytest.mark.parametrize("string_type", ["string", "large_string"])
def test_repeated_values_are_hashed_as_hash_text(string_type):
    rng = random.Random(5)
    cells = _memo_cells(rng, 15_000)
    arr = pa.array(cells, getattr(pa, string_type)())
    want = _want_single(cells)
    assert hash_cells(arr, MISSING).tolist() == want
    chunked = pa.chunked_array([arr.slice(0, 4100), arr.slice(4100, 7), arr.slice(4107)])
    assert hash_cells(chunked, MISSING).tolist() == want
    tail = pa.array(["q" * 5000] + ["abcdefgh", "abcdefg", "abcdefgh"] * 2000, getattr(pa, string_type)())
    assert hash_cells(tail, MISSING).tolist() == _want_single(tail.to_pylist())  # values that end the buffer
    alike = [f"abcdefgh{i:08d}" for i in range(1000)] * 5  # one head word and length: told apart by the rest
    assert hash_cells(pa.array(alike, getattr(pa, string_type)()), MISSING).tolist() == _want_single(alike)


@pytest.mark.parametrize("max_length", [None, 3])
def test_repeated_pieces_of_bags_are_hashed_as_hash_text(max_length):
    rng = random.Random(6)
    pieces = _memo_cells(rng, 30_000)
    cells = ["|".join(p or "" for p in pieces[i:i + rng.randint(0, 6)]) for i in range(0, 30_000, 4)]
    cells[7] = None
    bag = split_hash(pa.array(cells), "|", max_length, MISSING)
    got = [bag.values[bag.offsets[i]:bag.offsets[i + 1]].tolist() for i in range(len(cells))]
    assert got == _want_bags(cells, "|", max_length)
