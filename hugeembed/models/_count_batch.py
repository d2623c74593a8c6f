"""A batch's click counts in one pass over all count tables (hugeembed/models/_counts.py).

The batch's ids of every counted feature become (table, sample, id) triples, sorted once by (table, id)
(stable, so each id's samples stay in batch order): the distinct (table, id) pairs, each id's clicks (its
samples' labels summed in sample order, as the per-table loop summed them) and hits (one per sample, a
bag holding an id twice counting once).  The rows are then found, read and written with one call per
table group (a group's ``find`` takes a table column beside the keys, store/_group.py), not per table.

Sharded tables: :func:`gather_batch` gives every rank the global batch's triples (samples renumbered in
rank order, as one process on the global batch numbers them), labels and the count fit's inputs; each
rank writes the rows it holds.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .._device import host_to_device
from ..errors import ConfigError
from ..features import SparseFeatures
from ..store import DynamicTable
from ..store._common import gather_rows, scatter_rows
from ..types import ShardKind

__all__ = ["batch_entries", "count_pairs", "gather_batch", "CountWriter"]

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # table (its place in the counted features), sample, id


def batch_entries(sparse: SparseFeatures, features: Sequence[str]) -> Entries:
    """int64 (table, sample, id) of every id of `features` in the batch, table-major then sample-major;
    table i counts ``features[i]``."""
    dev, B, n = sparse.device, sparse.batch_size, sparse.values().numel()
    where = [sparse.index_of(f) for f in features]  # KeyError naming the batch's features
    if B == 0 or n == 0:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return none, none, none
    table_of = [-1] * sparse.num_features
    for i, p in enumerate(where):
        table_of[p] = i
    bag = torch.repeat_interleave(torch.arange(sparse.num_features * B, device=dev), sparse.lengths().long(),
                                  output_size=n)
    feature = bag // B
    t = host_to_device(table_of, torch.int64, dev)[feature]
    s, v = bag - feature * B, sparse.values().long()
    if -1 in table_of:  # features no count table counts
        keep = t >= 0
        t, s, v = t[keep], s[keep], v[keep]
    return t, s, v


def count_pairs(t: torch.Tensor, s: torch.Tensor, v: torch.Tensor, y: torch.Tensor):
    """(table, id) of each distinct pair, ascending, with its clicks and hits (float64) over the entries:
    one hit per (sample, id), the sample's label its clicks, added in sample order."""
    order = torch.argsort(v, stable=True)
    order = order[torch.argsort(t[order], stable=True)]  # (table, id), each pair's entries in input order
    t, s, v = t[order], s[order], v[order]
    new_id = torch.ones_like(t, dtype=torch.bool)
    new_id[1:] = (t[1:] != t[:-1]) | (v[1:] != v[:-1])
    new_pair = new_id.clone()  # a sample's repeats of an id lie side by side: one hit
    new_pair[1:] |= s[1:] != s[:-1]
    ids_t, ids_v = t[new_id], v[new_id]
    which = (torch.cumsum(new_id, 0) - 1)[new_pair]
    clicks = torch.zeros(ids_v.numel(), dtype=torch.float64, device=v.device)
    clicks.index_add_(0, which, y.to(v.device)[s[new_pair]])
    hits = torch.bincount(which, minlength=ids_v.numel()).double()
    return ids_t, ids_v, clicks, hits


def gather_batch(comm, entries: Entries, y: torch.Tensor, fit: tuple[torch.Tensor, torch.Tensor] | None,
                 width: int):
    """The global batch on every rank, ranks in order: its entries (samples renumbered), labels, and the
    fit's inputs ``([B, width] count log-odds, [B] logits)``, float64 — None unless every rank gave them."""
    dev, b = y.device, y.numel()
    sizes = comm.all_gather_object("click counts (sizes)", (entries[0].numel(), b, fit is not None))
    base = sum(r[1] for r in sizes[: comm.rank])
    n_max, b_max, fitted = max(r[0] for r in sizes), max(r[1] for r in sizes), all(r[2] for r in sizes)
    ints = torch.zeros(3, n_max, dtype=torch.int64, device=dev)
    ints[:, : entries[0].numel()] = torch.stack([entries[0], entries[1] + base, entries[2]])
    cols = 1 + (width + 1 if fitted else 0)  # label, then the fit's inputs and logit
    floats = torch.zeros(b_max, cols, dtype=torch.float64, device=dev)
    floats[:b, 0] = y
    if fitted:
        floats[:b, 1 : width + 1], floats[:b, width + 1] = fit[0], fit[1]
    got_i = comm.all_gather("click counts (ids)", ints)
    got_f = comm.all_gather("click counts (labels)", floats)
    t, s, v = (torch.cat([g[k, : r[0]] for g, r in zip(got_i, sizes)]).to(dev) for k in range(3))
    f = torch.cat([g[: r[1]] for g, r in zip(got_f, sizes)]).to(dev)
    return (t, s, v), f[:, 0].contiguous(), (f[:, 1 : width + 1], f[:, width + 1].contiguous()) if fitted else None


class CountWriter:
    """The count tables' rows this collection holds, read and written one table group at a time.

    Args:
        collection: an EmbeddingCollection (or a rank's ShardedEmbeddingCollection: the tables or rows it
            holds; a table held elsewhere is skipped).
        names: the count tables; an entry's table is its index here.
        width: their columns (log-odds, clicks, hits).
    """

    def __init__(self, collection, names: Sequence[str], width: int) -> None:
        index = {t.name: i for i, t in enumerate(collection.tables)}
        plan = getattr(collection, "plan", None)
        members: dict[int, list[tuple[int, int]]] = {}  # group -> (count table, its index in the group)
        for k, name in enumerate(names):
            if plan is not None and plan[name].kind is ShardKind.COLUMN_WISE:
                raise ConfigError(f"table {name!r}: click counts need whole rows; shard it row_wise, table_wise "
                                  "or data_parallel, not column_wise")
            at = collection.placement.where[index[name]]
            if at is None:  # held by another rank
                continue
            store = collection.store(name)
            if not isinstance(store, DynamicTable) or store.width != width or store.dtype != torch.float32:
                raise ConfigError(f"table {name!r}: click counts need a dynamic table of float32 rows of {width} "
                                  f"columns without optimizer state, got {type(store).__name__}, width "
                                  f"{store.width}, {store.dtype}")
            members.setdefault(at[0], []).append((k, at[1]))
        self.collection, self.names, self.width = collection, list(names), width
        # (group, local index of each count table or -1, a table of the group, all here); a dynamic table's
        # slots and rows are its group's: one table's view reads and writes the group's rows (looked up at
        # each call: loading a state_dict makes new groups and views)
        self.parts = []
        for g, ms in members.items():
            local = [-1] * len(names)
            for k, i in ms:
                local[k] = i
            self.parts.append((g, host_to_device(local, torch.int64, collection.device), names[ms[0][0]],
                               len(ms) == len(names)))

    def zero(self) -> None:
        """Every row this collection holds back to zeros."""
        for g, local, name, _ in self.parts:
            view = self.collection.store(name)
            slots = torch.cat([self.collection.groups[g].export_index(int(i)).slots for i in local.tolist() if i >= 0])
            view.scatter(slots, torch.zeros(slots.numel(), self.width, device=view.device))

    def add(self, ids_t: torch.Tensor, ids_v: torch.Tensor, clicks: torch.Tensor, hits: torch.Tensor,
            log_odds: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Adds the distinct (table, id) pairs' clicks and hits to their rows held here and writes the
        rows' log-odds ``log_odds(clicks, hits)``: one find, gather and scatter per group."""
        dev = self.collection.device
        ids_t, ids_v, clicks, hits = (x.to(dev) for x in (ids_t, ids_v, clicks, hits))
        for g, local, name, whole in self.parts:
            view = self.collection.store(name)
            tids, keys, c, n = local[ids_t], ids_v, clicks, hits
            if not whole:
                sel = tids >= 0
                tids, keys, c, n = tids[sel], keys[sel], c[sel], n[sel]
            slots = self.collection.groups[g].find(tids, keys)
            keep = slots >= 0  # ids < 0 are dropped by the lookup; an evicted id has no row (or another rank has)
            slots = slots[keep]
            # the rows of ids this step's training forward fetched: their last step is this step, so a snapshot
            # delta holds them; written without a direct-write stamp (store.scatter's), which would force the
            # next snapshot to be full
            rows = view.storage()
            old = gather_rows(rows, slots).double()
            c = old[:, 1] + c[keep]
            n = old[:, 2] + n[keep]
            scatter_rows(name, rows, slots, torch.stack([log_odds(c, n), c, n], 1).float())
