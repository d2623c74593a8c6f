"""The served program as a flat function (_flat_program.py): the same logits, bit for bit, as the exported
module called the way torch.export documents, at the request sizes the server sees (1 and 64 rows), on base
tables and on tables patched by a delta; and the training model's own eval on the same rows (the oracle)."""

from __future__ import annotations

import pytest
import torch

from hugeembed.serving import ServingModel, export, export_delta
from hugeembed.serving._lookup_ops import pooled_lookup, pooled_lookup_eager

from .conftest import reference_probs, snapshot


def module_logits(model: ServingModel, dense, values, offsets) -> torch.Tensor:
    s = model.served
    with torch.no_grad():
        return s.program(dense, values, offsets, *s.tables.args())  # pytree inputs, the export's input checks


def requests(heldout, sizes=(1, 64)):
    batch = heldout[1][0]
    for n in sizes:
        yield batch.dense[:n], batch.sparse.split([n, batch.dense.shape[0] - n])[0]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_the_flat_program_equals_the_exported_module(artifacts, heldout, dtype):
    m = ServingModel.load(artifacts(dtype))
    for dense, sparse in requests(heldout):
        values, offsets = m.check(dense, sparse)
        got = m.logits_raw(dense, values, offsets)
        assert got.shape == (dense.shape[0],)
        assert torch.equal(got, module_logits(m, dense, values, offsets))
        if dtype == "fp32":  # the oracle: the training model's eval on the same rows
            torch.testing.assert_close(torch.sigmoid(got), reference_probs(heldout[0], [_Batch(dense, sparse)]),
                                       atol=1e-6, rtol=0)


@pytest.mark.slow
def test_the_flat_program_reads_a_deltas_patch(run, heldout, tmp_path):
    """A version with a delta: its lookup node is patched_lookup (the patch as buffers), kept as such."""
    art = export(snapshot(run, 120), tmp_path / "art", dtype="fp32")
    export_delta(run, art)
    m = ServingModel.load(art)
    assert m.served.deltas and any(p is not None for p in m.served.patch)
    for dense, sparse in requests(heldout):
        values, offsets = m.check(dense, sparse)
        assert torch.equal(m.logits_raw(dense, values, offsets), module_logits(m, dense, values, offsets))
        torch.testing.assert_close(m.predict(dense, sparse), reference_probs(heldout[0], [_Batch(dense, sparse)]),
                                   atol=1e-6, rtol=0)


def test_the_lookup_ops_function_is_the_op(artifacts, heldout):
    m = ServingModel.load(artifacts("int8"))
    dense, sparse = next(requests(heldout, (64,)))
    values, offsets = m.check(dense, sparse)
    t = m.served.tables
    g = m.manifest["groups"][0]
    args = (values, offsets, t.rows[0], t.keys[0], t.lookup_index[0], t.meta[0], list(g["feature_pos"]),
            list(g["feature_table"]), list(g["combiners"]), 64, int(g["dim"]), "int8")
    assert torch.equal(pooled_lookup_eager(*args), pooled_lookup(*args))


class _Batch:
    def __init__(self, dense, sparse) -> None:
        self.dense, self.sparse = dense, sparse


class _EveryMappedOp(torch.nn.Module):
    """Every op _direct_calls rewrites, and a linear read twice (its relu must not overwrite it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8)
        self.register_buffer("pick", torch.tensor([0, 2, 5, 7]))

    def forward(self, x):
        h = torch.relu(self.a(x))  # fresh, read once: in place
        g = self.b(h)
        shared = torch.relu(g) + g  # g read twice: relu out of place
        m = torch.bmm(shared.view(-1, 2, 4), shared.reshape(-1, 2, 4).permute(0, 2, 1).transpose(1, 2).permute(0, 2, 1))
        c = torch.cat([m.flatten(1), torch.addmm(g, h, self.b.weight.t())], 1)
        s = torch.index_select(c, 1, self.pick).unsqueeze(2).squeeze(2) * 0.5
        return torch.sigmoid(s.sum(1) + torch.mm(h, self.b.weight.t()).sum(1))


def test_direct_calls_keep_every_kernel_and_never_overwrite_a_shared_result():
    from hugeembed.serving import _flat_program

    x = torch.randn(5, 6)
    program = torch.export.export(_EveryMappedOp().eval(), (x,), dynamic_shapes={"x": {0: torch.export.Dim("rows")}}
                                  ).module()
    run = _flat_program.flat_program(program)
    code = run.__closure__[0].cell_contents.__self__.code
    assert "torch.ops.aten" not in code.replace("torch.ops.aten._assert", "")  # every node rewritten
    assert code.count("relu_(") == 1 and code.count("torch.relu(") == 1
    with torch.no_grad():
        for rows in (1, 5):
            got = run(x[:rows])
            assert torch.equal(got, program(x[:rows]))
            assert torch.equal(got, _EveryMappedOp().eval()(x[:rows]))
