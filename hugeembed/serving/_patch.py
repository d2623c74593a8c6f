"""A served version after deltas: the base tables untouched, plus a small patch of the rows the deltas changed.

The base artifact's tables stay as loaded (memory-mapped, read-only); each dim group gets a
**patch** in the group format (``_runtime.group_tables``: rows, keys, hash index, meta), keyed by
(table, id) for every table, static ones included::

    patch rows   the rows the deltas since the base upserted, and for removed keys a copy of the
                 row a missing id reads (the table's shared row, or zeros); then one zero row
    miss         per table, the patch row that ids the base does not hold read (the table's shared
                 row when a delta changed it), or -1: the base's own miss row

A delta builds the next version's patch beside the served one (the served patch and the delta's
rows, merged per table), so applying it costs memory for the rows the deltas changed, never a
copy of the tables, and a failure half-way changes nothing.  The version's program is a fresh
module of the base's exported program with the delta's dense weights (plain arrays) assigned and,
where a group has a patch, its lookup node calling :func:`patched_lookup` with the patch as
buffers: every call reads one version, whole.

patched_lookup reads each id's row from the patch when the patch holds it, from the base
otherwise, gathers those rows into one small matrix and runs the same kernel on the same bags
in the same order as the base lookup would on a table holding them: a base plus deltas serves
what a full export of the newest snapshot serves, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _lookup_ops, _runtime
from ._index import group_tables, index_probes, is_serving_index
from ._runtime import KEY_BASE, MISS_ROW, NUM, ROW_BASE, SHARED_ROW_KEY

__all__ = ["PatchGroup", "merge_patch", "patched_lookup", "version_program", "effective_rows"]

_OP = "hugeembed_serve::pooled_lookup"


@dataclass(frozen=True)
class PatchGroup:
    """One dim group's patch: (rows, keys, index, meta) in the group format, every table keyed, and the
    per-table miss row (int64 [T]; -1: the base's).  ``removed[i]``: key i reads the miss row (copied)."""

    rows: torch.Tensor
    keys: torch.Tensor
    index: torch.Tensor
    meta: torch.Tensor
    miss: torch.Tensor
    removed: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.keys, self.index, self.meta, self.removed))

    def table_part(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, rows, removed) of table t, keys ascending."""
        lo, n = int(self.meta[t, KEY_BASE]), int(self.meta[t, NUM])
        return self.keys[lo: lo + n], self.rows[lo: lo + n], self.removed[lo: lo + n]


def merge_patch(group: dict[str, Any], base_rows: torch.Tensor, base_meta: torch.Tensor, prev: PatchGroup | None,
                upserts: dict[str, tuple[torch.Tensor, torch.Tensor]], removed: dict[str, torch.Tensor]
                ) -> PatchGroup | None:
    """The patch of one group after a delta: `prev` with the delta's rows (`upserts`: table -> (keys, rows),
    `removed`: table -> keys gone) merged in, table by table.  Built beside `prev`, which is untouched."""
    names = group["tables"]
    empty_rows = base_rows[:0]
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for t, name in enumerate(names):
        if prev is not None:
            old_k, old_r, old_gone = prev.table_part(t)
        else:
            old_k, old_r, old_gone = torch.zeros(0, dtype=torch.int64), empty_rows, torch.zeros(0, dtype=torch.bool)
        up_k, up_r = upserts.get(name, (torch.zeros(0, dtype=torch.int64), empty_rows))
        gone = removed.get(name, torch.zeros(0, dtype=torch.int64))
        gone = gone[~torch.isin(gone, up_k)]
        stay = ~torch.isin(old_k, torch.cat([up_k, gone]))
        keys = torch.cat([old_k[stay], up_k, gone])
        rows = torch.cat([old_r[stay], up_r, empty_rows.new_zeros((gone.numel(), *base_rows.shape[1:]))])
        flags = torch.cat([old_gone[stay], torch.zeros(up_k.numel(), dtype=torch.bool),
                           torch.ones(gone.numel(), dtype=torch.bool)])
        order = torch.argsort(keys)
        parts.append((keys[order], rows[order], flags[order]))
    sizes = [int(k.numel()) for k, _, _ in parts]
    if sum(sizes) == 0:
        return None
    keys = torch.cat([k for k, _, _ in parts])
    rows = torch.cat([*(r for _, r, _ in parts), empty_rows.new_zeros((1, *base_rows.shape[1:]))])
    flags = torch.cat([f for _, _, f in parts])
    record = {"table_keys": list(range(len(names))), "table_rows": [0] * len(names), "table_shared": [0] * len(names)}
    rows, keys, index, meta = group_tables(record, sizes, rows, keys)
    if _runtime.index_builder is not None:  # the patch's keys under a private, salted index, as the base's
        index = _runtime.index_builder(keys, index, meta)
    miss = torch.full((len(names),), -1, dtype=torch.int64)
    zero = rows.shape[0] - 1
    for t in range(len(names)):  # a table whose shared row a delta changed (or removed) reads it from the patch
        if not group["table_shared"][t] or group["table_keys"][t] < 0:
            continue
        lo, n = int(meta[t, KEY_BASE]), int(meta[t, NUM])
        at = torch.searchsorted(keys[lo: lo + n], torch.tensor([SHARED_ROW_KEY]))
        if int(at) < n and int(keys[lo + int(at)]) == SHARED_ROW_KEY:
            miss[t] = zero if bool(flags[lo + int(at)]) else lo + int(at)
    for t in range(len(names)):  # removed keys read what a missing id reads, now
        lo, n = int(meta[t, KEY_BASE]), int(meta[t, NUM])
        gone = lo + torch.nonzero(flags[lo: lo + n]).squeeze(1)
        if gone.numel():
            source = rows[int(miss[t])] if int(miss[t]) >= 0 else base_rows[int(base_meta[t, MISS_ROW])]
            rows[gone] = source.clone()
    return PatchGroup(rows, keys, index, meta, miss, flags)


def patched_lookup(values: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                   index: torch.Tensor, meta: torch.Tensor, feature_pos: list[int], feature_table: list[int],
                   combiners: list[int], batch_size: int, dim: int, dtype: str, *, patch_rows: torch.Tensor,
                   patch_keys: torch.Tensor, patch_index: torch.Tensor, patch_meta: torch.Tensor,
                   patch_miss: torch.Tensor) -> torch.Tensor:
    """``_runtime.pooled_lookup`` over the base tables (rows .. meta) with a group's patch on top."""
    B, F = batch_size, len(feature_pos)
    if F == 0 or B == 0:
        return torch.zeros(B, F, dim)
    accelerate = _lookup_ops.bags_accelerator
    if accelerate is not None:  # hugeembed's kernels: each id's row in the base and in the patch, batch-major
        base = accelerate(values, offsets, keys, index, meta, feature_pos, feature_table, B, rows.shape[0])
        patch = accelerate(values, offsets, patch_keys, patch_index, patch_meta, feature_pos, feature_table, B,
                           patch_rows.shape[0])
        if base is not None and patch is not None:
            out = _from_rows(base[0], patch[0], base[1], base[2], rows, meta, patch_rows, patch_miss, combiners,
                             B, F, dim, dtype)
            if out is not None:
                return out
    return _patched_torch(values, offsets, rows, keys, index, meta, feature_pos, feature_table, combiners, B, dim,
                          dtype, patch_rows, patch_keys, patch_index, patch_meta, patch_miss)


def _from_rows(base_idx: torch.Tensor, patch_idx: torch.Tensor, starts: torch.Tensor, kept: torch.Tensor,
               rows: torch.Tensor, meta: torch.Tensor, patch_rows: torch.Tensor, patch_miss: torch.Tensor,
               combiners: list[int], B: int, F: int, dim: int, dtype: str) -> torch.Tensor | None:
    """The pooled bags from each id's base row and patch row (batch-major, as he_serve_bags gives them): the
    patch's row where it holds the id, or where the base misses it and the patch holds the table's miss row.
    None when a base miss cannot be told from a dropped id here (a table whose base has no shared row, which
    a delta gave one: its misses read the zero row, as dropped ids do): the torch pass decides."""
    patch_zero = patch_rows.shape[0] - 1  # what an id the patch does not hold (or a dropped one) reads there
    from_patch = patch_idx < patch_zero
    moved = torch.nonzero(patch_miss >= 0).squeeze(1)
    if moved.numel():  # a base miss reads the table's miss row: the patch's where a delta changed it
        missing = meta[moved, MISS_ROW]
        if bool((missing == rows.shape[0] - 1).any()):
            return None
        order = torch.argsort(missing)
        missing, moved = missing[order], moved[order]
        at = torch.searchsorted(missing, base_idx).clamp_(max=missing.numel() - 1)
        miss = (missing.index_select(0, at) == base_idx) & ~from_patch
        patch_idx = torch.where(miss, patch_miss.index_select(0, moved.index_select(0, at)), patch_idx)
        from_patch |= miss
    gathered = rows.index_select(0, base_idx)  # each id's row, the patch's written over the base's
    sel = torch.nonzero(from_patch).squeeze(1)
    gathered.index_copy_(0, sel, patch_rows.index_select(0, patch_idx.index_select(0, sel)))
    out = _lookup_ops._embedding_bags(gathered, torch.arange(gathered.shape[0]), starts, dtype, dim).view(B, F, dim)
    return _lookup_ops._scale_bags(out, kept.view(B, F), combiners)


def _positions(ids: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
               meta: torch.Tensor) -> torch.Tensor:
    """Position in `keys` of each (id, table), -1 where absent: through hugeembed's private index (its
    kernels read it) or the artifact's own (the runtime's torch rounds)."""
    if is_serving_index(index):
        return index_probes(index, ids, table, keys, meta)[0]
    return _lookup_ops._find(ids, table, keys, index, meta)


def _patched_torch(values, offsets, rows, keys, index, meta, feature_pos, feature_table, combiners, B, dim, dtype,
                   patch_rows, patch_keys, patch_index, patch_meta, patch_miss) -> torch.Tensor:
    """patched_lookup with torch ops (no kernels): pooled_lookup's torch pass, on the base and on the patch."""
    F = len(feature_pos)
    at = (torch.tensor(feature_pos, dtype=torch.int64) * B)[:, None] + torch.arange(B + 1)
    bounds = offsets[at]  # [F, B + 1]: the group's bags, feature-major
    lengths = (bounds[:, 1:] - bounds[:, :-1]).reshape(-1)
    per_feature = bounds[:, -1] - bounds[:, 0]
    n = int(per_feature.sum())
    begin = torch.cumsum(per_feature, 0) - per_feature
    ids = values[torch.arange(n) + torch.repeat_interleave(bounds[:, 0] - begin, per_feature, output_size=n)]
    starts = torch.cumsum(lengths, 0) - lengths
    table = torch.repeat_interleave(torch.tensor(feature_table, dtype=torch.int64), per_feature, output_size=n)
    m = meta.index_select(0, table)
    # the base's row of each id: as pooled_lookup finds it
    static = m[:, KEY_BASE] < 0
    pos = _positions(ids, table, keys, index, meta)
    hit = torch.where(static, (ids >= 0) & (ids < m[:, NUM]), pos >= 0)
    base_row = torch.where(hit, torch.where(static, ids, pos - m[:, KEY_BASE]) + m[:, ROW_BASE], m[:, MISS_ROW])
    # the patch's: a hit (every patch table is keyed, its rows in key order), or its miss row
    ppos = _positions(ids, table, patch_keys, patch_index, patch_meta)
    miss = patch_miss.index_select(0, table)
    from_patch = (ppos >= 0) | (~hit & (miss >= 0))
    patch_row = torch.where(ppos >= 0, ppos, miss).clamp_(min=0)
    gathered = torch.where(from_patch[:, None], patch_rows.index_select(0, patch_row), rows.index_select(0, base_row))
    dropped = ids < 0  # adds nothing and is not counted, as in pooled_lookup
    local = torch.cat([gathered, rows[-1:]])  # and then the zero row
    idx = torch.where(dropped, torch.full_like(ids, n), torch.arange(n))
    out = _lookup_ops._embedding_bags(local, idx, starts, dtype, dim).view(F, B, dim).transpose(0, 1)
    kept = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(~dropped, 0, out=kept[1:])
    count = (kept[starts + lengths] - kept[starts]).view(F, B).t()
    return _lookup_ops._scale_bags(out, count, combiners).contiguous()


def version_program(exported, groups: list[dict[str, Any]], dense: dict[str, torch.Tensor] | None,
                    patch: tuple[PatchGroup | None, ...]) -> torch.nn.Module:
    """A fresh module of the base's exported program: `dense` weights assigned (None: the base's), and the
    lookup of each group with a patch reading it (its node calls patched_lookup, the patch as buffers)."""
    gm = exported.module()
    if dense is not None:
        gm.load_state_dict(dense, strict=True, assign=True)
    if not any(p is not None for p in patch):
        return gm
    op = getattr(torch.ops.hugeembed_serve.pooled_lookup, "default")
    arg_names = [a.name for a in op._schema.arguments]
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is op]:
        args = {**dict(zip(arg_names, node.args)), **node.kwargs}
        g = next((i for i, s in enumerate(groups) if list(s["feature_pos"]) == list(args["feature_pos"])
                  and int(s["dim"]) == int(args["dim"])), None)
        if g is None:
            raise _runtime.ArtifactError(f"the program's lookup of features {args['feature_pos']} matches no group "
                                         f"of the manifest")
        if patch[g] is None:
            continue
        extra = {}
        with graph.inserting_before(node):
            for what in ("rows", "keys", "index", "meta", "miss"):
                name = f"_hugeembed_patch{g}_{what}"
                gm.register_buffer(name, getattr(patch[g], what), persistent=False)
                extra[f"patch_{what}"] = graph.get_attr(name)
        node.target = patched_lookup
        node.args = tuple(args[a] for a in arg_names)
        node.kwargs = extra
    gm.recompile()
    return gm


def effective_rows(base: _runtime.Tables, patch: tuple[PatchGroup | None, ...], g: int, t: int, ids: torch.Tensor
                   ) -> torch.Tensor:
    """The stored rows that ids of table t of group g read in a version (for tests and inspection)."""
    rows, keys, index, meta = base.rows[g], base.keys[g], base.index[g], base.meta[g]
    table = torch.full_like(ids, t)
    m = meta.index_select(0, table)
    static = m[:, KEY_BASE] < 0
    pos = _positions(ids, table, keys, index, meta)
    hit = torch.where(static, (ids >= 0) & (ids < m[:, NUM]), pos >= 0)
    out = rows.index_select(0, torch.where(hit, torch.where(static, ids, pos - m[:, KEY_BASE]) + m[:, ROW_BASE],
                                           m[:, MISS_ROW]))
    p = patch[g]
    if p is None:
        return out
    ppos = _positions(ids, table, p.keys, p.index, p.meta)
    miss = p.miss.index_select(0, table)
    use = (ppos >= 0) | (~hit & (miss >= 0))
    return torch.where(use[:, None], p.rows.index_select(0, torch.where(ppos >= 0, ppos, miss).clamp(min=0)), out)
