"""New rows made by the triton index's find-or-insert: weights and optimizer state written by one kernel
(hugeembed/_triton/row_init.py) equal to what the torch reference's group writes (each initializer's
``generate``, the state template), for every built-in initializer, tables the group initialises itself
(a user initializer, a state that is not row-independent) beside them, and programs run in any order.

Under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py sets it without CUDA): tiny shapes."""

from __future__ import annotations

import pytest
import torch

from hugeembed._triton import row_init
from hugeembed.store import Constant, DynamicGroup, Normal, RowLayout, TableSettings, TruncatedNormal, Uniform
from hugeembed.store._init import FromCallable
from hugeembed.store._init import _A, _B, _C, _D, _E, _F
from hugeembed.store._index_triton import TritonIndex
from hugeembed._tensors import row_independent

pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAY = RowLayout(5, torch.float32, 2)


@row_independent
def _state_template(state: torch.Tensor) -> None:
    state[:, 0] = 0.25
    state[:, 1] = -3.0


def _per_row_state(state: torch.Tensor) -> None:  # not marked row-independent: the group runs it
    state.copy_(torch.arange(state.numel(), dtype=state.dtype).view_as(state))


def _tables() -> list[TableSettings]:
    inits = [Constant(0.3), Uniform(-0.2, 0.5), Normal(0.1, 0.7), TruncatedNormal(0.0, 0.05),
             TruncatedNormal(1.0, 2.0, a=-0.5, b=3.0), FromCallable(lambda k, d: k[:, None].float().expand(-1, d))]
    out = [TableSettings(f"t{i}", LAY, initializer=init, seed=17 * i + 1, salt=100 + i, init_state=_state_template)
           for i, init in enumerate(inits)]
    out.append(TableSettings("per_row", LAY, initializer=Uniform(-1, 1), seed=5, salt=99, init_state=_per_row_state))
    return out


def test_the_kernels_constants_are_the_initializers():
    got = row_init.coefficients((_A, _B, _C, _D, _E, _F))
    assert got[:48] == [*_A, *_B, *_C, *_D, *_E, *_F]
    assert got[48:] == [0.180625, 1.6, 5.0, 1e-300, 0.425, 0.5, 2.0**-53]


@pytest.mark.parametrize("shuffle", [None, 7], ids=["one-grid", "shuffled-programs"])
def test_new_rows_weights_and_state_equal_the_torch_groups(shuffle):
    ref, tri = (DynamicGroup(_tables(), backend=b, device=DEV) for b in ("torch", "triton"))
    if shuffle is not None:
        tri._index = TritonIndex(block=8, claim_block=4, shuffle=torch.Generator().manual_seed(shuffle))
    T = len(_tables())
    for step in range(2):
        keys = torch.arange(step * 40, step * 40 + 40, dtype=torch.int64).repeat(T) - 7  # negative keys too
        tids = torch.arange(T, dtype=torch.int64).repeat_interleave(40)
        keys, tids = keys.to(DEV), tids.to(DEV)
        slots = [g.find_or_insert(tids, keys, step) for g in (ref, tri)]
        assert torch.equal(slots[0], slots[1])
        assert torch.equal(ref.rows, tri.rows), (ref.rows - tri.rows).abs().max()
    # the oracle for the kernel's tables: each initializer's own values, the template's state
    s = tri.settings
    for t in range(5):
        k = keys[tids == t]
        rows = tri.rows[slots[1][tids == t]]
        assert torch.equal(rows[:, :5], s[t].initializer.generate(k, 5, s[t].seed)), s[t].initializer
        assert torch.equal(rows[:, 5:], torch.tensor([[0.25, -3.0]], device=DEV).expand(k.numel(), 2))


def test_a_group_that_initialises_every_table_itself_launches_no_init_kernel(monkeypatch):
    """Tables only the group can make (a user initializer): the kernel is not launched, the rows are the
    reference's."""
    tables = [TableSettings("user", LAY, initializer=FromCallable(lambda k, d: k[:, None].float().expand(-1, d)),
                            salt=3)]
    ref, tri = (DynamicGroup(tables, backend=b, device=DEV) for b in ("torch", "triton"))
    calls = []
    monkeypatch.setattr(row_init.init_rows_kernel, "run", lambda *a, **k: calls.append(a))
    keys = torch.arange(6, dtype=torch.int64, device=DEV)
    tids = torch.zeros_like(keys)
    for g in (ref, tri):
        g.find_or_insert(tids, keys, 0)
    assert torch.equal(ref.rows, tri.rows) and not calls
