"""Fused multi-table lookup: many features, shared tables, mixed dims, op count, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from hugeembed import ConfigError, InputError
from hugeembed.features import SparseFeatures
from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec, fused_embedding_lookup

from .test_safe_lookup import BACKENDS, backend_device_params, skip_native_on_accelerator, tol
from .tf_oracle import safe_lookup, unpooled_lookup


def make_batch(bags_per_feature: dict[str, list[list[int]]], weights: dict[str, list[list[float]]] | None = None):
    keys = list(bags_per_feature)
    values, lengths, ws = [], [], []
    for k in keys:
        for b, bag in enumerate(bags_per_feature[k]):
            values += bag
            lengths.append(len(bag))
            if weights is not None:
                ws += weights[k][b]
    w = torch.tensor(ws, dtype=torch.float32) if weights is not None else None
    return SparseFeatures(keys, torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64),
                          weights=w)


@pytest.mark.parametrize("backend,device", backend_device_params())
@given(data=st.data())
def test_many_features_many_tables_match_per_feature_oracle(backend, device, data):
    B = data.draw(st.integers(0, 5))
    tables = {"a": torch.randn(9, 4), "b": torch.randn(5, 8), "c": torch.randn(7, 4)}
    bag = lambda rows: st.lists(st.integers(-1, rows - 1), max_size=4)
    feats = {
        "f1": data.draw(st.lists(bag(9), min_size=B, max_size=B)),
        "f2": data.draw(st.lists(bag(5), min_size=B, max_size=B)),
        "f3": data.draw(st.lists(bag(9), min_size=B, max_size=B)),  # shares table a with f1
        "seq": data.draw(st.lists(bag(7), min_size=B, max_size=B)),
    }
    specs = [
        FeatureSpec("f1", "a", combiner="sum"),
        FeatureSpec("f2", "b", combiner="sqrtn", default_id=2),
        FeatureSpec("f3", "a", combiner="mean"),
        FeatureSpec("seq", "c", combiner="none"),
        FeatureSpec("f1_again", "c", source="f1", combiner="mean"),  # one input feature, two tables
    ]
    max_norm = {"a": 1.0}
    # f1_again reads table c (7 rows) with ids up to 8: prune those
    specs[4] = FeatureSpec("f1_again", "c", source="f1", combiner="mean", out_of_range="prune")
    sf = make_batch(feats).to(device)
    out = fused_embedding_lookup({k: v.to(device) for k, v in tables.items()}, sf, specs, max_norm=max_norm,
                                 backend=backend)
    assert out.keys() == ("f1", "f2", "f3", "f1_again")
    one = lambda rows: [[(i, 1.0) for i in b] for b in rows]
    np_t = {k: v.double().numpy() for k, v in tables.items()}
    expect = {
        "f1": safe_lookup(np_t["a"], one(feats["f1"]), "sum", None, 1.0),
        "f2": safe_lookup(np_t["b"], one(feats["f2"]), "sqrtn", 2, None),
        "f3": safe_lookup(np_t["a"], one(feats["f3"]), "mean", None, 1.0),
        "f1_again": safe_lookup(np_t["c"], one(feats["f1"]), "mean", None, None, out_of_range="prune"),
    }
    for name, ref in expect.items():
        torch.testing.assert_close(out[name].cpu().double(), torch.from_numpy(ref).reshape(B, ref.shape[1]),
                                   rtol=1e-5, atol=1e-5)
    seq = unpooled_lookup(np_t["c"], one(feats["seq"]))
    assert out.unpooled["seq"].lengths().tolist() == [len(r) for r in seq]
    # concat is plan order; groups are per dim
    assert out.concat().shape == (B, 4 + 8 + 4 + 4)
    torch.testing.assert_close(out.concat()[:, 4:12], out["f2"])
    assert [g.shape[1:] for g in out.groups()] == [(3, 4), (1, 8)]


def test_stacked_is_a_view_for_dlrm(device):
    tables = {f"t{i}": torch.randn(10, 8, device=device) for i in range(3)}
    specs = [FeatureSpec(f"f{i}", f"t{i}", combiner="sum") for i in range(3)]
    sf = make_batch({f"f{i}": [[1], [2]] for i in range(3)}).to(device)
    out = fused_embedding_lookup(tables, sf, specs)
    st_ = out.stacked()
    assert st_.shape == (2, 3, 8) and st_.is_contiguous()
    assert out.concat().data_ptr() == st_.data_ptr()  # no copy


def test_batch_may_hold_extra_features_in_any_order(device):
    t = torch.randn(10, 4)
    sf = make_batch({"other": [[1], [2]], "f": [[3], [4, 5]]}).to(device)
    out = fused_embedding_lookup({"t": t.to(device)}, sf, [FeatureSpec("f", "t", combiner="sum")])
    torch.testing.assert_close(out["f"].cpu(), torch.stack([t[3], t[4] + t[5]]))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_op_count_does_not_grow_with_features_sharing_a_dim(backend, device):
    skip_native_on_accelerator(backend, device)

    def ops(n_features: int) -> int:
        tables = [TableSpec("t", 8, num_rows=100)]
        specs = [FeatureSpec(f"f{i}", "t", combiner="sum") for i in range(n_features)]
        lookup = FusedEmbeddingLookup(tables, specs, backend=backend)
        W = torch.randn(100, 8, device=device, requires_grad=True)
        sf = make_batch({f"f{i}": [[i, i + 1], [i + 2]] for i in range(n_features)}).to(device)
        lookup([W], sf)  # warm caches of the plan
        with _CountOps() as counter:
            out = lookup([W], sf)
            out.concat().sum().backward()
        return counter.count

    assert ops(2) == ops(20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_are_clear_errors(backend):
    W = torch.randn(6, 4)
    lookup = FusedEmbeddingLookup([TableSpec("users", 4, num_rows=6)], [FeatureSpec("user", "users")], backend=backend)
    ok = make_batch({"user": [[1], [2]]})
    with pytest.raises(InputError, match="ids must be int64"):
        lookup([W], SparseFeatures(["user"], ok.values().int(), offsets=ok.offsets()))
    with pytest.raises(InputError, match="offsets must be int32 or int64"):
        lookup([W], SparseFeatures(["user"], ok.values(), offsets=ok.offsets().float()))
    with pytest.raises(InputError, match=r"feature 'user': offsets decrease at sample 1 \(5 -> 2\)"):
        lookup([W], SparseFeatures(["user"], ok.values(), offsets=torch.tensor([0, 5, 2])))
    with pytest.raises(InputError, match=r"feature 'user': weight nan of id 2 at sample 1 is not finite"):
        lookup([W], SparseFeatures(["user"], ok.values(), offsets=ok.offsets(), weights=torch.tensor([1.0, float("nan")])))
    with pytest.raises(InputError, match="weights must be floating point"):
        lookup([W], SparseFeatures(["user"], ok.values(), offsets=ok.offsets(), weights=torch.tensor([1, 2])))
    with pytest.raises(InputError, match=r"batch lacks features \['user'\]"):
        lookup([W], make_batch({"item": [[1]]}))
    with pytest.raises(InputError, match="table 'users': has 3 rows, spec says 6"):
        lookup([W[:3]], ok)
    with pytest.raises(InputError, match=r"id 7 at sample 1 is out of range for table 'users' of 6 rows"):
        lookup([W], make_batch({"user": [[1], [0, 7]]}))
    # offsets that start past 0: the batch's error comes first, also before backend='native'
    # refuses tables it cannot read (float64)
    late = SparseFeatures(["user"], ok.values(), offsets=torch.tensor([1, 2]))
    for w in (W, W.double()):
        with pytest.raises(InputError, match="offsets must start at 0, got 1"):
            lookup([w], late)


def test_a_batch_missing_features_with_bad_offsets_reports_its_offsets_first():
    """On the native path the count kernel checks the offsets' ends; a batch that also lacks
    the plan's features still reports its offsets first, as every native entry point did."""
    W = torch.randn(10, 3)
    sf = SparseFeatures(["extra"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 1]))
    f = FusedEmbeddingLookup([TableSpec("t", 3, num_rows=10)], [FeatureSpec("a", "t")], backend="native")
    for call in (lambda: f.prepare(sf, [W]), lambda: f.forward_static([W], sf), lambda: f([W.requires_grad_()], sf)):
        with pytest.raises(InputError, match="feature 'extra': lengths sum to 1"):
            call()


def test_bad_configs_are_clear_errors():
    with pytest.raises(ConfigError, match="table 'x': dim must be a positive int, got -4"):
        TableSpec("x", -4, num_rows=3)
    with pytest.raises(ConfigError, match="num_rows must be an int >= 0"):
        TableSpec("x", 4, num_rows=-1)
    with pytest.raises(ConfigError, match="max_norm must be a positive finite number"):
        TableSpec("x", 4, max_norm=0.0)
    with pytest.raises(ConfigError, match="unknown Combiner 'avg'"):
        FeatureSpec("f", "x", combiner="avg")
    with pytest.raises(ConfigError, match="out_of_range='default' needs a default_id"):
        FeatureSpec("f", "x", out_of_range="default")
    with pytest.raises(ConfigError, match="reads unknown table 'y'"):
        FusedEmbeddingLookup([TableSpec("x", 4, num_rows=3)], [FeatureSpec("f", "y")])
    with pytest.raises(ConfigError, match="default_id 5 is outside table 'x' of 3 rows"):
        FusedEmbeddingLookup([TableSpec("x", 4, num_rows=3)], [FeatureSpec("f", "x", default_id=5)])
    with pytest.raises(ConfigError, match="duplicate feature output names"):
        FusedEmbeddingLookup([TableSpec("x", 4, num_rows=3)], [FeatureSpec("f", "x"), FeatureSpec("f", "x")])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_without_dedup_equals_dedup_and_refuses_backward(backend, device):
    skip_native_on_accelerator(backend, device)
    g = torch.Generator().manual_seed(5)  # drawn on the CPU, then moved: the same numbers on every device
    tables = [TableSpec("a", 8, num_rows=70_000), TableSpec("b", 8, num_rows=50)]
    lookup = FusedEmbeddingLookup(tables, [FeatureSpec("x", "a", combiner="sum"), FeatureSpec("y", "b")],
                                  backend=backend)
    W = [torch.randn(70_000, 8, generator=g).to(device), torch.randn(50, 8, generator=g).to(device)]
    ids = {"x": [[int(i) for i in torch.randint(0, 70_000, (k,), generator=g)] for k in (3, 0, 5, 1)],
           "y": [[1, 1, 2], [7], [], [3, 3]]}
    sf = make_batch(ids).to(device)
    full = lookup.prepare(sf, W)
    lean = lookup.prepare(sf, W, deduplicate=False)
    assert lean.capacity == sf.values().numel() and sum(full.unique_count) < lean.capacity
    a = lookup.lookup(full, W, lookup.static_slots(full)).concat()
    b = lookup.lookup(lean, W, lookup.static_slots(lean)).concat()
    # bit-identical on the CPU; on CUDA the bag sums are atomic adds, in no fixed order
    exact = device.type == "cpu"
    torch.testing.assert_close(a, b, rtol=0 if exact else tol(device, 0), atol=0 if exact else tol(device, 0))
    with pytest.raises(ConfigError, match="deduplicate=False"):
        lookup.lookup(lean, W, lookup.static_slots(lean), params=[torch.zeros(0, requires_grad=True)],
                      row_grad_hook=lambda *args: None)


@given(data=st.data())
def test_one_pass_static_forward_is_bit_identical_to_prepare_and_lookup(data):
    """forward_static (inference) against the two-stage path it replaces, every TF rule in play."""
    B = data.draw(st.integers(0, 6))
    weighted = data.draw(st.booleans())
    g = torch.Generator().manual_seed(B)
    W = [torch.randn(9, 4, generator=g), torch.randn(6, 8, generator=g), torch.randn(7, 4, generator=g)]
    tables = [TableSpec("a", 4, num_rows=9, max_norm=data.draw(st.sampled_from([None, 1.0]))),
              TableSpec("b", 8, num_rows=6), TableSpec("c", 4, num_rows=7)]
    bag = st.lists(st.tuples(st.integers(-2, 10), st.sampled_from([0.0, -1.0, 0.5, 2.0])), max_size=5)
    feats = {k: data.draw(st.lists(bag, min_size=B, max_size=B)) for k in ("f1", "f2", "f3")}
    specs = [
        FeatureSpec("f1", "a", combiner=data.draw(st.sampled_from(["sum", "mean", "sqrtn"])), out_of_range="prune"),
        FeatureSpec("f2", "b", combiner="sqrtn", default_id=2, out_of_range="default"),
        FeatureSpec("f3", "c", combiner="mean", default_id=1, out_of_range="prune", prune_negative=True),
        FeatureSpec("f1c", "c", source="f1", combiner="sum", out_of_range="prune"),
    ]
    sf = make_batch({k: [[i for i, _ in b] for b in v] for k, v in feats.items()},
                    {k: [[w for _, w in b] for b in v] for k, v in feats.items()} if weighted else None)
    lookup = FusedEmbeddingLookup(tables, specs, backend="native")
    one_pass = lookup.forward_static(W, sf)
    assert one_pass is not None
    prep = lookup.prepare(sf, W, deduplicate=False)
    two_stage = lookup.lookup(prep, W, lookup.static_slots(prep))
    for a, b in zip(one_pass.groups(), two_stage.groups()):
        assert torch.equal(a, b)


def test_one_pass_forward_hands_errors_to_the_two_stage_path():
    lookup = FusedEmbeddingLookup([TableSpec("a", 4, num_rows=5)], [FeatureSpec("f", "a")], backend="native")
    W = [torch.randn(5, 4)]
    bad = make_batch({"f": [[1, 7]]})
    # id 7 >= 5: the one-pass kernel only detects it; the two-stage prepare reports the details,
    # whether forward_static is called directly or through the lookup
    with pytest.raises(InputError, match="id 7 at sample 0 is out of range for table 'a' of 5 rows"):
        lookup.forward_static(W, bad)
    with pytest.raises(InputError, match="id 7 at sample 0 is out of range for table 'a' of 5 rows"):
        lookup(W, bad)
    seq = FusedEmbeddingLookup([TableSpec("a", 4, num_rows=5)], [FeatureSpec("f", "a", combiner="none")])
    assert seq.forward_static(W, make_batch({"f": [[1]]})) is None  # sequence features: the two-stage path


def _streamed_batch(B: int, F: int, rows: int, g: torch.Generator) -> SparseFeatures:
    lengths = torch.randint(0, 4, (F * B,), generator=g)
    values = torch.randint(-1, rows + 2, (int(lengths.sum()),), generator=g)  # -1 and ids past the end too
    return SparseFeatures([f"f{k}" for k in range(F)], values, lengths=lengths, batch_size=B)


@pytest.mark.slow
@pytest.mark.parametrize("D", [64, 128])  # 64: sums kept in registers, 128: in a buffer
def test_outputs_larger_than_the_cache_are_streamed_bit_identically(D):
    """A pooled output larger than the last-level cache (40 MiB; 32 MiB here) is written with
    streaming stores by the native kernels (csrc/lookup_rows.h::streams): one pass and two
    stages give the same bits, and both the sums of a float64 oracle, every rule in play."""
    F, rows = 8, 50
    B = (40 << 20) // (F * D * 4)
    g = torch.Generator().manual_seed(5)
    W = [torch.randn(rows, D, generator=g) for _ in range(F)]
    combiners = ["sum", "mean", "sqrtn"]
    # odd features fill empty bags and replace ids past the end with default_id; even ones prune
    specs = [FeatureSpec(f"f{k}", f"t{k}", combiner=combiners[k % 3], default_id=(k if k % 2 else None),
                         out_of_range=("default" if k % 2 else "prune")) for k in range(F)]
    lookup = FusedEmbeddingLookup([TableSpec(f"t{k}", D, num_rows=rows) for k in range(F)], specs, backend="native")
    sf = _streamed_batch(B, F, rows, g)
    one_pass = lookup.forward_static(W, sf).groups()[0]
    assert one_pass.numel() * 4 > 32 << 20
    prep = lookup.prepare(sf, W, deduplicate=False)
    torch.testing.assert_close(lookup.lookup(prep, W, lookup.static_slots(prep)).groups()[0], one_pass,
                               rtol=0, atol=0)
    # the oracle: TF's rules per bag, in float64
    lengths, values = sf.lengths().tolist(), sf.values().tolist()
    want = torch.zeros(B, F, D, dtype=torch.float64)
    at = 0
    for k, spec in enumerate(specs):
        for b in range(B):
            bag = values[at : at + lengths[k * B + b]]
            at += len(bag)
            ids = [i if i < rows else spec.default_id for i in bag if i >= 0 and (i < rows or k % 2)]
            if not ids and k % 2:
                ids = [spec.default_id]
            if ids:
                s = W[k][ids].double().sum(0)
                n = len(ids)
                want[b, k] = s / n if k % 3 == 1 else s / n ** 0.5 if k % 3 == 2 else s
    torch.testing.assert_close(one_pass.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_weights_for_a_batch_without_ids_are_the_default_ids_ones(backend):
    """A weighted batch whose bags are all empty (weights of length 0): each bag pools its
    default id with weight 1, in the prepared weights, the training forward and the gradient
    (the native kernels get no weights buffer then; they used to leave the weights unset)."""
    W = [torch.arange(40.0).reshape(10, 4)]
    lookup = FusedEmbeddingLookup([TableSpec("t", 4, num_rows=10)],
                                  [FeatureSpec("f", "t", combiner="mean", default_id=3)], backend=backend)
    sf = SparseFeatures(["f"], torch.empty(0, dtype=torch.int64), lengths=torch.zeros(3, dtype=torch.int64),
                        weights=torch.empty(0))
    torch.empty(4096).fill_(7.0)  # junk in the allocator's free memory
    assert lookup.prepare(sf, W).weights.tolist() == [1.0, 1.0, 1.0]
    w = W[0].clone().requires_grad_()
    out = lookup([w], sf).concat()
    torch.testing.assert_close(out, W[0][3].expand(3, 4))
    out.sum().backward()
    want = torch.zeros(10, 4)
    want[3] = 3.0
    torch.testing.assert_close(w.grad.to_dense(), want)


def test_torch_prepare_gives_each_kept_id_its_bag():
    # kept id j lies in the bag whose cleaned offsets span it; the pool reads the bags from the prepare
    # (one dim's features consecutive or not: d4 reads features 0 and 2, d8 feature 1)
    tables = [TableSpec("a", 4, num_rows=9), TableSpec("b", 8, num_rows=5)]
    feats = [FeatureSpec("f1", "a", combiner="sum"), FeatureSpec("f2", "b", default_id=2),
             FeatureSpec("f3", "a", source="f1", combiner="sqrtn", out_of_range="prune")]
    W = [torch.randn(9, 4), torch.randn(5, 8)]
    sf = make_batch({"f1": [[1, -1, 3], [], [8, 8]], "f2": [[4], [], [0, 0, 1]]})
    ours, native = (FusedEmbeddingLookup(tables, feats, backend=b) for b in ("torch", "native"))
    for dedup in (True, False):
        prep = ours.prepare(sf, W, deduplicate=dedup)
        offs = prep.offsets.tolist()
        assert prep.bags.tolist() == [b for b in range(len(offs) - 1) for _ in range(offs[b + 1] - offs[b])]
    torch.testing.assert_close(ours(W, sf).concat(), native(W, sf).concat())
