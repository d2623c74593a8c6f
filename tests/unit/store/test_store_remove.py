"""store.remove(keys): admitted and pending keys go, their rows are freed (smallest first reused), the pins epoch
moves, and bad calls (absent / repeated keys, pinned rows, static tables) are refused before anything changes.
HashStore (native and torch backends) is held to the DictStore oracle under random sequences too."""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from store_helpers import check_layout
from test_store_stateful import _SETTINGS, StoreMachine

from hugeembed import _native
from hugeembed.errors import ConfigError, InputError, StoreError
from hugeembed.store import ArrayStore, DictStore, HashStore

T = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731

BACKENDS = ["torch"] + (["native"] if _native.available() else [])


def _stores(backend: str):
    """A HashStore and the DictStore oracle with the same history: 10, 20, 30 admitted, 40 pending."""
    out = []
    for s in (HashStore("clicks", 2, admit_min_count=2, backend=backend), DictStore("clicks", 2, admit_min_count=2)):
        s.find_or_insert(T(10, 20, 30, 40), 1, T(2, 2, 3, 1))
        out.append(s)
    return out


def _contents(s):
    e = s.export()
    return (e.keys.tolist(), e.rows.tolist(), e.counts.tolist(), e.last_step.tolist(), e.pending_keys.tolist(),
            e.pending_counts.tolist(), e.pending_last_step.tolist(), len(s), s.num_pending)


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_drops_rows_and_pending_keys_and_frees_slots(backend):
    h, d = _stores(backend)
    for s in (h, d):
        epoch = s.eviction_epoch
        assert s.remove(T(20, 40)) == 1  # 20 had a row, 40 was pending
        assert s.eviction_epoch == epoch + 1
        assert s.export().keys.tolist() == [10, 30] and s.num_pending == 0 and len(s) == 2
        assert s.find(T(20)).tolist() == [-1]
        # the freed slot (1) is the first one reused
        assert s.find_or_insert(T(50), 2, T(2)).tolist() == [1]
        assert s.remove(T(40)[:0]) == 0  # nothing to remove: nothing changes
    assert _contents(h) == _contents(d)
    check_layout(h)


@pytest.mark.parametrize("backend", BACKENDS)
def test_removing_only_pending_keys_keeps_the_pins_epoch(backend):
    h, _ = _stores(backend)
    epoch = h.eviction_epoch
    assert h.remove(T(40)) == 0 and h.eviction_epoch == epoch  # no slot was freed


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_removes_are_refused_and_change_nothing(backend):
    for s in _stores(backend):
        before = _contents(s)
        with pytest.raises(InputError, match=r"table 'clicks': cannot remove key 99: it is neither admitted nor "
                                             r"pending \(1 of the 2 keys are absent\)"):
            s.remove(T(10, 99))
        with pytest.raises(InputError, match="key 30 is given twice to remove"):
            s.remove(T(30, 10, 30))
        with pytest.raises(InputError, match="keys must be 1-D"):
            s.remove(T(10, 30).view(1, 2))
        handle = s.pin(s.find(T(10)))
        with pytest.raises(StoreError, match="cannot remove keys while 1 batches"):
            s.remove(T(30))
        s.unpin(handle)
        assert _contents(s) == before


def test_a_static_table_cannot_remove_keys():
    with pytest.raises(ConfigError, match="table 'country' is static.*cannot remove keys"):
        ArrayStore("country", 5, 2).remove(T(1))


class RemoveMachine(StoreMachine):
    """The store machine with removals of random present keys (admitted and pending) added."""

    @precondition(lambda self: hasattr(self, "h") and (len(self.d) + self.d.num_pending) > 0)
    @rule(data=st.data())
    def remove(self, data):
        e = self.d.export()
        present = e.keys.tolist() + e.pending_keys.tolist()
        keys = data.draw(st.lists(st.sampled_from(present), unique=True, min_size=1, max_size=8))
        k = T(*keys)
        assert self.h.remove(k) == self.d.remove(k)
        self.last_slots = torch.empty(0, dtype=torch.int64)  # slots freed: no longer a row's


class TorchRemoveMachine(RemoveMachine):
    backend = "torch"


TestNativeRemoveAgainstDict = RemoveMachine.TestCase
TestNativeRemoveAgainstDict.settings = _SETTINGS
TestNativeRemoveAgainstDict = pytest.mark.skipif(not _native.available(), reason="native kernels not built")(
    TestNativeRemoveAgainstDict)
TestTorchRemoveAgainstDict = TorchRemoveMachine.TestCase
TestTorchRemoveAgainstDict.settings = _SETTINGS
TestNativeRemoveAgainstDict = pytest.mark.slow(TestNativeRemoveAgainstDict)  # a few hundred store calls per example
TestTorchRemoveAgainstDict = pytest.mark.slow(TestTorchRemoveAgainstDict)  # a few hundred store calls per example
