"""A dynamic group of several tables (native and torch reference) against a dict of DictStores, one
per table (the plain-dict oracle), under random sequences of find-or-insert / find / evict / expire /
remove / export-import (hypothesis stateful testing).

Each table of the group must hold, by key, exactly what its DictStore holds: the same keys admitted
and pending, rows within one float32 ulp (the native initializer's log may differ in the last bit of
a double), the same counts and last steps.  Slots differ (the group hands them out over all its
tables), so rows are compared by key; the index stays a valid linear-probing table after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from store_helpers import SPECIAL_KEYS, check_layout, max_ulp_diff

from hugeembed import _native
from hugeembed.errors import CapacityError
from hugeembed.store import DictStore, DynamicGroup, RowLayout, TableSettings, Uniform

_POOL = SPECIAL_KEYS + list(range(-20, 40))
keys_st = st.lists(st.one_of(st.sampled_from(_POOL), st.integers(-(2**63), 2**63 - 1)), unique=True, max_size=20)
T = 3


def _init_state(state: torch.Tensor) -> None:
    state.fill_(0.25)


class GroupMachine(RuleBasedStateMachine):
    backend = "native"

    def __init__(self):
        super().__init__()
        self.step = 0

    @initialize(admits=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=T, max_size=T),
                caps=st.lists(st.sampled_from([None, None, 12, 40]), min_size=T, max_size=T),
                policy=st.sampled_from(["lfu", "lru"]), on_full=st.sampled_from(["evict", "evict", "error"]))
    def setup(self, admits, caps, policy, on_full):
        lay = RowLayout(3, torch.float32, 1)
        kws = [dict(initializer=Uniform(-1.0, 1.0), init_state=_init_state, capacity=caps[t], on_full=on_full,
                    eviction_policy=policy, admit_min_count=admits[t], seed=t) for t in range(T)]
        self.g = DynamicGroup([TableSettings(f"t{t}", lay, **kws[t]) for t in range(T)], backend=self.backend)
        self.d = [DictStore(f"t{t}", 3, 1, **kws[t]) for t in range(T)]

    def _oracle(self, fn):
        """Runs fn on every DictStore; (results, error type or None)."""
        out = []
        try:
            for t, d in enumerate(self.d):
                out.append(fn(t, d))
        except CapacityError:
            return None, CapacityError
        return out, None

    @rule(parts=st.lists(keys_st, min_size=T, max_size=T), data=st.data(), advance=st.integers(0, 3))
    def find_or_insert(self, parts, data, advance):
        self.step += advance
        keys = torch.tensor([k for p in parts for k in p], dtype=torch.int64)
        tids = torch.tensor([t for t, p in enumerate(parts) for _ in p], dtype=torch.int64)
        counts = None
        if keys.numel() and data.draw(st.booleans()):
            counts = torch.tensor(data.draw(st.lists(st.integers(1, 3), min_size=keys.numel(),
                                                     max_size=keys.numel())))
        # the oracle's tables one by one; the group at once: the same contents (or the same error:
        # a capacity error may leave the tables before it changed in the oracle, so stop comparing)
        expect, err = self._oracle(lambda t, d: d.find_or_insert(
            torch.tensor(parts[t], dtype=torch.int64), self.step,
            None if counts is None else counts[tids == t]))
        try:
            got = self.g.find_or_insert(tids, keys, self.step, counts)
        except CapacityError:
            assert err is CapacityError
            self._resync()
            return
        assert err is None
        for t in range(T):  # admitted or not agrees, key by key
            assert (got[tids == t] >= 0).tolist() == (expect[t] >= 0).tolist()

    def _resync(self) -> None:
        """After a capacity error the oracle's first tables may have changed: load them into the group."""
        for t, d in enumerate(self.d):
            self.g.replace_table(t, d.export())

    @rule(parts=st.lists(keys_st, min_size=T, max_size=T))
    def find(self, parts):
        keys = torch.tensor([k for p in parts for k in p], dtype=torch.int64)
        tids = torch.tensor([t for t, p in enumerate(parts) for _ in p], dtype=torch.int64)
        found = self.g.find(tids, keys)
        for t, p in enumerate(parts):
            assert (found[tids == t] >= 0).tolist() == (self.d[t].find(torch.tensor(p, dtype=torch.int64)) >= 0).tolist()

    @rule(t=st.integers(0, T - 1), ttl=st.one_of(st.none(), st.integers(0, 4)),
          max_rows=st.one_of(st.none(), st.integers(0, 30)), policy=st.sampled_from(["lfu", "lru"]))
    def evict(self, t, ttl, max_rows, policy):
        assert self.g.evict(t, self.step, ttl=ttl, max_rows=max_rows, policy=policy) == \
            self.d[t].evict(self.step, ttl=ttl, max_rows=max_rows, policy=policy)

    @rule(ttls=st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=T, max_size=T))
    def expire(self, ttls):
        """Every table's ttl in one pass equals each table's own ttl eviction."""
        got = self.g.expire(self.step, ttls, [None] * T)
        assert got == [self.d[t].evict(self.step, ttl=ttls[t]) if ttls[t] is not None else 0 for t in range(T)]

    @rule(t=st.integers(0, T - 1), data=st.data())
    def remove(self, t, data):
        ex = self.d[t].export()
        held = ex.keys.tolist() + ex.pending_keys.tolist()
        if not held:
            return
        gone = data.draw(st.lists(st.sampled_from(held), unique=True, min_size=1, max_size=4))
        k = torch.tensor(gone, dtype=torch.int64)
        assert self.g.remove(t, k) == self.d[t].remove(k)

    @rule(t=st.integers(0, T - 1))
    def reload_table(self, t):
        """A table's contents replaced by its own export leave it (and the others) as they were."""
        self.g.replace_table(t, self.g.view(t).export())

    @invariant()
    def same_contents(self):
        if not hasattr(self, "g"):
            return
        for t, d in enumerate(self.d):
            got, want = self.g.view(t).export(), d.export()
            for f in ("keys", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
                assert getattr(got, f).tolist() == getattr(want, f).tolist(), (t, f)
            assert max_ulp_diff(got.rows, want.rows) <= 1
        check_layout(self.g)


class TorchGroupMachine(GroupMachine):
    backend = "torch"


_SETTINGS = settings(max_examples=25, stateful_step_count=25, deadline=None)

TestNativeGroupAgainstDicts = GroupMachine.TestCase
TestNativeGroupAgainstDicts.settings = _SETTINGS
TestNativeGroupAgainstDicts = pytest.mark.skipif(not _native.available(), reason="native kernels not built")(
    TestNativeGroupAgainstDicts)
TestTorchGroupAgainstDicts = TorchGroupMachine.TestCase
TestTorchGroupAgainstDicts.settings = _SETTINGS
