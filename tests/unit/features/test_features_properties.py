"""Property tests on random jagged batches (empty bags, empty features and B = 0 included)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from features_oracle import batches, build, dense_of, device_settings, lists_of, offsets_of, weight_lists_of
from hugeembed.features import SparseFeatures


def dense_width(ids, extra):
    return max([len(r) for rows in ids.values() for r in rows] + [0]) + extra


@device_settings
@given(batches(), st.integers(0, 3), st.randoms(use_true_random=False))
def test_dense_padded_to_coo_to_csr_and_back(device, batch, extra, rnd):
    ids, weights, b = batch
    keys, width = list(ids), dense_width(ids, extra)
    seed = rnd.random()
    # padding lands at random places in each bag, also between ids
    dense = torch.tensor(dense_of(ids, b, width, rnd=random.Random(seed)), dtype=torch.int64,
                         device=device).view(b, len(keys), width)
    w = None
    if weights is not None:
        w = torch.tensor(dense_of(weights, b, width, pad=0.0, rnd=random.Random(seed)), dtype=torch.float32,
                         device=device).view(b, len(keys), width)
    sf = SparseFeatures.from_dense_padded(keys, dense, weights=w)
    assert sf.batch_size == b and lists_of(sf) == ids
    if weights is not None:
        assert weight_lists_of(sf) == weights
    sf.validate()

    coo = {k: (r, v, (b,), wt) for k, (r, v, wt) in sf.to_coo().items()}
    via_coo = SparseFeatures.from_coo(coo, batch_size=b)
    csr = via_coo.to_csr()
    back = SparseFeatures.from_csr(csr, batch_size=b)
    assert back.keys() == tuple(keys) and back.batch_size == b and lists_of(back) == ids
    if keys:  # a batch of no features has no tensor to carry its device through a dict of features
        assert back.device.type == device.type
    if weights is not None:
        assert weight_lists_of(back) == weights
    # and out again as compact dense: ids first, then padding
    assert back.to_dense_padded(max_nnz=width).tolist() == dense_of(ids, b, width)


@device_settings
@given(batches(max_features=3), st.randoms(use_true_random=False))
def test_coo_rows_in_any_order(device, batch, rnd):
    ids, weights, b = batch
    coo, tf_coo = {}, {}
    for k, rows in ids.items():
        # interleave the rows at random but keep each row's ids in order: the stable sort keeps them
        owners = [s for s, row in enumerate(rows) for _ in row]
        rnd.shuffle(owners)
        nxt = [0] * b
        r_idx, vals, wts = [], [], []
        for s in owners:
            r_idx.append(s)
            vals.append(rows[s][nxt[s]])
            wts.append(weights[k][s][nxt[s]] if weights else 0.0)
            nxt[s] += 1
        tw = torch.tensor(wts, device=device) if weights else None
        coo[k] = (torch.tensor(r_idx, dtype=torch.int64, device=device), torch.tensor(vals, dtype=torch.int64,
                  device=device), [b], tw)
        # TF-style indices: any order at all, the column says where each id goes
        pos = [(s, c) for s, row in enumerate(rows) for c in range(len(row))]
        perm = list(range(len(pos)))
        rnd.shuffle(perm)
        tf_idx = torch.tensor([pos[i] for i in perm], dtype=torch.int64, device=device).view(-1, 2)
        tf_vals = torch.tensor([rows[pos[i][0]][pos[i][1]] for i in perm], dtype=torch.int64, device=device)
        tf_w = torch.tensor([weights[k][pos[i][0]][pos[i][1]] for i in perm], device=device) if weights else None
        tf_coo[k] = (tf_idx, tf_vals, [b, 8], tf_w)
    for form in (coo, tf_coo):
        sf = SparseFeatures.from_coo(form, batch_size=b)
        assert lists_of(sf) == ids and sf.batch_size == b
        if weights is not None:
            assert weight_lists_of(sf) == weights


@device_settings
@given(batches(max_features=3, ids=st.integers(0, 50)), st.integers(0, 2))
def test_hugectr_slot_coo_equals_dense_padded(device, batch, extra):
    ids, _, b = batch
    keys = list(ids)
    if not keys:
        return
    width = dense_width(ids, extra)
    dense = torch.tensor(dense_of(ids, b, width), dtype=torch.int64, device=device).view(b, len(keys), width)
    flat = dense.reshape(b * len(keys), width)
    mask = flat != -1
    got = SparseFeatures.from_coo(keys, torch.nonzero(mask), flat[mask], dense_shape=[b * len(keys), width])
    assert lists_of(got) == ids and got.batch_size == b


@device_settings
@given(batches(), st.booleans())
def test_lists_dict_and_sparse_tensor_round_trips(device, batch, int32_offsets):
    ids, weights, b = batch
    sf = SparseFeatures.from_lists(ids, weights, batch_size=b, device=device)
    assert sf.batch_size == b and sf.device.type == device.type
    assert sf.to_lists() == ids
    values, lengths = [], []
    for rows in ids.values():
        for row in rows:
            values.extend(row)
            lengths.append(len(row))
    assert sf.values().tolist() == values and sf.offsets().tolist() == offsets_of(lengths)
    if weights is not None:
        assert sf.to_lists(with_weights=True) == (ids, weights)
    if int32_offsets:
        sf = SparseFeatures(sf.keys(), sf.values(), offsets=sf.offsets().int(), weights=sf.weights_or_none(),
                            batch_size=b)
    assert lists_of(SparseFeatures.from_dict(sf.to_dict(), batch_size=b)) == ids
    sparse = sf.to_sparse_coo_tensors(with_weights=weights is not None)
    again = SparseFeatures.from_sparse_coo_tensors(*sparse, batch_size=b) if weights is not None else \
        SparseFeatures.from_sparse_coo_tensors(sparse, batch_size=b)
    assert lists_of(again) == ids
    if weights is not None:
        assert weight_lists_of(again) == weights


@device_settings
@given(batches())
def test_torchrec_round_trip(device, batch):
    pytest.importorskip("torchrec.sparse.jagged_tensor")
    ids, weights, b = batch
    sf = SparseFeatures.from_lists(ids, weights, batch_size=b, device=device)
    kjt = sf.to_torchrec()
    assert kjt.keys() == list(ids) and kjt.stride() == b
    back = SparseFeatures.from_torchrec(kjt)
    assert lists_of(back) == ids and back.batch_size == b and back.device.type == device.type
    if weights is not None:
        assert weight_lists_of(back) == weights


@given(batches(), st.data())
def test_split_then_concat(batch, data):
    ids, weights, b = batch
    sf = build(ids, weights, b=b)
    cuts = sorted(data.draw(st.lists(st.integers(0, b), max_size=3)))
    sizes = [hi - lo for lo, hi in zip([0] + cuts, cuts + [b])]
    parts = sf.split(sizes)
    start = 0
    for size, part in zip(sizes, parts):
        assert part.batch_size == size
        assert lists_of(part) == {k: rows[start : start + size] for k, rows in ids.items()}
        if weights is not None:
            assert weight_lists_of(part) == {k: rows[start : start + size] for k, rows in weights.items()}
        start += size
    joined = SparseFeatures.concat_batches(parts)
    assert joined.batch_size == b and lists_of(joined) == ids
    if weights is not None:
        assert weight_lists_of(joined) == weights


@given(batches(), st.data(), st.sampled_from([torch.int32, torch.int64]))
def test_permute_and_select_against_oracle(batch, data, offsets_dtype):
    ids, weights, b = batch
    keys = list(ids)
    sf = build(ids, weights, b=b, offsets_dtype=offsets_dtype)
    order = data.draw(st.permutations(range(len(keys))))[: data.draw(st.integers(0, len(keys)))]
    got = sf.permute(order)
    assert got.keys() == tuple(keys[i] for i in order) and got.batch_size == b
    assert lists_of(got) == {keys[i]: ids[keys[i]] for i in order}
    if weights is not None:
        assert weight_lists_of(got) == {keys[i]: weights[keys[i]] for i in order}
    assert got.offsets().dtype == offsets_dtype
    chosen = [keys[i] for i in order]
    assert lists_of(sf.select(chosen)) == lists_of(got)
    for k in keys:
        jf = sf.feature(k)
        assert [jf.values[jf.offsets[s] : jf.offsets[s + 1]].tolist() for s in range(b)] == ids[k]
