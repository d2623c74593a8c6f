"""Python lists, dicts of jagged features and TorchRec's KeyedJaggedTensor."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from features_oracle import build, lists_of, weight_lists_of
from hugeembed.errors import InputError
from hugeembed.features import JaggedFeature, SparseFeatures

T = torch.tensor
DOC = {"user": [[1, 5], [], [7]], "item": [[2], [2, 3, 9], [4]]}
DOC_W = {"user": [[0.5, 1.0], [], [2.0]], "item": [[1.5], [0.25, 3.0, 4.0], [-1.0]]}


def test_from_lists_docstring_example(device):
    sf = SparseFeatures.from_lists(DOC, DOC_W, device=device)
    assert sf.keys() == ("user", "item") and sf.batch_size == 3
    assert sf.values().tolist() == [1, 5, 7, 2, 2, 3, 9, 4] and sf.values().dtype == torch.int64
    assert sf.offsets().tolist() == [0, 2, 2, 3, 4, 7, 8] and sf.offsets().dtype == torch.int64
    assert sf.weights().tolist() == [0.5, 1.0, 2.0, 1.5, 0.25, 3.0, 4.0, -1.0]
    assert sf.weights().dtype == torch.float32 and sf.device.type == device.type
    assert sf.to_lists() == DOC and sf.to_lists(with_weights=True) == (DOC, DOC_W)


def test_lists_edge_cases():
    empty = SparseFeatures.from_lists({"a": [], "b": []})
    assert empty.batch_size == 0 and empty.to_lists() == {"a": [], "b": []}
    assert SparseFeatures.from_lists({}, batch_size=2).batch_size == 2
    assert SparseFeatures.from_lists({"a": [[], []]}).to_lists() == {"a": [[], []]}
    big = SparseFeatures.from_lists({"a": [[2**62, 0]]})
    assert big.to_lists() == {"a": [[2**62, 0]]}
    # integer weights become float32
    assert SparseFeatures.from_lists({"a": [[1, 2]]}, {"a": [[1, 2]]}).weights().dtype == torch.float32


@pytest.mark.parametrize(
    "args, message",
    [
        (({"a": [[1.5]]},), r"feature 'a': ids must be integers, but sample 0 has 1.5 \(float\)"),
        (({"a": [[True]]},), r"feature 'a': ids must be integers, but sample 0 has True \(bool\)"),
        (({"a": [1, 2]},), "feature 'a': expected a list of samples, each a list of ids"),
        (({"a": [["x"]]},), r"feature 'a': ids must be integers, but sample 0 has 'x' \(str\)"),
        (({"a": [[2**64]]},), "feature 'a': cannot read the values as numbers"),
        (({"a": [[1]], "b": [[1], [2]]},), "feature 'b' has batch size 2, but feature 'a' has 1"),
        (({"a": [[1]]}, {"b": [[1.0]]}), "weights for unknown feature 'b'"),
        (({"a": [[1]], "b": [[2]]}, {"a": [[1.0]]}), "feature 'b': has no weights, but other features do"),
        (({"a": [[1], [2, 3]]}, {"a": [[1.0], [2.0]]}), "feature 'a': sample 1 has 2 ids but 1 weights"),
        (({"a": [[1], [2]]}, {"a": [[1.0]]}), "feature 'a': weights for 1 samples but ids for 2"),
        (({"a": [[1]]}, {"a": [[False]]}), r"feature 'a' weights: weights must be numbers, but sample 0 has False \(bool\)"),
    ],
)
def test_from_lists_errors(args, message):
    with pytest.raises(InputError, match=message):
        SparseFeatures.from_lists(*args)


def test_negative_batch_size():
    with pytest.raises(InputError, match=r"from_lists \[\]: batch_size must be >= 0, got -2"):
        SparseFeatures.from_lists({}, batch_size=-2)


def test_to_lists_without_weights_raises_when_asked_for_them():
    with pytest.raises(InputError, match="no weights"):
        build(DOC).to_lists(with_weights=True)


# -- dicts of jagged features -----------------------------------------------------------------


def test_dict_round_trip_with_mixed_entries(device):
    sf = SparseFeatures.from_dict({
        "user": JaggedFeature(T([1, 5, 7], device=device), T([0, 2, 2, 3], dtype=torch.int32, device=device),
                              T([0.5, 1.0, 2.0], device=device), name="user"),
        "item": (T([2, 2, 3, 9, 4], dtype=torch.int32, device=device), T([0, 1, 4, 5], device=device),
                 T([1.5, 0.25, 3.0, 4.0, -1.0], device=device)),
    })
    assert lists_of(sf) == DOC and weight_lists_of(sf) == DOC_W and sf.device.type == device.type
    d = sf.to_dict()
    assert list(d) == ["user", "item"] and all(isinstance(j, JaggedFeature) for j in d.values())
    assert d["item"].name == "item" and d["item"].offsets.tolist() == [0, 1, 4, 5]
    assert d["item"].values.tolist() == [2, 2, 3, 9, 4]
    assert d["item"].weights.tolist() == [1.5, 0.25, 3.0, 4.0, -1.0]
    again = SparseFeatures.from_dict(d)
    assert lists_of(again) == DOC and weight_lists_of(again) == DOC_W
    no_w = SparseFeatures.from_dict({"a": (T([1]), T([0, 0, 1]))})
    assert lists_of(no_w) == {"a": [[], [1]]} and no_w.weights_or_none() is None


@pytest.mark.parametrize(
    "features, message",
    [
        ({"a": T([1, 2])}, r"feature 'a': expected a JaggedFeature or \(values, offsets\[, weights\]\), got Tensor"),
        ({"a": [T([1]), 5]}, r"feature 'a': offsets must be 1-D \[B \+ 1\], got shape \(\)"),
        ({"a": (T([1]), T([0, 2]))}, "from_dict: feature 'a': offsets end at 2 but there are 1 ids"),
        ({"a": (T([1]), T([0, 1])), "b": (T([1]), T([0, 0, 1]))}, "feature 'b' has batch size 2, but feature 'a' has 1"),
        ({"a": JaggedFeature(T([1.0]), T([0, 1]))}, "feature 'a': ids must be integers"),
    ],
)
def test_from_dict_errors(features, message):
    with pytest.raises(InputError, match=message):
        SparseFeatures.from_dict(features)


# -- TorchRec ---------------------------------------------------------------------------------


def test_torchrec_round_trip(device):
    jt = pytest.importorskip("torchrec.sparse.jagged_tensor")
    sf = build(DOC, DOC_W, offsets_dtype=torch.int32, device=device)
    kjt = sf.to_torchrec()
    assert isinstance(kjt, jt.KeyedJaggedTensor)
    assert kjt.keys() == ["user", "item"] and kjt.stride() == 3
    # TorchRec's own reading of the layout (on CPU: fbgemm-gpu-cpu has no CUDA kernels)
    assert [t.tolist() for t in kjt.to(torch.device("cpu")).to_dict()["item"].to_dense()] == DOC["item"]
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 3, 1] and kjt.weights().tolist() == sf.weights().tolist()
    back = SparseFeatures.from_torchrec(kjt)
    assert lists_of(back) == DOC and weight_lists_of(back) == DOC_W
    assert back.offsets().dtype == torch.int64 and back.device.type == device.type
    # a KJT built by TorchRec itself, with int32 ids and no weights
    theirs = jt.KeyedJaggedTensor(keys=["a", "b"], values=T([5, 6, 7], dtype=torch.int32),
                                  lengths=T([0, 1, 2, 0]))
    assert lists_of(SparseFeatures.from_torchrec(theirs)) == {"a": [[], [5]], "b": [[6, 7], []]}
    empty = jt.KeyedJaggedTensor(keys=[], values=T([], dtype=torch.int64), lengths=T([], dtype=torch.int64), stride=4)
    assert SparseFeatures.from_torchrec(empty).batch_size == 4


def test_from_torchrec_errors():
    jt = pytest.importorskip("torchrec.sparse.jagged_tensor")
    with pytest.raises(InputError, match="from_torchrec: expected a KeyedJaggedTensor, got dict"):
        SparseFeatures.from_torchrec({"a": 1})
    vbe = jt.KeyedJaggedTensor(keys=["a", "b"], values=T([1, 2, 3]), lengths=T([1, 1, 0, 1]),
                               stride_per_key_per_rank=[[1], [3]])
    with pytest.raises(InputError, match=r"features have different batch sizes \{'a': 1, 'b': 3\}"):
        SparseFeatures.from_torchrec(vbe)


def test_torchrec_missing_names_the_extra(monkeypatch):
    # None in sys.modules makes `import torchrec...` raise ImportError, as if not installed
    for mod in ("torchrec", "torchrec.sparse", "torchrec.sparse.jagged_tensor"):
        monkeypatch.setitem(sys.modules, mod, None)
    sf = build(DOC)
    with pytest.raises(ImportError, match=r'to_torchrec needs torchrec.*pip install "hugeembed\[torchrec\]".*--no-deps'):
        sf.to_torchrec()
    with pytest.raises(ImportError, match=r'from_torchrec needs torchrec.*hugeembed\[torchrec\]'):
        SparseFeatures.from_torchrec(object())


def test_importing_features_does_not_import_torchrec():
    code = ("import sys, hugeembed.features as f; f.SparseFeatures.from_lists({'a': [[1]]}).to_lists();"
            "print([m for m in ('torchrec', 'fbgemm_gpu') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
