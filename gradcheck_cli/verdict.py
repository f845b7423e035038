"""The verdict of a gradient check from its numbers: pass, fail or inconclusive, the estimated error of
the finite differences, and the check's power (the smallest error it would have caught).

A check passes when every element satisfies |a - n| <= tolerance * size + floor (the floor bounds the
rounding of that element's difference quotient). Out of tolerance, it FAILS only when the discrepancy
is also far above the estimated error of the finite differences themselves; otherwise it is
inconclusive. That estimate comes from Richardson probes (the differences re-taken at half the step,
error(D_h) ~ 4/3 |D_h - D_h/2|) on the elements closest to failing and a few at random, and is made
robust by pooling: every element's estimate is at least the median, over all probes, of the measured
error in units of each probe's floor, times its own floor. One probe whose two differences agree by
luck cannot make a FAIL.

False alarms: if the rounding of D_h at an element is N(0, (s w)^2) with w its floor and s unknown,
each probe's estimate is 4/3 sqrt(5) s w |Z| and the pooled one 2.98 s w median|Z|; a FAIL needs the
rounding itself to exceed FAIL_FACTOR times that, |Z'| > 29.8 median|Z|: probability 1.7e-5 per
element with the 10 probes of a failing check (9e-6 with 9, 2e-7 with 16), before counting that the
element's own estimate and its noise floor (a bound on rounding) must be exceeded too. The rule it
replaces (own estimate only) fails that way with probability 2/(29.8 pi) = 2% per probed element.
"""
from __future__ import annotations

import numpy as np

#: Out of tolerance by more than this many times the (robust) estimated finite-difference error: FAIL.
FAIL_FACTOR = 10.0
#: A check whose noise floor exceeds this fraction of the gradient's size has no power to see bugs of
#: that size: it cannot pass, only be inconclusive.
POWER_LIMIT = 0.25


def pooled_scale(fd_err: np.ndarray, floor: np.ndarray) -> float:
    """The median over the probes of (estimated finite-difference error / floor): how large the
    differences' errors really are, in units of the rounding model. 0 without probes."""
    fd_err, floor = np.asarray(fd_err, dtype=np.float64), np.asarray(floor, dtype=np.float64)
    ok = floor > 0
    if not ok.any():
        return 0.0
    return float(np.median(fd_err[ok] / floor[ok]))


def estimate(own: np.ndarray, floor: np.ndarray, pooled: float) -> np.ndarray:
    """Per probed element: max(its own Richardson estimate, pooled x its floor)."""
    return np.maximum(own, pooled * floor)


def decide(disc: np.ndarray, allowed: np.ndarray, estimate_: np.ndarray) -> str:
    """fail | inconclusive for a check out of tolerance, from its probed elements: fail when some element
    is out of tolerance by more than FAIL_FACTOR x its estimated finite-difference error (or a
    discrepancy is not finite)."""
    if not np.isfinite(disc).all():
        return "fail"
    failing = disc > allowed
    clear = disc > FAIL_FACTOR * estimate_
    return "fail" if (failing & clear).any() else "inconclusive"


def detectable(ana: np.ndarray, num: np.ndarray, allowed: np.ndarray, fd_error: np.ndarray) -> float:
    """The smallest uniform relative error r of the analytic side (a x (1 + r) or a x (1 - r), whichever
    is harder to see) that this check would FAIL on: some element out of its allowed difference and by
    more than FAIL_FACTOR x its estimated finite-difference error. inf when the analytic side is zero."""
    a = np.asarray(ana, dtype=np.float64)
    e = a - np.asarray(num, dtype=np.float64)
    lim = np.maximum(allowed, FAIL_FACTOR * np.asarray(fd_error, dtype=np.float64))
    size = np.abs(a)
    keep = (size > 0) & np.isfinite(e) & np.isfinite(lim)
    if not keep.any():
        return float("inf")
    a, e, lim, size = a[keep], e[keep], lim[keep], size[keep]
    toward = np.sign(e) == np.sign(a)  # scaling up moves these further out first
    with np.errstate(over="ignore"):
        up = np.where(toward, lim - np.abs(e), lim + np.abs(e)) / size
        down = np.where(~toward | (e == 0), lim - np.abs(e), lim + np.abs(e)) / size
    return float(max(max(up.min(), 0.0), max(down.min(), 0.0)))
