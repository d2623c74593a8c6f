"""Fuzz: garbage into the constructors, converters and lookups gives only our errors, naming what is wrong.

Every exception raised must be a :class:`hugeembed.errors.HugeEmbedError` whose message names
the feature or the table involved (issue 10).  A call that succeeds is fine: much of the
garbage is valid input in disguise (a strided view, an empty batch).  Bounded: a few hundred
examples, a few seconds.
"""

from __future__ import annotations

import math
import os

import torch
from hypothesis import given, settings, strategies as st

from hugeembed.errors import HugeEmbedError
from hugeembed.features import SparseFeatures
from hugeembed.functional import (FeatureSpec, FusedEmbeddingLookup, TableSpec, embedding_lookup_unpooled,
                                  fused_embedding_lookup, safe_embedding_lookup_sparse)
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD

FEATURE, TABLE = "fz", "tq"  # names unlikely to appear in a message by chance
# a few seconds in CI; HUGEEMBED_FUZZ_EXAMPLES=5000 HYPOTHESIS_PROFILE=explore to hunt locally.  100: the
# (derandomized) draws test_fuzz_helpers_make_what_they_say shows reach every dtype, meta, strided and contiguous
FUZZ_EXAMPLES = int(os.environ.get("HUGEEMBED_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None)

DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32, torch.float64,
          torch.complex64]
NUMBERS = st.one_of(st.integers(-3, 12), st.sampled_from([2**40, -(2**40), 2**62]))


@st.composite
def tensors(draw, ndim=None, dtypes=DTYPES):
    """Small tensors of any dtype and shape, sometimes non-contiguous, on meta, or holding NaN."""
    nd = draw(st.sampled_from([0, 1, 1, 1, 2, 3])) if ndim is None else ndim
    shape = draw(st.lists(st.integers(0, 4), min_size=nd, max_size=nd))
    dtype = draw(st.sampled_from(dtypes))
    n = math.prod(shape)
    data = draw(st.lists(NUMBERS, min_size=2 * n, max_size=2 * n))
    t = torch.tensor(data, dtype=torch.int64)
    if dtype.is_floating_point or dtype.is_complex:
        t = t.to(torch.float64)
        if n and draw(st.booleans()):
            t[draw(st.integers(0, 2 * n - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    t = t.to(dtype) if dtype != torch.bool else t > 0
    t = t[::2] if draw(st.booleans()) else t[:n]  # a strided view half the time
    t = t.reshape(shape) if t.is_contiguous() else t.view(-1).as_strided(shape, _strides(shape, 2))
    if draw(st.integers(0, 9)) == 0:
        t = t.to("meta")
    return t


def _strides(shape, step):
    out, acc = [], step
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


JUNK = st.sampled_from([None, "x", 1.5, True, -1, [1, [2]], {}, object(), [[1, 2], 3], (1,)])
ANY = st.one_of(tensors(), tensors(ndim=1), tensors(ndim=1, dtypes=[torch.int64]), JUNK,
                st.lists(NUMBERS, max_size=4))
OFFSETS = st.one_of(
    tensors(ndim=1, dtypes=[torch.int64, torch.int32]),
    st.lists(st.integers(-2, 8), min_size=1, max_size=5).map(lambda x: torch.tensor(x)),
    st.lists(st.integers(0, 8), min_size=1, max_size=5).map(lambda x: torch.tensor(sorted(x))),
    ANY)
IDS = st.one_of(tensors(ndim=1, dtypes=[torch.int64]), st.lists(st.integers(-2, 12), max_size=6).map(torch.tensor),
                ANY)
WEIGHTS = st.one_of(st.none(), tensors(ndim=1, dtypes=[torch.float32, torch.float64]), ANY)


def check(call) -> None:
    """Runs `call`; an exception must be ours and name the feature or table."""
    try:
        call()
    except HugeEmbedError as e:
        msg = str(e)
        assert FEATURE in msg or TABLE in msg, f"error names neither {FEATURE!r} nor {TABLE!r}: {msg}"
    except Exception as e:  # noqa: BLE001 - the point of the test
        raise AssertionError(f"not a HugeEmbedError: {type(e).__name__}: {e}") from e


@FUZZ
@given(values=IDS, offsets=OFFSETS, weights=WEIGHTS, use_lengths=st.booleans(),
       batch_size=st.one_of(st.none(), st.integers(-1, 4)))
def test_constructor_and_everything_downstream(values, offsets, weights, use_lengths, batch_size):
    kw = dict(lengths=offsets) if use_lengths else dict(offsets=offsets)
    made = []
    check(lambda: made.append(SparseFeatures([FEATURE], values, weights=weights, batch_size=batch_size, **kw)))
    if not made:
        return
    sf = made[0]
    check(sf.validate)
    W = torch.randn(10, 3)
    lookup = FusedEmbeddingLookup([TableSpec(TABLE, 3, num_rows=10)], [FeatureSpec(FEATURE, TABLE)])
    check(lambda: lookup([W], sf))
    check(lambda: lookup([W.requires_grad_()], sf))
    check(lambda: safe_embedding_lookup_sparse(W.detach(), sf, table=TABLE))
    check(lambda: embedding_lookup_unpooled(W.detach(), sf, table=TABLE, backend="torch"))
    ec = EmbeddingCollection([TableConfig(TABLE, dim=3, features=(FEATURE,))], optimizer=SGD(lr=0.1))
    check(lambda: ec(sf))
    check(lambda: ec.eval()(sf))
    # converters out of a batch that was never validated
    for convert in (sf.to_lists, sf.to_coo, sf.to_csr, sf.to_dense_padded, sf.to_sparse_coo_tensors,
                    lambda: sf.split(1), lambda: sf.select([FEATURE])):
        check(convert)


@FUZZ
@given(weight=st.one_of(tensors(ndim=2), tensors(ndim=2, dtypes=[torch.float32]), ANY), values=IDS,
       offsets=OFFSETS, weights=WEIGHTS, combiner=st.sampled_from(["sum", "mean", "sqrtn", "max", None, 3]),
       backend=st.sampled_from(["auto", "torch", "native"]), max_norm=st.sampled_from([None, 1.0, -1.0, math.nan]))
def test_safe_lookup(weight, values, offsets, weights, combiner, backend, max_norm):
    check(lambda: safe_embedding_lookup_sparse(weight, (values, offsets, weights), combiner=combiner, name=FEATURE,
                                               table=TABLE, max_norm=max_norm, backend=backend))
    check(lambda: safe_embedding_lookup_sparse(weight, (values, offsets), weights, name=FEATURE, table=TABLE))
    check(lambda: embedding_lookup_unpooled(weight, (values, offsets), name=FEATURE, table=TABLE, backend=backend))


@FUZZ
@given(rows=st.one_of(
    st.lists(st.lists(st.one_of(NUMBERS, JUNK, st.floats(allow_nan=True)), max_size=3), max_size=3),
    ANY), wrows=st.one_of(st.none(), st.lists(st.lists(st.one_of(st.floats(), JUNK), max_size=3), max_size=3)),
    device=st.sampled_from([None, "cpu", "meta"]))
def test_from_lists(rows, wrows, device):
    weights = None if wrows is None else {FEATURE: wrows}
    check(lambda: SparseFeatures.from_lists({FEATURE: rows}, weights, device=device))


@FUZZ
@given(a=ANY, b=OFFSETS, c=WEIGHTS, shape=st.one_of(st.none(), st.lists(st.integers(-1, 5), max_size=3), JUNK),
       padding=st.sampled_from([-1, 0, 3]), batch_size=st.one_of(st.none(), st.integers(-1, 4)))
def test_tensor_converters(a, b, c, shape, padding, batch_size):
    check(lambda: SparseFeatures.from_dense_padded([FEATURE], a, c, padding=padding))
    check(lambda: SparseFeatures.from_coo(FEATURE, b, a, shape, c, batch_size=batch_size))
    check(lambda: SparseFeatures.from_coo({FEATURE: (b, a, shape)}, batch_size=batch_size))
    check(lambda: SparseFeatures.from_coo([FEATURE, "g"], b, a, shape, c))
    check(lambda: SparseFeatures.from_csr({FEATURE: (b, a, c)}, batch_size=batch_size))
    check(lambda: SparseFeatures.from_dict({FEATURE: (a, b, c)}, batch_size=batch_size))
    check(lambda: SparseFeatures.from_sparse_coo_tensors({FEATURE: a}))


def test_fuzz_helpers_make_what_they_say():
    """The strategies above reach the cases they are meant to within the fuzz tests' examples (else the fuzz
    would be vacuous)."""
    seen = set()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None)
    @given(t=tensors())
    def probe(t):
        seen.add(("meta" if t.device.type == "meta" else "real", t.is_contiguous(), t.dtype))

    probe()
    assert {s[0] for s in seen} == {"meta", "real"} and {s[1] for s in seen} == {True, False}
    assert {s[2] for s in seen} == set(DTYPES)


@FUZZ
@given(weights=st.one_of(ANY, st.lists(st.one_of(tensors(ndim=2), ANY), max_size=2),
                         st.dictionaries(st.sampled_from([TABLE, TABLE + "2"]), st.one_of(tensors(ndim=2), ANY))),
       batch=st.one_of(ANY, st.just("valid")), backend=st.sampled_from(["auto", "torch", "native"]))
def test_fused_lookup_with_junk_tables_or_batch(weights, batch, backend):
    sf = SparseFeatures.from_lists({FEATURE: [[1, 2], [], [3]]}) if batch == "valid" else batch
    lookup = FusedEmbeddingLookup([TableSpec(TABLE, 3, num_rows=10)], [FeatureSpec(FEATURE, TABLE)], backend=backend)
    check(lambda: lookup(weights, sf))
    check(lambda: lookup.prepare(sf, weights if isinstance(weights, list) else ()))
    if isinstance(weights, dict):
        check(lambda: fused_embedding_lookup(weights, sf, [FeatureSpec(FEATURE, TABLE)], backend=backend))
