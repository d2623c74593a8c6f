"""A training lookup's gradient rows on the triton kernels (a plain row hook, no fused optimizer): each
unique row summed from the triton prepare's runs (functional/_triton_backward.gradient_rows_triton)
equals the torch reference's index_add, for every combiner, weights, two dims, max_norm, hot rows
split across programs, programs in any order; and the torch path's [ids, D] product is never made."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed._triton._grid import shuffled_programs
from hugeembed.features import SparseFeatures
from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec
from hugeembed.functional import _lookup_run

from ._batches import COMBINERS, DEV

pytestmark = pytest.mark.triton


def _rows_by_hook(backend: str, tables, feats, sf, weights, grad):
    """{table: (slots, gradient rows)} the row hook receives in one backward."""
    lookup = FusedEmbeddingLookup(tables, feats, backend=backend)
    prep = lookup.prepare(sf, weights)
    got = {}
    anchor = torch.zeros(0, requires_grad=True, device=sf.device)
    out = lookup.lookup(prep, weights, lookup.static_slots(prep), params=[anchor],
                        row_grad_hook=lambda t, slots, g: got.__setitem__(t, (slots.clone(), g.clone())))
    sum((out[name] * g).sum() for name, g in grad.items()).backward()
    return got


@st.composite
def cases(draw):
    dims = draw(st.sampled_from([(4,), (4, 8)]))
    T = draw(st.integers(1, 3))
    tables = [TableSpec(f"t{i}", dims[i % len(dims)], num_rows=draw(st.integers(1, 5)),
                        max_norm=draw(st.sampled_from([None, None, 0.5]))) for i in range(T)]
    feats = [FeatureSpec(f"f{i}", f"t{i}", combiner=draw(st.sampled_from(COMBINERS))) for i in range(T)]
    B = draw(st.integers(1, 4))
    lengths = [draw(st.integers(0, 4)) for _ in range(T * B)]
    values = [draw(st.integers(0, tables[k // B].num_rows - 1)) for k, n in enumerate(lengths) for _ in range(n)]
    weighted = draw(st.booleans())
    w = torch.tensor([draw(st.floats(0.25, 2.0)) for _ in values], dtype=torch.float32) if weighted else None
    sf = SparseFeatures([f.name for f in feats], torch.tensor(values, dtype=torch.int64),
                        lengths=torch.tensor(lengths), weights=w, batch_size=B)
    return tables, feats, sf.to(DEV)


def _weights(tables, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.num_rows, t.dim, generator=g).to(DEV) for t in tables]


def _grad(tables, feats, B, seed=1):
    """Each pooled output's gradient, by feature."""
    g = torch.Generator().manual_seed(seed)
    dim = {t.name: t.dim for t in tables}
    return {f.name: torch.randn(B, dim[f.table], generator=g).to(DEV) for f in feats}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for t in want:
        assert torch.equal(got[t][0], want[t][0]), t
        torch.testing.assert_close(got[t][1], want[t][1], rtol=1e-6, atol=1e-6)


@pytest.fixture
def no_torch_rows(monkeypatch):
    """The torch path's gradient rows (its [ids, D] product) must not run."""
    def refuse(*args, **kwargs):
        raise AssertionError("gradient_rows_torch ran on the triton backend")

    monkeypatch.setattr(_lookup_run, "gradient_rows_torch", refuse)


@settings(max_examples=20, deadline=None)
@given(cases())
def test_gradient_rows_equal_the_torch_reference(case):
    tables, feats, sf = case
    weights = _weights(tables)
    grad = _grad(tables, feats, sf.batch_size)
    want = _rows_by_hook("torch", tables, feats, sf, weights, grad)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_lookup_run, "gradient_rows_torch", lambda *a, **k: pytest.fail("torch gradient rows ran"))
        got = _rows_by_hook("triton", tables, feats, sf, weights, grad)
    _assert_same(got, want)


def test_hot_rows_split_across_programs_in_any_order(no_torch_rows):
    """Row 0 read 150 times (3 chunks of 64: partial sums added in order), weighted mean bags."""
    tables = [TableSpec("a", 4, num_rows=3), TableSpec("b", 8, num_rows=2)]
    feats = [FeatureSpec("x", "a", combiner="mean"), FeatureSpec("y", "b", combiner="sqrtn")]
    B = 50
    values = torch.cat([torch.zeros(150, dtype=torch.int64), torch.tensor([1, 0] * 25)])
    lengths = torch.tensor([3] * B + [1] * B)
    w = torch.linspace(0.5, 1.5, values.numel())
    sf = SparseFeatures(["x", "y"], values, lengths=lengths, weights=w).to(DEV)
    weights, grad = _weights(tables), _grad(tables, feats, B)
    got = _rows_by_hook("triton", tables, feats, sf, weights, grad)
    with shuffled_programs(7):
        shuffled = _rows_by_hook("triton", tables, feats, sf, weights, grad)
    _assert_same(shuffled, got)
    # the oracle, written here: each row's sum of grad[b, k] * w / denom over its ids, in batch order
    for t, (f, dim) in enumerate([("x", 4), ("y", 8)]):
        slots, rows = got[t]
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        expect = torch.zeros(tables[t].num_rows, dim, dtype=torch.float64)
        k = t  # feature k reads table k
        for b in range(B):
            lo, hi = int(offs[k * B + b]), int(offs[k * B + b + 1])
            ws = w[lo:hi].double()
            den = ws.sum() if f == "x" else ws.pow(2).sum().sqrt()
            for i in range(lo, hi):
                expect[int(values[i])] += grad[f][b].cpu().double() * (ws[i - lo] / den)
        torch.testing.assert_close(rows.cpu().double(), expect[slots.cpu()], rtol=1e-5, atol=1e-5)
