"""Reading files under a schema: CSV / TSV (header, quoted fields, gzip), Parquet, Criteo; in chunks.

``TableReader(paths, schema)`` yields Blocks of about `chunk_bytes` of text (Parquet: `chunk_rows`
rows).  CSV and TSV are split and typed by pyarrow's streaming reader (its own threads, the GIL
released), Parquet by pyarrow.parquet, then :class:`~hugeembed.data._encode.Encoder` makes the
Block; Criteo files under the built-in schema go through the native Criteo parser as always.
A file that breaks the schema is an InputError of one line naming file, row or line, column, value.
"""

from __future__ import annotations

import csv as _pycsv
import math
import os
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..errors import ConfigError, InputError
from ._block import Block
from ._criteo import CriteoReader, FileSummary, PathLike, ReadSummary, as_paths, open_bytes
from ._encode import Encoder, Where, require_pyarrow
from ._parse import check_on_error
from ._prefetch import threaded
from ._schema import Schema, criteo_schema

__all__ = ["TableReader", "read_table", "fit_stats", "read_header", "count_rows"]

_MAX_EXAMPLES = 20


def _delimiter(schema: Schema, fmt: str) -> str:
    return schema.delimiter or ("," if fmt == "csv" else "\t")


def read_header(path: Path, schema: Schema, fmt: str) -> list[str]:
    """The column names of a text file: its first line (quotes honoured), or the schema's columns."""
    if not schema.header or fmt == "criteo":
        return list(schema.columns or ())
    stream, raw = open_bytes(path)
    try:
        first = stream.readline(1 << 20)
    except (EOFError, OSError) as e:
        raise InputError(f"{path}: corrupt or truncated gzip data ({e})") from None
    finally:
        raw.close()
    text = first.decode("utf-8", "replace").rstrip("\r\n")
    if not text:
        raise InputError(f"{path}: empty file (the schema expects a header line naming the columns)")
    return next(_pycsv.reader([text], delimiter=_delimiter(schema, fmt)))


def _check_columns(path: Path, schema: Schema, have: Sequence[str], where: str = "header") -> None:
    lacking = [c for c in schema.needed_columns() if c not in have]
    if lacking:
        raise InputError(f"{path}: the schema names columns {lacking} that the {where} lacks; the {where} has "
                         f"{', '.join(map(repr, have))}")


class TableReader:
    """Reads files under `schema` as a stream of :class:`Block` (the Criteo reader's interface).

    Args:
        paths: one file or a list, read in order (each in the schema's format, or its extension's).
        schema: the schema (default: the built-in Criteo one).
        on_error: ``"raise"`` (InputError at the first bad row) or ``"skip"`` (skip and count it).
        chunk_bytes: text read per block; Parquet reads `chunk_rows` rows.
        rank, world_size: read only rows ``i % world_size == rank`` (i counts rows over all files).
        need_label: False reads files without the label column (labels zero).
    """

    def __init__(self, paths: PathLike | Sequence[PathLike], schema: Schema | None = None, *, on_error: str = "raise",
                 chunk_bytes: int = 8 << 20, chunk_rows: int = 1 << 16, rank: int = 0, world_size: int = 1,
                 native: bool | None = None, need_label: bool = True) -> None:
        self.paths = as_paths(paths)
        self.schema = schema or criteo_schema()
        self.skip = check_on_error(on_error)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.chunk_bytes, self.chunk_rows = int(chunk_bytes), int(chunk_rows)
        self.rank, self.world_size, self.need_label = int(rank), int(world_size), need_label
        self.formats = [self.schema.resolved_format(p) for p in self.paths]
        self._criteo: CriteoReader | None = None
        if self.schema.is_criteo() and all(f == "criteo" for f in self.formats):
            self._criteo = CriteoReader(self.paths, on_error=on_error, chunk_bytes=chunk_bytes, rank=rank,
                                        world_size=world_size, native=native)
        else:
            require_pyarrow()
            self._encoder = Encoder(self.schema, native=native)
            for path, fmt in zip(self.paths, self.formats):  # every file's columns checked before reading any
                if fmt == "parquet":
                    _check_columns(path, self.schema, _parquet_names(path), "file")
                else:
                    _check_columns(path, self.schema, read_header(path, self.schema, fmt))
        self.summary = self._fresh_summary()

    def _fresh_summary(self) -> ReadSummary:
        return ReadSummary([FileSummary(str(p), p.stat().st_size) for p in self.paths])

    def __iter__(self) -> Iterator[Block]:
        if self._criteo is not None:
            for block in self._criteo:
                self.summary = self._criteo.summary
                yield block
            self.summary = self._criteo.summary
            return
        self.summary = summary = self._fresh_summary()
        done_bytes, global_row = 0, 0
        for path, fmt, fs in zip(self.paths, self.formats, summary.files):
            # a pipeline of threads: pyarrow parses chunk k + 2, the encoder makes chunk k + 1's block
            # (both release the GIL for most of their work) while the caller takes chunk k
            blocks = threaded(lambda path=path, fmt=fmt, fs=fs: self._read_file(path, fmt, fs, summary), depth=2)
            for block, first, pos in blocks:
                n = len(block)
                if self.world_size > 1:
                    rows = np.arange(global_row, global_row + n)
                    block = block.take(np.flatnonzero(rows % self.world_size == self.rank))
                global_row += n
                fs.rows += len(block)
                summary.bytes_read = done_bytes + pos
                if len(block):
                    yield block
            done_bytes += fs.bytes
            summary.bytes_read = done_bytes

    def read_all(self) -> Block:
        """Every row of every file as one block (for inputs that fit in memory)."""
        return Block.concat(list(self))

    def _read_file(self, path: Path, fmt: str, fs: FileSummary, summary: ReadSummary):
        """(block, first data row, bytes read so far) per chunk of one file."""
        header = 1 if self.schema.header and fmt != "criteo" else 0
        if fmt == "parquet":
            batches = _parquet_batches(path, self.schema, self.chunk_rows)
        else:  # pyarrow parses the next block in its thread while this one encodes the last
            batches = threaded(lambda: _text_batches(path, self.schema, fmt, self.chunk_bytes, self.skip, fs,
                                                     summary), depth=2)
        row = 0
        for batch, pos in batches:
            where = Where(str(path), row, None if fmt == "parquet" else header)
            block = self._encode(batch, where, fs, summary) if self.skip else \
                self._encoder.encode(batch, where, need_label=self.need_label)
            fs.lines += batch.num_rows
            row += batch.num_rows
            yield block, where.first_row, pos

    def _encode(self, batch, where: Where, fs: FileSummary, summary: ReadSummary) -> Block:
        """Encodes `batch`, skipping its bad rows: halves are tried until each bad row stands alone."""
        try:
            return self._encoder.encode(batch, where, need_label=self.need_label)
        except InputError as e:
            if batch.num_rows == 1:
                fs.skipped += 1
                if len(summary.skipped_examples) < _MAX_EXAMPLES:
                    summary.skipped_examples.append(str(e))
                return Block.empty(self.schema.num_dense, sum(not s.is_bag for s in self.schema.sparse),
                                   sum(s.is_bag for s in self.schema.sparse))
            half = batch.num_rows // 2
            return Block.concat([self._encode(batch.slice(0, half), where, fs, summary),
                                 self._encode(batch.slice(half), Where(where.source, where.first_row + half,
                                                                       where.line_offset), fs, summary)])


def _parquet_names(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return list(pq.ParquetFile(path).schema_arrow.names)
    except Exception as e:  # pyarrow's errors for a file that is no Parquet
        raise InputError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _parquet_batches(path: Path, schema: Schema, chunk_rows: int):
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    read = 0
    for batch in f.iter_batches(batch_size=chunk_rows, columns=schema.needed_columns()):
        read += batch.num_rows
        yield batch, int(path.stat().st_size * read / max(f.metadata.num_rows, 1))


def _column_types(schema: Schema, typed: bool) -> dict:
    """pyarrow types of the needed columns: all text, or (`typed`) a dense column's numbers parsed by pyarrow.
    Categorical columns stay text: the encoder dictionary-encodes each once per chunk (the reader's own
    dictionaries are per 1 MB block, so a value would be hashed once per block, and cost more to build)."""
    import pyarrow as pa

    uses: dict[str, set[str]] = {}
    for d in schema.dense:
        uses.setdefault(d.column, set()).add("dense")
    for sp in schema.sparse:
        uses.setdefault(sp.column, set()).add("sparse")
    types = {c: pa.string() for c in schema.needed_columns()}
    if typed:
        for c, kinds in uses.items():
            if kinds == {"dense"} and (schema.label is None or c != schema.label.column):
                types[c] = pa.float64()
    return types


_FIRST_CHUNK = 1 << 20
_BLOCK_BYTES = 1 << 20  # pyarrow's block: a piece's columns come in chunks of about this much text


def _chunks(path: Path, chunk_bytes: int):
    """The bytes of a (plain or gzip) file in pieces of up to `chunk_bytes` that end on a line's end
    (memoryviews: each piece is read once into its own buffer, never copied again; the few bytes after
    its last line's end start the next piece's buffer).

    The pieces start at 1 MiB and double (the pipeline's other stages start work after one small parse,
    not a full chunk's), and a plain file's last pieces are at most half of what is left (its last
    encode and write, which nothing overlaps, stay short)."""
    stream, raw = open_bytes(path)
    plain = stream is raw
    left = os.fstat(raw.fileno()).st_size if plain else 0
    size = min(chunk_bytes, _FIRST_CHUNK)
    carry = b""
    try:
        while True:
            want = min(max(min(size, left // 2), _FIRST_CHUNK) if plain else size, chunk_bytes)
            size = min(2 * size, chunk_bytes)
            buf = bytearray(len(carry) + want)
            buf[:len(carry)] = carry
            view = memoryview(buf)
            try:
                got = stream.readinto(view[len(carry):])
                left -= got
            except (EOFError, OSError, zlib.error) as e:
                raise InputError(f"{path}: corrupt or truncated gzip data ({e})") from None
            if not got:
                if carry:
                    yield memoryview(carry), raw.tell()
                return
            end = len(carry) + got
            cut = buf.rfind(b"\n", 0, end)
            if cut < 0:
                carry = bytes(view[:end])
                continue
            carry = bytes(view[cut + 1:end])
            yield view[: cut + 1], raw.tell()
    finally:
        raw.close()


def _text_batches(path: Path, schema: Schema, fmt: str, chunk_bytes: int, skip: bool, fs: FileSummary,
                  summary: ReadSummary):
    """(table, bytes read) per chunk of a CSV / TSV file.  Each chunk (whole lines: a cell holds no newline)
    is parsed by pyarrow's multi-threaded reader, its numbers typed and its categorical columns as text;
    a chunk with a value that does not convert is parsed again as text, where the
    encoder names the value exactly."""
    import pyarrow as pa
    from pyarrow import csv

    needed = schema.needed_columns()
    header = schema.header and fmt != "criteo"
    names = read_header(path, schema, fmt) if header else list(schema.columns or ())
    parse = dict(delimiter=_delimiter(schema, fmt), quote_char=False if fmt == "criteo" else '"',
                 ignore_empty_lines=False)
    line = 1  # the number of the chunk's first line
    for chunk, pos in _chunks(path, chunk_bytes):
        if header and line == 1:  # the header line itself
            first = bytes(chunk).find(b"\n")
            chunk, line = chunk[first + 1:], 2
            if not len(chunk):
                continue
        bad: list = []

        def on_invalid(row, bad=bad) -> str:
            bad.append(row)
            return "skip" if skip else "error"

        table, typed = None, True
        # two blocks or more per piece: pyarrow parses a piece's blocks side by side, so the first (1 MiB)
        # and the last (small) pieces keep both cores busy too; a line longer than a block: one block
        block = min(_BLOCK_BYTES, max(len(chunk) // 2, 1 << 16))
        while table is None:
            try:
                table = csv.read_csv(pa.py_buffer(chunk),
                                     read_options=csv.ReadOptions(column_names=names, block_size=block),
                                     parse_options=csv.ParseOptions(**parse, invalid_row_handler=on_invalid),
                                     convert_options=csv.ConvertOptions(include_columns=needed,
                                                                        column_types=_column_types(schema, typed),
                                                                        strings_can_be_null=False))
            except pa.ArrowInvalid as e:
                if "straddl" in str(e) and block <= len(chunk):
                    block = len(chunk) + 1
                elif bad and not skip:
                    raise InputError(_field_count_message(path, bad[0], chunk, line)) from None
                elif typed and "conversion error" in str(e).lower():
                    typed = False
                else:
                    raise InputError(f"{path}: {str(e).splitlines()[0]}") from None
                bad.clear()
        for row in bad if skip else ():
            fs.skipped += 1
            if len(summary.skipped_examples) < _MAX_EXAMPLES:
                summary.skipped_examples.append(_field_count_message(path, row, chunk, line))
        line += table.num_rows + len(bad)  # a row per line (a cell holds no newline), the skipped ones too
        yield table, pos


def _field_count_message(path: Path, row, chunk: bytes, first_line: int) -> str:
    """One line for a row of the wrong field count; its line found in `chunk` (pyarrow's threaded reader
    does not know it), which starts at line `first_line` of the file."""
    lines = bytes(chunk).decode("utf-8", "replace").split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.rstrip("\r") == row.text), None)
    where = f"line {first_line + at}" if at is not None else "a line"
    text = row.text if len(row.text) <= 60 else row.text[:57] + "..."
    return f"{path}: {where}: expected {row.expected_columns} fields, got {row.actual_columns}: {text!r}"


def read_table(paths: PathLike | Sequence[PathLike], schema: Schema | None = None, *, on_error: str = "raise") -> Block:
    """Every row of `paths` under `schema` as one Block."""
    return TableReader(paths, schema, on_error=on_error).read_all()


def fit_stats(paths: PathLike | Sequence[PathLike], schema: Schema) -> Schema:
    """`schema` with the mean and std of its standardize columns fitted on `paths` (filled raw values;
    a constant column gets std 1).  A schema with nothing to fit comes back as it is."""
    todo = [d for d in schema.dense if d.transform == "standardize" and (d.mean is None or d.std is None)]
    if not todo:
        return schema
    import dataclasses

    raw = dataclasses.replace(schema, label=None, sparse=(),
                              dense=tuple(dataclasses.replace(d, transform="none") for d in todo))
    count, mean, m2 = 0, np.zeros(len(todo)), np.zeros(len(todo))
    for block in TableReader(paths, raw, need_label=False):
        x = block.dense.astype(np.float64)
        n = x.shape[0]
        if not n:
            continue
        bm = x.mean(axis=0)
        bm2 = ((x - bm) ** 2).sum(axis=0)
        delta = bm - mean
        total = count + n
        mean = mean + delta * n / total
        m2 = m2 + bm2 + delta ** 2 * count * n / total
        count = total
    if count == 0:
        raise InputError(f"{', '.join(map(str, as_paths(paths)))}: no rows to fit the standardize columns on")
    std = np.sqrt(m2 / count)
    return schema.with_stats({d.name: (float(m), float(s) if s > 0 and math.isfinite(s) else 1.0)
                              for d, m, s in zip(todo, mean, std)})


def count_rows(paths: PathLike | Sequence[PathLike], schema: Schema | None = None) -> int:
    """Rows of data files without parsing them: Parquet's metadata, text files' lines (less a header line);
    a quoted cell holding a newline counts twice (the count paces a run, it decides nothing)."""
    from ._criteo import count_lines

    schema = schema or criteo_schema()
    total = 0
    for path in as_paths(paths):
        fmt = schema.resolved_format(path)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            total += max(0, count_lines(path) - (1 if schema.header and fmt != "criteo" else 0))
    return total
