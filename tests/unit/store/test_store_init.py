"""Initializers: deterministic per (seed, key, column) whatever the order, batch or
backend; sane statistics; truncation bounds; the native kernel equals the torch twin
within one float32 ulp."""

from __future__ import annotations

import math

import pytest
import torch
from store_helpers import SPECIAL_KEYS, max_ulp_diff

from hugeembed import _native
from hugeembed._hashing import mix64_int
from hugeembed.errors import ConfigError, InputError
from hugeembed.store import Constant, FromCallable, HashStore, Normal, TruncatedNormal, Uniform, Zeros
from hugeembed.store._init import init_rows_native

INITS = [Uniform(-0.5, 0.25), Normal(0.1, 2.0), TruncatedNormal(0.0, 1.0), TruncatedNormal(1.0, 0.5, -1.0, 0.5),
         Constant(0.75), Zeros()]
needs_native = pytest.mark.skipif(not _native.available(), reason="native kernels not built")


def _u53(key: int, seed: int, stream: int) -> float:
    """The generator's uniform written with Python ints (an oracle for the torch code)."""
    m = (1 << 64) - 1
    base = mix64_int((key ^ mix64_int((seed + 0x9E3779B97F4A7C15) & m)) & m) & m
    x = mix64_int((base + stream * 0xD1B54A32D192ED03) & m) & m
    return (x >> 11) * 2.0**-53


def test_uniform_matches_python_oracle():
    keys = [0, 1, -5, 2**63 - 1, -(2**63)]
    got = Uniform(-1.0, 3.0).generate(torch.tensor(keys), 5, seed=7)
    want = torch.tensor([[-1.0 + 4.0 * _u53(k, 7, j) for j in range(5)] for k in keys], dtype=torch.float64)
    assert torch.equal(got, want.float())


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def test_normal_matches_inverse_cdf_oracle():
    """z = Phi^-1(u) of the column's uniform, with scipy's ndtri as the oracle of Phi^-1."""
    ndtri = pytest.importorskip("scipy.special").ndtri
    keys = [3, -9, 2**40, 0, -(2**63)]
    got = Normal(0.5, 2.0).generate(torch.tensor(keys), 5, seed=1)
    want = [[0.5 + 2.0 * float(ndtri(_u53(k, 1, j) + 2.0**-54)) for j in range(5)] for k in keys]
    assert max_ulp_diff(got, torch.tensor(want)) <= 1


def test_truncated_normal_matches_inverse_cdf_oracle():
    ndtri = pytest.importorskip("scipy.special").ndtri
    keys = list(range(-20, 20)) + [2**62]
    a, b = -1.0, 0.5
    got = TruncatedNormal(1.0, 0.5, a, b).generate(torch.tensor(keys), 6, seed=4)
    pa, pb = _phi(a), _phi(b)
    want = [[1.0 + 0.5 * min(max(float(ndtri(pa + (_u53(k, 4, j) + 2.0**-54) * (pb - pa))), a), b)
             for j in range(6)] for k in keys]
    assert max_ulp_diff(got, torch.tensor(want)) <= 1


def test_inverse_normal_cdf_against_scipy():
    """AS 241 as written here (the native kernel evaluates the same) vs scipy's ndtri."""
    ndtri = pytest.importorskip("scipy.special").ndtri
    from hugeembed.store._init import inverse_normal_cdf

    p = torch.cat([torch.linspace(1e-12, 1 - 1e-12, 20001, dtype=torch.float64),
                   torch.logspace(-300, -1, 600, dtype=torch.float64),
                   1 - torch.logspace(-16, -1, 300, dtype=torch.float64)])
    got = inverse_normal_cdf(p)
    want = torch.from_numpy(ndtri(p.numpy()))
    torch.testing.assert_close(got, want, rtol=4e-15, atol=1e-300)


@pytest.mark.parametrize("init", INITS, ids=repr)
def test_same_key_same_row_whatever_the_batch(init, device):
    keys = torch.tensor(SPECIAL_KEYS + list(range(100)), device=device)
    full = init.generate(keys, 7, seed=3)
    perm = torch.randperm(keys.numel(), device=device)
    assert torch.equal(init.generate(keys[perm], 7, seed=3), full[perm])
    assert torch.equal(init.generate(keys[5:6], 7, seed=3), full[5:6])
    # a wider table extends, not reshuffles, the columns of a narrower one
    assert torch.equal(init.generate(keys, 9, seed=3)[:, :7], full)
    if not isinstance(init, Constant):
        assert not torch.equal(init.generate(keys, 7, seed=4), full)


@needs_native
@pytest.mark.parametrize("init", INITS, ids=repr)
def test_native_kernel_equals_torch_twin(init):
    keys = torch.cat([torch.tensor(SPECIAL_KEYS), torch.randint(-(2**62), 2**62, (3000,))])
    out = torch.full((keys.numel(), 11), float("nan"))
    assert init_rows_native(init, keys, 9, 5, out, None)
    assert max_ulp_diff(out[:, :9], init.generate(keys, 9, 5)) <= 1
    assert torch.isnan(out[:, 9:]).all()  # the state columns are not the initializer's


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_store_rows_do_not_depend_on_backend_or_order(backend):
    if backend == "native" and not _native.available():
        pytest.skip("native kernels not built")
    keys = torch.randint(-(2**62), 2**62, (500,))
    a = HashStore("t", 8, initializer=Normal(0.0, 1.0), seed=11, backend=backend)
    b = HashStore("t", 8, initializer=Normal(0.0, 1.0), seed=11, backend="torch")
    ra = a.gather(a.find_or_insert(keys, 0))
    b.find_or_insert(keys.flip(0)[:250], 0)
    rb = b.gather(b.find_or_insert(keys, 1))
    assert max_ulp_diff(ra, rb) <= 1


def test_statistics():
    keys = torch.arange(20000)
    u = Uniform(-2.0, 1.0).generate(keys, 16, 0).double()
    assert u.min() >= -2.0 and u.max() < 1.0
    assert abs(u.mean() + 0.5) < 0.01 and abs(u.std() - 3 / math.sqrt(12)) < 0.01
    n = Normal(1.0, 3.0).generate(keys, 16, 0).double()
    assert abs(n.mean() - 1.0) < 0.03 and abs(n.std() - 3.0) < 0.03
    # columns and keys are independent: no correlation between neighbouring columns
    assert abs(torch.corrcoef(n[:, :2].T)[0, 1]) < 0.03
    t = TruncatedNormal(0.5, 2.0).generate(keys, 16, 0).double()
    assert t.min() >= 0.5 - 4.0 and t.max() <= 0.5 + 4.0
    # a normal truncated at +-2 std has std 0.8796 std
    assert abs(t.mean() - 0.5) < 0.03 and abs(t.std() - 2.0 * 0.8796) < 0.03
    # values near the edge exist: the truncation samples the whole interval, it does not squash
    assert (t > 0.5 + 3.9).any() and (t < 0.5 - 3.9).any()
    assert (t == 0.5 + 4.0).float().mean() < 1e-3  # and no mass piles up on the bounds
    asym = TruncatedNormal(0.0, 1.0, -0.5, 3.0).generate(keys, 4, 0)
    assert asym.min() >= -0.5 and asym.max() <= 3.0


def test_constant_zeros_and_callable():
    keys = torch.tensor([4, -1])
    assert torch.equal(Constant(2.5).generate(keys, 3, 0), torch.full((2, 3), 2.5))
    assert torch.equal(Zeros().generate(keys, 3, 0), torch.zeros(2, 3))
    f = FromCallable(lambda k, d: k[:, None].float().expand(-1, d) * 0.5)
    assert torch.equal(f.generate(keys, 2, 0), torch.tensor([[2.0, 2.0], [-0.5, -0.5]]))
    store = HashStore("t", 2, initializer=f)
    assert torch.equal(store.gather(store.find_or_insert(keys, 0)), torch.tensor([[2.0, 2.0], [-0.5, -0.5]]))
    with pytest.raises(InputError, match=r"shape \(2, 2\)"):
        FromCallable(lambda k, d: torch.zeros(3)).generate(keys, 2, 0)


@pytest.mark.parametrize("make", [lambda: Uniform(1.0, 1.0), lambda: Normal(0.0, 0.0), lambda: Constant(math.nan),
                                  lambda: TruncatedNormal(0.0, 1.0, 2.0, -2.0), lambda: FromCallable(3),
                                  lambda: Zeros(1.0)])
def test_bad_initializer_config(make):
    with pytest.raises(ConfigError):
        make()
