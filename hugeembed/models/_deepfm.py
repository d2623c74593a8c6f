"""DeepFM (Guo et al. 2017): first-order weights + FM second order + a deep MLP, sharing embeddings."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..functional import PooledEmbeddings
from ..nn import EmbeddingCollection
from ._base import Fields, RecModel, resolve_first_order
from ._layers import MLP, FactorizationMachine, check_dropout, check_sizes

__all__ = ["DeepFM"]


class DeepFM(RecModel):
    """DeepFM: a factorization machine and an MLP over the same field embeddings.

    ::

        logit = bias + <w, dense> + sum_f w_f[id_f]                 first order  (dim-1 tables)
              + sum_{i<j} <v_i, v_j>                                FM second order over the fields
              + MLP(v_1 .. v_n) -> 1                                deep part, same embeddings

    Fields are the embeddings ``v_f`` of the categorical features and, with
    `dense_fields` (default), one per dense feature: ``v_k = x_k * u_k`` with a learned
    vector ``u_k`` (the paper's treatment of continuous fields, as in HugeCTR's DeepFM
    sample), so dense features join the FM and the MLP.  Without it, the MLP reads
    ``[dense, v_1 .. v_F]`` and the FM only the categorical fields.

    The collection holds two kinds of tables (see :func:`deepfm_tables`): embedding
    tables (one common dim D) and first-order tables of dim 1 reading the same
    features -- by default every dim-1 table is first-order.

    Defaults: the paper's Criteo setting, MLP 400-400-400 with ReLU and dropout 0.5.

    Args:
        collection: embedding and first-order tables.
        num_dense: dense features per sample (Criteo: 13; 0 for none).
        first_order: names of the first-order (dim 1) tables; None: every dim-1 table;
            ``()`` for no first-order term on categorical features.
        deep: hidden widths of the MLP (an output layer of width 1 is added).
        dropout: dropout after each hidden layer of the MLP.
        dense_fields: embed dense features as fields (see above).
        device: where the dense layers live (default: the collection's device).

    Example::

        ec = EmbeddingCollection(deepfm_tables(CRITEO_SPARSE_FEATURES, dim=10), optimizer=Adagrad(lr=0.05))
        model = DeepFM(ec)
        logits = model(batch.dense, batch.sparse)                     # [B]
    """

    def __init__(self, collection: EmbeddingCollection, num_dense: int = 13, *,
                 first_order: Sequence[str] | None = None, deep: Sequence[int] = (400, 400, 400),
                 dropout: float = 0.5, dense_fields: bool = True,
                 device: torch.device | str | None = None) -> None:
        super().__init__(collection, num_dense, "DeepFM")
        device = collection.device if device is None else device
        wide, embedding = resolve_first_order(collection, first_order, "DeepFM")
        self.first_order = Fields(collection, wide)
        self.fields = Fields(collection, embedding)
        dim = self.fields.common_dim("DeepFM (the FM term)")
        self.embedding_dim = dim
        self.dense_fields = bool(dense_fields) and self.num_dense > 0
        nd = self.num_dense
        self.bias = nn.Parameter(torch.zeros(1, device=device))
        self.dense_linear = nn.Linear(nd, 1, bias=False, device=device) if nd else None
        if self.dense_fields:
            # small, like the embeddings of deepfm_tables, so the FM term starts near 0
            u = torch.empty(nd, dim, device=device)
            self.dense_embedding = nn.Parameter(u if u.is_meta else nn.init.normal_(u, std=0.01))
            deep_in = (nd + len(self.fields)) * dim
        else:
            self.register_parameter("dense_embedding", None)
            deep_in = nd + len(self.fields) * dim
        self.fm = FactorizationMachine()
        self.deep = MLP(deep_in, check_sizes(deep, "DeepFM deep", allow_empty=False),
                        dropout=check_dropout(dropout, "DeepFM"), device=device)
        self.deep_out = nn.Linear(self.deep.out_features, 1, bias=False, device=device)

    def forward_pooled(self, dense: torch.Tensor, out: PooledEmbeddings) -> torch.Tensor:
        """Logits ``[B]``.

        Args:
            dense: float ``[B, num_dense]``.
            out: the pooled embeddings of the batch (``self.lookup``'s, or a frozen export's).
        """
        v = self.on(self.fields.stacked(out), dense)  # [B, F, D]
        logit = self.bias.expand(dense.shape[0])
        if len(self.first_order):
            logit = logit + self.on(self.first_order.concat(out), dense).sum(dim=1)
        if self.dense_linear is not None:
            logit = logit + self.dense_linear(dense).squeeze(1)
        if self.dense_fields:
            v = torch.cat([dense.unsqueeze(2) * self.dense_embedding, v], dim=1)  # [B, nd + F, D]
            deep_in = v.flatten(1)
        else:
            deep_in = torch.cat([dense, v.flatten(1)], dim=1)
        logit = logit + self.fm(v)
        return logit + self.deep_out(self.deep(deep_in)).squeeze(1)
