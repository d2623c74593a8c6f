"""RowLayout: typed views of a row record, packing of 16-bit weights beside fp32 state, and the
stores built on it (initial rows, raw export/import, refused combinations)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.errors import ConfigError, InputError
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import FTRL, Adam
from hugeembed.store import ArrayStore, DictStore, HashStore, RowLayout, TruncatedNormal, Uniform

LOW = [torch.float16, torch.bfloat16]


@given(dim=st.integers(1, 9), state=st.integers(0, 7), dtype=st.sampled_from([torch.float32, torch.float64, *LOW]))
@settings(max_examples=40, deadline=None)
def test_plain_layout_views_are_todays_column_slices(dim, state, dtype):
    lay = RowLayout(dim, dtype, state, dtype)
    s = torch.randn(5, dim + state).to(dtype)
    assert not lay.packed and lay.width == dim + state and lay.storage_dtype == dtype
    w, st_ = lay.weights(s), lay.state(s)
    # the same views as storage[:, :D] / storage[:, D:]: same memory, same strides, no copy
    for got, want in ((w, s[:, :dim]), (st_, s[:, dim:])):
        assert got.data_ptr() == want.data_ptr() and got.stride() == want.stride() and got.shape == want.shape
        assert got.dtype == dtype


@given(dim=st.integers(1, 9), state=st.integers(0, 7), dtype=st.sampled_from(LOW), seed=st.integers(0, 99))
@settings(max_examples=40, deadline=None)
def test_packed_layout_round_trips_every_weight_and_state_value(dim, state, dtype, seed):
    lay = RowLayout(dim, dtype, state)  # the default state dtype of 16-bit weights: float32
    assert lay.packed and lay.state_dtype == torch.float32 and lay.storage_dtype == torch.float32
    assert lay.width == (dim + 1) // 2 + state  # ceil(D * 2 / 4) packed columns
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, dim, generator=g).to(dtype)
    s_ = torch.randn(6, state, generator=g)
    storage = torch.zeros(6, lay.width)
    lay.weights(storage)[:] = w
    lay.state(storage)[:] = s_
    # each view aliases the storage: one record per row
    assert lay.weights(storage).dtype == dtype and lay.state(storage).dtype == torch.float32
    assert torch.equal(lay.weights(storage), w) and torch.equal(lay.state(storage), s_)
    # the weights are the bit patterns of the first columns, independently re-read
    packed = storage[:, : (dim + 1) // 2].contiguous().view(torch.int16)
    want = w.view(torch.int16)
    assert torch.equal(packed[:, :dim], want)
    # an index write through the view reaches the storage (the optimizers write this way)
    rows = torch.tensor([4, 1])
    lay.weights(storage)[rows] = torch.full((2, dim), 3.0, dtype=dtype)
    assert bool((lay.weights(storage)[rows] == 3.0).all())
    assert torch.equal(lay.state(storage), s_)


@pytest.mark.parametrize("dtype, state, match", [
    (torch.float32, torch.float16, "state_dtype torch.float16 is not supported with float32 weights"),
    (torch.float32, torch.float64, "not supported with float32"),
    (torch.float16, torch.bfloat16, "or float32 \\(the default\\)"),
    (torch.bfloat16, torch.float64, "not supported with bfloat16"),
])
def test_unsupported_state_dtypes_are_config_errors_naming_the_table(dtype, state, match):
    with pytest.raises(ConfigError, match=f"table 'emb'.*{match}"):
        TableConfig("emb", 4, dtype=dtype, state_dtype=state)
    with pytest.raises(ConfigError, match="table 'emb'"):
        RowLayout(4, dtype, 2, state, table="emb")


def test_table_config_defaults_validation_and_describe():
    assert TableConfig("t", 4, dtype=torch.float16).row_layout(None).state_dtype == torch.float32
    assert TableConfig("t", 4, dtype=torch.bfloat16).row_layout(None).state_dtype == torch.float32
    assert TableConfig("t", 4, dtype=torch.float64).row_layout(None).state_dtype == torch.float64
    assert TableConfig("t", 4).row_layout(None).state_dtype == torch.float32
    d = TableConfig("t", 4, dtype=torch.float16, stochastic_rounding=True).describe()
    assert d["dtype"] == "float16" and d["state_dtype"] == "float32" and d["stochastic_rounding"] is True
    assert TableConfig("t", 4, dtype=torch.float16, state_dtype=torch.float16).describe()["state_dtype"] == "float16"
    with pytest.raises(ConfigError, match="table 't'.*stochastic_rounding.*float32"):
        TableConfig("t", 4, stochastic_rounding=True)
    with pytest.raises(ConfigError, match="table 't'.*stochastic_rounding must be True or False"):
        TableConfig("t", 4, dtype=torch.float16, stochastic_rounding=1)
    with pytest.raises(ConfigError, match="table 't'.*state_dtype must be None or one of"):
        TableConfig("t", 4, state_dtype=torch.int32)


@pytest.mark.parametrize("adam", [Adam(lr=0.1, mode="global"), Adam(lr=0.1, bias_correction="per_row")])
def test_adam_counter_in_16_bit_state_is_refused_at_build(adam):
    with pytest.raises(ConfigError, match="table 'u'.*integer step counter.*float32 or float64"):
        TableConfig("u", 4, dtype=torch.float16, state_dtype=torch.float16, optimizer=adam)
    with pytest.raises(ConfigError, match="table 'v'.*integer step counter"):  # the collection's default rule
        EmbeddingCollection([TableConfig("v", 4, dtype=torch.bfloat16, state_dtype=torch.bfloat16)], optimizer=adam)
    # lazy global-step Adam keeps no counter: 16-bit state is allowed (the user asked for it)
    EmbeddingCollection([TableConfig("v", 4, dtype=torch.bfloat16, state_dtype=torch.bfloat16)],
                        optimizer=Adam(lr=0.1))


def _stores(dtype, layout, init, init_state):
    kw = dict(initializer=init, init_state=init_state, dtype=dtype, seed=7, layout=layout)
    out = [("dict", DictStore("t", layout.dim, layout.state_width, **kw)),
           ("hash-torch", HashStore("t", layout.dim, layout.state_width, backend="torch", **kw))]
    if _native.available():
        out.append(("hash-native", HashStore("t", layout.dim, layout.state_width, backend="native", **kw)))
    return out


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("init", [Uniform(-1, 1), TruncatedNormal(0.0, 0.3)])
def test_stores_initialise_packed_rows_as_the_initializer_rounded(dtype, init):
    opt = FTRL(lr=0.1, initial_accumulator_value=0.25)
    dim = 5
    layout = RowLayout(dim, dtype, opt.state_width(dim), table="t")
    keys = torch.tensor([3, -9, 2**40, 17, 0])
    want_w = init.generate(keys, dim, 7).to(dtype)  # the oracle: the initializer's own float32 values
    want_s = torch.cat([torch.full((5, dim), 0.25), torch.zeros(5, dim)], 1)
    for name, store in _stores(dtype, layout, init, opt.init_state):
        slots = store.find_or_insert(keys, step=1)
        assert store.storage().dtype == torch.float32 and store.width == 3 + 2 * dim, name
        assert torch.equal(store.weights()[slots], want_w), name
        assert torch.equal(store.state()[slots], want_s), name
        # a second batch (a grown storage) keeps the first rows
        store.find_or_insert(torch.arange(100, 300), step=2)
        assert torch.equal(store.weights()[store.find(keys)], want_w), name
    arr = ArrayStore("t", 20, dim, 2 * dim, initializer=init, init_state=opt.init_state, dtype=dtype, seed=7,
                     layout=layout)
    k = torch.tensor([3, 17, 0])
    assert torch.equal(arr.weights()[k], init.generate(k, dim, 7).to(dtype))
    assert torch.equal(arr.state()[k], want_s[:3])


@pytest.mark.parametrize("dtype", LOW)
def test_raw_rows_export_and_import_bit_identically_and_foreign_rows_are_refused(dtype):
    layout = RowLayout(3, dtype, 4, table="t")
    src = HashStore("t", 3, 4, dtype=dtype, layout=layout, seed=1)
    slots = src.find_or_insert(torch.arange(10), step=1)
    src.state()[slots] = torch.randn(10, 4)
    ex = src.export()
    assert ex.rows.dtype == torch.float32 and ex.width == layout.width
    for dst in (HashStore("t", 3, 4, dtype=dtype, layout=layout), DictStore("t", 3, 4, dtype=dtype, layout=layout)):
        dst.import_(ex)
        back = dst.export()
        assert torch.equal(back.rows.view(torch.int32), ex.rows.view(torch.int32))
        assert torch.equal(dst.weights()[dst.find(torch.arange(10))], src.weights()[slots])
    plain = HashStore("t", 3, 4, dtype=dtype, seed=1)  # state in the weight dtype: 7 columns, not 6
    with pytest.raises(InputError, match="table 't': import has rows of width 6"):
        plain.import_(ex)
    wrong = type(ex)(ex.keys, ex.rows.double(), ex.counts, ex.last_step, ex.pending_keys, ex.pending_counts,
                     ex.pending_last_step)
    with pytest.raises(InputError, match="table 't': import has torch.float64 rows.*packed"):
        HashStore("t", 3, 4, dtype=dtype, layout=layout).import_(wrong)


def test_store_layout_must_match_its_arguments():
    with pytest.raises(ConfigError, match="table 't': layout .* does not match dim 4"):
        HashStore("t", 4, 2, dtype=torch.float16, layout=RowLayout(3, torch.float16, 2))
    with pytest.raises(ConfigError, match="table 't': layout must be a RowLayout"):
        ArrayStore("t", 5, 4, layout="fp32")


def test_native_and_torch_hash_backends_agree_on_packed_rows():
    if not _native.available():
        pytest.skip("native kernels not built")
    layout = RowLayout(7, torch.bfloat16, 1, table="t")
    a = HashStore("t", 7, 1, dtype=torch.bfloat16, layout=layout, backend="native", seed=3)
    b = HashStore("t", 7, 1, dtype=torch.bfloat16, layout=layout, backend="torch", seed=3)
    keys = torch.randint(-(2**50), 2**50, (500,)).unique()
    sa, sb = a.find_or_insert(keys, step=1), b.find_or_insert(keys, step=1)
    assert torch.equal(a.weights()[sa], b.weights()[sb]) and torch.equal(a.state()[sa], b.state()[sb])


def test_lookup_rows_are_the_storage_itself_when_plain_and_the_typed_weights_when_packed():
    plain = HashStore("t", 4, 1)
    plain.find_or_insert(torch.arange(5), step=1)
    assert plain.lookup_rows() is plain.storage()  # no view built per batch on the default path
    packed = HashStore("t", 4, 1, dtype=torch.float16, layout=RowLayout(4, torch.float16, 1))
    packed.find_or_insert(torch.arange(5), step=1)
    rows = packed.lookup_rows()
    assert rows.dtype == torch.float16 and rows.shape == (packed.storage().shape[0], 4)
    assert rows.data_ptr() == packed.storage().data_ptr()
