"""safe_embedding_lookup_sparse against the NumPy oracle of TF's semantics and embedding_bag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from hugeembed import InputError, _native
from hugeembed.functional import embedding_lookup_unpooled, safe_embedding_lookup_sparse

from tests.conftest import DEVICES

from .tf_oracle import OracleIdError, safe_lookup, unpooled_lookup

BACKENDS = ["native", "torch"]
NATIVE_IS_CPU_ONLY = ("the native kernels run on CPU only (backend='native' on CUDA: "
                      "test_native_backend_on_cuda_refuses)")


def backend_device_params():
    """(backend, device) pairs for hypothesis tests (a function-scoped fixture would not reset per
    example): every backend on CPU; on CUDA only the torch twin, native marked skipped."""
    return [pytest.param(b, d, id=f"{b}-{d}", marks=[pytest.mark.skip(reason=NATIVE_IS_CPU_ONLY)] if
                         b == "native" and d != "cpu" else [])
            for d in DEVICES for b in BACKENDS]


def skip_native_on_accelerator(backend: str, device: torch.device) -> None:
    if backend == "native" and device.type != "cpu":
        pytest.skip(NATIVE_IS_CPU_ONLY)


def tol(device: torch.device | str, cpu: float) -> float:
    """A tolerance: `cpu` on the CPU; on an accelerator at least 1e-5 (float32 reductions run in
    another order there: atomic adds, other blockings)."""
    return cpu if torch.device(device).type == "cpu" else max(cpu, 1e-5)


def to_tensors(bags, with_weights, offsets_dtype=torch.int64):
    values = [i for bag in bags for i, _ in bag]
    weights = [w for bag in bags for _, w in bag]
    offsets = np.cumsum([0] + [len(b) for b in bags])
    v = torch.tensor(values, dtype=torch.int64)
    o = torch.tensor(offsets, dtype=offsets_dtype)
    w = torch.tensor(weights, dtype=torch.float32) if with_weights else None
    return v, o, w


@st.composite
def batches(draw, max_rows=12):
    rows = draw(st.integers(1, max_rows))
    with_weights = draw(st.booleans())
    weight = st.sampled_from([0.0, -1.0, 0.5, 1.0, 2.0, 3.25]) if with_weights else st.just(1.0)
    bag = st.lists(st.tuples(st.integers(-2, rows - 1), weight), max_size=5)
    bags = draw(st.lists(bag, max_size=7))
    return rows, bags, with_weights


@pytest.mark.parametrize("backend,device", backend_device_params())
@given(case=batches(), combiner=st.sampled_from(["sum", "mean", "sqrtn"]), use_default=st.booleans(),
       max_norm=st.sampled_from([None, 0.5, 2.0]), dim=st.sampled_from([1, 3, 8]),
       offsets_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_matches_tf_oracle(backend, device, case, combiner, use_default, max_norm, dim, offsets_dtype):
    rows, bags, with_weights = case
    table = torch.randn(rows, dim, dtype=torch.float64)
    default_id = rows - 1 if use_default else None
    expected = safe_lookup(table.numpy(), bags, combiner, default_id, max_norm)
    v, o, w = (None if t is None else t.to(device) for t in to_tensors(bags, with_weights, offsets_dtype))
    got = safe_embedding_lookup_sparse(table.float().to(device), (v, o, w), combiner=combiner, default_id=default_id,
                                       max_norm=max_norm, backend=backend)
    assert got.shape == (len(bags), dim) and got.device.type == torch.device(device).type
    torch.testing.assert_close(got.cpu().double(), torch.from_numpy(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@given(case=batches(), combiner=st.sampled_from(["sum", "mean", "sqrtn"]), max_norm=st.sampled_from([None, 1.0]))
def test_float64_tables_exact_to_oracle(device, case, combiner, max_norm):
    rows, bags, with_weights = case
    table = torch.randn(rows, 4, dtype=torch.float64)
    v, o, w = to_tensors(bags, with_weights)
    w = None if w is None else w.double().to(device)
    # float64 on any device: summation order moves the result by ~1e-16, far inside 1e-12
    got = safe_embedding_lookup_sparse(table.to(device), (v.to(device), o.to(device), w), combiner=combiner,
                                       max_norm=max_norm)
    assert got.dtype == torch.float64
    expected = safe_lookup(table.numpy(), bags, combiner, None, max_norm)
    torch.testing.assert_close(got.cpu(), torch.from_numpy(expected), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_half_precision_tables(dtype, combiner, device):
    bags = [[(1, 1.0), (2, 1.0)], [], [(3, 1.0), (3, 1.0), (0, 1.0)]]
    table = torch.randn(5, 8).to(dtype)
    v, o, _ = to_tensors(bags, False)
    got = safe_embedding_lookup_sparse(table.to(device), (v.to(device), o.to(device)), combiner=combiner)
    assert got.dtype == dtype
    expected = safe_lookup(table.double().numpy(), bags, combiner)
    torch.testing.assert_close(got.cpu().double(), torch.from_numpy(expected), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend,device", backend_device_params())
@pytest.mark.parametrize("mode", ["sum", "mean"])
@given(case=batches())
def test_matches_embedding_bag_where_semantics_coincide(backend, device, mode, case):
    """No negative ids, no default, positive weights only with sum: embedding_bag is the same op."""
    rows, bags, _ = case
    bags = [[(abs(i), 1.0) for i, _ in bag] for bag in bags]
    table = torch.randn(rows + 2, 5)
    v, o, _ = to_tensors(bags, False)
    got = safe_embedding_lookup_sparse(table.to(device), (v.to(device), o.to(device)), combiner=mode, backend=backend)
    ref = F.embedding_bag(v, table, o[:-1], mode=mode) if bags else torch.zeros(0, 5)  # on the CPU
    torch.testing.assert_close(got.cpu(), ref, rtol=tol(device, 1e-6), atol=tol(device, 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_weighted_sum_matches_embedding_bag_per_sample_weights(backend, device):
    skip_native_on_accelerator(backend, device)
    g = torch.Generator().manual_seed(3)  # drawn on the CPU (the same numbers on every device), then moved
    table = torch.randn(50, 7, generator=g)
    v = torch.randint(0, 50, (40,), generator=g)
    o = torch.tensor([0, 3, 3, 10, 25, 40])
    w = torch.rand(40, generator=g) + 0.1
    got = safe_embedding_lookup_sparse(table.to(device), (v.to(device), o.to(device), w.to(device)), combiner="sum",
                                       backend=backend)
    ref = F.embedding_bag(v, table, o[:-1], mode="sum", per_sample_weights=w)
    torch.testing.assert_close(got.cpu(), ref, rtol=tol(device, 1e-6), atol=tol(device, 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_empty_batch_and_zero_batch(backend, device):
    skip_native_on_accelerator(backend, device)
    table = torch.randn(4, 3)
    v = torch.zeros(0, dtype=torch.int64, device=device)
    z4, z1 = torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    got = safe_embedding_lookup_sparse(table.to(device), (v, z4), backend=backend)
    assert got.device.type == device.type and torch.equal(got.cpu(), torch.zeros(3, 3))
    got = safe_embedding_lookup_sparse(table.to(device), (v, z4), default_id=2, backend=backend)
    torch.testing.assert_close(got.cpu(), table[2].expand(3, 3))
    got = safe_embedding_lookup_sparse(table.to(device), (v, z1), backend=backend)
    assert got.shape == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["prune", "default"])
def test_out_of_range_policies(backend, policy, device):
    skip_native_on_accelerator(backend, device)
    rows = 6
    bags = [[(2, 1.0), (9, 1.0)], [(17, 1.0)], [(5, 1.0), (-1, 1.0)]]
    table = torch.randn(rows, 4, dtype=torch.float64)
    v, o, _ = to_tensors(bags, False)
    got = safe_embedding_lookup_sparse(table.float().to(device), (v.to(device), o.to(device)), combiner="sum",
                                       default_id=0, out_of_range=policy, backend=backend)
    expected = safe_lookup(table.numpy(), bags, "sum", 0, None, out_of_range=policy)
    torch.testing.assert_close(got.cpu().double(), torch.from_numpy(expected), rtol=tol(device, 1e-6),
                               atol=tol(device, 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_is_an_error_naming_feature_table_id_and_size(backend):
    table = torch.randn(6, 4)
    v, o, _ = to_tensors([[(1, 1.0)], [(2, 1.0), (6, 1.0)]], False)
    with pytest.raises(InputError, match=r"feature 'user'.*id 6 at sample 1.*table 'users' of 6 rows"):
        safe_embedding_lookup_sparse(table, (v, o), name="user", table="users", backend=backend)
    with pytest.raises(OracleIdError):  # the oracle agrees it is an error
        safe_lookup(table.double().numpy(), [[(1, 1.0)], [(2, 1.0), (6, 1.0)]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_ids_kept_when_not_pruned_are_out_of_range(backend):
    table = torch.randn(6, 4)
    v, o, _ = to_tensors([[(-3, 1.0)]], False)
    with pytest.raises(InputError, match="id -3"):
        safe_embedding_lookup_sparse(table, (v, o), prune_negative=False, backend=backend)


@pytest.mark.parametrize("backend,device", backend_device_params())
@given(case=batches(), max_norm=st.sampled_from([None, 1.0]))
def test_unpooled_matches_oracle(backend, device, case, max_norm):
    rows, bags, with_weights = case
    table = torch.randn(rows, 3, dtype=torch.float64)
    v, o, w = (None if t is None else t.to(device) for t in to_tensors(bags, with_weights))
    got = embedding_lookup_unpooled(table.float().to(device), (v, o, w), max_norm=max_norm, backend=backend)
    expected = unpooled_lookup(table.numpy(), bags, max_norm)
    assert got.lengths().tolist() == [len(x) for x in expected]
    flat = [r for rows_ in expected for r in rows_]
    ref = torch.tensor(np.array(flat), dtype=torch.float64) if flat else torch.zeros(0, 3, dtype=torch.float64)
    torch.testing.assert_close(got.values.cpu().double(), ref, rtol=1e-5, atol=1e-5)


ACCELERATORS = [d for d in DEVICES if d != "cpu"]
needs_accelerator = pytest.mark.skipif(not ACCELERATORS, reason="CUDA parity needs a GPU")


@needs_accelerator
@pytest.mark.parametrize("device", ACCELERATORS or ["cuda"])
def test_cuda_matches_cpu(device):
    """The torch twin on the accelerator against the CPU (native kernels under "auto"): forward
    and the sparse gradient, with every TF rule in play (pruned ids, weights, default, clipping)."""
    g = torch.Generator().manual_seed(11)
    table = torch.randn(100, 16, generator=g)
    v = torch.randint(-1, 100, (500,), generator=g)
    o = torch.arange(0, 501, 5)
    o[7:9] = o[6]  # two empty bags: they read the default row
    w = torch.rand(500, generator=g)
    up = torch.randn(100, 16, generator=g)
    for combiner in ("sum", "mean", "sqrtn"):
        kw = dict(combiner=combiner, max_norm=1.0, default_id=3)
        W_cpu, W_dev = table.clone().requires_grad_(), table.clone().to(device).requires_grad_()
        cpu = safe_embedding_lookup_sparse(W_cpu, (v, o, w), **kw)
        dev = safe_embedding_lookup_sparse(W_dev, (v.to(device), o.to(device), w.to(device)), **kw)
        assert dev.device.type == torch.device(device).type
        torch.testing.assert_close(dev.detach().cpu(), cpu.detach(), rtol=1e-5, atol=1e-5)
        (cpu * up).sum().backward()
        (dev * up.to(device)).sum().backward()
        assert W_dev.grad.is_sparse
        torch.testing.assert_close(W_dev.grad.to_dense().cpu(), W_cpu.grad.to_dense(), rtol=1e-5, atol=1e-5)


@needs_accelerator
@pytest.mark.parametrize("device", ACCELERATORS or ["cuda"])
def test_native_backend_on_cuda_refuses(device):
    """backend="native" on an accelerator batch is a clear error (the kernels are CPU-only), never a
    silent fallback; "auto" takes the torch twin there."""
    table = torch.randn(6, 4, device=device)
    ids = (torch.tensor([1, 2, 3], device=device), torch.tensor([0, 1, 3], device=device))
    if _native.available():
        with pytest.raises(InputError, match="backend='native' needs CPU float32 tables and a CPU batch"):
            safe_embedding_lookup_sparse(table, ids, backend="native")
    else:  # kernels not built (or disabled) on this machine: the error says how to build them
        with pytest.raises(ImportError, match="native"):
            safe_embedding_lookup_sparse(table, ids, backend="native")
    got = safe_embedding_lookup_sparse(table, ids, combiner="sum", backend="auto")
    torch.testing.assert_close(got.cpu(), torch.stack([table[1], table[2] + table[3]]).cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [70_000, 300])  # above and below the size where dedup switches to a hash
def test_large_and_small_static_tables_match_embedding_bag(backend, rows, device):
    skip_native_on_accelerator(backend, device)
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(rows, 8, generator=g)
    v = torch.randint(0, rows, (3000,), generator=g)
    v[::7] = v[0]  # plenty of duplicates
    o = torch.arange(0, 3001, 3)
    ids = (v.to(device), o.to(device))
    for mode in ("sum", "mean"):
        got = safe_embedding_lookup_sparse(table.to(device), ids, combiner=mode, backend=backend)
        torch.testing.assert_close(got.cpu(), F.embedding_bag(v, table, o[:-1], mode=mode), rtol=tol(device, 1e-6),
                                   atol=tol(device, 1e-6))
    W = table.clone().to(device).requires_grad_()
    safe_embedding_lookup_sparse(W, ids, combiner="sum", backend=backend).sum().backward()
    expected = torch.bincount(v, minlength=rows).float()
    g_dense = W.grad.to_dense().cpu()
    torch.testing.assert_close(g_dense[:, 0], expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_clip_rows_rounds_max_norm_to_the_rows_dtype(dtype):
    """TF's clip_by_norm with max_norm held in the rows' dtype (a half-precision table clips
    at 0.1 rounded to half), though clip_rows takes it as a Python scalar (no copy to the
    device per call)."""
    from hugeembed.functional import clip_rows

    rows = torch.randn(200, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    for max_norm in (0.1, 0.7, 3.3):
        c = torch.tensor(max_norm, dtype=dtype)
        norm = torch.sqrt((rows * rows).sum(dim=1, keepdim=True))
        assert torch.equal(clip_rows(rows, max_norm), (rows * c) / torch.maximum(norm, c)), max_norm
