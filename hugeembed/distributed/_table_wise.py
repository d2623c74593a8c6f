"""Table-wise sharding ("localized" embedding): the owner of a whole table pools for everyone.

One step, for the pooled tables owned by rank o::

    requester r: per table, its unique ids, hit counts, and its bags as (lengths, index of each
                 id in those unique ids, weights) ─► o
    owner o    : rebuilds one batch of sum_r B_r samples (rank r's samples after rank r-1's:
                 the global batch, in order), dedups the ids over the ranks, find_or_insert,
                 and runs the fused lookup on it ─► pooled [B_r, F_t, D] back to each rank
    backward   : each rank's gradient of its pooled outputs ─► o, which runs the lookup's
                 backward over the whole batch and applies the optimizer in place

Only pooled vectors travel back, so this wins when bags hold many ids (pooling factor
>> 1).  Sequence tables (combiner "none") go the row-wise way to their owner instead.
"""

from __future__ import annotations

import torch

from .. import _native
from ..errors import ShardingError
from ..functional import Prepared
from ._wire import CODE_DTYPE, Packer, padded

__all__ = ["TableWisePooling"]


class _PoolTable:
    def __init__(self, coll, t: int, pt: int, owner: int, feats: tuple[int, ...], names: list[str], col: int,
                 wire_dtype: torch.dtype, dim: int) -> None:
        cfg = coll.tables[t]
        self.t, self.pt, self.owner, self.feats, self.names, self.col = t, pt, owner, feats, names, col
        self.name, self.dim, self.rule = cfg.name, dim, coll.rules[t]
        self.whole = dim == cfg.dim  # else one block of a column-wise table's columns
        self.wire_dtype = wire_dtype
        self.out_bytes = dim * len(feats) * torch.empty(0, dtype=wire_dtype).element_size()


class TableWisePooling:
    """The exchange of every pooled table-wise table (see the module docstring).

    A column-wise table has one entry per block (_column_wise.py): each block's owner pools its
    columns as a table-wise owner pools a whole table; the blocks' outputs are concatenated.

    Args:
        coll: the ShardedEmbeddingCollection.
        tables: per table or column block, (collection index, index in the requesters' pool lookup,
            owner rank, dim of what that owner pools).
        col: its first column in the exchange header (two per table).
        wire_dtypes: per table, the dtype of pooled vectors and their gradients on the wire.
    """

    def __init__(self, coll, tables: list[tuple[int, int, int, int]], col: int,
                 wire_dtypes: list[torch.dtype]) -> None:
        self.coll = coll
        plan = coll._pool_req.plan
        self.tables: list[_PoolTable] = []
        for i, ((t, pt, owner, dim), wd) in enumerate(zip(tables, wire_dtypes)):
            feats = plan.table_features[pt]
            if list(feats) != list(range(feats[0], feats[0] + len(feats))):
                raise ShardingError(f"table {coll.tables[t].name!r}: its features are not contiguous in the "
                                    "lookup plan (internal error)")
            names = [plan.features[f].name for f in feats]
            self.tables.append(_PoolTable(coll, t, pt, owner, feats, names, col + 2 * i, wd, dim))
        self.header_cols = 2 * len(self.tables)
        self.mine = [p for p in self.tables if p.owner == coll.rank]

    # -- forward -------------------------------------------------------------------------

    def input_dist(self, st, header: torch.Tensor, packer: Packer) -> None:
        prep, B = st.prep_p, st.batch_size
        offs = prep.offsets
        for p in self.tables:
            f0, f1 = p.feats[0], p.feats[-1] + 1
            lo, hi = int(offs[f0 * B]), int(offs[f1 * B])
            keys = prep.keys_of(p.pt)
            lengths = (offs[f0 * B + 1 : f1 * B + 1] - offs[f0 * B : f1 * B]).to(torch.int32)
            ids = (prep.inverse[lo:hi].to(torch.int64) - prep.unique_base[p.pt]).to(torch.int32)
            header[p.owner, p.col] = keys.numel()
            header[p.owner, p.col + 1] = hi - lo
            packer.add(p.owner, keys)
            if st.training:
                packer.add(p.owner, prep.counts_of(p.pt).to(torch.int32))
            packer.add(p.owner, lengths)
            packer.add(p.owner, ids)
            if prep.weights is not None:
                packer.add(p.owner, prep.weights[lo:hi])

    def input_bytes(self, st, r: int) -> int:
        B = int(st.hdr_in[r, st.COL_B])
        wdt = CODE_DTYPE[int(st.hdr_in[r, st.COL_W])]
        welt = torch.empty(0, dtype=wdt).element_size() if wdt is not None else 0
        total = 0
        for p in self.mine:
            nk, ni = int(st.hdr_in[r, p.col]), int(st.hdr_in[r, p.col + 1])
            total += padded(8 * nk) + (padded(4 * nk) if st.training else 0) + padded(4 * len(p.feats) * B)
            total += padded(4 * ni) + padded(welt * ni)
        return total

    def compute(self, st, readers, replies: Packer) -> None:
        """Owner: one batch from every rank's bags, one fused lookup, pooled rows back to each rank."""
        for p in self.tables:
            if p.owner != st.rank and bool((st.hdr_in[:, p.col] != 0).any()):
                raise ShardingError(f"table {p.name!r}: rank {st.rank} got ids but does not own this table "
                                    "(ranks disagree on the sharding plan)")
        if not self.mine:
            return
        W, dev = st.world_size, self.coll.device
        Bs = st.hdr_in[:, st.COL_B].tolist()
        wdts = [CODE_DTYPE[int(c)] for c in st.hdr_in[:, st.COL_W].tolist()]
        wdt = next((d for d in wdts if d is not None), None)
        Bm = sum(Bs)
        st.pool_replies = []
        lengths_all, ids_all, w_all = [], [], []
        ukeys, ucounts, base, count, slots_all, hits_all = [], [], [], [], [], []
        st.rare[self] = {}  # per table owned: its shared row's slot
        overlay = {}  # eval: caught-up copies of rows read (global Adam), see coll.current_rows
        for p in self.mine:
            F = len(p.feats)
            keys, counts, lens, ids, ws = [], [], [], [], []
            for r in range(W):
                nk, ni = int(st.hdr_in[r, p.col]), int(st.hdr_in[r, p.col + 1])
                keys.append(readers[r].take(nk, torch.int64).to(dev))
                counts.append(readers[r].take(nk, torch.int32).to(dev) if st.training else None)
                lens.append(readers[r].take(F * Bs[r], torch.int32).to(dev).view(F, Bs[r]))
                ids.append(readers[r].take(ni, torch.int32).to(dev))
                ws.append(readers[r].take(ni, wdts[r]).to(dev) if wdts[r] is not None else
                          (torch.ones(ni, dtype=wdt, device=dev) if wdt is not None else None))
            sources = [r for r in range(W) if keys[r].numel()]
            b0 = sum(count)
            if len(sources) <= 1:
                uniq = keys[sources[0]] if sources else keys[0]
                maps = [None] * W
                uc = counts[sources[0]].to(torch.int64) if sources and st.training else None
            else:
                uniq, inv = torch.unique(torch.cat(keys), sorted=True, return_inverse=True)
                maps = list(torch.split(inv, [k.numel() for k in keys]))
                uc = None
                if st.training:
                    uc = torch.zeros(uniq.numel(), dtype=torch.int64, device=dev).index_add_(
                        0, inv, torch.cat(counts).to(torch.int64))
            fetched = self.coll.fetch_slots([p.t], [uniq], st.step, st.training, None if uc is None else [uc])
            got = fetched.slots[0]
            hits_all.append(fetched.hits[0])
            st.rare[self][p.t] = fetched.shared[0]
            if st.training:
                st.flight.pin(self.coll.group_index(p.t), got)
            else:
                overlay[p.t], got = self.coll.current_rows(p.t, got, uniq)
            slots_all.append(got)
            ukeys.append(uniq)
            ucounts.append(uc if uc is not None else torch.ones_like(uniq))
            base.append(b0)
            count.append(uniq.numel())
            # per feature k: the bags of rank 0, then rank 1, ... (the global batch in order)
            starts = []
            for r in range(W):
                acc = [0]
                for n in lens[r].sum(1).tolist():
                    acc.append(acc[-1] + n)
                starts.append(acc)
            for k in range(F):
                for r in range(W):
                    lengths_all.append(lens[r][k])
                    seg = ids[r][starts[r][k] : starts[r][k + 1]].to(torch.int64)
                    ids_all.append((seg if maps[r] is None else maps[r][seg]) + b0)
                    if wdt is not None:
                        w_all.append(ws[r][starts[r][k] : starts[r][k + 1]])
        lengths = torch.cat(lengths_all).to(torch.int64)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offsets[1:])
        weights = torch.cat(w_all) if wdt is not None else None
        native = (self.coll.backend != "torch" and _native.available() and dev.type == "cpu"
                  and (weights is None or weights.dtype == torch.float32))
        inverse = torch.cat(ids_all).to(torch.int32 if native else torch.int64)
        mprep = Prepared(Bm, offsets, inverse, weights, torch.cat(ukeys), torch.cat(ucounts), base, count,
                         sum(count), native=native)
        slots = torch.cat(slots_all)
        storages = [overlay.get(p.t, self.coll.rows_of(p.t)) for p in self.mine]
        trainable = st.training and any(p.rule is not None for p in self.mine)
        if trainable:
            out = self.coll._pool_own.lookup(mprep, storages, slots, params=[self.coll._pool_anchor],
                                             row_grad_hook=self._owner_hook(st, mprep, slots, hits_all))
        else:
            out = self.coll._pool_own.lookup(mprep, storages, slots)
        start = 0
        for r in range(W):
            for p in self.mine:
                block = torch.stack([out[n][start : start + Bs[r]] for n in p.names], dim=1).to(p.wire_dtype)
                replies.add(r, block)
                if trainable and p.rule is not None:
                    st.pool_replies.append(block)
            start += Bs[r]

    def _owner_hook(self, st, prep, all_slots, hits: list):
        def apply(j: int, slots: torch.Tensor, grad: torch.Tensor) -> None:
            b, n = prep.unique_base[j], prep.unique_count[j]
            keys, h = prep.unique_keys[b : b + n], hits[j]
            if slots.numel() != n:  # the lookup dropped ids without a row
                known = all_slots[b : b + n] >= 0
                keys, h = keys[known], (h[known] if h is not None else None)
            t = self.mine[j].t
            self.coll.update_rows(t, slots, grad, st.flight, keys=keys, hits=h, shared_slot=st.rare[self][t])

        return apply

    def output_bytes(self, st, d: int) -> int:
        return sum(padded(st.batch_size * p.out_bytes) for p in self.tables if p.owner == d)

    def output_dist(self, st, readers) -> None:
        B = st.batch_size
        blocks: dict[int, list] = {}
        for p in self.tables:
            block = readers[p.owner].take(B * len(p.feats) * p.dim, p.wire_dtype).view(B, len(p.feats), p.dim)
            block = block.to(self.coll.device)
            if st.training and p.rule is not None:
                block = block.detach().requires_grad_()
            st.pooled[p.t if p.whole else (p.t, p.col)] = block  # the leaf grad_dist reads
            blocks.setdefault(p.t, []).append(block)
        for t, parts in blocks.items():
            if len(parts) > 1:  # a column-wise table's blocks, in column order
                st.pooled[t] = torch.cat(parts, dim=2)

    # -- backward ------------------------------------------------------------------------

    def grad_dist(self, st, packer: Packer) -> None:
        for p in self.tables:
            if p.rule is None:
                continue
            leaf = st.pooled[p.t if p.whole else (p.t, p.col)]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if st.grad_scale != 1.0:
                grad = grad * st.grad_scale
            packer.add(p.owner, grad.to(p.wire_dtype).contiguous())

    def grad_bytes(self, st, r: int) -> int:
        B = int(st.hdr_in[r, st.COL_B])
        return sum(padded(B * p.out_bytes) for p in self.mine if p.rule is not None)

    def apply(self, st, readers) -> None:
        grads = []
        for r in range(st.world_size):
            B = int(st.hdr_in[r, st.COL_B])
            for p in self.mine:
                if p.rule is not None:
                    g = readers[r].take(B * len(p.feats) * p.dim, p.wire_dtype).view(B, len(p.feats), p.dim)
                    grads.append(g.to(self.coll.device))
        if st.pool_replies:
            torch.autograd.backward(st.pool_replies, grads)  # the owner's lookup backward: hook applies
