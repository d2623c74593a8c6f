"""Writing Criteo-format text: synthetic rows as TSV (plain or .gz) for tests and demos."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ._synthetic import RawRows, SyntheticCriteo
from ._synthetic_config import SyntheticConfig

__all__ = ["write_criteo_tsv", "format_criteo_lines"]

_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def format_criteo_lines(raw: RawRows, newline: str = "\n") -> bytes:
    """Criteo TSV text of raw rows: empty fields where missing, ids as 8 lowercase hex digits."""
    n = raw.labels.shape[0]
    if n == 0:
        return b""
    cols: list[list[str]] = [raw.labels.astype(np.int64).astype(str).tolist()]
    for i in range(raw.ints.shape[1]):
        s = raw.ints[:, i].astype(str)
        s[raw.ints_missing[:, i]] = ""
        cols.append(s.tolist())
    ids = raw.ids.astype(np.uint64) & np.uint64(0xFFFFFFFF)
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    digits = _HEX_DIGITS[((ids[:, :, None] >> shifts) & np.uint64(15)).astype(np.intp)]  # [n, 26, 8]
    hexes = digits.reshape(n, -1).view("S8").astype(str)  # [n, 26]
    hexes[raw.ids_missing] = ""
    cols.extend(hexes[:, j].tolist() for j in range(hexes.shape[1]))
    text = newline.join("\t".join(fields) for fields in zip(*cols)) + newline
    return text.encode("ascii")


def write_criteo_tsv(path: str | os.PathLike, n_rows: int, seed: int = 0, *, config: SyntheticConfig | None = None,
                     start: int = 0, crlf: bool = False, rows_per_write: int = 65536) -> Path:
    """Writes rows [start, start + n_rows) of the synthetic generator as Criteo text.

    A path ending in ``.gz`` is gzip-compressed.  Reading the file back with the Criteo
    reader gives exactly ``SyntheticCriteo(config).rows(start, n_rows)``.

    Args:
        path: output file.
        n_rows: number of lines.
        seed: generator seed (ignored when `config` is given).
        config: full generator configuration (default: ``SyntheticConfig(seed=seed)``).
        crlf: end lines with CRLF instead of LF.

    Example::

        write_criteo_tsv("demo.txt.gz", 100_000, seed=1)
        blk = read_criteo("demo.txt.gz")       # 100000 rows, with empty fields here and there
    """
    if n_rows < 0:
        raise ConfigError(f"n_rows must be >= 0, got {n_rows}")
    gen = SyntheticCriteo(config or SyntheticConfig(seed=seed))
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    newline = "\r\n" if crlf else "\n"
    with opener(path, "wb") as f:
        for a in range(start, start + n_rows, rows_per_write):
            f.write(format_criteo_lines(gen.raw_rows(a, min(rows_per_write, start + n_rows - a)), newline))
    return path
