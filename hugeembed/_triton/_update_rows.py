"""The update kernel of segment_optim.py: one program per unique row sums its gradient (its first chunk, then
the other chunks' partial sums in order) and applies its unit's rule to the row and its state in place."""

from __future__ import annotations

import triton
import triton.language as tl

from ._rule_math import adam_catch_up, f64, pow_int, pow_nonneg, round_weights, to_nearest, widen

__all__ = []


@triton.jit
def _sum_entries(acc, lo, hi, order, bag_of, slot, weights, denom, grad, grad_stride, B, Fg, d, dmask,
                 HAS_W: tl.constexpr):
    """acc + the gradient terms of sorted positions [lo, hi), in order."""
    i = lo
    while i < hi:
        j = tl.load(order + i)
        bag = tl.load(bag_of + j)
        f = bag // B
        row = (bag - f * B) * Fg + tl.load(slot + f)
        if HAS_W:
            wj = tl.load(weights + j)
        else:
            wj = tl.full((), 1.0, tl.float32)
        coef = tl.div_rn(wj, tl.load(denom + bag))
        g = tl.load(grad + row.to(tl.int64) * grad_stride + d, mask=dmask, other=0.0)
        acc += g * coef
        i += 1
    return acc



@triton.jit
def _update_rows(pid0, n_programs, order, seg_start, counts, rows, tables, unit_tables, cum_extra, partial, chunk,
                 bag_of, slot, weights, denom, grad, grad_stride, B, Fg,
                 wts, w_stride, st, s_stride, D, entry_keys, table_seed, mixed, step,
                 p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, q0, q1, q2, q3,
                 RULE: tl.constexpr, WD: tl.constexpr, NESTEROV: tl.constexpr, ADAM_MODE: tl.constexpr,
                 DECOUPLED: tl.constexpr, EPS_TF: tl.constexpr, FTRL_SQRT: tl.constexpr,
                 STOCHASTIC: tl.constexpr, HAS_W: tl.constexpr, UNIT_MAP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Unique rows s = p, p + n_programs, ... below the device's count (a grid from shapes, not the count:
    no host read, and no program per possible row): each row's update (_update_row)."""
    s = pid0 + tl.program_id(0)
    n_unique = tl.load(counts + 1)
    while s < n_unique:
        _update_row(s, n_unique, order, seg_start, rows, tables, unit_tables, cum_extra, partial, chunk,
                    bag_of, slot, weights, denom, grad, grad_stride, B, Fg,
                    wts, w_stride, st, s_stride, D, entry_keys, table_seed, mixed, step,
                    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, q0, q1, q2, q3,
                    RULE, WD, NESTEROV, ADAM_MODE, DECOUPLED, EPS_TF, FTRL_SQRT, STOCHASTIC, HAS_W, UNIT_MAP, BLOCK_D)
        s += n_programs


@triton.jit
def _update_row(s, n_unique, order, seg_start, rows, tables, unit_tables, cum_extra, partial, chunk,
                bag_of, slot, weights, denom, grad, grad_stride, B, Fg,
                wts, w_stride, st, s_stride, D, entry_keys, table_seed, mixed, step,
                p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, q0, q1, q2, q3,
                RULE: tl.constexpr, WD: tl.constexpr, NESTEROV: tl.constexpr, ADAM_MODE: tl.constexpr,
                DECOUPLED: tl.constexpr, EPS_TF: tl.constexpr, FTRL_SQRT: tl.constexpr,
                STOCHASTIC: tl.constexpr, HAS_W: tl.constexpr, UNIT_MAP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Unique row s (< n_unique): its gradient (first chunk + partials, in order), then the rule on row rows[s]
    when its table is the unit's: UNIT_MAP, ``unit_tables[tables[s]] >= 0`` (the unit's index of the table),
    else ``tables[s]`` is that index."""
    live = s < n_unique
    local = tl.load(tables + s, mask=live, other=-1)
    if UNIT_MAP:
        local = tl.load(unit_tables + local, mask=live, other=-1)
    live = live & (local >= 0)
    start = tl.load(seg_start + s)
    end = tl.where(live, tl.load(seg_start + s + 1), start)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    g = _sum_entries(tl.zeros((BLOCK_D,), tl.float32), start, tl.minimum(end, start + chunk), order, bag_of, slot,
                     weights, denom, grad, grad_stride, B, Fg, d, dmask, HAS_W)
    e_lo = tl.load(cum_extra + s - 1, mask=s > 0, other=0)
    e_hi = tl.where(live, tl.load(cum_extra + s), e_lo)
    e = e_lo
    while e < e_hi:
        g += tl.load(partial + e.to(tl.int64) * D + d, mask=dmask, other=0.0)
        e += 1
    ok = dmask & live
    r = tl.load(rows + s).to(tl.int64)
    wp = wts + r * w_stride + d
    sp = st + r * s_stride
    w = widen(tl.load(wp, mask=ok, other=0.0))
    if RULE == 0:  # SGD: p = lr, wd
        if WD:
            g = g + w * p1
        w = w - g * p0
    elif RULE == 1:  # momentum: p = lr, momentum, wd
        buf = widen(tl.load(sp + d, mask=ok, other=0.0))
        if WD:
            g = g + w * p2
        buf = buf * p1 + g
        if NESTEROV:
            w = w - (g + buf * p1) * p0
        else:
            w = w - buf * p0
        tl.store(sp + d, to_nearest(buf, st.dtype.element_ty), mask=ok)
    elif RULE == 2:  # Adagrad: p = clr, eps, wd
        acc = widen(tl.load(sp + d, mask=ok, other=0.0))
        if WD:
            g = g + w * p2
        acc = acc + g * g
        w = w - tl.div_rn(g * p0, tl.sqrt_rn(acc) + p1)
        tl.store(sp + d, to_nearest(acc, st.dtype.element_ty), mask=ok)
    elif RULE == 3:  # row-wise Adagrad: p = lr, eps, wd
        acc = widen(tl.load(sp, mask=live, other=0.0))
        gp = g
        if WD:
            gp = g + w * p2
        gp64 = gp.to(tl.float64)
        acc = acc + (tl.sum(gp64 * gp64, axis=0) / D).to(tl.float32)
        mult = tl.div_rn(p0 + tl.zeros((), tl.float32), tl.sqrt_rn(acc) + p1)
        if WD:
            w = w * (1.0 - mult * p2) - g * mult
        else:
            w = w - g * mult
        tl.store(sp, to_nearest(acc, st.dtype.element_ty), mask=live)
    elif RULE == 4:  # Adam: p = lr, b1, 1-b1, b2, 1-b2, eps, wd, c, step_scale, dscale, tol, fa, fb
        m = widen(tl.load(sp + d, mask=ok, other=0.0))
        v = widen(tl.load(sp + D + d, mask=ok, other=0.0))
        step_scale = p8 + tl.zeros((), tl.float32)
        dscale = p9 + tl.zeros((), tl.float32)
        if ADAM_MODE != 0:
            cnt = tl.load(sp + 2 * D, mask=live, other=0.0).to(tl.int32, bitcast=True)
        if ADAM_MODE == 2:  # global: replay the steps since the row's last, then this one
            w, m, v = adam_catch_up(w, m, v, cnt, step - 1 - cnt, f64(q0), f64(q1), f64(q2), f64(q3), p1, p3, p5,
                                    p7, p10, p11, p12, dmask, DECOUPLED and WD, EPS_TF)
            cnt = step + cnt * 0
        elif ADAM_MODE == 1:  # per-row bias correction: the row's own count
            cnt = cnt + 1
            bc1 = 1.0 - pow_int(f64(q1), cnt)
            bc2 = 1.0 - pow_int(f64(q2), cnt)
            if EPS_TF:
                step_scale = (f64(q0) * tl.sqrt(bc2) / bc1).to(tl.float32)
            else:
                step_scale = (f64(q0) / bc1).to(tl.float32)
                dscale = tl.sqrt(bc2).to(tl.float32)
        if WD and DECOUPLED:
            w = w * p7
        if WD and not DECOUPLED:
            g = g + w * p6
        m = m * p1 + g * p2
        v = v * p3 + (g * g) * p4
        w = w - tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v), dscale) + p5) * step_scale
        tl.store(sp + d, to_nearest(m, st.dtype.element_ty), mask=ok)
        tl.store(sp + D + d, to_nearest(v, st.dtype.element_ty), mask=ok)
        if ADAM_MODE != 0:
            tl.store(sp + 2 * D, cnt.to(tl.float32, bitcast=True), mask=live)  # (fp32 state: kernel_params checks)
    else:  # FTRL: p = lr, l1, 2 l2', 2 l2_shrinkage, -lr_power
        n = widen(tl.load(sp + d, mask=ok, other=0.0))
        z = widen(tl.load(sp + D + d, mask=ok, other=0.0))
        gs = g
        if WD:
            gs = g + w * p3
        n_new = n + g * g
        if FTRL_SQRT:
            pn = tl.sqrt_rn(n_new)
            po = tl.sqrt_rn(n)
        else:
            pn = pow_nonneg(n_new, f64(q0)).to(tl.float32)
            po = pow_nonneg(n, f64(q0)).to(tl.float32)
        sigma = tl.div_rn(pn - po, p0 + tl.zeros_like(pn))
        z = z + (gs - sigma * w)
        quad = tl.where(ok, tl.div_rn(pn, p0 + tl.zeros_like(pn)) + p2, 1.0)  # lanes past D: no 0 / 0
        w = tl.div_rn(tl.minimum(tl.maximum(z, -p1), p1) - z, quad)
        tl.store(sp + d, to_nearest(n_new, st.dtype.element_ty), mask=ok)
        tl.store(sp + D + d, to_nearest(z, st.dtype.element_ty), mask=ok)
    if STOCHASTIC:  # the row's key (its first entry's) and its table's seed draw the rounding
        key = tl.load(entry_keys + tl.load(order + start))
        seed = tl.load(table_seed + local)
    else:
        key = r
        seed = r
    tl.store(wp, round_weights(w, wts.dtype.element_ty, STOCHASTIC, seed, mixed, key, d), mask=ok)
