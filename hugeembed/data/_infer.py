"""A starting schema for a file (``hugeembed schema data.csv``): a TOML text the user edits.

From the first `sample_rows` rows: a column of numbers is dense (``log1p`` when it is non-negative
and heavy-tailed, else ``standardize``) unless its name says it is an id; any other column is
sparse, a bag when its cells hold a separator (``|``, ``;``, ``,``, a space) whose items recur in other cells; the label is a 0/1
(or true/false) column named label, click, clicked, y or target.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..errors import InputError
from ._criteo import as_paths
from ._encode import require_pyarrow
from ._reader import read_header
from ._schema import Schema, format_of

__all__ = ["infer_schema"]

_LABEL_NAMES = ("label", "click", "clicked", "is_click", "y", "target")
_ID_NAME = re.compile(r"(^id$|_id$|[a-z]Id$|ID$|_key$|^key$)")
_SEPARATORS = ("|", ";", ",", " ")


def _sample(path: Path, fmt: str, rows: int):
    """The first `rows` rows of `path`, every column as text (Parquet: as stored)."""
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(path).iter_batches(batch_size=rows)
        batch = next(batches, None)
        if batch is None:
            raise InputError(f"{path}: no rows")
        return pa.Table.from_batches([batch])
    from pyarrow import csv

    names = read_header(path, _probe(fmt), fmt)
    delimiter = "," if fmt == "csv" else "\t"
    raw = pa.OSFile(str(path))
    gz = raw.read(2) == b"\x1f\x8b"
    raw.seek(0)
    stream = pa.CompressedInputStream(raw, "gzip") if gz else raw
    reader = csv.open_csv(stream, read_options=csv.ReadOptions(block_size=1 << 20),
                          parse_options=csv.ParseOptions(delimiter=delimiter),
                          convert_options=csv.ConvertOptions(column_types={c: pa.string() for c in names}))
    batches, n = [], 0
    for batch in reader:
        batches.append(batch)
        n += batch.num_rows
        if n >= rows:
            break
    raw.close()
    if not batches:
        raise InputError(f"{path}: no rows under the header")
    return pa.Table.from_batches(batches).slice(0, rows)


def _probe(fmt: str):
    from ._schema import DenseSpec

    return Schema(format=fmt, header=True, dense=(DenseSpec("x", "x"),))


def _numbers(values: list) -> np.ndarray | None:
    """The non-empty values as floats, or None if one of them is not a number."""
    out = []
    for v in values:
        if v is None or v == "":
            continue
        if isinstance(v, bool):
            return None
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            return None
    return np.array(out, np.float64)


def infer_schema(path: str | Path, *, sample_rows: int = 10_000) -> str:
    """A starting schema for `path` (CSV / TSV / Parquet, by extension), as TOML text with comments."""
    require_pyarrow()
    import pyarrow as pa

    path = as_paths(path)[0]
    fmt = format_of(path)
    if fmt is None:
        raise InputError(f"{path}: cannot tell the format from the file name (.csv, .tsv, .parquet, optionally .gz)")
    table = _sample(path, fmt, sample_rows)
    n = table.num_rows
    lines = [f"# a starting schema for {path.name}, from its first {n:,} rows: check it, then",
             f"#   hugeembed train --schema THIS.toml --data {path.name}",
             f"format = {json.dumps(fmt)}"]
    if fmt != "parquet":
        lines.append("header = true")
    label, dense, sparse = None, [], []
    for name in table.column_names:
        col = table.column(name)
        values = col.to_pylist()
        present = [v for v in values if v is not None and v != ""]
        kind = col.type
        is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        nums = None if is_list else _numbers(values)
        lowered = {str(v).strip().lower() for v in present}
        if label is None and name.lower() in _LABEL_NAMES and lowered <= {"0", "1", "true", "false", "0.0", "1.0"}:
            label = name
            continue
        distinct = len({json.dumps(v, default=str) for v in present})
        if nums is not None and nums.size and not _ID_NAME.search(name):
            heavy = nums.min() >= 0 and np.percentile(nums, 99) > 10 * max(np.median(nums), 1.0)
            transform = "log1p" if heavy else "standardize"
            dense.append((name, transform, f"numbers from {nums.min():g} to {nums.max():g}"
                          + (f", {len(values) - nums.size:,} empty" if nums.size < len(values) else "")))
            continue
        sep = None
        if is_list:
            sep = "|"
            note = "a list column: each cell is a bag"
        else:
            texts = [str(v) for v in present]
            for cand in _SEPARATORS:
                if cand == "," and fmt == "csv":
                    continue
                share = sum(cand in t for t in texts) / max(len(texts), 1)
                # a bag's items recur in other combinations: fewer distinct items than distinct cells
                # (a city "New York" splits into as many words as it has values)
                items = {i for t in texts for i in t.split(cand) if i}
                if share >= 0.05 and len(items) < len(set(texts)):
                    sep = cand
                    break
            note = f"{distinct:,} distinct values"
            if sep is not None:
                lengths = [len(t.split(sep)) for t in texts]
                note += f"; cells hold {sep!r}: a bag of {np.mean(lengths):.1f} values on average, at most {max(lengths)}"
        longest = max((len(v) if is_list else len(str(v).split(sep)) for v in present), default=0) \
            if sep is not None else 0
        sparse.append((name, sep, note, longest > 50))
    lines.append("")
    if label is not None:
        lines += ["[label]", f"column = {json.dumps(label)}                 # 0/1"]
    else:
        lines += ["# no 0/1 column named label, click, clicked, y or target: name the label column",
                  "[label]", 'column = "CHANGE ME"              # values 0/1, or add positive = "the value that is 1"']
    for name, transform, note in dense:
        lines += ["", f"[dense.{_key(name)}]                  # {note}", *_column(name),
                  f"transform = {json.dumps(transform)}"]
    for name, sep, note, long in sparse:
        lines += ["", f"[sparse.{_key(name)}]                 # {note}", *_column(name)]
        if sep is not None:
            lines += [f"separator = {json.dumps(sep)}", 'combiner = "mean"']
            if long:
                lines.append("max_length = 50                    # keep the last 50 values of a longer cell")
    return "\n".join(lines) + "\n"


def _key(name: str) -> str:
    """A feature name (a bare TOML key) for a column name."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name) or "column"


def _column(name: str) -> list[str]:
    """``column = ...`` when the feature's name differs from its column's."""
    return [] if _key(name) == name else [f"column = {json.dumps(name)}"]
