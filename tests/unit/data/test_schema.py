"""Schemas: the file format and its checks, the hash, readers against a plain-Python reader, shards, Criteo's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hugeembed.data import (CAT_NAMES, DENSE_NAMES, Loader, Schema, ShardSet, TableReader, convert, criteo_schema,
                            fit_stats, hash_text, infer_schema, load_schema, read_criteo, read_table,
                            write_criteo_tsv)
from hugeembed.data._hash import hash_utf8, hex_utf8
from hugeembed.errors import ConfigError, InputError

from .schema_oracle import SCHEMA, oracle, write_rows

pa = pytest.importorskip("pyarrow")


@pytest.fixture
def schema(tmp_path):
    (tmp_path / "s.toml").write_text(SCHEMA)
    return load_schema(tmp_path / "s.toml")


def _bags(block, k):
    b = block.bags[k]
    return [b.values[b.offsets[i]:b.offsets[i + 1]].tolist() for i in range(len(b))]


# -- the schema file ---------------------------------------------------------------------------

def test_schema_file_reads_as_written(schema):
    assert schema.sparse_names == ("user_id", "movie_id", "genres", "history", "city")
    assert schema.dense_names == ("age", "score") and schema.label.column == "clicked"
    assert schema.tables() == {"user_id": ("user_id",), "movie_id": ("movie_id", "history"), "genres": ("genres",),
                               "city": ("city",)}
    assert schema.table_combiner("movie_id") == "mean"
    assert Schema.from_dict(json.loads(json.dumps(schema.to_dict()))) == schema  # the saved form keeps the order


@pytest.mark.parametrize("text,message", [
    ('format = "csv"\nhedaer = true\n[sparse.a]\n', "unknown key 'hedaer' (did you mean 'header'?)"),
    ('[sparse.a]\nseperator = "|"\n', "unknown key sparse.a.'seperator' (did you mean 'separator'?)"),
    ('[dense.a]\ntransform = "log"\n', "dense.a.transform must be one of none, log1p, standardize"),
    ('[sparse.a]\nids = "str"\n', "sparse.a.ids must be one of hash, int, hex"),
    ('[sparse.a]\nmax_length = 5\n', "max_length applies to a bag"),
    ('[sparse.a]\ntable = "b"\n', "table = 'b' names no sparse feature"),
    ('[sparse.a]\n[sparse.b]\ntable = "a"\n[sparse.c]\ntable = "b"\n', "which itself reads table 'a'"),
    ('[label]\ncolumn = "y"\nnegative = "n"\n', "label.negative goes with label.positive"),
    ('[label]\ncolumn = "y"\n', "names no dense and no sparse column"),
    ('format = "tsv"\nheader = false\n[sparse.a]\n', "header = false needs columns"),
    ('format = "xls"\n[sparse.a]\n', "format must be one of csv, tsv, parquet, criteo"),
    ('[dense.a]\n[sparse.a]\n', "named both as dense and as sparse"),
    ('[sparse.a]\nseparator = "|"\ncombiner = "sum"\n[sparse.b]\nseparator = "|"\ntable = "a"\ncombiner = "mean"\n',
     "pool their bags differently"),
])
def test_schema_errors_name_the_key(tmp_path, text, message):
    (tmp_path / "bad.toml").write_text(text)
    with pytest.raises(ConfigError, match="bad.toml") as e:
        load_schema(tmp_path / "bad.toml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_criteo_schema_file_is_the_criteo_layout():
    s = criteo_schema()
    assert s.format == "criteo" and not s.header and s.label.column == "label"
    assert s.dense_names == DENSE_NAMES and s.sparse_names == CAT_NAMES
    assert all(d.transform == "log1p" for d in s.dense) and all(x.ids == "hex" and not x.is_bag for x in s.sparse)
    assert s.is_criteo()


# -- the hash ----------------------------------------------------------------------------------

def test_hash_is_pinned_and_typed_values_hash_as_their_text():
    from hugeembed._hashing import mix64_int

    # pinned: served models and snapshots hold these ids, so the function may never change
    assert hash_text("196") == hash_text(196) == hash_text(196.0) == 6249491221583746643
    # FNV-1a of no bytes is its offset basis; then mix64 (the store's own oracle) and bit 62
    assert hash_text("") == (mix64_int(0xCBF29CE484222325) & (2**62 - 1)) | 2**62
    assert hash_text(True) == hash_text("true")
    words = ["", "a", "196", "ünïcode", "x" * 300, "Action|Comedy"]
    data = "".join(words).encode()
    offsets = np.cumsum([0] + [len(w.encode()) for w in words])
    assert hash_utf8(offsets, np.frombuffer(data, np.uint8)).tolist() == [hash_text(w) for w in words]
    assert all(2**62 <= hash_text(w) < 2**63 for w in words)


def test_hash_is_the_same_in_another_process():
    import hugeembed.data._hash as mod

    # the module loaded on its own (it needs numpy only), with another PYTHONHASHSEED: no torch import
    code = ("import importlib.util as u; s = u.spec_from_file_location('h', %r); m = u.module_from_spec(s); "
            "s.loader.exec_module(m); print([m.hash_text(w) for w in ['196', 'Paris', 'ünï']])" % mod.__file__)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    assert json.loads(out) == [hash_text(w) for w in ["196", "Paris", "ünï"]]


def test_hex_ids():
    words = ["0", "ff", "DEADbeef", "123456789abcdef", "", "xyz", "1234567890abcdef"]
    offsets = np.cumsum([0] + [len(w) for w in words])
    ids, bad = hex_utf8(offsets, np.frombuffer("".join(words).encode(), np.uint8))
    assert bad.tolist() == [False, False, False, False, True, True, True]
    assert ids[:4].tolist() == [0, 255, 0xDEADBEEF, 0x123456789ABCDEF]


# -- readers against the plain-Python reader ----------------------------------------------------

@pytest.mark.parametrize("name,delimiter,fmt,native", [("d.csv", ",", None, None), ("d.tsv.gz", "\t", "tsv", None),
                                                      ("d.csv", ",", None, False)])
def test_reader_matches_a_plain_python_reader(tmp_path, schema, name, delimiter, fmt, native):
    """The native encoder (where built) and the NumPy path, each against the plain-Python reader."""
    path = write_rows(tmp_path / name, 700, seed=3, delimiter=delimiter)
    s = Schema.from_dict({**{k: v for k, v in schema.to_dict().items() if k != "format"}, **({"format": fmt} if fmt
                                                                                           else {})})
    dense, cats, labels, bags = oracle(path, delimiter)
    blocks = list(TableReader(path, s, chunk_bytes=4096))
    assert len(blocks) > 3  # several chunks
    got = TableReader(path, s, native=native).read_all()
    np.testing.assert_array_equal(got.dense, dense)
    np.testing.assert_array_equal(got.cats, cats)
    np.testing.assert_array_equal(got.labels, labels)
    assert _bags(got, 0) == bags["genres"] and _bags(got, 1) == bags["history"]


@pytest.mark.parametrize("name", ["d.csv", "d.csv.gz"])
@pytest.mark.parametrize("native", [None, False])
def test_columns_parsed_in_blocks_match_the_plain_python_reader(tmp_path, schema, monkeypatch, name, native):
    """pyarrow's blocks (small here) give each piece's columns in chunks, read chunk by chunk: the rows of the
    plain-Python reader, with bags of empty items, sequences cut from the front, quoted and non-ASCII cells."""
    import gzip

    from hugeembed.data import _reader

    monkeypatch.setattr(_reader, "_BLOCK_BYTES", 1500)
    path = write_rows(tmp_path / "d.csv", 600, seed=6)
    extra = ('1,"a ""q"", b",3,São Paulo,|Action||Drama|, 7  8 ,5,0.5,x\n'
             '0,,,,||,1 2 3 4 5 6,,,x\n'
             '1,ünï,1,"New York",Comedy|,   ,0,-0.25,x\n')
    text = path.read_text() + extra
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    dense, cats, labels, bags = oracle(path)
    got = TableReader(path, schema, chunk_bytes=8192, native=native).read_all()
    np.testing.assert_array_equal(got.dense, dense)
    np.testing.assert_array_equal(got.cats, cats)
    np.testing.assert_array_equal(got.labels, labels)
    assert _bags(got, 0) == bags["genres"] and _bags(got, 1) == bags["history"]
    assert _bags(got, 1)[-2] == [hash_text(x) for x in "3456"] and _bags(got, 0)[-2] == [2**32 + 2]


def test_a_line_longer_than_a_block_is_read(tmp_path, schema, monkeypatch):
    """A piece is parsed in blocks (here 4 KiB); a line longer than a few blocks (a long sequence), which
    pyarrow refuses to parse across blocks, is read with the piece as one block."""
    from pyarrow import csv

    from hugeembed.data import _reader

    monkeypatch.setattr(_reader, "_BLOCK_BYTES", 4096)
    calls = []
    monkeypatch.setattr(csv, "read_csv", lambda *a, _read=csv.read_csv, **k: calls.append(1) or _read(*a, **k))
    path = write_rows(tmp_path / "d.csv", 50, seed=8)
    with open(path, "a") as f:
        f.write("1,u1,3,Paris,Drama," + " ".join(str(i) for i in range(10_000)) + ",5,0.5,x\n")  # ~50 KB
    dense, cats, labels, bags = oracle(path)
    got = read_table(path, schema)
    assert len(calls) == 2  # refused in blocks, then read whole
    np.testing.assert_array_equal(got.cats, cats)
    assert _bags(got, 1) == bags["history"] and _bags(got, 1)[-1] == [hash_text(i) for i in range(9_996, 10_000)]


def test_bad_lines_in_later_pieces_are_named_by_their_line(tmp_path, schema):
    """Line numbers count on over the pieces: a short line far into the file is named by its own line,
    raised or skipped."""
    path = write_rows(tmp_path / "d.csv", 400, seed=7)
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(250, "1,u,1,c,,,5\n")  # line 251
    lines.insert(380, "0,u\n")           # line 381
    path.write_text("".join(lines))
    with pytest.raises(InputError, match=r"d.csv: line 251: expected 9 fields, got 7"):
        list(TableReader(path, schema, chunk_bytes=2048))
    reader = TableReader(path, schema, chunk_bytes=2048, on_error="skip")
    assert len(reader.read_all()) == 400 and reader.summary.skipped == 2
    assert [m.split(": expected")[0].split(": ")[-1] for m in reader.summary.skipped_examples] == ["line 251",
                                                                                                   "line 381"]


@pytest.mark.parametrize("gz", [False, True])
def test_text_chunks_are_whole_lines_that_ramp_up(tmp_path, monkeypatch, gz):
    """A text file's pieces join to the file, each ends a line, the first is small (the pipeline starts
    early), none is over the chunk size, and a plain file's last pieces shrink (its tail stays short)."""
    import gzip

    from hugeembed.data import _reader

    monkeypatch.setattr(_reader, "_FIRST_CHUNK", 1000)
    rng = np.random.default_rng(5)
    text = b"".join(b"x" * int(n) + b"\n" for n in rng.integers(0, 90, 3000))
    path = tmp_path / ("t.csv.gz" if gz else "t.csv")
    path.write_bytes(gzip.compress(text) if gz else text)
    pieces = [bytes(p) for p, _ in _reader._chunks(path, 16_000)]
    assert b"".join(pieces) == text and all(p.endswith(b"\n") for p in pieces)
    sizes = [len(p) for p in pieces]
    assert sizes[0] <= 1000 and max(sizes) <= 16_000 + 100  # + the line carried from the piece before
    assert sizes[:4] == sorted(sizes[:4])  # 1000, 2000, 4000, 8000 (less a carried line's end)
    if not gz:
        assert sizes[-3] > sizes[-2] > sizes[-1] or len(sizes) < 4


def test_sequences_keep_their_last_values_and_shared_tables_share_ids(tmp_path, schema):
    path = tmp_path / "seq.csv"
    path.write_text("clicked,user_id,age,city,genres,history,movie_id,score\n"
                    "1,u,1,c,,1 2 3 4 5 6,5,0\n0,u,1,c,A||B,,6,0\n")
    blk = read_table(path, schema)
    assert _bags(blk, 1)[0] == [hash_text(x) for x in "3456"]  # the front is cut, order kept
    assert _bags(blk, 1)[1] == [2**32 + 3] and _bags(blk, 0)[1] == [hash_text("A"), hash_text("B")]
    assert blk.cats[0, 1] == _bags(blk, 1)[0][-2]  # movie 5 and history's 5: one id in one table


def test_parquet_with_list_columns_matches_the_text(tmp_path, schema):
    import pyarrow.parquet as pq

    path = write_rows(tmp_path / "d.csv", 300, seed=5)
    text = read_table(path, schema)
    from pyarrow import csv

    t = csv.read_csv(path, convert_options=csv.ConvertOptions(column_types={c: pa.string() for c in
                                                                            ["user_id", "movie_id", "city", "history"]}))
    hist = [[x for x in (h or "").split(" ") if x] for h in t.column("history").to_pylist()]
    t = t.set_column(t.schema.get_field_index("history"), "history", pa.array(hist, pa.list_(pa.string())))
    t = t.set_column(t.schema.get_field_index("movie_id"), "movie_id", t.column("movie_id").cast(pa.int64()))
    pq.write_table(t, tmp_path / "d.parquet", row_group_size=100)
    got = read_table(tmp_path / "d.parquet", Schema.from_dict({k: v for k, v in schema.to_dict().items()
                                                               if k not in ("format", "header")}))
    assert got.equals(text)  # ints hash as their digits, list cells are bags


def test_shards_round_trip_and_loader_batches(tmp_path, schema):
    path = write_rows(tmp_path / "d.csv", 500, seed=7)
    summary = convert(path, tmp_path / "shards", schema=schema, rows_per_shard=130)
    shards = ShardSet(tmp_path / "shards")
    assert summary.rows == 500 and summary.shards == 4 and shards.schema == schema
    assert shards.read_all().equals(read_table(path, schema))
    assert shards.read(120, 270).equals(read_table(path, schema).slice(120, 270))
    batches = list(Loader(tmp_path / "shards", 64, shuffle=True, seed=1))
    assert sum(b.batch_size for b in batches) == 500
    b = batches[0]
    assert b.sparse.keys() == schema.sparse_names and b.dense.shape == (64, 2)
    assert all(n >= 1 for n in b.sparse.lengths().tolist())  # an empty cell is a missing id, never an empty bag
    text = list(Loader(path, 64, schema=schema, prefetch=0))
    assert [x.batch_size for x in text] == [64] * 7 + [52]


def test_standardize_statistics_are_fitted_and_stored(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("y,x,c\n1,1,a\n0,3,b\n1,,a\n0,8,b\n")
    s = Schema.from_dict({"format": "csv", "label": {"column": "y"}, "dense": {"x": {"transform": "standardize"}},
                          "sparse": {"c": {}}})
    with pytest.raises(InputError, match="never fitted"):
        read_table(path, s)
    fitted = fit_stats(path, s)
    x = np.array([1, 3, 0, 8.0])
    assert fitted.dense[0].mean == pytest.approx(x.mean()) and fitted.dense[0].std == pytest.approx(x.std())
    assert np.allclose(read_table(path, fitted).dense[:, 0], (x - x.mean()) / x.std(), atol=1e-6)
    convert(path, tmp_path / "sh", schema=s)
    assert ShardSet(tmp_path / "sh").schema == fitted


def test_criteo_files_read_as_before(tmp_path):
    write_criteo_tsv(tmp_path / "c.txt", 300, seed=1)
    ref = read_criteo(tmp_path / "c.txt")
    assert read_table(tmp_path / "c.txt").equals(ref)
    generic = Schema.from_dict({**criteo_schema().to_dict(), "delimiter": None})  # the same layout ...
    assert TableReader(tmp_path / "c.txt", generic)._criteo is not None
    # ... and the generic reader gives the native parser's rows (same ids, same floats)
    from hugeembed.data._encode import Encoder, Where
    from pyarrow import csv

    t = csv.read_csv(tmp_path / "c.txt", read_options=csv.ReadOptions(column_names=["label", *DENSE_NAMES, *CAT_NAMES]),
                     parse_options=csv.ParseOptions(delimiter="\t"),
                     convert_options=csv.ConvertOptions(column_types={c: pa.string() for c in
                                                                      ["label", *DENSE_NAMES, *CAT_NAMES]}))
    assert Encoder(criteo_schema()).encode(t, Where("c.txt")).equals(ref)


@pytest.mark.parametrize("body,message", [
    ("1,u,abc,c,,,5,0\n", "d.csv: row 2 (line 3): column 'age': not a number: 'abc'"),
    ("7,u,1,c,,,5,0\n", "d.csv: row 2 (line 3): column 'clicked': label must be 0/1 or true/false, got '7'"),
    ("1,u,1,c,,,5\n", "d.csv: line 3: expected 8 fields, got 7"),
])
def test_bad_rows_name_file_row_column_value(tmp_path, schema, body, message):
    path = tmp_path / "d.csv"
    path.write_text("clicked,user_id,age,city,genres,history,movie_id,score\n1,u,1,c,,,5,0\n" + body)
    with pytest.raises(InputError) as e:
        read_table(path, schema)
    assert str(e.value).startswith(str(tmp_path / "d.csv")) and message.split("d.csv")[1] in str(e.value)
    skipped = TableReader(path, schema, on_error="skip")
    assert len(skipped.read_all()) == 1 and skipped.summary.skipped == 1


def test_inferred_schema_is_a_valid_starting_point(tmp_path):
    path = write_rows(tmp_path / "d.csv", 400, seed=2)
    text = infer_schema(path)
    (tmp_path / "s.toml").write_text(text)
    s = load_schema(tmp_path / "s.toml")
    assert s.label.column == "clicked" and set(s.dense_names) == {"age", "score"}
    assert {x.name: x.separator for x in s.sparse if x.is_bag} == {"genres": "|", "history": " "}
    assert len(read_table(path, fit_stats(path, s))) == 400
