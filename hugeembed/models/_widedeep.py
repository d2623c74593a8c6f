"""Wide & Deep (Cheng et al. 2016): a linear model and an MLP, trained jointly."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..functional import PooledEmbeddings
from ..nn import EmbeddingCollection
from ._base import Fields, RecModel, resolve_first_order
from ._layers import MLP, check_dropout, check_sizes

__all__ = ["WideAndDeep", "WIDE_AND_DEEP_PAPER_DEEP"]

WIDE_AND_DEEP_PAPER_DEEP: tuple[int, ...] = (1024, 512, 256)
"""The deep part of the paper (Google Play; 32-dim embeddings): ``WideAndDeep(ec, deep=WIDE_AND_DEEP_PAPER_DEEP)``."""


class WideAndDeep(RecModel):
    """Wide & Deep: logistic regression on sparse ids (wide) plus an MLP on embeddings (deep).

    ::

        wide : bias + <w, dense> + sum_f w_f[id_f]        dim-1 tables: one weight per id
        deep : MLP([dense, e_1 .. e_F]) -> 1              embedding tables (any dims), ReLU
        logit = wide + deep                               one loss: trained jointly

    The wide tables may read other features than the deep ones: the paper's wide part
    adds cross-product features (e.g. ``"installed_app x impression_app"``), which are
    just more sparse features of the batch read by wide-only tables.  The paper trains
    the wide part with FTRL + L1 and the deep part with AdaGrad: give the wide tables
    ``optimizer=FTRL(...)`` in their TableConfig (``first_order_optimizer`` of
    :func:`wide_and_deep_tables`).

    Defaults: a small MLP ``(256, 128)``, cheap in tests and benchmarks;
    :data:`WIDE_AND_DEEP_PAPER_DEEP` = ``(1024, 512, 256)`` is the paper's.

    Args:
        collection: embedding tables and wide (dim 1) tables.
        num_dense: dense features per sample (Criteo: 13; 0 for none).
        wide: names of the wide (dim 1) tables; None: every dim-1 table.
        deep: hidden widths of the MLP (an output layer of width 1 is added).
        dropout: dropout after each hidden layer of the MLP.
        device: where the dense layers live (default: the collection's device).

    Example::

        ec = EmbeddingCollection(wide_and_deep_tables(CRITEO_SPARSE_FEATURES, dim=32),
                                 optimizer=Adagrad(lr=0.05))
        model = WideAndDeep(ec)
        logits = model(batch.dense, batch.sparse)                     # [B]
    """

    def __init__(self, collection: EmbeddingCollection, num_dense: int = 13, *,
                 wide: Sequence[str] | None = None, deep: Sequence[int] = (256, 128), dropout: float = 0.0,
                 device: torch.device | str | None = None) -> None:
        super().__init__(collection, num_dense, "WideAndDeep")
        device = collection.device if device is None else device
        wide_tables, embedding = resolve_first_order(collection, wide, "WideAndDeep")
        self.wide_fields = Fields(collection, wide_tables)
        self.fields = Fields(collection, embedding)
        nd = self.num_dense
        self.bias = nn.Parameter(torch.zeros(1, device=device))
        self.dense_linear = nn.Linear(nd, 1, bias=False, device=device) if nd else None
        self.deep = MLP(nd + self.fields.total_dim, check_sizes(deep, "WideAndDeep deep", allow_empty=False),
                        dropout=check_dropout(dropout, "WideAndDeep"), device=device)
        self.deep_out = nn.Linear(self.deep.out_features, 1, bias=False, device=device)

    def forward_pooled(self, dense: torch.Tensor, out: PooledEmbeddings) -> torch.Tensor:
        """Logits ``[B]``.

        Args:
            dense: float ``[B, num_dense]``.
            out: the pooled embeddings of the batch (``self.lookup``'s, or a frozen export's).
        """
        logit = self.bias.expand(dense.shape[0])
        if len(self.wide_fields):
            logit = logit + self.on(self.wide_fields.concat(out), dense).sum(dim=1)
        if self.dense_linear is not None:
            logit = logit + self.dense_linear(dense).squeeze(1)
        x = torch.cat([dense, self.on(self.fields.concat(out), dense)], dim=1)
        return logit + self.deep_out(self.deep(x)).squeeze(1)
