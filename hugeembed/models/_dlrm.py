"""DLRM (Naumov et al. 2019): bottom MLP on dense features, dot interaction, top MLP."""

from __future__ import annotations

from typing import Sequence

import torch

from torch import nn

from ..errors import ConfigError
from ..functional import PooledEmbeddings
from ..nn import EmbeddingCollection
from ._base import Fields, RecModel, resolve_first_order
from ._counts import COUNT_COLUMNS
from ._layers import MLP, DotInteraction, check_dropout, check_sizes

__all__ = ["DLRM"]


class DLRM(RecModel):
    """Deep Learning Recommendation Model: dense and sparse features meet in pairwise dot products.

    ::

        dense [B, 13] ─ bottom MLP 13-512-256-D ─► d [B, D] ─┐
        sparse ─ EmbeddingCollection ─► e_1..e_F [B, F, D] ──┴─ DotInteraction ─► [B, D + (F+1)F/2]
                                                                   ─ top MLP 512-512-256-1 ─► logits [B]

    Every table must have the same dim D: the bottom MLP ends in D so that ``d`` is one
    more field of the interaction.  ReLU follows every bottom layer (as in the reference
    implementation and TorchRec's DenseArch) and every top layer but the last.

    Defaults: TorchRec's DLRM example on Criteo (``dense_arch_layer_sizes`` 512,256,D;
    ``over_arch_layer_sizes`` 512,512,256,1).  MLPerf's Criteo-Terabyte DLRM uses D = 128,
    ``bottom_mlp=(512, 256)`` and ``top_mlp=(1024, 1024, 512, 256)``.

    Args:
        collection: the embedding tables (pooled outputs, one common dim D).
        num_dense: dense features per sample (Criteo: 13); 0: the dense field of the interaction is
            a learned vector (data without dense columns).
        bottom_mlp: hidden widths of the bottom MLP (its last layer, of width D, is added).
        top_mlp: hidden widths of the top MLP (its last layer, of width 1, is added).
        self_interaction: keep the ``<t_i, t_i>`` terms too (DLRM ``--arch-interaction-itself``).
        first_order: names of dim-1 tables (:func:`~hugeembed.models.first_order_tables`) whose
            pooled weights are added to the logit: a per-id bias, as Wide&Deep's and DeepFM's
            first-order term, beside the interaction (which then reads the other tables).
        dropout: dropout probability after each hidden layer of the top MLP (0: none).
        counts: names of click-count tables (:func:`~hugeembed.models.click_count_tables`): the first
            column of each (an id's smoothed click log-odds, counted from earlier rows) is added to the
            logit with a weight per table (1 at first) and an intercept (0 at first), ``count_fit``, which
            :class:`~hugeembed.models.ClickCountUpdater` fits by Newton's method on each training batch
            (hugeembed/models/_count_fit.py); it writes their rows too; the run's rows and clicks are
            ``count_rows``.
        device: where the dense layers live (default: the collection's device).

    Example::

        tables = criteo_tables(dim=64)
        model = DLRM(EmbeddingCollection(tables, optimizer=RowWiseAdagrad(lr=0.05)))
        logits = model(batch.dense, batch.sparse)                   # [B]
        opt = torch.optim.Adagrad(model.dense_parameters(), lr=0.05)
    """

    def __init__(self, collection: EmbeddingCollection, num_dense: int = 13, *,
                 bottom_mlp: Sequence[int] = (512, 256), top_mlp: Sequence[int] = (512, 512, 256),
                 self_interaction: bool = False, first_order: Sequence[str] = (), dropout: float = 0.0,
                 counts: Sequence[str] = (), device: torch.device | str | None = None) -> None:
        super().__init__(collection, num_dense, "DLRM")
        device = collection.device if device is None else device
        first_order = (first_order,) if isinstance(first_order, str) else tuple(first_order)
        wide, deep = resolve_first_order(collection, first_order, "DLRM") if first_order else \
            (set(), {t.name for t in collection.tables})
        self.first_order = Fields(collection, wide) if wide else None
        counts = (counts,) if isinstance(counts, str) else tuple(counts)
        self.counts = self._count_fields(collection, counts) if counts else None
        deep = deep - set(counts)
        self.fields = Fields(collection, deep)
        dim = self.fields.common_dim("DLRM (the dot interaction)")
        self.embedding_dim = dim
        sizes = (*check_sizes(bottom_mlp, "DLRM bottom_mlp"), dim)
        # without dense features the dense field is a learned vector: its dot products with the
        # embeddings are one learned linear term per field, as the bottom MLP of a constant input gives
        self.bottom = MLP(self.num_dense, sizes, device=device) if self.num_dense else ConstantField(dim, device)
        self.interaction = DotInteraction(len(self.fields), self_interaction=self_interaction, device=device)
        self.top = MLP(self.interaction.output_dim(dim), (*check_sizes(top_mlp, "DLRM top_mlp"), 1),
                       final_activation=False, dropout=check_dropout(dropout, "DLRM"), device=device)
        if self.counts is not None:
            # [intercept, one weight per feature]: counting's own sum at first; fitted by Newton's method on
            # each training batch (not by the dense optimizer: _count_fit.py), with its running Hessian
            self.register_buffer("count_fit", torch.cat([torch.zeros(1), torch.ones(len(self.counts))]).to(device))
            self.register_buffer("count_hessian", torch.zeros(len(self.counts) + 1, len(self.counts) + 1,
                                                              dtype=torch.float64, device=device))
            # the count log-odds the last training forward read ([B, F]): the fit's inputs
            self.count_inputs: torch.Tensor | None = None
            # rows and clicks counted in this pass (the prior's click rate): saved with the dense state
            self.register_buffer("count_rows", torch.zeros(2, dtype=torch.float64, device=device))
            # the run's end: a shift of the logit out of training (evaluation, export, serving) that makes the final
            # model's mean prediction on its training rows their click rate (ClickCountUpdater.calibrate); kept
            # apart from count_fit so that a run resumed past the end trains as the straight run
            self.register_buffer("count_shift", torch.zeros(1, device=device))
            self.optional_buffers = ("count_shift",)  # snapshots and artifacts before it load with 0 (no shift)

    @staticmethod
    def _count_fields(collection: EmbeddingCollection, counts: tuple[str, ...]) -> Fields:
        dims = {t.name: t.dim for t in collection.tables}
        unknown = sorted(set(counts) - set(dims))
        if unknown:
            raise ConfigError(f"DLRM: click-count tables {unknown} are not in the collection; tables: {list(dims)}")
        wrong = {n: dims[n] for n in counts if dims[n] != COUNT_COLUMNS}
        if wrong:
            raise ConfigError(f"DLRM: click-count tables hold {COUNT_COLUMNS} columns per id, got dims {wrong}")
        return Fields(collection, counts)

    def forward_pooled(self, dense: torch.Tensor, out: PooledEmbeddings) -> torch.Tensor:
        """Logits ``[B]`` (apply a sigmoid for probabilities).

        Args:
            dense: float ``[B, num_dense]``.
            out: the pooled embeddings of the batch (``self.lookup``'s, or a frozen export's).
        """
        d = self.bottom(dense)
        e = self.on(self.fields.stacked(out), d)
        logit = self.top(self.interaction(d, e)).squeeze(1)
        if self.first_order is not None:
            logit = logit + self.on(self.first_order.concat(out), d).sum(dim=1)
        if self.counts is not None:  # column 0 of each count table: the ids' smoothed click log-odds
            s = self.on(self.counts.concat(out), d).unflatten(1, (len(self.counts), COUNT_COLUMNS))[:, :, 0]
            if self.training:
                self.count_inputs = s.detach()
            fit = self.count_fit.to(s)
            logit = logit + s @ fit[1:] + fit[0]
            if not self.training:
                logit = logit + self.count_shift.to(s)
        return logit


class ConstantField(nn.Module):
    """The dense field of a DLRM without dense features: one learned vector ``[D]`` for every sample."""

    def __init__(self, dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.vector = nn.Parameter(torch.empty(dim).uniform_(-0.05, 0.05).to(device))

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.vector.unsqueeze(0).expand(dense.shape[0], -1)
