"""Dense building blocks of the models: MLP, DLRM's dot interaction, the FM term, DCN-v2's cross network.

Plain PyTorch; every module takes ``device=`` (``"meta"`` works, for shape checks).
Shape letters: B batch, F fields (feature vectors), D embedding dim, N features of a flat input.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import ConfigError, InputError

__all__ = ["MLP", "DotInteraction", "FactorizationMachine", "CrossNetworkV2"]


def check_sizes(sizes: Sequence[int], who: str, *, allow_empty: bool = True) -> tuple[int, ...]:
    """Layer widths as a tuple of positive ints, or ConfigError naming `who`."""
    try:
        out = tuple(sizes) if not isinstance(sizes, (str, bytes)) else None
    except TypeError:  # not iterable: a bare int
        out = None
    if out is None or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in out):
        raise ConfigError(f"{who}: layer sizes must be a sequence of positive ints, got {sizes!r}")
    if not out and not allow_empty:
        raise ConfigError(f"{who}: needs at least one layer")
    return out


def check_positive_int(value: object, who: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{who} must be an int >= {minimum}, got {value!r}")
    return value


def check_dropout(p: object, who: str) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ConfigError(f"{who}: dropout must be a float in [0, 1), got {p!r}")
    return float(p)


class MLP(nn.Module):
    """A stack of Linear layers with ReLU between them.

    Args:
        in_features: N, width of the input ``[B, N]``.
        sizes: output width of each Linear layer, e.g. ``(512, 256, 64)``.
        final_activation: apply ReLU after the last layer too (True for DLRM's bottom
            MLP and hidden stacks; False for a layer that produces logits).
        dropout: dropout probability after each ReLU (so never after a logit layer).
        device: where the weights live.

    Example::

        mlp = MLP(13, (512, 256, 64))          # 13-512-256-64, ReLU after each layer
        mlp(torch.randn(8, 13)).shape          # torch.Size([8, 64])
    """

    def __init__(self, in_features: int, sizes: Sequence[int], *, final_activation: bool = True,
                 dropout: float = 0.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        in_features = check_positive_int(in_features, "MLP in_features")
        sizes = check_sizes(sizes, "MLP", allow_empty=False)
        dropout = check_dropout(dropout, "MLP")
        layers: list[nn.Module] = []
        prev = in_features
        for i, width in enumerate(sizes):
            layers.append(nn.Linear(prev, width, device=device))
            last = i == len(sizes) - 1
            if not last or final_activation:
                layers.append(nn.ReLU())
                if dropout > 0:
                    layers.append(nn.Dropout(dropout))
            prev = width
        self.net = nn.Sequential(*layers)
        self.in_features = in_features
        self.out_features = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DotInteraction(nn.Module):
    """DLRM's interaction: pairwise dot products of the dense vector and the embeddings.

    The ``1 + F`` vectors ``[d, e_1 .. e_F]`` (each of dim D) give the Gram matrix
    ``Z = T T^T``; its upper triangle without the diagonal (with it if
    `self_interaction`) is flattened row by row and concatenated after ``d``::

        T = [d, e_1, e_2]          Z = | . z01 z02 |      out = [d, z01, z02, z12]
                                       |     .  z12 |            [B, D + 3]
                                       |         .  |

    Args:
        num_sparse: F, embeddings per sample.
        self_interaction: also keep the diagonal ``<t_i, t_i>`` (DLRM's
            ``--arch-interaction-itself``).

    Shapes: ``forward(dense [B, D], sparse [B, F, D]) -> [B, D + P]`` with
    ``P = (F + 1) F / 2`` (or ``(F + 1)(F + 2) / 2`` with self interaction).
    """

    def __init__(self, num_sparse: int, *, self_interaction: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_sparse = check_positive_int(num_sparse, "DotInteraction num_sparse", minimum=0)
        self.self_interaction = bool(self_interaction)
        n = self.num_sparse + 1
        rows, cols = torch.triu_indices(n, n, offset=0 if self.self_interaction else 1)
        # flat positions in the [n, n] Gram matrix: one gather instead of two-index fancy indexing
        self.register_buffer("flat_index", (rows * n + cols).to(device), persistent=False)

    @property
    def num_pairs(self) -> int:
        return int(self.flat_index.numel())

    def output_dim(self, dim: int) -> int:
        """Width of the output for embedding dim D."""
        return dim + self.num_pairs

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        B, D = dense.shape
        if sparse.dim() != 3 or sparse.shape[0] != B or sparse.shape[1] != self.num_sparse or sparse.shape[2] != D:
            raise InputError(f"DotInteraction: sparse must be [B={B}, F={self.num_sparse}, D={D}], "
                             f"got {tuple(sparse.shape)}")
        t = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # [B, F + 1, D]
        gram = torch.bmm(t, t.transpose(1, 2))  # [B, F + 1, F + 1]
        pairs = gram.flatten(1).index_select(1, self.flat_index)
        return torch.cat([dense, pairs], dim=1)


class FactorizationMachine(nn.Module):
    """The FM second-order term: the sum over field pairs i < j of ``<v_i, v_j>``.

    Computed in O(F D) with Rendle's identity
    ``sum_{i<j} <v_i, v_j> = 0.5 * sum_d ((sum_i v_id)^2 - sum_i v_id^2)``.

    Shapes: ``forward(v [B, F, D]) -> [B]``.

    Example::

        fm = FactorizationMachine()
        v = torch.randn(4, 26, 10)     # 26 field embeddings of dim 10
        fm(v).shape                     # torch.Size([4])
    """

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if v.dim() != 3:
            raise InputError(f"FactorizationMachine: input must be [B, F, D], got {tuple(v.shape)}")
        square_of_sum = v.sum(dim=1).square()  # [B, D]
        sum_of_squares = v.square().sum(dim=1)  # [B, D]
        return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1)


class CrossNetworkV2(nn.Module):
    """DCN-v2's cross network: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l`` for l = 0 .. L-1.

    Three forms of ``W_l`` (Wang et al. 2021, "DCN V2", eqs. 1 and 3):

    * full rank (``low_rank=None``): ``W_l`` is ``[N, N]``;
    * low rank (``low_rank=r``): ``W_l = U_l V_l^T`` with ``U_l, V_l`` of ``[N, r]``;
    * mixture of low-rank experts (``low_rank=r, num_experts=K > 1``)::

          x_{l+1} = sum_i G_i(x_l) * E_i(x_l) + x_l
          E_i(x)  = x_0 * (U_li g(C_li g(V_li^T x)) + b_l)     g = ReLU, C_li: [r, r]
          G(x)    = softmax_i(g_i^T x)                          (a linear gate per expert)

    Args:
        in_features: N, width of ``x_0`` ``[B, N]``.
        num_layers: L cross layers.
        low_rank: r, or None for full-rank layers.
        num_experts: K experts per layer (needs `low_rank`).

    Weights are Xavier-normal and biases zero (as TorchRec's CrossNet).

    Shapes: ``forward(x0 [B, N]) -> [B, N]``.
    """

    def __init__(self, in_features: int, num_layers: int, *, low_rank: int | None = None, num_experts: int = 1,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = check_positive_int(in_features, "CrossNetworkV2 in_features")
        self.num_layers = check_positive_int(num_layers, "CrossNetworkV2 num_layers", minimum=0)
        self.num_experts = check_positive_int(num_experts, "CrossNetworkV2 num_experts")
        if low_rank is not None:
            check_positive_int(low_rank, "CrossNetworkV2 low_rank")
        elif self.num_experts > 1:
            raise ConfigError("CrossNetworkV2: a mixture of experts (num_experts > 1) needs low_rank")
        self.low_rank = low_rank
        N, L, K = self.in_features, self.num_layers, self.num_experts

        def param(*shape: int) -> nn.Parameter:
            w = torch.empty(*shape, device=device)
            if w.device.type != "meta":
                # xavier over the last two dims: fan_in / fan_out of one [out, in] matrix
                for m in w.view(-1, shape[-2], shape[-1]):
                    nn.init.xavier_normal_(m)
            return nn.Parameter(w)

        self.bias = nn.Parameter(torch.zeros(L, N, device=device))
        if low_rank is None:
            self.W = param(L, N, N)
        else:
            r = low_rank
            self.V = param(L, K, r, N)  # [r, N] per (layer, expert): x -> V x
            self.U = param(L, K, N, r)
            if K > 1:
                self.C = param(L, K, r, r)
                self.gate = param(L, K, N)  # one linear gate (no bias) per expert

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        if x0.dim() != 2 or x0.shape[1] != self.in_features:
            raise InputError(f"CrossNetworkV2: input must be [B, {self.in_features}], got {tuple(x0.shape)}")
        x = x0
        for l in range(self.num_layers):
            if self.low_rank is None:
                x = x0 * (x @ self.W[l].t() + self.bias[l]) + x
            elif self.num_experts == 1:
                x = x0 * ((x @ self.V[l, 0].t()) @ self.U[l, 0].t() + self.bias[l]) + x
            else:
                h = torch.relu(torch.einsum("bn,krn->bkr", x, self.V[l]))  # [B, K, r]
                h = torch.relu(torch.einsum("bkr,kqr->bkq", h, self.C[l]))  # [B, K, r]
                e = torch.einsum("bkr,knr->bkn", h, self.U[l]) + self.bias[l]  # [B, K, N]
                experts = x0.unsqueeze(1) * e  # [B, K, N]
                g = torch.softmax(x @ self.gate[l].t(), dim=1)  # [B, K]
                x = (g.unsqueeze(2) * experts).sum(dim=1) + x
        return x
