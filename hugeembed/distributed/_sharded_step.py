"""One step of a ShardedEmbeddingCollection, the exchanges between its ranks::

    input_dist -> compute (owners) -> output_dist -> local pooling; backward: grad_dist -> owners' updates

each a named method, each route (distributed/_routes.py) adding its part of every exchange.
"""

from __future__ import annotations

import torch

from ..errors import ShardingError
from ..features import SparseFeatures
from ..functional import JaggedEmbeddings, PooledEmbeddings
from ._data_parallel import ReplicatedGroup
from ._step import MAGIC, ExchangeBackward, StepState
from ._wire import DTYPE_CODE, Packer, readers


class ShardedStep:
    """The forward and backward of ShardedEmbeddingCollection (which builds the routes, the comm
    and the local lookups these methods use)."""

    # -- forward ------------------------------------------------------------------------

    def _lookup_batch(self, features: SparseFeatures, training: bool, step: int,
                      runs: list | None = None) -> PooledEmbeddings:
        """input_dist -> compute -> output_dist -> local pooling (the base forward checked the batch)."""
        if runs is not None:
            raise NotImplementedError("a sharded collection inside torch.compile / torch.export is not supported "
                                      "yet (its all-to-alls are not custom ops): compile the dense part only")
        w = features.weights_or_none()
        if w is not None and w.requires_grad and torch.is_grad_enabled():
            # table-wise owners pool with the weights they receive: no gradient would come back
            raise NotImplementedError("gradients with respect to per-id weights are not implemented for the sharded "
                                      "collection; detach the weights or use EmbeddingCollection in one process")
        if self._pipeline is not None:
            if training:
                return self._pool(self._pipeline.take(features, step))
            self._pipeline.drain()  # an eval forward's collectives run here, with the thread idle
        return self._pool(self._fetch_step(features, step, training))

    def _fetch_step(self, features: SparseFeatures, step: int, training: bool = True,
                    replicas_late: bool = False) -> StepState:
        """input_dist -> compute -> output_dist of one batch (on the exchange thread under staleness);
        `replicas_late`: the replicated rows are copied later, by :meth:`_read_replicas`."""
        if features.batch_size and self.is_server:
            raise ShardingError(f"rank {self.rank} of {self.world_size} is a server (servers={self.servers}): it "
                                f"reads no data, so its batches are empty; got {features.batch_size} samples")
        scale = 1.0 / self.workers if self.gradient_reduction == "mean" else 1.0
        st = StepState(training, step, self.rank, self.world_size, features.batch_size, scale)
        st.stale_reads = training and self._pipeline is not None and self._pipeline.staleness > 0
        st.replicas_late = st.stale_reads and replicas_late
        self.comm.step = step
        self.comm.stats.new_step()
        self.input_dist(st, features)
        self.compute(st)
        self.output_dist(st)
        return st

    def _dummies(self, ts) -> list[torch.Tensor]:
        return [torch.empty(0, self.tables[t].dim, dtype=self.tables[t].dtype, device=self.device) for t in ts]

    def input_dist(self, st: StepState, sf: SparseFeatures) -> None:
        """Stage 1: local clean + dedup, then keys and bags to their owners (header + one byte all-to-all)."""
        local = list(self._local_index)
        if self._local_prep is not None:
            st.prep_l = self._local_prep.prepare(sf, self._dummies(local))
            st.slots_l = torch.full((st.prep_l.capacity,), -1, dtype=torch.int64, device=self.device)
            st.storages_l = [None] * len(local)
        if self._pool_req is not None:
            st.prep_p = self._pool_req.prepare(sf, self._dummies(self._pool_tables))
        W = self.world_size
        header = torch.zeros(W, self._header_cols, dtype=torch.int64)
        header[:, :StepState.COMMON] = torch.tensor(
            [MAGIC, int(st.training), st.step, st.batch_size,
             DTYPE_CODE[st.prep_p.weights.dtype if st.prep_p is not None and st.prep_p.weights is not None
                        else None]])
        packer = Packer(W)
        for route in self._routes:
            route.input_dist(st, header, packer)
        st.hdr_in = header
        if not (self._exchanges or st.training):
            return  # eval with replicated tables only: nothing to exchange
        st.hdr_in = self.comm.exchange_counts("input_dist (header)", header)
        self._check_headers(st)
        sizes = [sum(route.input_bytes(st, r) for route in self._routes) for r in range(W)]
        buf = self.comm.all_to_all_bytes("input_dist", packer.buffer(self.device), packer.sizes, sizes)
        st.in_readers = readers(buf, sizes, "input_dist")

    def _check_headers(self, st: StepState) -> None:
        for r, row in enumerate(st.hdr_in.tolist()):
            if row[0] != MAGIC or row[1] != int(st.training) or row[2] != st.step:
                mode = lambda tr: "training" if tr else "eval"  # noqa: E731
                raise ShardingError(
                    f"rank {r} is at step {row[2]} ({mode(row[1])}) while rank {st.rank} is at step {st.step} "
                    f"({mode(st.training)}): every rank must run the same sequence of forwards")

    def compute(self, st: StepState) -> None:
        """Stage 2 (owners): find-or-insert the keys every rank asked for; gather rows or pool."""
        if st.training:  # after input_dist checked the batch: a bad batch evicts nothing
            self._evict_expired(st.step)
            st.flight = self._in_flight(st.step)  # owner rows fetched below stay put until backward_step
        st.replies = Packer(self.world_size)
        rds = st.in_readers or [None] * self.world_size
        for route in self._routes:
            route.compute(st, rds, st.replies)
        for rd in st.in_readers or []:
            rd.finish()

    def output_dist(self, st: StepState) -> None:
        """Stage 3: rows and pooled vectors back to the ranks that asked (one byte all-to-all)."""
        rds = [None] * self.world_size
        if st.in_readers is not None and self._exchanges:
            sizes = [sum(route.output_bytes(st, d) for route in self._routes) for d in range(self.world_size)]
            buf = self.comm.all_to_all_bytes("output_dist", st.replies.buffer(self.device), st.replies.sizes, sizes)
            rds = readers(buf, sizes, "output_dist")
        for route in self._routes:
            route.output_dist(st, rds)
        for rd in rds:
            if rd is not None:
                rd.finish()

    @property
    def _has_replicas(self) -> bool:
        return any(isinstance(route, ReplicatedGroup) for route in self._routes)

    def _replicated_tables(self) -> frozenset[int]:
        """Indices of the data-parallel tables."""
        return frozenset(t for route in self._routes if isinstance(route, ReplicatedGroup) for t in route.ts)

    def _read_replicas(self, st: StepState) -> None:
        """The replicated rows of a fetched batch whose read was left for later (``replicas_late``), as now."""
        for route in self._routes:
            if isinstance(route, ReplicatedGroup):
                route.read_replica(st)

    def _pool(self, st: StepState) -> PooledEmbeddings:
        """Local pooling from the received rows / replicas, then the outputs in the unsharded layout."""
        trainable = st.training and any(r is not None for r in self.rules)
        out_l = None
        if st.prep_l is not None:
            if trainable:
                out_l = self._local_pool.lookup(st.prep_l, st.storages_l, st.slots_l, params=[self._inner_anchor],
                                                row_grad_hook=lambda lt, s, g: st.local_grads.__setitem__(lt, (s, g)))
            else:
                out_l = self._local_pool.lookup(st.prep_l, st.storages_l, st.slots_l)
        B = st.batch_size
        groups = []
        for dim, dtype, whole, cols in self._assembly:
            if not cols:
                groups.append(torch.zeros(B, 0, dim, device=self.device))
            elif whole is not None:
                groups.append(out_l.groups()[whole].to(dtype))
            else:
                parts = [out_l[a].to(dtype) if kind == "local" else st.pooled[a][:, k].to(dtype)
                         for kind, a, k in cols]
                groups.append(torch.stack(parts, dim=1))
        unpooled = dict(out_l.unpooled) if out_l is not None else {}
        names = self.lookup.plan.pooled_names()
        if not trainable:
            return PooledEmbeddings(names, groups, self.lookup._where, unpooled)
        keys = list(unpooled)
        st.outputs = groups + [unpooled[k].values for k in keys]
        outs = ExchangeBackward.apply(self, st, self._anchor)
        jagged = {k: JaggedEmbeddings(outs[len(groups) + i], unpooled[k].offsets) for i, k in enumerate(keys)}
        return PooledEmbeddings(names, list(outs[: len(groups)]), self.lookup._where, jagged)

    # -- backward -------------------------------------------------------------------------

    def backward_step(self, st: StepState, grads) -> None:
        """Backward of one step: local per-key gradients, their exchange (grad_dist), owners' updates."""
        tensors, gs = [], []
        for t, g in zip(st.outputs, grads):
            if t.requires_grad and g is not None:
                tensors.append(t)
                gs.append(g)
        if tensors:
            torch.autograd.backward(tensors, gs)  # local lookup backward -> st.local_grads, pooled leaves' .grad
        if self._pipeline is not None:
            # the learning rates of this step, as the synchronous backward would read them now
            st.flight.lrs = {t: self._lr(t) for t in range(len(self.tables)) if self.rules[t] is not None}
            self._pipeline.submit_grads(st)
            return
        self._grad_exchange(st)

    def _grad_exchange(self, st: StepState) -> None:
        """grad_dist and the owners' updates of one step (on the exchange thread under staleness)."""
        self.comm.step = st.step
        packer = Packer(self.world_size)
        for route in self._routes:
            route.grad_dist(st, packer)
        sizes = [sum(route.grad_bytes(st, r) for route in self._routes) for r in range(self.world_size)]
        buf = self.comm.all_to_all_bytes("grad_dist", packer.buffer(self.device), packer.sizes, sizes)
        rds = readers(buf, sizes, "grad_dist")
        for route in self._routes:
            route.apply(st, rds)
        for rd in rds:
            rd.finish()
        st.flight.release_all()
