"""Criteo TSV reader: every quirk of the format, both parsers, against the plain-Python oracle."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from hugeembed import _native
from hugeembed.data import MISSING_IDS, CriteoReader, missing_id, read_criteo
from hugeembed.errors import ConfigError, InputError

from .criteo_oracle import line, parse_text

BACKENDS = [pytest.param(False, id="numpy")] + (
    [pytest.param(True, id="native")] if _native.available() else []
)


@pytest.fixture(params=BACKENDS)
def native(request) -> bool:
    return request.param


def read(tmp_path, text: str | bytes, native: bool, name: str = "t.txt", **kw):
    path = tmp_path / name
    data = text.encode() if isinstance(text, str) else text
    if name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    reader = CriteoReader(path, native=native, **kw)
    return reader.read_all(), reader.summary


def assert_matches_oracle(blk, text: str, skip: bool = False):
    labels, dense, cats, _ = parse_text(text, skip)
    assert blk.labels.tolist() == labels
    assert blk.dense.tolist() == (dense or [])
    assert blk.cats.tolist() == (cats or [])


QUIRKY = "\n".join([
    line("0", ints=[""] * 13, cats=[""] * 26),                               # everything missing
    line("1", ints=["-1", "0", "-20", "5", "", "123456789012345678"] + ["7"] * 7),  # negatives, 18 digits
    line("0", cats=["ABCDEF01", "abcdef01", "0", "ffffffff", "1"] + [""] * 21),  # case, short hex, max
])


def test_quirky_lines(tmp_path, native):
    blk, summary = read(tmp_path, QUIRKY + "\n", native)
    assert_matches_oracle(blk, QUIRKY)
    assert blk.dense.dtype == np.float32 and blk.cats.dtype == np.int64 and blk.labels.dtype == np.float32
    assert blk.dense[0].tolist() == [0.0] * 13 and blk.cats[0].tolist() == list(MISSING_IDS)
    assert blk.dense[1, :3].tolist() == [0.0, 0.0, 0.0]  # negative -> log1p(0)
    assert blk.dense[1, 5] == np.float32(math.log1p(123456789012345678))
    assert blk.cats[2, :5].tolist() == [0xABCDEF01, 0xABCDEF01, 0, 0xFFFFFFFF, 1]
    assert summary.rows == 3 and summary.skipped == 0


def test_crlf_and_missing_trailing_newline(tmp_path, native):
    lf, _ = read(tmp_path, QUIRKY + "\n", native, "lf.txt")
    crlf, _ = read(tmp_path, QUIRKY.replace("\n", "\r\n") + "\r\n", native, "crlf.txt")
    bare, _ = read(tmp_path, QUIRKY.replace("\n", "\r\n"), native, "bare.txt")
    assert len(lf) == 3 and crlf.equals(lf) and bare.equals(lf)


def test_gzip_equals_plain(tmp_path, native):
    plain, _ = read(tmp_path, QUIRKY + "\n", native, "a.txt")
    gz, summary = read(tmp_path, QUIRKY + "\n", native, "a.txt.gz")
    assert gz.equals(plain) and summary.rows == 3


def test_missing_ids_cannot_collide_with_hex():
    assert min(MISSING_IDS) > 0xFFFFFFFF and len(set(MISSING_IDS)) == 26
    assert missing_id("C1") == 2**32 and missing_id(25) == 2**32 + 25
    with pytest.raises(KeyError):
        missing_id("I1")


BAD = [
    (line(ints=["1"] * 12), "got 39", "wrong field count"),                       # missing trailing field
    (line() + "\t", "got 41", "wrong field count"),                               # one too many
    ("", "got 1", "wrong field count"),                                           # blank line
    (line(label="2"), "field label (column 1)", "bad label"),
    (line(label=""), "field label (column 1)", "bad label"),
    (line(ints=["1", "x7"] + ["1"] * 11), "field I2 (column 3): not an integer", "bad integer in I2"),
    (line(ints=["-"] + ["1"] * 12), "field I1 (column 2)", "bad integer in I1"),
    (line(ints=["1.5"] + ["1"] * 12), "'1.5'", "bad integer in I1"),
    (line(ints=["1"] * 12 + ["1" * 19]), "field I13 (column 14)", "bad integer in I13"),
    (line(cats=["zz12"] + ["1"] * 25), "field C1 (column 15): not a hex id of 1-8 digits: 'zz12'", "bad hex id in C1"),
    (line(cats=["1"] * 25 + ["123456789"]), "field C26 (column 40)", "bad hex id in C26"),
    (line(cats=["1"] * 3 + [" 12"] + ["1"] * 22), "field C4", "bad hex id in C4"),
]


@pytest.mark.parametrize("bad,message,reason", BAD)
def test_malformed_line_raises_with_file_line_and_field(tmp_path, native, bad, message, reason):
    text = "\n".join([line(), line("0"), bad, line()]) + "\n"
    with pytest.raises(InputError) as err:
        read(tmp_path, text, native, "bad.txt")
    assert "bad.txt:3: " in str(err.value) and message in str(err.value)
    blk, summary = read(tmp_path, text, native, "bad.txt", on_error="skip")
    assert len(blk) == 3 and summary.skipped == 1 and summary.rows == 3 and summary.lines == 4
    assert summary.skipped_examples == [f"{tmp_path / 'bad.txt'}:3: {reason}"]
    assert_matches_oracle(blk, text, skip=True)


def test_error_line_numbers_across_chunks_and_files(tmp_path, native):
    good = "\n".join(line(str(i % 2)) for i in range(500)) + "\n"
    (tmp_path / "a.txt").write_text(good)
    (tmp_path / "b.txt").write_text(good + line(label="7") + "\n" + good)
    reader = CriteoReader([tmp_path / "a.txt", tmp_path / "b.txt"], chunk_bytes=4096, native=native)
    with pytest.raises(InputError, match=r"b\.txt:501: field label"):
        reader.read_all()
    reader = CriteoReader([tmp_path / "a.txt", tmp_path / "b.txt"], chunk_bytes=4096, native=native, on_error="skip")
    assert len(reader.read_all()) == 1500 and reader.summary.skipped == 1
    assert [f.rows for f in reader.summary.files] == [500, 1000]


def test_small_chunks_and_a_line_longer_than_the_buffer(tmp_path, native):
    text = "\n".join([line(ints=["9" * 18] * 13, cats=["ffffffff"] * 26)] * 40 + [line()] * 7)
    whole, _ = read(tmp_path, text, native, "s.txt")
    tiny, _ = read(tmp_path, text, native, "t.txt", chunk_bytes=1024)  # first lines are ~720 bytes
    assert len(whole) == 47 and whole.equals(tiny)
    assert_matches_oracle(tiny, text)


def test_rank_slicing_reads_every_line_once(tmp_path, native):
    lines = [line(str(i % 2), ints=[str(i)] + [""] * 12) for i in range(1001)]
    (tmp_path / "a.txt").write_text("\n".join(lines[:400]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(lines[400:]))
    seen = []
    for rank in range(3):
        blk = CriteoReader([tmp_path / "a.txt", tmp_path / "b.txt"], rank=rank, world_size=3, chunk_bytes=2048,
                           native=native).read_all()
        ids = np.rint(np.expm1(blk.dense[:, 0].astype(np.float64))).astype(int).tolist()
        assert ids == list(range(rank, 1001, 3))
        seen += ids
    assert sorted(seen) == list(range(1001))


def test_rank_slicing_validates_only_own_lines(tmp_path, native):
    text = "\n".join([line(), "garbage", line()]) + "\n"
    (tmp_path / "x.txt").write_text(text)
    assert len(CriteoReader(tmp_path / "x.txt", rank=0, world_size=2, native=native).read_all()) == 2
    with pytest.raises(InputError, match="x.txt:2"):
        CriteoReader(tmp_path / "x.txt", rank=1, world_size=2, native=native).read_all()


def test_empty_file_and_bad_arguments(tmp_path):
    (tmp_path / "e.txt").write_bytes(b"")
    assert len(read_criteo(tmp_path / "e.txt")) == 0
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        CriteoReader(tmp_path / "nope.txt")
    with pytest.raises(ConfigError, match="on_error"):
        CriteoReader(tmp_path / "e.txt", on_error="ignore")
    with pytest.raises(ConfigError, match="rank"):
        CriteoReader(tmp_path / "e.txt", rank=2, world_size=2)
    with pytest.raises(IsADirectoryError):
        CriteoReader(tmp_path)


def test_corrupt_gzip_is_an_input_error(tmp_path):
    data = gzip.compress(("\n".join([line()] * 2000) + "\n").encode())
    (tmp_path / "cut.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.gz: corrupt or truncated gzip"):
        read_criteo(tmp_path / "cut.gz")


# -- parity: native kernel vs NumPy twin vs oracle on random (often malformed) text ----------

_valid_int = st.one_of(st.just(""), st.integers(-(10**18) + 1, 10**18 - 1).map(str), st.integers(0, 10**6).map(str))
_junk = st.text("0123456789abcdefABCDEF-x \r", max_size=10)


@st.composite
def criteo_texts(draw):
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.sampled_from([40] * 12 + [39, 41, 1]))
        fields = [draw(st.sampled_from(["0", "1"] * 8 + ["2", ""]))]
        # mostly valid fields (so that whole lines are often valid), 1 in 40 arbitrary junk
        fields += [draw(_junk if draw(st.integers(0, 39)) == 0 else _valid_int) for _ in range(min(n - 1, 13))]
        fields += [draw(_junk) if draw(st.integers(0, 39)) == 0 else
                   draw(st.one_of(st.just(""), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
                                  st.integers(0, 2**32 - 1).map(lambda v: f"{v:X}")))
                   for _ in range(n - 14)]
        rows.append("\t".join(fields))
    end = draw(st.sampled_from(["\n", "\r\n", ""]))
    return end.join(rows) + (end if rows and draw(st.booleans()) else "")


@pytest.mark.skipif(not _native.available(), reason="native kernels not built")
@given(criteo_texts(), st.booleans())
def test_native_numpy_and_oracle_agree(text, skip):
    from hugeembed.data._parse import parse_buffer

    buf = np.frombuffer(text.encode(), np.uint8).copy()
    outcomes = []
    for nat in (True, False):
        try:
            res = parse_buffer(buf, source="h.txt", skip=skip, native=nat)
            outcomes.append(("ok", res.block.labels.tolist(), res.block.dense.tolist(), res.block.cats.tolist(),
                             res.skipped, res.bad.tolist()))
        except InputError as e:
            outcomes.append(("error", str(e)))
    assert outcomes[0] == outcomes[1]
    lines_text = text.replace("\r\n", "\n") if "\r\n" in text else text
    try:
        labels, dense, cats, skipped = parse_text(text, skip)
    except ValueError as e:
        (line_no, field) = e.args[0]
        assert outcomes[0][0] == "error" and f"h.txt:{line_no}:" in outcomes[0][1]
        return
    assert outcomes[0][:5] == ("ok", labels, dense, cats, skipped), lines_text


# -- the kernels' calling convention (csrc/call.h) -----------------------------------------------


def _parse_call(text: bytes, cap: int, *, short: str | None = None, skip: bool = False, stride: int = 1):
    """he_criteo_parse's buffers, one of them a row short where `short` names it."""
    buf = np.frombuffer(text, np.uint8).copy()
    out = {"labels": np.full(cap, -1.0, np.float32), "dense": np.full((cap, 13), -1.0, np.float32),
           "cats": np.full((cap, 26), -1, np.int64), "counts": np.full(2, -1, np.int64),
           "bad": np.full((4, 3), -1, np.int64)}
    if short is not None:
        out[short] = out[short][:-1].copy()
    bufs = [buf, np.array(MISSING_IDS, np.int64)] + list(out.values())
    return bufs, out, [0, stride, 0, int(skip), cap, 4]


@pytest.mark.skipif(not _native.available(), reason="native kernels not built")
@pytest.mark.parametrize("short", ["labels", "dense", "cats", "counts", "bad"])
def test_the_parser_refuses_a_too_short_buffer_and_writes_nothing(short):
    bufs, out, ints = _parse_call(((line() + "\n") * 3).encode(), 3, short=short)
    with pytest.raises(_native.KernelError, match=rf"\({short}\) holds") as e:
        _native.call("he_criteo_parse", bufs, ints)
    assert e.value.status == _native.Status.BAD_CALL
    assert all((a == -1).all() for a in out.values())


@pytest.mark.skipif(not _native.available(), reason="native kernels not built")
def test_the_parser_kernel_refuses_text_that_is_not_bytes_and_a_bad_stride():
    with pytest.raises(_native.KernelError, match=r"must be bytes \(uint8\)"):
        _native.call("he_criteo_count_lines", [np.zeros(4, np.int32)])
    bufs, _, ints = _parse_call(line().encode(), 1)
    ints[1] = 0
    with pytest.raises(_native.KernelError, match="need 0 <= phase < stride") as e:
        _native.call("he_criteo_parse", bufs, ints)
    assert e.value.status == _native.Status.BAD_CALL


@pytest.mark.skipif(not _native.available(), reason="native kernels not built")
def test_a_malformed_line_fails_the_kernel_with_where_it_is():
    good = (line() + "\n").encode()
    bufs, _, ints = _parse_call(good * 2 + line(label="2").encode() + b"\n" + good, 4)
    with pytest.raises(_native.KernelError) as e:
        _native.call("he_criteo_parse", bufs, ints)
    assert e.value.status == _native.Status.BAD_VALUE
    assert e.value.detail[:4] == (2, 2 * len(good), 0, 2)  # line, its offset, field label, BAD_LABEL
    bufs, _, ints = _parse_call(good + line().encode() + b"\t\n", 4)
    with pytest.raises(_native.KernelError) as e:
        _native.call("he_criteo_parse", bufs, ints)
    assert e.value.detail[:5] == (1, len(good), -1, 1, 41)  # ..., field count: FIELD_COUNT, fields found


@pytest.mark.skipif(not _native.available(), reason="native kernels not built")
def test_too_few_output_rows_is_a_loud_runtime_error(monkeypatch):
    from hugeembed.data import _parse

    text = ((line() + "\n") * 5).encode()
    bufs, _, ints = _parse_call(text, 2)
    with pytest.raises(_native.KernelError, match="ran out of output rows") as e:
        _native.call("he_criteo_parse", bufs, ints)
    assert e.value.status == _native.Status.BAD_CALL and e.value.detail[:2] == (2, 2)
    real = _native.call
    monkeypatch.setattr(_native, "call", lambda name, bufs, ints=(): 1 if name == "he_criteo_count_lines"
                        else real(name, bufs, ints))  # a line count that is too small
    with pytest.raises(RuntimeError, match="r.txt: Criteo parser failed: .*ran out of output rows"):
        _parse.parse_buffer(np.frombuffer(text, np.uint8).copy(), source="r.txt", native=True)
