"""DCN-v2 (Wang et al. 2021): a cross network and an MLP over [dense, embeddings]."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..functional import PooledEmbeddings
from ..nn import EmbeddingCollection
from ._base import Fields, RecModel
from ._layers import MLP, CrossNetworkV2, check_dropout, check_positive_int, check_sizes

__all__ = ["DCNv2"]

_STRUCTURES = ("stacked", "parallel")


class DCNv2(RecModel):
    """Deep & Cross Network v2: explicit feature crosses of bounded degree, then (or beside) an MLP.

    ::

        x0 = [dense, e_1 .. e_F]                       [B, N],  N = num_dense + sum D
        x_{l+1} = x0 * (W_l x_l + b_l) + x_l           num_cross layers (CrossNetworkV2)

        stacked  (default):  logit = Linear(MLP(cross(x0)))
        parallel          :  logit = Linear([cross(x0), MLP(x0)])

    The paper (Fig. 1) proposes both structures, the better one being data dependent;
    stacked is the default here, as in TF Recommenders' DCN tutorial.
    Tables may have different dims (the input is a concatenation).

    Args:
        collection: the embedding tables (pooled outputs, any dims).
        num_dense: dense features per sample (Criteo: 13; 0 for none).
        num_cross: cross layers (3 by default).
        deep: hidden widths of the MLP (an output layer of width 1 is added); ``()``
            gives the cross network alone.
        structure: ``"stacked"`` or ``"parallel"``.
        low_rank: rank r of ``W_l = U_l V_l^T`` (None: full rank).
        num_experts: a mixture of this many low-rank experts per layer (needs `low_rank`).
        dropout: dropout after each hidden layer of the MLP.
        device: where the dense layers live (default: the collection's device).

    Example::

        ec = EmbeddingCollection(criteo_tables(dim=16), optimizer=Adagrad(lr=0.05))
        model = DCNv2(ec, num_cross=3, deep=(512, 256))
        logits = model(batch.dense, batch.sparse)                     # [B]
    """

    def __init__(self, collection: EmbeddingCollection, num_dense: int = 13, *, num_cross: int = 3,
                 deep: Sequence[int] = (512, 256), structure: str = "stacked", low_rank: int | None = None,
                 num_experts: int = 1, dropout: float = 0.0, device: torch.device | str | None = None) -> None:
        super().__init__(collection, num_dense, "DCNv2")
        if structure not in _STRUCTURES:
            raise ConfigError(f"DCNv2: structure must be one of {_STRUCTURES}, got {structure!r}")
        device = collection.device if device is None else device
        self.structure = structure
        self.fields = Fields(collection)
        n = self.num_dense + self.fields.total_dim
        deep = check_sizes(deep, "DCNv2 deep")
        check_positive_int(num_cross, "DCNv2 num_cross", minimum=0)
        if num_cross == 0 and not deep:
            raise ConfigError("DCNv2: num_cross=0 and deep=() leave nothing but a linear model")
        self.cross = CrossNetworkV2(n, num_cross, low_rank=low_rank, num_experts=num_experts, device=device)
        dropout = check_dropout(dropout, "DCNv2")
        self.deep = MLP(n, deep, dropout=dropout, device=device) if deep else None
        if self.deep is None:
            head_in = n
        else:
            head_in = self.deep.out_features + (n if structure == "parallel" else 0)
        self.head = nn.Linear(head_in, 1, device=device)

    def forward_pooled(self, dense: torch.Tensor, out: PooledEmbeddings) -> torch.Tensor:
        """Logits ``[B]``.

        Args:
            dense: float ``[B, num_dense]``.
            out: the pooled embeddings of the batch (``self.lookup``'s, or a frozen export's).
        """
        x0 = torch.cat([dense, self.on(self.fields.concat(out), dense)], dim=1)
        crossed = self.cross(x0)
        if self.deep is None:
            h = crossed
        elif self.structure == "stacked":
            h = self.deep(crossed)
        else:
            h = torch.cat([crossed, self.deep(x0)], dim=1)
        return self.head(h).squeeze(1)
