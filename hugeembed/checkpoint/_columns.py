"""Reading a column-wise table's shards: one per block of columns, joined into whole rows.

Each rank of a column-wise placement writes its own block (distributed/_column_wise.py's
ColumnBlockShard), full or delta: the keys, counts, last steps and pending keys every block
holds alike, and its rows -- columns ``[lo, hi)`` of the weights, then the same columns of
each per-column state part, then the per-row state -- with ``"columns": {"lo", "hi",
"state_parts"}`` in its shard record.  A reader checks that the blocks tile the table's
columns, have the width their columns and the table's state give, and hold the same keys,
then joins them (a torn or partial snapshot is refused, naming the table).  Snapshots
written whole (older hugeembed: the first rank gathered the blocks) have no ``columns``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..distributed._column_wise import join_columns
from ..errors import CheckpointError
from ..store import EXPORT_FIELDS, StoreExport
from ._files import read_tensor

_CHUNK_BYTES = 32 << 20  # whole rows joined at a time while reading

__all__ = ["is_column_blocks", "key_shards", "read_column_blocks"]


def is_column_blocks(entry: dict[str, Any]) -> bool:
    """Whether a table's shards are blocks of its columns."""
    return any(isinstance(sh, dict) and "columns" in sh for sh in entry["shards"])


def key_shards(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The shards whose keys make up the table: all of them, but of column blocks the first only
    (every block holds the same keys)."""
    if not is_column_blocks(entry):
        return entry["shards"]
    return [min(entry["shards"], key=lambda sh: sh.get("columns", {}).get("lo", 0))]


def _blocks(snap: Path, entry: dict[str, Any]) -> tuple[list[dict[str, Any]], int, int]:
    """(the shards by first column, block dim, per-column state parts), checked; CheckpointError naming the table."""
    where = f"{snap}: table {entry['name']!r}"
    shards = entry["shards"]
    cols = [sh.get("columns") for sh in shards]
    if not all(isinstance(c, dict) and all(isinstance(c.get(k), int) and c[k] >= 0 for k in ("lo", "hi", "state_parts"))
               for c in cols):
        raise CheckpointError(f"{where}: some shards are blocks of columns and some not, or a block's columns are "
                              f"malformed ({cols[:4]}): the snapshot is damaged")
    shards = sorted(shards, key=lambda sh: sh["columns"]["lo"])
    dim, n = int(entry["dim"]), len(shards)
    spans = [(sh["columns"]["lo"], sh["columns"]["hi"]) for sh in shards]
    d = dim // n
    if dim % n or spans != [(i * d, (i + 1) * d) for i in range(n)]:
        raise CheckpointError(f"{where}: its blocks hold columns {spans} of dim {dim}, not {n} equal blocks covering "
                              f"every column once: a block is missing or repeated (a partial snapshot)")
    parts = {sh["columns"]["state_parts"] for sh in shards}
    k = parts.pop()
    if parts or (k + 1) * dim > int(entry["width"]):
        raise CheckpointError(f"{where}: its blocks disagree on the state layout (per-column parts "
                              f"{sorted(parts | {k})}, row width {entry['width']}): the snapshot is damaged")
    return shards, d, k


def read_column_blocks(snap: Path, entry: dict[str, Any], rank_filter=None) -> StoreExport:
    """A column-wise table's blocks, verified and joined into whole rows (see the module docstring).

    Joined and passed through `rank_filter` (read_table's) 32 MiB of whole rows at a time, from the
    blocks' memory-mapped files: a rank keeps what the filter keeps (a column-wise rank its block)
    without ever holding the whole table.
    """
    where = f"{snap}: table {entry['name']!r}"
    shards, d, k = _blocks(snap, entry)
    dim = int(entry["dim"])
    per_row = int(entry["width"]) - (k + 1) * dim
    width = (k + 1) * d + per_row

    def read(sh: dict[str, Any], field: str) -> torch.Tensor:
        return read_tensor(snap / sh["files"][field]["file"], sh["files"][field])

    first = {f: read(shards[0], f) for f in EXPORT_FIELDS if f != "rows"}
    n = first["keys"].numel()
    blocks = []
    for sh in shards:
        lo, hi = sh["columns"]["lo"], sh["columns"]["hi"]
        if sh is not shards[0] and not (torch.equal(read(sh, "keys"), first["keys"])
                                        and torch.equal(read(sh, "pending_keys"), first["pending_keys"])):
            raise CheckpointError(f"{where}: the block of columns [{lo}, {hi}) holds other keys than the block of "
                                  f"columns [0, {d}) (a torn snapshot: its blocks were not written together)")
        rows = read(sh, "rows")
        if rows.dim() != 2 or rows.shape[1] != width or rows.shape[0] != n:
            raise CheckpointError(f"{where}: the block of columns [{lo}, {hi}) holds rows of shape {list(rows.shape)}, "
                                  f"expected [{n}, {width}] (its {d} columns with their state)")
        blocks.append(rows)
    keep = rank_filter if rank_filter is not None else (lambda fields: fields)
    admitted, pending = ("keys", "counts", "last_step"), ("pending_keys", "pending_counts", "pending_last_step")
    none = {f: first[f][:0] for f in admitted + pending}
    step = max(1, _CHUNK_BYTES // max(1, int(entry["width"]) * blocks[0].element_size()))
    parts = []
    for a in range(0, n, step):  # whole rows a chunk at a time, kept or dropped as the filter says
        rows = join_columns([b[a : a + step] for b in blocks], dim, k)
        parts.append(keep({**none, **{f: first[f][a : a + step] for f in admitted}, "rows": rows}))
    # the pending keys (no rows), on their own
    no_rows = join_columns([b[:0] for b in blocks], dim, k)
    parts.append(keep({**none, **{f: first[f] for f in pending}, "rows": no_rows}))
    return StoreExport(**{f: torch.cat([p[f] for p in parts]) for f in EXPORT_FIELDS})
