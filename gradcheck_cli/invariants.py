"""Semantic checks that finite differences cannot make (they only verify the derivative of the
forward as written): a forward that ignores the mask has gradients that agree perfectly with its
own finite differences. Each function returns ``result.Check`` records; nothing here prints.

Exact identities are checked to ``INVARIANT_ULPS`` units of rounding of the values involved;
"exactly zero" claims are checked with no slack at all.
"""
from __future__ import annotations

import numpy as np

from .result import Check, Kind, Verdict


def not_applicable(name: str, tensor: str, why: str) -> Check:
    """An invariant this code cannot have checked (``why``: e.g. a setting it needs is fixed inside a module):
    neither a pass nor a fail, counted apart (verdict ``not applicable``)."""
    return Check(kind=Kind.INVARIANT, name=name, tensor=tensor, shape=None, max_abs_error=0.0, relative_error=0.0,
                 tolerance=0.0, noise_floor=0.0, worst_index=None, passed=True, verdict=Verdict.NOT_APPLICABLE,
                 detail=f"not applicable here: {why}")


def bounded(name: str, tensor: str, values: np.ndarray, bound: float, detail: str,
           index_shape: tuple[int, ...] | None = None) -> Check:
    """An invariant ``|values| <= bound`` everywhere; reports the worst element."""
    values = np.abs(np.asarray(values, dtype=np.float64))
    if values.size == 0:
        return Check(kind=Kind.INVARIANT, name=name, tensor=tensor, shape=None, max_abs_error=0.0,
                     relative_error=0.0, tolerance=bound, noise_floor=0.0, worst_index=None, passed=True,
                     detail=detail + " (vacuous: nothing to check)")
    flat = int(np.argmax(values))
    worst = float(values.ravel()[flat])
    index = tuple(int(i) for i in np.unravel_index(flat, index_shape or values.shape))
    return Check(kind=Kind.INVARIANT, name=name, tensor=tensor, shape=tuple(index_shape or values.shape),
                 max_abs_error=worst, relative_error=worst, tolerance=bound, noise_floor=0.0, worst_index=index,
                 passed=bool(worst <= bound), detail=detail)


def bounded_each(name: str, tensor: str, values: np.ndarray, bounds: np.ndarray, detail: str,
                 guarded: float | None = None) -> Check:
    """An invariant ``|values_i| <= bounds_i`` for every element (each its own allowance, from the size
    of the terms it is made of); reports the element closest to failing. With ``guarded`` (the size of
    what the invariant protects): an allowance over POWER_LIMIT of it means the invariant cannot see a
    violation that size, so it passes as inconclusive ("no power"), never as a pass."""
    from .verdict import POWER_LIMIT
    values = np.abs(np.asarray(values, dtype=np.float64))
    bounds = np.broadcast_to(np.asarray(bounds, dtype=np.float64), values.shape)
    if values.size == 0:
        return Check(kind=Kind.INVARIANT, name=name, tensor=tensor, shape=None, max_abs_error=0.0,
                     relative_error=0.0, tolerance=0.0, noise_floor=0.0, worst_index=None, passed=True,
                     detail=detail + " (vacuous: nothing to check)")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(values > 0, values / bounds, 0.0)
    ratio = np.where(np.isnan(ratio), np.inf, ratio)
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, values.shape))
    worst, allowed = float(values.ravel()[flat]), float(bounds.ravel()[flat])
    passed = bool(ratio.ravel()[flat] <= 1.0)
    outcome = "pass" if passed else "fail"
    top = float(bounds.max(initial=0.0))
    if passed and guarded is not None and top > POWER_LIMIT * guarded:
        outcome = "inconclusive"
        detail += (f"; no power: its allowance ({top:.3g}) is over {POWER_LIMIT:.0%} of what it guards "
                   f"({guarded:.3g}), so a violation that size would pass unseen")
    return Check(kind=Kind.INVARIANT, name=name, tensor=tensor, shape=tuple(values.shape), max_abs_error=worst,
                 relative_error=worst, tolerance=allowed, noise_floor=0.0, worst_index=index,
                 passed=outcome == "pass", detail=detail, verdict=outcome)
