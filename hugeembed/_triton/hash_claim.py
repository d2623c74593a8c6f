"""Placing a find-or-insert's new records in the key index as the reference does (store/_index_torch.py::claim),
in triton kernels (issue 32, item 4); store/_index_triton.py launches them after its one read, gated by then.

* ``claim_*``        one round of placing new records: each key's window of W buckets (scan: its first
                     empty bucket), its crowd's rank (keys whose first empty bucket is one bucket: a
                     stable sort of those buckets, then a binary search in it) and the bucket it wants,
                     stamped with ``atomic_max`` of (epoch, lowest batch position) (want); then the
                     winners write and the losers probe on (place).  A round's result never depends on
                     the order the programs run in.
* ``claim_finish_kernel``  one program: rounds over the records listed (windows of 32, 64, then 128
                     buckets: every round of a call with few new keys, its crowd ranks by comparing
                     records pairwise; or 128-bucket rounds over what launched rounds left), on the
                     device until none is left, so a find-or-insert reads nothing after its claims.

Every kernel takes its first program id (``pid0``) so a test can launch grids of one program in a
shuffled order.  Scalars arrive as i32 or i64 (triton specializes by value): each is widened to
int64 before it meets 64-bit words.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .hash_index import EMPTY_TABLE, _sig

__all__ = ["claim_scan_kernel", "claim_want_kernel", "claim_place_kernel", "claim_finish_kernel", "FINISH_EPOCH",
           "STAMP_BITS", "COMPILE_CASES"]

# a claim stamp: the round's epoch above, (2**STAMP_BITS - 1 - batch position) below: max = lowest position
STAMP_BITS = 40
# the epoch of claim_finish_kernel's stamps: above every epoch of the rounds launched one by one (their stamps never
# reach it), cleared before the kernel ends
FINISH_EPOCH = 2 ** (63 - STAMP_BITS) - 1
# the same values as the kernels see them (a kernel reads only constexpr globals)
_K_EMPTY = tl.constexpr(EMPTY_TABLE)
_K_STAMP_BITS, _K_STAMP_LOW = tl.constexpr(STAMP_BITS), tl.constexpr((1 << STAMP_BITS) - 1)
_K_FINISH = tl.constexpr(FINISH_EPOCH << STAMP_BITS)


@triton.jit
def _window_empty(buckets, nb, p, active, W: tl.constexpr):
    """[BLOCK, W]: whether bucket (p + w) % B is empty, for the active keys."""
    win = (p[:, None] + tl.arange(0, W)[None, :]) % nb
    table = tl.load(buckets + win * 4 + 1, mask=active[:, None], other=0)
    return active[:, None] & (table == _K_EMPTY)


@triton.jit(do_not_specialize=["nbuckets", "n", "pid0"])
def claim_scan_kernel(buckets, nbuckets, n, active, start, first, pid0, W: tl.constexpr, BLOCK: tl.constexpr):
    """first[j]: the first empty bucket in key j's window [p, p + W), -1 when none or j is placed."""
    j = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < n
    a = live & (tl.load(active + j, mask=live, other=0) != 0)
    p = tl.load(start + j, mask=a, other=0)
    nb = nbuckets.to(tl.int64)
    empty = _window_empty(buckets, nb, p, a, W)
    at = tl.min(tl.where(empty, tl.arange(0, W)[None, :], W), axis=1)
    tl.store(first + j, tl.where(a & (at < W), (p + at) % nb, -1), mask=live)


@triton.jit(do_not_specialize=["nbuckets", "n", "epoch", "pid0"])
def claim_want_kernel(buckets, nbuckets, n, start, sorted_first, order, want, claims, epoch, pid0,
                      W: tl.constexpr, BLOCK: tl.constexpr):
    """For key j = order[s] (`order` sorts the keys' first empty buckets stably, `sorted_first` is
    that sort): its rank in its crowd (the keys before it in batch order with its first empty
    bucket: its distance to where its value starts in the sort, a binary search), then want[j]
    the (rank + 1)-th empty bucket of its window (-1 past the window or when it has none), stamped
    with atomic_max so the lowest batch position wanting a bucket holds its claim."""
    s = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = s < n
    j = tl.load(order + s, mask=live, other=0)
    f = tl.load(sorted_first + s, mask=live, other=-1)
    a = live & (f >= 0)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.where(a, s, 0)
    while tl.max((lo < hi).to(tl.int32), axis=0) > 0:
        open_ = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(sorted_first + mid, mask=open_, other=0) < f
        lo = tl.where(open_ & below, mid + 1, lo)
        hi = tl.where(open_ & ~below, mid, hi)
    r = s - lo
    p = tl.load(start + j, mask=a, other=0)
    nb = nbuckets.to(tl.int64)
    empty = _window_empty(buckets, nb, p, a, W).to(tl.int32)
    at = tl.sum((tl.cumsum(empty, axis=1) <= r[:, None]).to(tl.int32), axis=1)
    ok = a & (at < W)
    bucket = (p + at) % nb
    stamp = (epoch.to(tl.int64) << _K_STAMP_BITS) | (_K_STAMP_LOW - j)
    tl.atomic_max(claims + bucket, stamp, mask=ok)
    tl.store(want + j, tl.where(ok, bucket, -1), mask=live)


@triton.jit(do_not_specialize=["nbuckets", "n", "epoch", "pid0"])
def claim_place_kernel(buckets, nbuckets, n, active, start, want, claims, epoch, rec_keys, rec_tids, rec_word2,
                       rec_last, left, pid0, W: tl.constexpr, BLOCK: tl.constexpr):
    """The winners write their records (and take themselves off `left`, the records still to
    place); the others go on from the bucket after the one they wanted (or past their window)."""
    j = (pid0 + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < n
    a = live & (tl.load(active + j, mask=live, other=0) != 0)
    p = tl.load(start + j, mask=a, other=0)
    bucket = tl.load(want + j, mask=a, other=-1)
    ok = a & (bucket >= 0)
    stamp = (epoch.to(tl.int64) << _K_STAMP_BITS) | (_K_STAMP_LOW - j)
    won = ok & (tl.load(claims + bucket, mask=ok, other=0) == stamp)
    rec = buckets + bucket * 4
    tl.store(rec, tl.load(rec_keys + j, mask=won, other=0), mask=won)
    tl.store(rec + 1, tl.load(rec_tids + j, mask=won, other=0).to(tl.int64), mask=won)
    tl.store(rec + 2, tl.load(rec_word2 + j, mask=won, other=0), mask=won)
    tl.store(rec + 3, tl.load(rec_last + j, mask=won, other=0), mask=won)
    nb = nbuckets.to(tl.int64)
    tl.store(start + j, tl.where(ok, (bucket + 1) % nb, (p + W) % nb), mask=a & ~won)
    tl.store(active + j, tl.zeros([BLOCK], tl.int32), mask=won)
    tl.atomic_add(left, -tl.sum(won.to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["nbuckets", "width0", "max_rounds", "pid0"])
def claim_finish_kernel(buckets, nbuckets, listed, todo, active, start, claims, rec_keys, rec_tids, rec_word2, rec_last,
                        left, cur, first, want, width0, max_rounds, pid0, W: tl.constexpr, BLOCK: tl.constexpr):
    """A grid of one program: claim rounds (scan, want, place as above, each phase over every record left
    before the next begins) of windows of width0 buckets, then twice as wide up to W (the reference's
    32, 64, 128, 128, ...), until `left` is 0 or `max_rounds` ran; `left` then holds the records not
    placed (0 unless the index has no empty bucket: an internal error the caller reports).  The records
    are todo[:listed[0]] (positions in batch order), those whose `active` is set; cur, first, want:
    int64 [n] scratch.  Its stamps (epoch FINISH_EPOCH) are cleared after each round."""
    if pid0 + tl.program_id(0) == 0:
        nb = nbuckets.to(tl.int64)
        n_listed = tl.load(listed)
        remaining = tl.load(left)
        rounds = tl.zeros((), tl.int64)
        width = tl.zeros((), tl.int64) + width0.to(tl.int64)
        lanes = tl.arange(0, W)[None, :]
        while (remaining > 0) & (rounds < max_rounds):
            # the records left, in batch order
            m = tl.zeros((), tl.int64)
            i = tl.zeros((), tl.int64)
            while i < n_listed:
                at = i + tl.arange(0, BLOCK)
                j = tl.load(todo + at, mask=at < n_listed, other=0)
                a = ((at < n_listed) & (tl.load(active + j, mask=at < n_listed, other=0, cache_modifier=".cg") != 0)
                     ).to(tl.int64)
                tl.store(cur + m + tl.cumsum(a, axis=0) - a, j, mask=a != 0)
                m += tl.sum(a, axis=0)
                i += BLOCK
            tl.debug_barrier()
            # each one's first empty bucket in its window
            s0 = tl.zeros((), tl.int64)
            while s0 < m:
                s = s0 + tl.arange(0, BLOCK)
                ms = s < m
                j = tl.load(cur + s, mask=ms, other=0, cache_modifier=".cg")
                p = tl.load(start + j, mask=ms, other=0, cache_modifier=".cg")
                empty = _window_empty(buckets, nb, p, ms, W) & (lanes < width)
                at = tl.min(tl.where(empty, lanes, W), axis=1)
                tl.store(first + s, tl.where(ms & (at < width), (p + at) % nb, -1), mask=ms)
                s0 += BLOCK
            tl.debug_barrier()
            # its rank among the records with that first empty bucket (lower batch positions first), the bucket it
            # wants, claimed by the lowest position
            s0 = tl.zeros((), tl.int64)
            while s0 < m:
                s = s0 + tl.arange(0, BLOCK)
                ms = s < m
                j = tl.load(cur + s, mask=ms, other=0, cache_modifier=".cg")
                f = tl.load(first + s, mask=ms, other=-1, cache_modifier=".cg")
                r = tl.zeros([BLOCK], tl.int64)
                q0 = tl.zeros((), tl.int64)
                while q0 < m:
                    q = q0 + tl.arange(0, BLOCK)
                    mq = q < m
                    fq = tl.load(first + q, mask=mq, other=-1, cache_modifier=".cg")
                    jq = tl.load(cur + q, mask=mq, other=0, cache_modifier=".cg")
                    same = mq[None, :] & (fq[None, :] == f[:, None]) & (jq[None, :] < j[:, None])
                    r += tl.sum(same.to(tl.int64), axis=1)
                    q0 += BLOCK
                a = ms & (f >= 0)
                p = tl.load(start + j, mask=ms, other=0, cache_modifier=".cg")
                empty = (_window_empty(buckets, nb, p, a, W) & (lanes < width)).to(tl.int32)
                at = tl.sum((tl.cumsum(empty, axis=1) <= r[:, None]).to(tl.int32), axis=1)
                ok = a & (at < width)
                bucket = (p + at) % nb
                tl.atomic_max(claims + bucket, _K_FINISH | (_K_STAMP_LOW - j), mask=ok)
                tl.store(want + s, tl.where(ok, bucket, -1), mask=ms)
                s0 += BLOCK
            tl.debug_barrier()
            # the winners write their records, the others go on
            placed = tl.zeros((), tl.int64)
            s0 = tl.zeros((), tl.int64)
            while s0 < m:
                s = s0 + tl.arange(0, BLOCK)
                ms = s < m
                j = tl.load(cur + s, mask=ms, other=0, cache_modifier=".cg")
                p = tl.load(start + j, mask=ms, other=0, cache_modifier=".cg")
                bucket = tl.load(want + s, mask=ms, other=-1, cache_modifier=".cg")
                ok = ms & (bucket >= 0)
                won = ok & (tl.load(claims + bucket, mask=ok, other=0, cache_modifier=".cg") ==
                            (_K_FINISH | (_K_STAMP_LOW - j)))
                rec = buckets + bucket * 4
                tl.store(rec, tl.load(rec_keys + j, mask=won, other=0), mask=won)
                tl.store(rec + 1, tl.load(rec_tids + j, mask=won, other=0).to(tl.int64), mask=won)
                tl.store(rec + 2, tl.load(rec_word2 + j, mask=won, other=0), mask=won)
                tl.store(rec + 3, tl.load(rec_last + j, mask=won, other=0), mask=won)
                tl.store(start + j, tl.where(ok, (bucket + 1) % nb, (p + width) % nb), mask=ms & ~won)
                tl.store(active + j, tl.zeros([BLOCK], tl.int32), mask=won)
                placed += tl.sum(won.to(tl.int64), axis=0)
                s0 += BLOCK
            tl.debug_barrier()
            s0 = tl.zeros((), tl.int64)  # the round's stamps cleared: the rounds launched later stamp lower epochs
            while s0 < m:
                s = s0 + tl.arange(0, BLOCK)
                ms = s < m
                bucket = tl.load(want + s, mask=ms, other=-1, cache_modifier=".cg")
                tl.store(claims + bucket, tl.zeros([BLOCK], tl.int64), mask=ms & (bucket >= 0))
                s0 += BLOCK
            tl.debug_barrier()
            remaining -= placed
            rounds += 1
            width = tl.minimum(width * 2, W)
        tl.store(left, remaining)


_I64, _CONST = "i64", "constexpr"
_ROUND = {"nbuckets": _I64, "n": _I64, "epoch": _I64, "max_rounds": _I64, "pid0": _I64, "active": "*i32", "W": _CONST,
          "BLOCK": _CONST}
_SCAN = _sig("buckets nbuckets n active start first pid0 W BLOCK", _ROUND)
_WANT = _sig("buckets nbuckets n start sorted_first order want claims epoch pid0 W BLOCK", _ROUND)
_PLACE = _sig("buckets nbuckets n active start want claims epoch rec_keys rec_tids rec_word2 rec_last left pid0 W "
              "BLOCK", _ROUND)
_FINISH = _sig("buckets nbuckets listed todo active start claims rec_keys rec_tids rec_word2 rec_last left cur first "
               "want width0 max_rounds pid0 W BLOCK", {**_ROUND, "width0": _I64})

# (name, kernel, signature, constexprs): what `python -m hugeembed._triton.compile_check` builds for sm_90
# every window a claim round launches with (store/_index_triton.py: 32, 64, 128)
COMPILE_CASES = [(f"hash_claim.{name}[W={w}]", fn, sig, {"W": w, "BLOCK": 32}) for w in (32, 64, 128)
                 for name, fn, sig in (("claim_scan", claim_scan_kernel, _SCAN),
                                       ("claim_want", claim_want_kernel, _WANT),
                                       ("claim_place", claim_place_kernel, _PLACE))]
COMPILE_CASES += [("hash_claim.claim_finish[W=128]", claim_finish_kernel, _FINISH, {"W": 128, "BLOCK": 32})]
# the same with every scalar an i32 (values below 2**31 arrive so)
COMPILE_CASES += [(f"{name} (i32 scalars)", fn, {k: "i32" if v == _I64 else v for k, v in sig.items()}, cx)
                  for name, fn, sig, cx in COMPILE_CASES]
