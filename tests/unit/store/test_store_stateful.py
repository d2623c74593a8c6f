"""HashStore (native and torch backends) against the DictStore oracle under random
sequences of find-or-insert / find / scatter / evict / export-import (hypothesis
stateful testing).  Slots must be equal (both hand them out in batch order,
smallest free slot first), rows equal within one float32 ulp, and the hash layout
valid after every step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from store_helpers import SPECIAL_KEYS, check_layout, max_ulp_diff

from hugeembed import _native
from hugeembed.errors import CapacityError
from hugeembed.store import DictStore, HashStore, Uniform

_POOL = SPECIAL_KEYS + list(range(-20, 40))
keys_st = st.lists(st.one_of(st.sampled_from(_POOL), st.integers(-(2**63), 2**63 - 1)), unique=True, max_size=24)


def _init_state(state: torch.Tensor) -> None:
    state.fill_(0.25)


class StoreMachine(RuleBasedStateMachine):
    backend = "native"

    def __init__(self):
        super().__init__()
        self.step = 0
        self.last_slots = torch.empty(0, dtype=torch.int64)

    @initialize(admit=st.sampled_from([1, 1, 2, 3]), cap=st.sampled_from([None, None, 12, 50]),
                on_full=st.sampled_from(["evict", "evict", "error"]), policy=st.sampled_from(["lfu", "lru"]),
                seed=st.integers(0, 3))
    def setup(self, admit, cap, on_full, policy, seed):
        kw = dict(initializer=Uniform(-1.0, 1.0), init_state=_init_state, capacity=cap, on_full=on_full,
                  eviction_policy=policy, admit_min_count=admit, seed=seed)
        self.h = HashStore("t", 3, 1, backend=self.backend, **kw)
        self.d = DictStore("t", 3, 1, **kw)

    def _both(self, fn):
        """Runs fn on both stores: same result or the same error type."""
        results = []
        for store in (self.h, self.d):
            try:
                results.append(fn(store))
            except CapacityError as e:
                results.append(type(e))
        a, b = results
        if isinstance(a, type) or isinstance(b, type):
            assert a == b, (a, b)
            return None
        return a, b

    @rule(keys=keys_st, data=st.data(), advance=st.integers(0, 3))
    def find_or_insert(self, keys, data, advance):
        self.step += advance
        counts = None
        if keys and data.draw(st.booleans()):
            counts = torch.tensor(data.draw(st.lists(st.integers(1, 3), min_size=len(keys), max_size=len(keys))))
        k = torch.tensor(keys, dtype=torch.int64)
        got = self._both(lambda s: s.find_or_insert(k, self.step, counts))
        if got is None:
            return
        a, b = got
        assert a.tolist() == b.tolist()
        assert max_ulp_diff(self.h.gather(a), self.d.gather(b)) <= 1
        self.last_slots = a

    @rule(start=st.integers(-(2**40), 2**40), n=st.integers(50, 300))
    def insert_range(self, start, n):
        """Many keys at once: drives the buckets through several rehashes."""
        self.step += 1
        k = torch.arange(start, start + n)
        got = self._both(lambda s: s.find_or_insert(k, self.step))
        if got is not None:
            assert got[0].tolist() == got[1].tolist()

    @rule(keys=keys_st)
    def find(self, keys):
        k = torch.tensor(keys, dtype=torch.int64)
        assert self.h.find(k).tolist() == self.d.find(k).tolist()

    @precondition(lambda self: self.last_slots.numel() > 0)
    @rule(value=st.floats(-4, 4, width=32))
    def scatter(self, value):
        slots = self.last_slots
        rows = torch.full((slots.numel(), 4), value) + torch.arange(slots.numel())[:, None]
        self.h.scatter(slots, rows)
        self.d.scatter(slots, rows)

    @rule(ttl=st.one_of(st.none(), st.integers(0, 4)), max_rows=st.one_of(st.none(), st.integers(0, 30)),
          policy=st.sampled_from(["lfu", "lru"]), use_protect=st.booleans())
    def evict(self, ttl, max_rows, policy, use_protect):
        protect = self.last_slots if use_protect else None
        a = self.h.evict(self.step, ttl=ttl, max_rows=max_rows, policy=policy, protect=protect)
        b = self.d.evict(self.step, ttl=ttl, max_rows=max_rows, policy=policy, protect=protect)
        assert a == b
        self.last_slots = torch.empty(0, dtype=torch.int64)

    @rule()
    def roundtrip(self):
        """export -> import into a fresh store gives the same export."""
        e = self.h.export()
        fresh = HashStore("t", 3, 1, backend=self.backend, admit_min_count=self.h.admit_min_count)
        fresh.import_(e)
        e2 = fresh.export()
        for f in ("keys", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
            assert torch.equal(getattr(e, f), getattr(e2, f)), f
        assert torch.equal(e.rows, e2.rows)
        check_layout(fresh)

    @invariant()
    def same_contents(self):
        if not hasattr(self, "h"):
            return
        assert len(self.h) == len(self.d) and self.h.num_pending == self.d.num_pending
        eh, ed = self.h.export(), self.d.export()
        for f in ("keys", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
            assert getattr(eh, f).tolist() == getattr(ed, f).tolist(), f
        assert max_ulp_diff(eh.rows, ed.rows) <= 1
        check_layout(self.h)


class TorchStoreMachine(StoreMachine):
    backend = "torch"


_SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None)

TestNativeAgainstDict = StoreMachine.TestCase
TestNativeAgainstDict.settings = _SETTINGS
TestNativeAgainstDict = pytest.mark.skipif(not _native.available(), reason="native kernels not built")(
    TestNativeAgainstDict
)
TestTorchAgainstDict = TorchStoreMachine.TestCase
TestTorchAgainstDict.settings = _SETTINGS
TestNativeAgainstDict = pytest.mark.slow(TestNativeAgainstDict)  # a few hundred store calls per example
TestTorchAgainstDict = pytest.mark.slow(TestTorchAgainstDict)  # a few hundred store calls per example
