"""Dense layers against their formulas written out with loops (float64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hugeembed import ConfigError, InputError
from hugeembed.models import MLP, CrossNetworkV2, DotInteraction, FactorizationMachine

f64 = torch.float64


# -- MLP ------------------------------------------------------------------------------


@pytest.mark.parametrize("final_activation", [True, False])
def test_mlp_is_linear_relu_stack(device, final_activation):
    mlp = MLP(5, (7, 3), final_activation=final_activation, device=device).to(f64)
    x = torch.randn(4, 5, dtype=f64, device=device)
    l1, l2 = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    h = torch.clamp(x @ l1.weight.t() + l1.bias, min=0)
    want = h @ l2.weight.t() + l2.bias
    want = torch.clamp(want, min=0) if final_activation else want
    torch.testing.assert_close(mlp(x), want)
    assert (mlp.in_features, mlp.out_features) == (5, 3)


def test_mlp_dropout_after_each_relu_only_in_training():
    mlp = MLP(6, (8, 8, 1), final_activation=False, dropout=0.5)
    kinds = [type(m).__name__ for m in mlp.net]
    assert kinds == ["Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout", "Linear"]
    x = torch.randn(64, 6)
    assert not torch.equal(mlp(x), mlp(x))  # training: dropout masks differ
    mlp.eval()
    assert torch.equal(mlp(x), mlp(x))


@pytest.mark.parametrize("bad", [dict(sizes=()), dict(sizes=(4, 0)), dict(sizes=(4, 2.5)), dict(sizes=4),
                                 dict(dropout=1.0), dict(dropout=-0.1), dict(in_features=0)])
def test_mlp_bad_config(bad):
    args = dict(in_features=3, sizes=(4,), dropout=0.0) | bad
    with pytest.raises(ConfigError):
        MLP(args["in_features"], args["sizes"], dropout=args["dropout"])


# -- DotInteraction -------------------------------------------------------------------


def dot_interaction_oracle(dense, sparse, self_interaction):
    """Explicit loops: every pair i < j (i <= j with self interaction) of [dense, e_1 .. e_F], row by row."""
    B, F, D = sparse.shape
    vectors = [dense] + [sparse[:, f] for f in range(F)]
    cols = [dense[:, d] for d in range(D)]
    for i in range(F + 1):
        for j in range(i if self_interaction else i + 1, F + 1):
            cols.append(sum(vectors[i][:, d] * vectors[j][:, d] for d in range(D)))
    return torch.stack(cols, dim=1)


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize("F", [0, 1, 5])
def test_dot_interaction_matches_pairwise_dots(device, F, self_interaction):
    B, D = 3, 4
    layer = DotInteraction(F, self_interaction=self_interaction, device=device)
    dense = torch.randn(B, D, dtype=f64, device=device)
    sparse = torch.randn(B, F, D, dtype=f64, device=device)
    got = layer(dense, sparse)
    pairs = (F + 1) * F // 2 + (F + 1 if self_interaction else 0)
    assert got.shape == (B, D + pairs) and layer.output_dim(D) == D + pairs
    torch.testing.assert_close(got, dot_interaction_oracle(dense, sparse, self_interaction))


def test_dot_interaction_rejects_wrong_shapes():
    layer = DotInteraction(3)
    with pytest.raises(InputError, match=r"\[B=2, F=3, D=4\]"):
        layer(torch.randn(2, 4), torch.randn(2, 2, 4))
    with pytest.raises(InputError):
        layer(torch.randn(2, 4), torch.randn(2, 3, 5))


# -- FactorizationMachine -------------------------------------------------------------


@given(B=st.integers(1, 4), F=st.integers(0, 6), D=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fm_equals_sum_over_pairs(B, F, D, seed):
    v = torch.randn(B, F, D, dtype=f64, generator=torch.Generator().manual_seed(seed))
    want = torch.zeros(B, dtype=f64)
    for i in range(F):
        for j in range(i + 1, F):
            want += (v[:, i] * v[:, j]).sum(dim=1)
    torch.testing.assert_close(FactorizationMachine()(v), want)


def test_fm_gradient_matches_pairwise_form():
    v = torch.randn(2, 4, 3, dtype=f64, requires_grad=True)
    FactorizationMachine()(v).sum().backward()
    # d/dv_i sum_{j<k} <v_j, v_k> = sum_{j != i} v_j
    want = v.detach().sum(dim=1, keepdim=True) - v.detach()
    torch.testing.assert_close(v.grad, want)


# -- CrossNetworkV2 -------------------------------------------------------------------


def test_cross_full_rank_one_layer_is_the_formula(device):
    net = CrossNetworkV2(6, 1, device=device).to(f64)
    with torch.no_grad():
        net.bias.normal_()  # zero at init: make it count
    x0 = torch.randn(5, 6, dtype=f64, device=device)
    W, b = net.W[0], net.bias[0]
    want = torch.stack([
        torch.stack([x0[n, i] * (sum(W[i, j] * x0[n, j] for j in range(6)) + b[i]) + x0[n, i] for i in range(6)])
        for n in range(5)])
    torch.testing.assert_close(net(x0), want)


def test_cross_layers_recurse_on_x0():
    net = CrossNetworkV2(4, 3).to(f64)
    with torch.no_grad():
        net.bias.normal_()
    x0 = torch.randn(3, 4, dtype=f64)
    x = x0
    for l in range(3):
        x = x0 * (x @ net.W[l].t() + net.bias[l]) + x
    torch.testing.assert_close(net(x0), x)


def test_cross_low_rank_is_full_rank_with_w_equal_uv():
    net = CrossNetworkV2(5, 2, low_rank=2).to(f64)
    full = CrossNetworkV2(5, 2).to(f64)
    with torch.no_grad():
        net.bias.normal_()
        full.bias.copy_(net.bias)
        for l in range(2):
            full.W[l] = net.U[l, 0] @ net.V[l, 0]  # W = U V^T with V stored as [r, N]
    x0 = torch.randn(4, 5, dtype=f64)
    torch.testing.assert_close(net(x0), full(x0))
    assert net.U.shape == (2, 1, 5, 2) and net.V.shape == (2, 1, 2, 5)


def test_cross_mixture_of_experts_matches_loop_formula():
    N, L, K, r = 4, 2, 3, 2
    net = CrossNetworkV2(N, L, low_rank=r, num_experts=K).to(f64)
    with torch.no_grad():
        net.bias.normal_()
    x0 = torch.randn(3, N, dtype=f64)
    relu = torch.relu
    x = x0
    for l in range(L):
        nxt = []
        for n in range(x0.shape[0]):
            gates = torch.softmax(torch.stack([net.gate[l, i] @ x[n] for i in range(K)]), dim=0)
            mix = sum(gates[i] * x0[n] * (net.U[l, i] @ relu(net.C[l, i] @ relu(net.V[l, i] @ x[n])) + net.bias[l])
                      for i in range(K))
            nxt.append(mix + x[n])
        x = torch.stack(nxt)
    torch.testing.assert_close(net(x0), x)


def test_cross_init_xavier_weights_zero_bias():
    net = CrossNetworkV2(300, 2)
    assert torch.count_nonzero(net.bias) == 0
    std = float(net.W.detach().std())
    assert abs(std - (2 / 600) ** 0.5) < 0.1 * (2 / 600) ** 0.5  # xavier normal: sqrt(2 / (fan_in + fan_out))


def test_cross_bad_config_and_input():
    with pytest.raises(ConfigError, match="needs low_rank"):
        CrossNetworkV2(4, 2, num_experts=2)
    with pytest.raises(ConfigError):
        CrossNetworkV2(4, 2, low_rank=0)
    with pytest.raises(InputError, match=r"\[B, 4\]"):
        CrossNetworkV2(4, 1)(torch.randn(2, 5))


# -- meta device ------------------------------------------------------------------------


def test_layers_on_meta_device():
    B = 7
    assert MLP(5, (8, 2), device="meta")(torch.empty(B, 5, device="meta")).shape == (B, 2)
    out = DotInteraction(3, device="meta")(torch.empty(B, 4, device="meta"), torch.empty(B, 3, 4, device="meta"))
    assert out.shape == (B, 4 + 6) and out.is_meta
    assert FactorizationMachine()(torch.empty(B, 3, 4, device="meta")).shape == (B,)
    for kw in (dict(), dict(low_rank=2), dict(low_rank=2, num_experts=3)):
        net = CrossNetworkV2(6, 2, device="meta", **kw)
        assert all(p.is_meta for p in net.parameters())
        assert net(torch.empty(B, 6, device="meta")).shape == (B, 6)


def test_mlp_sizes_from_any_iterable():
    assert MLP(3, (w for w in (4, 2))).out_features == 2  # a generator is read once, not consumed by the check
    assert MLP(3, range(5, 7)).out_features == 6
