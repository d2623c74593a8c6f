"""The portable and the AVX2 build of the kernels compute the same floats, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hugeembed import _native

_WORKLOAD = textwrap.dedent("""
    import hashlib, io, torch
    from hugeembed import _native
    from hugeembed.features import SparseFeatures
    from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec
    from hugeembed.nn import EmbeddingCollection, TableConfig
    from hugeembed.optim import FTRL, Adagrad, Adam, RowWiseAdagrad
    from hugeembed.store import TruncatedNormal

    assert _native.available()
    print(_native.lib()._name)
    g = torch.Generator().manual_seed(0)
    tables = [TableConfig("a", 24, optimizer=Adam(lr=0.01), combiner="mean"),
              TableConfig("b", 64, optimizer=Adagrad(lr=0.1), combiner="sqrtn", max_norm=0.7),
              TableConfig("c", 8, num_rows=500, optimizer=FTRL(lr=0.1, l1=0.01), combiner="sum"),
              TableConfig("d", 16, optimizer=RowWiseAdagrad(lr=0.1), initializer=TruncatedNormal(0, 0.1)),
              TableConfig("e", 16, num_rows=300, optimizer=Adam(lr=0.01, mode="global"), combiner="none")]
    ec = EmbeddingCollection(tables, seed=3)
    outs = []
    for step in range(4):
        lengths = torch.randint(0, 4, (5 * 40,), generator=g)
        values = torch.randint(0, 300, (int(lengths.sum()),), generator=g)
        w = torch.rand(values.numel(), generator=g) + 0.1
        sf = SparseFeatures(["a", "b", "c", "d", "e"], values, lengths=lengths, weights=w)
        out = ec(sf)
        loss = (out.concat() ** 2).sum() + (out.unpooled["e"].values ** 2).sum()
        loss.backward()
        outs.append(out.concat().detach())
    ec.eval()
    with torch.no_grad():
        outs.append(ec(sf).concat())
    W = [torch.randn(1000, 64, generator=g), torch.randn(70, 32, generator=g)]
    lk = FusedEmbeddingLookup([TableSpec("x", 64, num_rows=1000, max_norm=1.0), TableSpec("y", 32, num_rows=70)],
                              [FeatureSpec("p", "x", combiner="mean"), FeatureSpec("q", "y", combiner="sqrtn")])
    sf = SparseFeatures(["p", "q"], torch.randint(0, 70, (400,), generator=g),
                        lengths=torch.full((200,), 2), weights=torch.rand(400, generator=g))
    with torch.no_grad():
        outs += lk(W, sf).groups()
    state = {k: v for k, v in ec.state_dict().items()}
    buf = io.BytesIO()
    torch.save({"outs": outs, "state": state}, buf)
    print(hashlib.sha256(buf.getvalue()).hexdigest())
""")


def _run(kernels: str) -> list[str]:
    env = dict(os.environ, HUGEEMBED_KERNELS=kernels)
    out = subprocess.run([sys.executable, "-c", _WORKLOAD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _avx2_build() -> bool:
    here = Path(_native.__file__).parent
    return any(here.glob("_kernels_avx2*")) and _native._cpu_has_avx2()


@pytest.mark.skipif(not _avx2_build(), reason="needs the AVX2 build and an AVX2 CPU")
@pytest.mark.slow
def test_portable_and_avx2_builds_agree_to_the_last_bit():
    portable, avx2 = _run("portable"), _run("avx2")
    assert "_kernels_avx2" not in portable[0] and "_kernels_avx2" in avx2[0]
    assert portable[1] == avx2[1]


def test_a_bad_kernels_choice_is_a_clear_error():
    env = dict(os.environ, HUGEEMBED_KERNELS="sse9")
    out = subprocess.run([sys.executable, "-c", "from hugeembed import _native; _native.available()"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "HUGEEMBED_KERNELS='sse9'" in out.stderr
