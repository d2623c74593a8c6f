"""Bad input to every lookup entry point: a clear error from hugeembed.errors, nothing pooled silently.

Issue 10: offsets that do not start at 0 / end at len(values) / decrease, non-float tables,
non-contiguous ids (valid: accepted), empty dynamic tables in eval (valid: zeros), tables and
batches on different devices, meta batches.  The oracle for offsets is SparseFeatures.validate()
(its own tests check it against hand-written cases): whatever it refuses, every lookup refuses.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hugeembed.errors import ConfigError, HugeEmbedError, InputError
from hugeembed.features import JaggedFeature, SparseFeatures
from hugeembed.functional import (FeatureSpec, FusedEmbeddingLookup, TableSpec, embedding_lookup_unpooled,
                                  safe_embedding_lookup_sparse)
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD

BACKENDS = ["native", "torch"]
ROWS, DIM = 10, 3


def _fused(backend, combiner="sum"):
    return FusedEmbeddingLookup([TableSpec("t", DIM, num_rows=ROWS)], [FeatureSpec("a", "t", combiner=combiner)],
                                backend=backend)


def _collection(backend, dynamic=False):
    cfg = TableConfig("a", dim=DIM, num_rows=None if dynamic else ROWS, combiner="sum")
    return EmbeddingCollection([cfg], optimizer=SGD(lr=0.1), backend=backend)


def _entry_points(backend):
    """(name, call(values, offsets)) for every way a batch reaches a lookup."""
    W = torch.randn(ROWS, DIM)
    Wg = W.clone().requires_grad_()
    sf = lambda v, o: SparseFeatures(["a"], v, offsets=o)  # noqa: E731

    def collection(train, dynamic):
        def call(v, o):
            ec = _collection(backend, dynamic).train(train)
            with torch.set_grad_enabled(train):
                ec(sf(v, o))
        return call

    # forward_static is the native one-pass path; with backend="torch" it does not apply (returns
    # None at once) and its callers take prepare, listed here
    static = [("FusedEmbeddingLookup.forward_static", lambda v, o: _fused(backend).forward_static([W], sf(v, o)))]
    return static * (backend == "native") + [
        ("safe_embedding_lookup_sparse", lambda v, o: safe_embedding_lookup_sparse(
            W, (v, o), combiner="sum", name="a", backend=backend)),
        ("safe_embedding_lookup_sparse grad", lambda v, o: safe_embedding_lookup_sparse(
            Wg, (v, o), combiner="mean", name="a", backend=backend)),
        ("safe lookup of a SparseFeatures", lambda v, o: safe_embedding_lookup_sparse(W, sf(v, o), backend=backend)),
        ("safe lookup of a JaggedFeature", lambda v, o: safe_embedding_lookup_sparse(
            W, JaggedFeature(v, o, name="a"), backend=backend)),
        ("embedding_lookup_unpooled", lambda v, o: embedding_lookup_unpooled(W, (v, o), name="a", backend=backend)),
        ("FusedEmbeddingLookup.__call__", lambda v, o: _fused(backend)([W], sf(v, o))),
        ("FusedEmbeddingLookup.__call__ grad", lambda v, o: _fused(backend)([Wg], sf(v, o))),
        ("FusedEmbeddingLookup.prepare", lambda v, o: _fused(backend).prepare(sf(v, o), [W])),
        ("EmbeddingCollection train static", collection(True, False)),
        ("EmbeddingCollection eval static", collection(False, False)),
        ("EmbeddingCollection train dynamic", collection(True, True)),
        ("EmbeddingCollection eval dynamic", collection(False, True)),
    ]


BAD_OFFSETS = [
    ([1, 2, 3], [0, 1], "lengths sum to 1"),              # the repro: ids 2 and 3 were dropped
    ([1, 2, 3], [1, 3], "offsets must start at 0, got 1"),
    ([1, 2, 3], [0, 2, 4], "lengths sum to 4"),            # past the end
    ([1, 2, 3], [0, 3, 1, 3], r"offsets decrease at sample 1 \(3 -> 1\)"),
    ([1, 2, 3], [-1, 3], "offsets must start at 0, got -1"),
    ([1, 2, 3], [0, 2**40], "lengths sum to 1099511627776"),
    ([], [0, 0, 1], "lengths sum to 1"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("values, offsets, message", BAD_OFFSETS)
def test_bad_offsets_are_refused_by_every_entry_point(backend, values, offsets, message):
    v, o = torch.tensor(values, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)
    for name, call in _entry_points(backend):
        with pytest.raises(InputError, match=r"feature 'a'.*" + message):
            call(v, o)
        if max(map(abs, offsets)) < 2**31:
            with pytest.raises(InputError, match=r"feature 'a'.*" + message):
                call(v, o.int())  # int32 offsets too


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 4), offsets=st.lists(st.integers(-2, 6), min_size=1, max_size=4),
       backend=st.sampled_from(BACKENDS))
def test_whatever_validate_refuses_every_lookup_refuses(n, offsets, backend):
    """Property: validate() is the oracle; an accepted batch is looked up, a refused one never is."""
    v, o = torch.arange(n, dtype=torch.int64) % ROWS, torch.tensor(offsets, dtype=torch.int64)
    sf = SparseFeatures(["a"], v, offsets=o)
    try:
        sf.validate()
        refused = None
    except InputError as e:
        refused = e
    for name, call in _entry_points(backend):
        if refused is None:
            call(v, o)  # a valid batch is looked up without complaint
        else:
            with pytest.raises(InputError, match="'a'") as got:  # 'feature 'a'' or, with no samples, "['a']"
                call(v, o)
            assert str(got.value) == str(refused), name  # the very message of validate()


def test_corrupt_bags_of_a_feature_no_table_reads_are_refused():
    # 'extra' is read by no table; its offsets decrease while 'a''s are fine and the ends are right
    sf = SparseFeatures(["a", "extra"], torch.tensor([1, 2, 3, 4]), offsets=torch.tensor([0, 1, 2, 2, 4, 3, 4]))
    with pytest.raises(InputError, match=r"feature 'extra': offsets decrease at sample 1 \(4 -> 3\)"):
        sf.validate()
    for backend in BACKENDS:
        for train in (True, False):
            ec = _collection(backend).train(train)
            with torch.set_grad_enabled(train), pytest.raises(InputError, match="feature 'extra': offsets decrease"):
                ec(sf)
        with pytest.raises(InputError, match="feature 'extra': offsets decrease"):
            safe_embedding_lookup_sparse(torch.randn(ROWS, DIM), sf, name="a", backend=backend)


def test_a_refused_batch_changes_nothing():
    ec = _collection("native", dynamic=True)
    bad = SparseFeatures(["a"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 1]))
    with pytest.raises(InputError):
        ec(bad)
    assert len(ec.store("a")) == 0  # no id of the refused batch was inserted


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8])
def test_non_float_tables_are_refused(dtype):
    W = torch.ones(ROWS, DIM, dtype=dtype)
    ids = (torch.tensor([1, 2, 3]), torch.tensor([0, 3]))
    with pytest.raises(ConfigError, match=f"table 'a_table': weight must be floating point, got {dtype}"):
        safe_embedding_lookup_sparse(W, ids, name="a")
    with pytest.raises(ConfigError, match=f"table 'mine': weight must be floating point, got {dtype}"):
        embedding_lookup_unpooled(W, ids, table="mine")
    sf = SparseFeatures(["a"], *ids[:1], offsets=ids[1])
    for backend in BACKENDS:
        with pytest.raises(InputError, match=f"table 't': rows must be floating point, got {dtype}"):
            _fused(backend, "mean")([W], sf)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_ids_and_weights_are_looked_up(backend):
    W = torch.randn(ROWS, DIM)
    ids = torch.arange(12)[::2] % ROWS      # [0, 2, 4, 6, 8, 0], not contiguous
    w = torch.arange(1.0, 13.0)[::2]
    offs = torch.tensor([0, 2, 6])
    got = safe_embedding_lookup_sparse(W, (ids, offs, w), combiner="sum", backend=backend)
    want = torch.stack([(W[ids[:2]] * w[:2, None]).sum(0), (W[ids[2:]] * w[2:, None]).sum(0)])
    torch.testing.assert_close(got, want)
    got = _fused(backend)([W], SparseFeatures(["a"], ids, offsets=offs[::1]))["a"]
    torch.testing.assert_close(got, torch.stack([W[ids[:2]].sum(0), W[ids[2:]].sum(0)]))
    rows = embedding_lookup_unpooled(W, (ids, offs), backend=backend).values
    torch.testing.assert_close(rows, W[ids])


EMPTY_CASES = [
    # (backend, dtype, combiner, max_norm)
    ("torch", torch.float32, "sum", None),
    ("torch", torch.float32, "mean", 1.0),
    ("torch", torch.float32, "sqrtn", None),
    ("torch", torch.float32, "none", None),
    ("auto", torch.float64, "mean", None),
    ("auto", torch.float64, "sqrtn", 0.5),
    ("auto", torch.float64, "none", 2.0),
    ("auto", torch.float32, "mean", 1.0),
    ("auto", torch.float16, "sum", None),
]


@pytest.mark.parametrize("backend, dtype, combiner, max_norm", EMPTY_CASES)
def test_eval_of_a_dynamic_table_with_no_rows_reads_zeros(backend, dtype, combiner, max_norm):
    ec = EmbeddingCollection([TableConfig("u", dim=4, dtype=dtype, combiner=combiner, max_norm=max_norm)],
                             optimizer=SGD(lr=0.1), backend=backend).eval()
    sf = SparseFeatures.from_lists({"u": [[1, 2], [], [7]]})
    with torch.no_grad():
        out = ec(sf)
    if combiner == "none":
        jagged = out.unpooled["u"]
        assert jagged.values.shape == (3, 4) and not jagged.values.any()
        assert jagged.offsets.tolist() == [0, 2, 2, 3]
    else:
        assert out["u"].shape == (3, 4) and out["u"].dtype == dtype and not out["u"].any()
    assert len(ec.store("u")) == 0  # eval inserted nothing


def test_training_step_after_an_empty_eval_still_works():
    ec = EmbeddingCollection([TableConfig("u", dim=4, max_norm=1.0)], optimizer=SGD(lr=0.1), backend="torch")
    sf = SparseFeatures.from_lists({"u": [[1, 2], [3]]})
    with torch.no_grad():
        ec.eval()(sf)
    ec.train()
    ec(sf)["u"].sum().backward()
    assert len(ec.store("u")) == 3


def test_table_and_batch_on_different_devices_name_both():
    ids = (torch.tensor([1, 2]), torch.tensor([0, 2]))
    meta_w = torch.empty(ROWS, DIM, device="meta")
    for backend in ("auto", "torch"):
        with pytest.raises(InputError, match="table 'a_table' is on meta but the batch is on cpu"):
            safe_embedding_lookup_sparse(meta_w, ids, name="a", backend=backend)
        with pytest.raises(InputError, match="table 'a_table' is on meta but the batch is on cpu"):
            safe_embedding_lookup_sparse(meta_w.requires_grad_(), ids, name="a", backend=backend)
        meta_w = meta_w.detach()
        with pytest.raises(InputError, match="table 't' is on meta but the batch is on cpu"):
            _fused(backend)([meta_w], SparseFeatures(["a"], *ids[:1], offsets=ids[1]))


def test_meta_batches_are_clear_errors_in_lookups():
    meta = SparseFeatures(["a"], torch.zeros(2, dtype=torch.int64, device="meta"),
                          offsets=torch.tensor([0, 2], device="meta"))
    for backend in BACKENDS:
        with pytest.raises(InputError, match=r"features \['a'\]: the batch is on the meta device"):
            _fused(backend)([torch.randn(ROWS, DIM, device="meta")], meta)
        with pytest.raises(InputError, match=r"batch \['a'\] is on meta but the tables are on cpu"):
            _collection(backend)(meta)
    # a collection on the meta device takes it: shapes only
    ec = EmbeddingCollection([TableConfig("a", dim=DIM)], optimizer=SGD(lr=0.1), device="meta")
    assert ec(meta)["a"].shape == (1, DIM)


def test_errors_are_hugeembed_errors():
    assert issubclass(InputError, HugeEmbedError) and issubclass(ConfigError, HugeEmbedError)
