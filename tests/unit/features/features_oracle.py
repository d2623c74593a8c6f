"""Plain-Python oracles and hypothesis strategies for the SparseFeatures tests.

A batch is described as ``{name: [[ids of sample 0], [ids of sample 1], ...]}`` (plus the
same shape of weights); everything the tests compare against is built from that with
list operations only, never with the code under test.
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# the `device` fixture is immutable, so reusing it across hypothesis examples is safe
device_settings = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
)

NAMES = ["user", "item", "ctx", "tags", "geo"]


def flat(batch: dict[str, list[list]], keys=None) -> tuple[list, list[int]]:
    """Feature-major flat values and lengths of a list batch."""
    values, lengths = [], []
    for k in keys if keys is not None else batch:
        for row in batch[k]:
            values.extend(row)
            lengths.append(len(row))
    return values, lengths


def offsets_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def dense_of(batch: dict[str, list[list[int]]], b: int, width: int, pad: int = -1, rnd: random.Random | None = None):
    """``[B][F][width]`` nested lists; with `rnd`, ids sit at random sorted positions (padding in between)."""
    out = [[[pad] * width for _ in batch] for _ in range(b)]
    for f, k in enumerate(batch):
        for s, row in enumerate(batch[k]):
            cols = sorted(rnd.sample(range(width), len(row))) if rnd else range(len(row))
            for c, v in zip(cols, row):
                out[s][f][c] = v
    return out


def lists_of(sf) -> dict[str, list[list]]:
    """The oracle view of a SparseFeatures, read through values/offsets only."""
    values, offsets, b = sf.values().tolist(), sf.offsets().tolist(), sf.batch_size
    return {k: [values[offsets[f * b + s] : offsets[f * b + s + 1]] for s in range(b)] for f, k in enumerate(sf.keys())}


def weight_lists_of(sf) -> dict[str, list[list[float]]]:
    w, offsets, b = sf.weights().tolist(), sf.offsets().tolist(), sf.batch_size
    return {k: [w[offsets[f * b + s] : offsets[f * b + s + 1]] for s in range(b)] for f, k in enumerate(sf.keys())}


def build(batch, weights=None, b=None, offsets_dtype=torch.int64, device="cpu"):
    """A SparseFeatures made directly with the constructor (not through a converter)."""
    from hugeembed.features import SparseFeatures

    keys = list(batch)
    values, lengths = flat(batch, keys)
    offs = torch.tensor(offsets_of(lengths), dtype=offsets_dtype, device=device)
    w = None if weights is None else torch.tensor(flat(weights, keys)[0], dtype=torch.float32, device=device)
    return SparseFeatures(keys, torch.tensor(values, dtype=torch.int64, device=device), offsets=offs, weights=w,
                          batch_size=b)


@st.composite
def batches(draw, max_features=4, max_batch=5, max_len=4, with_weights=None, ids=None):
    """(ids, weights or None, B): a random jagged batch as lists; empty bags and B = 0 included."""
    f = draw(st.integers(0, max_features))
    b = draw(st.integers(0, max_batch))
    keys = NAMES[:f]
    id_st = ids if ids is not None else st.integers(0, 2**62)
    # float32-exact weights so that comparisons can be exact
    w_st = st.integers(-64, 64).map(lambda x: x / 8)
    # with no features "has weights" means nothing: SparseFeatures' converters give None then
    has_w = f > 0 and (draw(st.booleans()) if with_weights is None else with_weights)
    out, wout = {}, {}
    for k in keys:
        rows = [draw(st.lists(id_st, max_size=max_len)) for _ in range(b)]
        out[k] = rows
        wout[k] = [[draw(w_st) for _ in row] for row in rows]
    return out, (wout if has_w else None), b
