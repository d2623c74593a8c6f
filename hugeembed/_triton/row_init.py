"""New rows' initial weights and optimizer state in one kernel (issue 32): the triton index's find-or-insert
launches it after its commit, over the rows the call made (store/_index_triton.py), where the native index
initialises them inside its own kernel (csrc/store_init.cpp).

Per table, as DynamicGroup._kernel_init_args gives them: kinds int64 [T, 2] (store/_init.py's
``_native_spec`` kind: 0 constant, 1 uniform, 2 normal, 3 truncated normal, -1 made by the group; the
seed), spec float64 [T, 6] (the spec's), state float32 [T, S] (each table's state template).  The
values are store/_init.py's torch expressions in the same double operations and order (fp fusion off, so
no multiply-add is contracted): equal to the torch path's rows but for the last bit of a double log.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._rule_math import mix64

__all__ = ["init_rows_kernel", "coefficients", "COMPILE_CASES"]

_GOLDEN, _STREAM = tl.constexpr(0x9E3779B97F4A7C15), tl.constexpr(0xD1B54A32D192ED03)
# AS 241's coefficients (store/_init.py's _A .. _F, 8 each), then 0.180625, 1.6, 5.0, 1e-300, 0.425, 0.5, 2^-53:
# loaded as float64 from a tensor (a float literal in a kernel may be taken as float32)
_C_A, _C_B, _C_C, _C_D, _C_E, _C_F, _C_R = (tl.constexpr(8 * i) for i in range(7))


def coefficients(horner) -> list[float]:
    """The float64 constants the kernel loads (``coefs``): `horner`, store/_init.py's (_A, _B, _C, _D, _E, _F)
    (given by the caller: this package sits below store), then the expressions' other constants."""
    assert len(horner) == 6 and all(len(c) == 8 for c in horner)
    return [c for cs in horner for c in cs] + [0.180625, 1.6, 5.0, 1e-300, 0.425, 0.5, 2.0**-53]


@triton.jit
def _horner(coefs, at: tl.constexpr, x):
    """store/_init.py::_horner over coefs[at : at + 8]: acc = c7; acc = acc * x + c_k down to c0."""
    acc = tl.zeros_like(x) + tl.load(coefs + at + 7)
    for i in tl.static_range(7):
        acc = acc * x + tl.load(coefs + at + 6 - i)
    return acc


@triton.jit
def _inverse_normal_cdf(p, coefs):
    """store/_init.py::inverse_normal_cdf (Wichura's AS 241) on float64 p in (0, 1)."""
    half = tl.load(coefs + _C_R + 5)
    q = p - half
    r = tl.load(coefs + _C_R) - q * q
    central = q * _horner(coefs, _C_A, r) / _horner(coefs, _C_B, r)
    one = half + half
    t = tl.sqrt(-tl.log(tl.maximum(tl.where(q < 0, p, one - p), tl.load(coefs + _C_R + 3))))
    tn = t - tl.load(coefs + _C_R + 1)
    tf = t - tl.load(coefs + _C_R + 2)
    near = _horner(coefs, _C_C, tn) / _horner(coefs, _C_D, tn)
    far = _horner(coefs, _C_E, tf) / _horner(coefs, _C_F, tf)
    tail = tl.where(t <= tl.load(coefs + _C_R + 2), near, far)
    tail = tl.where(q < 0, -tail, tail)
    return tl.where(tl.abs(q) <= tl.load(coefs + _C_R + 4), central, tail)


@triton.jit(do_not_specialize=["m", "row_stride", "dim", "state_at", "state_width", "pid0"])
def init_rows_kernel(pid0, rows, row_stride, m, slots, keys, tids, kinds, spec, state, coefs, dim, state_at,
                     state_width, HAS_STATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_S: tl.constexpr):
    """Rows slots[:m] (of keys[:m], tables tids[:m]) of float32 `rows` [R, row_stride]: weights in columns
    [0, dim) by the table's kind (none when -1), state columns [state_at, state_at + state_width) from its
    template (HAS_STATE: every table has one)."""
    r = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < m
    t = tl.load(tids + r, mask=live, other=0).to(tl.int64)
    slot = tl.load(slots + r, mask=live, other=0)
    kind = tl.load(kinds + t * 2, mask=live, other=-1)
    seed = tl.load(kinds + t * 2 + 1, mask=live, other=0).to(tl.uint64, bitcast=True)
    key = tl.load(keys + r, mask=live, other=0).to(tl.uint64, bitcast=True)
    base = mix64(key ^ mix64(seed + _GOLDEN))
    cols = tl.arange(0, BLOCK_D)
    bits = (mix64(base[:, None] + cols[None, :].to(tl.uint64) * _STREAM) >> 11).to(tl.float64)
    unit = tl.load(coefs + _C_R + 6)
    p0 = tl.load(spec + t * 6, mask=live, other=0.0)[:, None]
    p1 = tl.load(spec + t * 6 + 1, mask=live, other=0.0)[:, None]
    p2 = tl.load(spec + t * 6 + 2, mask=live, other=0.0)[:, None]
    p3 = tl.load(spec + t * 6 + 3, mask=live, other=0.0)[:, None]
    p4 = tl.load(spec + t * 6 + 4, mask=live, other=0.0)[:, None]
    p5 = tl.load(spec + t * 6 + 5, mask=live, other=0.0)[:, None]
    k = kind[:, None]
    uniform = p0 + (p1 - p0) * (bits * unit)
    u = (bits + tl.load(coefs + _C_R + 5)) * unit  # in (0, 1): store/_init.py::_open_unit
    u = tl.where(k == 3, p4 + u * (p5 - p4), u)
    z = _inverse_normal_cdf(u, coefs)
    z = tl.where(k == 3, tl.minimum(tl.maximum(z, p2), p3), z)
    value = tl.where(k == 0, p0, tl.where(k == 1, uniform, p0 + p1 * z))
    at = rows + slot[:, None] * row_stride
    tl.store(at + cols[None, :], value.to(tl.float32), mask=live[:, None] & (k >= 0) & (cols[None, :] < dim))
    if HAS_STATE:  # (kind -1: the group makes the row's state too)
        sc = tl.arange(0, BLOCK_S)[None, :]
        ms = live[:, None] & (k >= 0) & (sc < state_width)
        tl.store(at + state_at + sc, tl.load(state + t[:, None] * state_width + sc, mask=ms, other=0.0), mask=ms)


_SIG = {"pid0": "i32", "rows": "*fp32", "row_stride": "i64", "m": "i64", "slots": "*i64", "keys": "*i64",
        "tids": "*i64", "kinds": "*i64", "spec": "*fp64", "state": "*fp32", "coefs": "*fp64", "dim": "i32",
        "state_at": "i32", "state_width": "i32", "HAS_STATE": "constexpr", "BLOCK_R": "constexpr",
        "BLOCK_D": "constexpr", "BLOCK_S": "constexpr"}
# fp fusion off: store/_init.py's torch expressions round each multiply and add apart
_OPTIONS = {"enable_fp_fusion": False}
COMPILE_CASES = [(f"row_init.init_rows[state={int(s)}, D={d}]", init_rows_kernel, _SIG,
                  {"HAS_STATE": s, "BLOCK_R": 16, "BLOCK_D": d, "BLOCK_S": 4}, _OPTIONS)
                 for s in (False, True) for d in (16, 128)]
