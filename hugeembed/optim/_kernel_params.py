"""A rule's hyper-parameters as the fused triton optimizer kernel (hugeembed/_triton/segment_optim.py)
takes them: host side, no device work.

The kernel takes 13 float32 scalars ``p``, 4 float64 scalars ``q`` (as bit patterns: a Python float
argument arrives as float32) and constexpr flags.  The values are what the torch twins use: Python
doubles (rounded to float32 where the twin multiplies a float32 tensor by them), per-step values
(Adagrad's decayed lr, Adam's bias corrections at the global step) computed here in float64 as the
twins compute them.
"""

from __future__ import annotations

import math
import struct

import torch

from ._adagrad import Adagrad, RowWiseAdagrad
from ._adam import Adam
from ._adam_catchup import bound_factors, negligible_fraction
from ._base import SparseOptimizer
from ._ftrl import FTRL
from ._sgd import SGD, MomentumSGD

__all__ = ["RULE_CODES", "kernel_params", "supported_rule"]

# rule class -> the kernel's RULE constexpr
RULE_CODES = {SGD: 0, MomentumSGD: 1, Adagrad: 2, RowWiseAdagrad: 3, Adam: 4, FTRL: 5}
_ADAM_MODE = {("lazy", "global_step"): 0, ("lazy", "per_row"): 1, ("global", "global_step"): 2}


def supported_rule(rule: SparseOptimizer) -> bool:
    """Whether the fused kernel has this rule (exactly these classes: a subclass may change the math)."""
    return type(rule) in RULE_CODES


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _f32(x: float) -> float:
    """`x` rounded to float32 (what a float32 tensor times `x` uses; inf past its range), on the host."""
    try:
        return struct.unpack("<f", struct.pack("<f", float(x)))[0]
    except OverflowError:  # (beyond float32's range: what the cast gives)
        return math.copysign(math.inf, x)


def kernel_params(rule: SparseOptimizer, lr: float, step: int, weight_dtype: torch.dtype):
    """(p: 13 floats, q: 4 int bit patterns, flags: dict of constexprs) for one step of `rule`."""
    p = [0.0] * 13
    q = [_bits(0.0)] * 4
    flags = dict(RULE=RULE_CODES[type(rule)], WD=False, NESTEROV=False, ADAM_MODE=0, DECOUPLED=False,
                 EPS_TF=False, FTRL_SQRT=True)
    if isinstance(rule, SGD):
        p[:2] = [lr, rule.weight_decay]
        flags["WD"] = rule.weight_decay != 0.0
    elif isinstance(rule, MomentumSGD):
        p[:3] = [lr, rule.momentum, rule.weight_decay]
        flags.update(WD=rule.weight_decay != 0.0, NESTEROV=rule.nesterov)
    elif isinstance(rule, Adagrad):
        p[:3] = [rule._clr(lr, step), rule.eps, rule.weight_decay]
        flags["WD"] = rule.weight_decay != 0.0
    elif isinstance(rule, RowWiseAdagrad):
        p[:3] = [lr, rule.eps, rule.weight_decay]
        flags["WD"] = rule.weight_decay != 0.0
    elif isinstance(rule, Adam):
        b1, b2 = rule.betas
        wd = rule.weight_decay
        c = 1.0 - lr * wd
        mode = _ADAM_MODE[(rule.mode, rule.bias_correction)]
        step_scale, dscale = rule._scalars(lr, b1**step, b2**step)
        fa, fb = bound_factors(b1, b2, rule.eps)
        p[:13] = [lr, b1, 1.0 - b1, b2, 1.0 - b2, rule.eps, wd, c, step_scale, dscale,
                  negligible_fraction(weight_dtype), _f32(fa), _f32(fb)]
        q = [_bits(lr), _bits(b1), _bits(b2), _bits(c)]
        flags.update(WD=wd != 0.0, ADAM_MODE=mode, DECOUPLED=rule.decoupled_weight_decay,
                     EPS_TF=rule.epsilon == "tf")
    elif isinstance(rule, FTRL):
        two_l2, two_shrink = rule._hyper(lr)
        p[:5] = [lr, rule.l1, two_l2, two_shrink, -rule.lr_power]
        q[0] = _bits(-rule.lr_power)  # the power in float64, as the twin's
        flags.update(WD=two_shrink != 0.0, FTRL_SQRT=rule.lr_power == -0.5)
    # float32 arguments: inf (fb with b1 >= sqrt(b2)) passes as inf, as the twin's float32 copy
    return [_f32(x) for x in p], q, flags
