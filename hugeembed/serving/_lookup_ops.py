"""The serving lookup op and the key index it reads, with torch alone: one of the two files an export copies
into the artifact (``lookup_ops.py``, beside ``runtime.py``, the reader, which imports it).

It imports nothing from hugeembed, so a process without hugeembed can run an artifact's program
(``hugeembed.serving`` plugs its compiled id -> row pass in through the hooks below: the same rows, faster).

The lookup of all tables of one dim is one custom op, ``hugeembed_serve::pooled_lookup`` (with a fake
impl, so ``torch.export`` keeps the graph whole), and one kernel call over the group's row matrix
(tables one after the other, then a zero row).  Rows: fp32 / fp16 ``[R, D]``; int8 ``uint8 [R, D + 8]``
and int4 ``uint8 [R, D/2 + 4]`` in torch's ``embedding_bag_byte_prepack`` / ``embedding_bag_4bit_prepack``
layouts (per row scale and bias after the values).  Keys and the hash index: see "the key index" below
(built at export by ``hugeembed.serving._index.build_index``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ArtifactError", "pooled_lookup", "pooled_lookup_eager", "table_meta", "hash_slots", "SHARED_ROW_KEY",
           "ROW_BASE", "NUM", "KEY_BASE", "MISS_ROW", "MAX_PROBE"]

# hugeembed.nn._rare.SHARED_ROW_KEY (this file imports nothing from hugeembed; a test checks they agree)
SHARED_ROW_KEY = -1


class ArtifactError(ValueError):
    """A missing, damaged or foreign artifact, or a delta that does not follow the served version."""


# -- the lookup op -------------------------------------------------------------------------------------------------


def pooled_lookup_eager(values: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                  index: torch.Tensor, meta: torch.Tensor, feature_pos: list[int], feature_table: list[int],
                  combiners: list[int], batch_size: int, dim: int, dtype: str) -> torch.Tensor:
    """Pooled embeddings ``[B, F_g, D]`` (float32) of the features of one dim group.

    Args:
        values, offsets: the batch's ids, feature-major jagged (``SparseFeatures`` layout:
            bag ``f * B + b`` is ``values[offsets[f*B+b] : offsets[f*B+b+1]]``).
        rows: the group's row matrix (tables in order, then one zero row).
        keys: int64, the keys of the group's dynamic tables, one table after the other, each
            ascending (a dynamic table's row i holds its key i).
        index: int32 or int64 ``[C]`` (C a power of two), the group's hash index: a position in
            `keys` or -1 per slot (see the key index below).
        meta: int64 ``[T, 5]``, per table of the group (table_meta): its first row in `rows`, its
            rows, its first key in `keys` (-1: a static table, the id is the row), the row an id it
            does not hold reads (its shared row, the key SHARED_ROW_KEY, or the zero row), and its
            max probe length in `index`.
        feature_pos: per output feature, the index of its input feature in the batch.
        feature_table: per output feature, the table it reads (index into the group's tables).
        combiners: per output feature, 0 sum, 1 mean, 2 sqrtn.
        batch_size: B.  dim: D.  dtype: ``fp32 | fp16 | int8 | int4`` (the format of `rows`).

    Ids < 0 are dropped (not counted by mean/sqrtn); ids a table does not hold read its
    shared row or the zero row (and are counted, as a training model's eval reads them);
    empty bags pool to 0.  All features of the group are looked up at once: one probe pass
    over all their ids, one kernel call.
    """
    B, F = batch_size, len(feature_pos)
    zero_row = rows.shape[0] - 1
    if F == 0 or B == 0:
        return torch.zeros(B, F, dim)
    if pool_accelerator is not None and dtype in ("int8", "int4"):  # hugeembed's kernels: all of it in one call
        got = pool_accelerator(values, offsets, rows, keys, index, meta, feature_pos, feature_table, B, dim, dtype)
        if got is not None:
            return _scale_bags(got[0], got[1], combiners)
    if bags_accelerator is not None:  # hugeembed's kernels: the whole id -> row pass in one call
        got = bags_accelerator(values, offsets, keys, index, meta, feature_pos, feature_table, B, rows.shape[0])
        if got is not None:
            idx, bstart, kept = got
            out = _embedding_bags(rows, idx, bstart, dtype, dim).view(B, F, dim)
            return _scale_bags(out, kept.view(B, F), combiners)
    # the group's bags, [F * B + 1] offsets into its ids
    p0 = feature_pos[0]
    if feature_pos == list(range(p0, p0 + F)):  # consecutive input features: one slice
        bounds = offsets[p0 * B: (p0 + F) * B + 1]
        first = int(bounds[0])
        ids = values[first: int(bounds[-1])]
        starts = bounds[:-1] - first
        per_feature = bounds[B::B] - bounds[:-B:B]
        lengths = bounds[1:] - bounds[:-1]
    else:
        at = (torch.tensor(feature_pos, dtype=torch.int64) * B)[:, None] + torch.arange(B + 1)
        bounds = offsets[at]  # [F, B + 1]
        lengths = (bounds[:, 1:] - bounds[:, :-1]).reshape(-1)
        per_feature = bounds[:, -1] - bounds[:, 0]
        n = int(per_feature.sum())
        begin = torch.cumsum(per_feature, 0) - per_feature  # where each feature's ids go
        ids = values[torch.arange(n) + torch.repeat_interleave(bounds[:, 0] - begin, per_feature, output_size=n)]
        starts = torch.cumsum(lengths, 0) - lengths
    n = ids.numel()
    if index.numel() & (index.numel() - 1):  # not the artifact's slot index (hugeembed's own: its kernels read it)
        raise ArtifactError(f"a key index of {index.numel()} slots: the artifact's index has a power of two")
    table = torch.repeat_interleave(torch.tensor(feature_table, dtype=torch.int64), per_feature, output_size=n)
    m = meta.index_select(0, table)  # [n, 5]: each id's table record
    static = m[:, KEY_BASE] < 0
    if bool(static.any()):  # the id is the row, range checked
        local = torch.where(static, ids, _find(ids, table, keys, index, meta) - m[:, KEY_BASE])
        hit = torch.where(static, (ids >= 0) & (ids < m[:, NUM]), local >= 0)
    else:
        pos = _find(ids, table, keys, index, meta)
        hit = pos >= 0
        local = pos - m[:, KEY_BASE]
    idx = torch.where(hit, local + m[:, ROW_BASE], m[:, MISS_ROW])
    dropped = ids < 0
    any_dropped = bool(dropped.any())
    if any_dropped:  # a dropped id adds nothing, as the zero row does
        idx.masked_fill_(dropped, zero_row)
    # The kernel pools the bags batch-major (bag b * F + f), so it writes [B, F, D] in place: ids are
    # reordered (a gather of n ids) instead of the output transposed (at B 4096, F 26, D 64 the
    # transpose copy alone cost 12 ms, more than the kernel).
    order = torch.arange(F * B).view(F, B).t().reshape(-1)
    blen = lengths.index_select(0, order)
    bstart = torch.cumsum(blen, 0) - blen
    src = torch.repeat_interleave(starts.index_select(0, order) - bstart, blen, output_size=n) + torch.arange(n)
    out = _embedding_bags(rows, idx.index_select(0, src), bstart, dtype, dim).view(B, F, dim)
    if not any(c != 0 for c in combiners):
        return out
    if any_dropped:
        kept = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(~dropped, 0, out=kept[1:])
        count = kept[starts + lengths] - kept[starts]
    else:
        count = lengths
    return _scale_bags(out, count.view(F, B).t(), combiners)


def _scale_bags(out: torch.Tensor, count: torch.Tensor, combiners: list[int]) -> torch.Tensor:
    """mean / sqrtn: each bag's sum ``out [B, F, D]`` scaled by its count of kept ids ``count [B, F]``."""
    if not any(c != 0 for c in combiners):
        return out
    count = count.clamp(min=1).to(torch.float32)
    comb = torch.tensor(combiners)[None, :]
    scale = torch.where(comb == 1, count.reciprocal(), torch.where(comb == 2, count.rsqrt(), 1.0))
    return out * scale[:, :, None]


# The op the exported program calls.  A caller that runs the graph itself (hugeembed's ServingModel) calls
# pooled_lookup_eager, the same function, directly: the custom op's dispatch cost 60 us a call.
pooled_lookup = torch.library.custom_op("hugeembed_serve::pooled_lookup", mutates_args=())(pooled_lookup_eager)


@pooled_lookup.register_fake
def _(values, offsets, rows, keys, index, meta, feature_pos, feature_table, combiners, batch_size, dim, dtype):
    return values.new_empty((batch_size, len(feature_pos), dim), dtype=torch.float32)


def _embedding_bags(rows: torch.Tensor, idx: torch.Tensor, starts: torch.Tensor, dtype: str, dim: int
                    ) -> torch.Tensor:
    """One kernel over every bag: ``[bags, D]`` float32 sums of rows."""
    if dtype in ("fp32", "fp16"):
        return torch.nn.functional.embedding_bag(idx, rows, starts, mode="sum").float()
    op = (torch.ops.quantized.embedding_bag_byte_rowwise_offsets if dtype == "int8"
          else torch.ops.quantized.embedding_bag_4bit_rowwise_offsets)
    out = op(rows, idx, starts, False, 0, False, None, None, False)
    return out[:, :dim]


# -- the key index --------------------------------------------------------------------------------------------------
#
# One open-addressing hash index per dim group over the keys of all its dynamic tables: `index[C]`
# (C a power of two, >= 2 keys: load factor <= 0.5) holds at each slot a position into the group's
# `keys` (the dynamic tables' keys one table after the other) or -1 (empty).  The slot of (key, table)
# is found by linear probing from mix64(key + (table + 1) * GOLDEN) & (C - 1); a hit checks the key at
# that position and that the position lies in the table's key range, so one key held by two tables
# of the group finds each table's own row.  Every probe sequence ends at an empty slot (the build
# fills a slot only after every slot before it on the key's path is taken), and at the table's max
# probe length (recorded at build): an id no key of its table has is known missing after as many
# probes as the longest present key needed.  The hash is part of the format: changing it needs a
# new FORMAT_VERSION (ServingModel reads artifacts with the installed runtime, not their copy).

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64's constants, as signed int64 (torch wraps on overflow)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_EMPTY = -1
# meta columns: one row per table of the group (see pooled_lookup)
ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE = range(5)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def hash_slots(ids: torch.Tensor, table: torch.Tensor, capacity: int) -> torch.Tensor:
    """Home slot of each (id, table): splitmix64's finalizer of id + (table + 1) * GOLDEN, masked."""
    z = table + 1
    z *= _GOLDEN
    z += ids
    z ^= _srl(z, 30)
    z *= _MIX1
    z ^= _srl(z, 27)
    z *= _MIX2
    z ^= _srl(z, 31)
    return z.bitwise_and_(capacity - 1)


def table_meta(table_keys: list[int], table_rows: list[int], table_shared: list[int], sizes: list[int],
               keys: torch.Tensor, max_probe: list[int]) -> torch.Tensor:
    """The lookup's per-table record (int64 [T, 5]: ROW_BASE, NUM, KEY_BASE, MISS_ROW, MAX_PROBE) of a
    group whose tables hold `sizes` rows (dynamic tables: their keys, in `keys` one after the other)."""
    zero_row = sum(sizes)
    out, row, key = [], 0, 0
    for k, n, shared, size, probe in zip(table_keys, table_rows, table_shared, sizes, max_probe):
        if k < 0:
            if size != n:
                raise ArtifactError(f"a static table of {n} rows holds {size}")
            out.append([row, n, -1, zero_row, 0])
        else:
            # the shared row is the key SHARED_ROW_KEY, first of the table's ascending keys (others are >= 0)
            has = bool(shared) and size > 0 and int(keys[key]) == SHARED_ROW_KEY
            out.append([row, size, key, row if has else zero_row, probe])
            key += size
        row += size
    if key != keys.numel():
        raise ArtifactError(f"the tables hold {key} keys, the key array {keys.numel()}")
    return torch.tensor(out, dtype=torch.int64).reshape(len(out), 5)


# A compiled probe with _find's results (hugeembed.serving installs csrc/serve.cpp's where its kernels
# are built; this file imports nothing from hugeembed): fn(ids, table, keys, index, meta) -> positions,
# or None where it cannot run (then the torch rounds do).
find_accelerator: Any = None
# The same for pooled_lookup's whole id -> row pass: fn(values, offsets, keys, index, meta, feature_pos,
# feature_table, B, n_rows) -> (row of each id, bags batch-major; each bag's first id; each bag's kept
# ids), or None.
bags_accelerator: Any = None
# The same for the whole lookup of int8 / int4 rows (the id -> row pass and the quantized embedding_bag op, the
# same floats): fn(values, offsets, rows, keys, index, meta, feature_pos, feature_table, B, dim, dtype) ->
# (pooled sums [B, F, D], kept ids per bag [B, F]), or None.
pool_accelerator: Any = None




def _find(ids: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, meta: torch.Tensor
          ) -> torch.Tensor:
    """Position in `keys` of each (id, table) (``meta``: the group's [T, 5] table records), or -1."""
    if find_accelerator is not None:
        got = find_accelerator(ids, table, keys, index, meta)
        if got is not None:
            return got
    return _find_torch(ids, table, keys, index, meta.index_select(0, table))


def _find_torch(ids: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, m: torch.Tensor
                ) -> torch.Tensor:
    """_find with torch ops (``m``: the tables' meta rows, one per id).  Probe rounds over the ids
    not yet resolved: a round reads one slot and one key per id."""
    cap = index.numel()
    found = torch.full_like(ids, -1)
    live: torch.Tensor | None = None  # positions in `ids` still probing (None: all)
    h = hash_slots(ids, table, cap)
    lo = m[:, KEY_BASE]
    hi = lo + m[:, NUM]
    limit = m[:, MAX_PROBE]
    rounds = int(limit.max()) if limit.numel() else 0
    for r in range(rounds):
        s = index.index_select(0, h).to(torch.int64)
        hit = (s >= lo) & (s < hi)  # in the id's table (an empty slot, -1, is in none)
        hit &= keys.index_select(0, s.clamp(min=0)) == ids
        go = ~hit
        go &= s != _EMPTY
        go &= limit > r + 1
        if live is None:
            found = torch.where(hit, s, found)
            live = go.nonzero().squeeze(1)
        else:
            found.index_copy_(0, live[hit], s[hit])
            live = live[go]
        if live.numel() == 0:
            break
        h, ids, lo, hi, limit = ((h[go] + 1).bitwise_and_(cap - 1), ids[go], lo[go], hi[go], limit[go])
    return found

