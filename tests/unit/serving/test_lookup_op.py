"""The serving lookup op against a plain Python oracle, and row-wise quantization error bounds."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from hugeembed.serving import dequantize, pooled_lookup, quantize


@st.composite
def cases(draw):
    D = 4
    keys = sorted(draw(st.sets(st.integers(0, 1 << 40), min_size=0, max_size=6)))
    shared = draw(st.booleans())  # unknown ids read the shared row, when the table holds one (key -1)
    if draw(st.booleans()):
        keys = [-1, *keys]
    static_rows = draw(st.integers(1, 5))
    B = draw(st.integers(1, 4))
    combiners = draw(st.lists(st.sampled_from([0, 1, 2]), min_size=3, max_size=3))
    pool = keys + [static_rows + 3, (1 << 41) + 7, -1, 0, 1]
    bags = [[draw(st.lists(st.sampled_from(pool), max_size=4)) for _ in range(B)] for _ in range(3)]
    rng = np.random.default_rng(draw(st.integers(0, 1 << 30)))
    dyn = torch.from_numpy(rng.normal(size=(len(keys), D)).astype(np.float32))
    stat = torch.from_numpy(rng.normal(size=(static_rows, D)).astype(np.float32))
    return D, keys, dyn, stat, B, combiners, bags, shared


def oracle(D, keys, dyn, stat, B, combiners, bags, shared, read):
    """Bags pooled one by one: feature 0 and 2 read the dynamic table, feature 1 the static one;
    an unknown id of the dynamic table reads its shared row (key -1) when `shared` and it has one."""
    out = torch.zeros(B, 3, D)
    for f in range(3):
        for b in range(B):
            kept = [i for i in bags[f][b] if i >= 0]
            acc = torch.zeros(D)
            for i in kept:
                if f == 1:
                    acc += read(stat)[i] if i < stat.shape[0] else 0
                elif i in keys:
                    acc += read(dyn)[keys.index(i)]
                elif shared and -1 in keys:
                    acc += read(dyn)[keys.index(-1)]
            n = max(len(kept), 1)
            out[b, f] = acc / {0: 1.0, 1: n, 2: n ** 0.5}[combiners[f]] if kept else acc
    return out


@given(cases(), st.sampled_from(["fp32", "fp16", "int8", "int4"]))
def test_pooled_lookup_matches_the_oracle(case, dtype):
    D, keys, dyn, stat, B, combiners, bags, shared = case
    values = torch.tensor([i for f in bags for bag in f for i in bag], dtype=torch.int64)
    lengths = torch.tensor([len(bag) for f in bags for bag in f])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    # the group's matrix: dynamic table, static table, zero row
    rows = quantize(torch.cat([dyn, stat, torch.zeros(1, D)]), dtype)
    got = pooled_lookup(values, offsets, rows, [torch.tensor(keys, dtype=torch.int64)], [0, -1], [0, stat.shape[0]],
                        [int(shared), 0], [0, 1, 2], [0, 1, 0], combiners, B, D, dtype)

    def read(w):  # what the stored rows hold, as float32
        return dequantize(quantize(w, dtype), dtype, D)

    tol = 1e-5 if dtype == "fp32" else 1e-2
    torch.testing.assert_close(got, oracle(D, keys, dyn, stat, B, combiners, bags, shared, read), atol=tol, rtol=tol)


@given(st.integers(1, 40), st.integers(1, 8).map(lambda h: 2 * h), st.integers(0, 1 << 30),
       st.floats(1e-3, 1e3))
def test_row_wise_quantization_error_is_half_a_step(n, dim, seed, spread):
    """int8: |x - q(x)| <= (max - min) / 255 / 2 per row; int4: / 15 / 2 (+ float16 scale rounding)."""
    w = torch.from_numpy(np.random.default_rng(seed).normal(scale=spread, size=(n, dim)).astype(np.float32))
    span = (w.max(1).values - w.min(1).values)[:, None]
    err8 = (dequantize(quantize(w, "int8"), "int8", dim) - w).abs()
    assert bool((err8 <= span / 255 / 2 * 1.001 + 1e-6 * w.abs().max()).all())
    err4 = (dequantize(quantize(w, "int4"), "int4", dim) - w).abs()
    assert bool((err4 <= span / 15 / 2 * 1.01 + 2e-3 * (w.abs().max(1).values[:, None] + span)).all())
    assert quantize(w, "int8").shape == (n, dim + 8) and quantize(w, "int4").shape == (n, dim // 2 + 4)


def test_the_runtime_names_the_shared_row_key_as_the_tables_do():
    from hugeembed.nn._rare import SHARED_ROW_KEY
    from hugeembed.serving import _runtime
    assert _runtime.SHARED_ROW_KEY == SHARED_ROW_KEY
