"""choose_victims (store/_evict.py: the one victim chooser of the dynamic store's eviction and the
tiered cache; he_choose_victims in csrc/victims.cpp, lowest_k off the CPU) against a plain-Python
oracle: the candidates (valid, not excluded) sorted by the policy's columns and the first `want` of
them taken.  Both backends: the native kernel and the torch selection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hugeembed import _native
from hugeembed.store._evict import choose_victims, policy_columns

BACKENDS = ["native", "torch"] if _native.available() else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(_native, "available", lambda: False)
    return request.param

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def oracle(owner, tick, keys, freq, exclude, min_take, want):
    """freq None: the columns (tick, key); else (freq, tick, key)."""
    skip = set(exclude)
    cand = [s for s in range(len(owner)) if owner[s] >= 0 and s not in skip]
    if len(cand) < min_take:
        return len(cand), []
    if freq is None:
        order = sorted(cand, key=lambda s: (tick[s], keys[s]))
    else:
        order = sorted(cand, key=lambda s: (freq[s], tick[s], keys[s]))
    return len(cand), sorted(order[: max(0, min(len(cand), want))])


def cache_victims(owner, tick, keys, freq, exclude, min_take, want):
    cols = [tick, keys] if freq is None else [freq, tick, keys]
    return choose_victims(cols, want, owner, exclude, min_take)


@st.composite
def caches(draw):
    cap = draw(st.integers(0, 120))
    resident = draw(st.lists(st.booleans(), min_size=cap, max_size=cap))
    owner = [draw(st.integers(0, 10**6)) if r else -1 for r in resident]
    span = draw(st.sampled_from([1, 2, 3, 50]))  # few distinct values: many ties
    extreme = st.sampled_from([I64_MIN, I64_MIN + 1, -1, 0, 1, I64_MAX - 1, I64_MAX])
    tick = [draw(st.one_of(st.integers(0, span), extreme)) for _ in range(cap)]
    # keys unique among resident slots (negatives and the int64 extremes among them); an empty
    # slot keeps whatever key it held, so it may repeat a resident one
    pool = draw(st.lists(st.one_of(st.integers(I64_MIN, I64_MAX), extreme), min_size=cap, max_size=cap,
                         unique=True))
    keys = [pool[s] if resident[s] or not draw(st.booleans()) or cap == 0 else pool[0] for s in range(cap)]
    freq = None
    if draw(st.booleans()):
        freq = [draw(st.one_of(st.integers(0, span), st.sampled_from([I32_MIN, -1, I32_MAX]))) for _ in range(cap)]
    exclude = draw(st.lists(st.integers(-3, max(cap - 1, -1)), max_size=40))  # repeats, -1s, empty slots
    min_take = draw(st.integers(0, cap + 3))
    want = draw(st.integers(0, cap + 5))
    return owner, tick, keys, freq, exclude, min_take, want


def run(owner, tick, keys, freq, exclude, min_take, want):
    t = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt)  # noqa: E731
    return cache_victims(t(owner), t(tick), t(keys), None if freq is None else t(freq, torch.int32),
                         t(exclude), min_take, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(caches())
@pytest.mark.slow
def test_victims_are_the_smallest_candidates_in_lexicographic_order(backend, cache):
    n, got = run(*cache)
    want_n, want = oracle(*cache)
    assert n == want_n
    assert got.tolist() == want  # ascending slots, the order the torch path frees them in


def test_too_few_candidates_writes_nothing_and_returns_the_count(backend):
    owner, tick, keys = [0, 1, -1, 3], [5, 4, 3, 2], [10, 11, 12, 13]
    n, got = run(owner, tick, keys, None, [1], 4, 10)
    assert n == 2 and got.numel() == 0
    n, got = run(owner, tick, keys, [1, 1, 1, 1], [1], 2, 10)
    assert n == 2 and got.tolist() == [0, 3]


def test_excluded_slots_are_candidates_again_in_the_next_call(backend):
    owner, tick, keys = [0, 1, 2, 3], [1, 1, 1, 1], [4, 3, 2, 1]
    assert run(owner, tick, keys, None, [3, 2, -1, 3], 0, 1)[1].tolist() == [1]
    assert run(owner, tick, keys, None, [], 0, 1)[1].tolist() == [3]
    assert run(owner, tick, keys, [0, 0, 1, 1], [], 0, 3)[1].tolist() == [0, 1, 3]


def test_an_excluded_slot_out_of_range_is_refused(backend):
    with pytest.raises(_native.KernelError, match=r"exclude\[1\] = 2 is not an index of the 2 candidates") as e:
        run([0, 1], [0, 0], [1, 2], None, [0, 2], 0, 1)
    assert e.value.status == _native.Status.BAD_VALUE and e.value.detail[:3] == (1, 2, 2)
    assert run([0, 1], [0, 0], [1, 2], None, [0], 0, 1)[1].tolist() == [1]  # and nothing was left marked
    assert run([0, 1], [0, 0], [1, 2], None, [], 0, 1)[1].tolist() == [0]


@pytest.mark.skipif(not _native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("short", ["col0", "col1", "col2", "out"])
def test_a_too_short_buffer_is_refused_and_nothing_written(short):
    t = lambda v, dt=torch.int64: torch.tensor(v, dtype=dt)  # noqa: E731
    bufs = {"valid": t([0, 1, 2]), "exclude": t([-1]), "col0": t([0, 0, 0], torch.int32), "col1": t([3, 2, 1]),
            "col2": t([1, 2, 3]), "out": torch.full((2,), -7, dtype=torch.int64)}
    bufs[short] = bufs[short][:-1]
    with pytest.raises(_native.KernelError, match=f"\\({short}\\) holds") as e:
        _native.call("he_choose_victims", list(bufs.values()), [0, 2])
    assert e.value.status == _native.Status.BAD_CALL
    assert bufs["out"].eq(-7).all()


@pytest.mark.parametrize("tick_span", [20, 2**40])  # one histogram round per column; rounds past its window
@pytest.mark.slow
def test_many_candidates_match_a_sort(backend, tick_span):
    g = torch.Generator().manual_seed(0)
    cap = 300_007  # enough candidates for the widest histogram
    owner = torch.where(torch.rand(cap, generator=g) < 0.95, torch.arange(cap), -1)
    tick = torch.randint(0, tick_span, (cap,), generator=g)
    keys = torch.randperm(cap, generator=g) * 7 - cap
    freq = torch.randint(0, 4, (cap,), generator=g, dtype=torch.int32)
    exclude = torch.randint(-1, cap, (5000,), generator=g)
    for f in (None, freq):
        for want in (1, 4700, 150_000):
            n, got = cache_victims(owner, tick, keys, f, exclude, 10, want)
            cand = (owner >= 0).clone()
            cand[exclude[exclude >= 0]] = False
            idx = cand.nonzero().squeeze(1)
            assert n == idx.numel()
            cols = [tick[idx], keys[idx]] if f is None else [f[idx].long(), tick[idx], keys[idx]]
            order = torch.arange(idx.numel())
            for c in reversed(cols):  # stable sorts, last column first: a lexicographic order
                order = order[c[order].sort(stable=True).indices]
            assert torch.equal(got, idx[order[:want]].sort().values)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_each_policy_orders_by_its_columns(backend, policy):
    """The policies' orders, as documented in store/_evict.py: what the dynamic store and the cache
    both evict first."""
    counts, lasts = [3, 1, 1, 2, 1, 0], [5, 9, 2, 2, 2, 7]
    keys = [10, 11, 12, 13, 14, 15]
    rank = (lambda s: (counts[s], lasts[s], keys[s])) if policy == "lfu" else (lambda s: (lasts[s], counts[s], keys[s]))
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    for k in range(7):
        _, got = choose_victims(policy_columns(policy, t(counts), t(lasts), t(keys)), k)
        assert got.tolist() == sorted(sorted(range(6), key=rank)[:k])
