"""A hash store's find-or-insert and find as torch.library ops (store/_ops.py): code that drives a
store compiles into one graph (fullgraph) and does exactly what the eager calls do."""

import pytest
import torch

from hugeembed.store import HashStore
from hugeembed.store._ops import _find_or_insert


def _twins(**kw):
    return HashStore(dim=4, name="users", seed=3, **kw), HashStore(dim=4, name="users", seed=3, **kw)


def _step(store, keys, step):
    slots = store.find_or_insert(keys, step)
    known = store.find(keys + 1000)  # never inserted: -1 each
    return slots * 2 + known


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.slow
def test_a_compiled_store_step_equals_the_eager_one(backend, compiler):
    eager, compiled = _twins(backend=backend, admit_min_count=2)
    fn = torch.compile(_step, fullgraph=True, backend=compiler)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 6):
        keys = torch.randperm(200, generator=gen)[:50]
        assert torch.equal(fn(compiled, keys, step), _step(eager, keys, step))
    assert torch.equal(compiled.export().keys.sort().values, eager.export().keys.sort().values)
    assert torch.equal(compiled.storage()[: len(compiled)], eager.storage()[: len(eager)])


def test_the_ops_fake_gives_the_slots_shape_and_bad_input_still_raises_inside():
    store, _ = _twins()
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        keys = torch.empty(7, dtype=torch.int64)
        out = _find_or_insert(1, torch.empty(8, dtype=torch.int64), keys, 1, None)
        assert out.shape == (7,) and out.dtype == torch.int64
    fn = torch.compile(lambda s, k: s.find_or_insert(k, 1), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="given twice"):
        fn(store, torch.tensor([5, 5]))
    assert len(store) == 0


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_a_copied_store_compiles_into_itself_not_its_original(how):
    import copy
    import pickle
    original, _ = _twins()
    original.find_or_insert(torch.arange(5), 1)
    twin = {"deepcopy": copy.deepcopy, "copy": copy.copy, "pickle": lambda s: pickle.loads(pickle.dumps(s))}[how](original)
    if how == "copy":  # a shallow copy shares its arrays: only the handle must differ
        assert twin._op_handle != original._op_handle
        return
    fn = torch.compile(lambda s, k: s.find_or_insert(k, 2), fullgraph=True, backend="aot_eager")
    fn(twin, torch.arange(5, 10))
    assert len(twin) == 10 and len(original) == 5
