"""Device functions of the fused optimizer kernel: the rules' arithmetic on one row, float64 powers,
global Adam's catch-up and the rounding of 16-bit weights.

Each function performs the float operations of its torch twin in hugeembed/optim in the same order
and precision (float32 values with float32 hyper-parameters, float64 where the twin uses float64),
with correctly rounded square roots and divisions (``sqrt_rn`` / ``div_rn``, as the twins' ``sqrt_rn``
and true division), so the kernel equals the twin to float32 rounding (a GPU may contract a multiply
and an add into one FMA).
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def f64(bits):
    """A float64 passed as its bit pattern (a Python float argument would arrive as float32)."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True)


@triton.jit
def pow_int(base, e):
    """base ** e for float64 `base` and an integer e >= 0, by squaring (exact to a few float64 ulps)."""
    r = tl.full((), 1.0, tl.float64)
    b = base.to(tl.float64)
    e = e.to(tl.int64)
    while e > 0:
        r = tl.where((e & 1) != 0, r * b, r)
        b = b * b
        e = e >> 1
    return r


@triton.jit
def pow_nonneg(x, p):
    """x ** p in float64 for float32 x >= 0, as torch's ``x.double().pow(p)`` (0 ** 0 = 1)."""
    x64 = x.to(tl.float64)
    r = tl.exp(p * tl.log(tl.where(x64 > 0, x64, 1.0)))
    return tl.where(x64 > 0, r, tl.where(p == 0, 1.0, 0.0))


@triton.jit
def mix64(x):
    """MurmurHash3's fmix64 on uint64 (hugeembed._hashing.mix64)."""
    x = x ^ (x >> 33)
    x = x * 0xFF51AFD7ED558CCD
    x = x ^ (x >> 33)
    x = x * 0xC4CEB9FE1A85EC53
    x = x ^ (x >> 33)
    return x


@triton.jit
def counter_uniform(seed, mixed, key, cols):
    """float64 uniforms of (seed, step, key, column) as hugeembed._hashing.counter_uniform; `mixed` is
    ``mix64_int(step ^ salt)`` (from the host), `seed` and `key` int64 scalars, `cols` a column range."""
    s = (seed.to(tl.int64) ^ mixed.to(tl.int64)).to(tl.uint64, bitcast=True)
    base = mix64(key.to(tl.int64).to(tl.uint64, bitcast=True) ^ mix64(s + 0x9E3779B97F4A7C15))
    x = mix64(base + cols.to(tl.uint64) * 0xD1B54A32D192ED03)
    return (x >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2^-53


@triton.jit
def _next16(h, up):
    """The 16-bit float next to `h` towards +inf (up) or -inf, as torch.nextafter (h finite)."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    mag = b & 0x7FFF
    ordered = tl.where((b & 0x8000) != 0, -mag, mag)  # +0 and -0 both 0
    o = ordered + tl.where(up, 1, -1)
    nb = tl.where(o < 0, 0x8000 | (-o), o)
    return nb.to(tl.int16).to(h.dtype, bitcast=True)


@triton.jit
def to_nearest(x, DT: tl.constexpr):
    """float32 `x` as DT rounded to nearest even.  bfloat16 by the bits (what cvt.rn.bf16.f32 does):
    triton 3.6's interpreter truncates a float32 to bfloat16 whatever rounding it is told."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # a carry into the exponent rounds up to the next binade / inf
        r = tl.where(x != x, 0x7FC0, r)  # NaN stays NaN
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float32:
        return x
    else:
        return x.to(DT)


@triton.jit
def widen(h):
    """A float32 copy of `h` (bfloat16 by its bits: exact, where the interpreter loses subnormals)."""
    if h.dtype == tl.bfloat16:
        return (h.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return h.to(tl.float32)


@triton.jit
def _finite(x):
    return tl.abs(x) < float("inf")


@triton.jit
def round_weights(x, WDT: tl.constexpr, STOCHASTIC: tl.constexpr, seed, mixed, key, cols):
    """float32 row `x` as WDT: to nearest, or stochastically as optim/_rounding.round_stochastic."""
    near = to_nearest(x, WDT)
    if STOCHASTIC:
        nf = widen(near)
        below = nf < x
        other = _next16(near, below)
        of = widen(other)  # (to float64 through float32: the interpreter casts bfloat16's raw bits)
        lo = tl.where(below, nf, of).to(tl.float64)
        hi = tl.where(below, of, nf).to(tl.float64)
        p_up = (x.to(tl.float64) - lo) / (hi - lo)
        u = counter_uniform(seed, mixed, key, cols)
        out = to_nearest(tl.where(u < p_up, hi, lo).to(tl.float32), WDT)  # exact: hi, lo are WDT values
        keep = (nf == x) | ~_finite(nf) | ~_finite(of)
        near = tl.where(keep, near, out)
    return near


@triton.jit
def adam_catch_up(w, m, v, last, gap, lr64, b1_64, b2_64, c64, b1, b2, eps, c, tol, fa, fb, mask,
                  DECAY: tl.constexpr, EPS_TF: tl.constexpr):
    """Replays `gap` zero-gradient steps after step `last` (optim/_adam_catchup.catch_up_rows, one row):
    step by step until the tail bound says the rest is negligible, the rest in closed form."""
    p1 = pow_int(b1_64, last + 1)
    p2 = pow_int(b2_64, last + 1)
    cg = pow_int(c64, gap).to(tl.float32)
    k = gap * 0
    go = gap > 0
    while go:
        bc1 = 1.0 - p1
        bc2 = 1.0 - p2
        if EPS_TF:
            step_scale = (lr64 * tl.sqrt(bc2) / bc1).to(tl.float32)
            dscale = tl.full((), 1.0, tl.float32)
        else:
            step_scale = (lr64 / bc1).to(tl.float32)
            dscale = tl.sqrt(bc2).to(tl.float32)
        big_s = (lr64 / bc1).to(tl.float32)
        if DECAY:
            w = w * c
        m = m * b1
        v = v * b2
        sq = tl.sqrt_rn(v)
        w = w - tl.div_rn(m, tl.div_rn(sq, dscale) + eps) * step_scale
        k += 1
        am = tl.abs(m) * big_s
        # v == 0: the second bound is inf (or NaN with m == 0, a row already done): the first alone
        bound = tl.where(sq > 0, tl.minimum(am * fa, tl.div_rn(am * fb, tl.where(sq > 0, sq, 1.0))), am * fa)
        limit = tl.abs(w) * tol
        if DECAY:
            limit = limit * cg
        ok = (m == 0) | (bound <= limit) | ~mask
        go = (tl.min(ok.to(tl.int32), axis=0) == 0) & (gap > k)
        p1 = p1 * b1_64
        p2 = p2 * b2_64
    rem = tl.maximum(gap - k, 0)
    m = m * pow_int(b1_64, rem).to(tl.float32)
    v = v * pow_int(b2_64, rem).to(tl.float32)
    if DECAY:
        w = w * pow_int(c64, rem).to(tl.float32)
    return w, m, v
