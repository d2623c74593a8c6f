import torch
from hypothesis import given, strategies as st

from hugeembed import _native
from hugeembed._hashing import mix64, mix64_int

int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(st.lists(int64s, min_size=1, max_size=50))
def test_torch_mix64_matches_python_oracle(keys):
    got = mix64(torch.tensor(keys, dtype=torch.int64)).tolist()
    assert got == [mix64_int(k) for k in keys]


@given(st.lists(int64s, min_size=1, max_size=50))
def test_native_mix64_matches_python_oracle(keys):
    t = torch.tensor(keys, dtype=torch.int64)
    out = torch.empty_like(t)
    _native.call("he_mix64", [t, out])
    assert out.tolist() == [mix64_int(k) for k in keys]


def test_mix64_known_value():
    # fmix64(1) from MurmurHash3's reference implementation
    assert mix64_int(1) & ((1 << 64) - 1) == 0xB456BCFC34C2CB2C
