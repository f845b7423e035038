"""Central differences of a scalar loss, batched: perturbed copies are stacked on a leading axis and
evaluated in one vectorised call per chunk, each chunk bounded by a memory budget.

``loss(x)`` takes ``x`` with extra leading copy axes and returns L per copy.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

Loss = Callable[[np.ndarray], np.ndarray]
Progress = Callable[[int], None]


def perturb(x: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """The one step policy: h = epsilon * max(1, |x|), and the perturbed values x + h, x - h.

    The difference quotient divides by (x + h) - (x - h), the step that was actually taken in
    floating point, not by the nominal 2h.
    """
    h = (epsilon * np.maximum(1.0, np.abs(x))).astype(x.dtype)
    return x + h, x - h


def chunk_size(copy_bytes: int, budget_bytes: int) -> int:
    """How many perturbed copies fit in the memory budget (at least one)."""
    return max(1, int(budget_bytes // max(1, copy_bytes)))


def elements(loss: Loss, x: np.ndarray, indices: np.ndarray, epsilon: float, chunk: int,
             progress: Progress | None = None) -> np.ndarray:
    """dL/dx at the given flat indices by central differences: one +h and one -h copy each."""
    flat_x = x.ravel()
    out = np.empty(len(indices), dtype=np.float64)
    per = max(1, chunk // 2)
    for start in range(0, len(indices), per):
        idx = indices[start:start + per]
        c = len(idx)
        copies = np.broadcast_to(x, (2 * c,) + x.shape).copy()
        flat = copies.reshape(2 * c, -1)
        plus, minus = perturb(flat_x[idx], epsilon)
        rows = np.arange(c)
        flat[rows, idx] = plus
        flat[c + rows, idx] = minus
        values = np.asarray(loss(copies), dtype=np.float64)
        step = plus.astype(np.float64) - minus.astype(np.float64)
        out[start:start + c] = (values[:c] - values[c:]) / step
        if progress:
            progress(c)
    return out


def directions(loss: Loss, x: np.ndarray, units: np.ndarray, epsilon: float, chunk: int,
               progress: Progress | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Directional derivatives along unit directions ``units`` [m, *x.shape].

    Returns (numeric [m], taken [m, *x.shape]) where ``taken`` is the direction actually stepped
    ((x + h u) - (x - h u)) / 2h, so the analytic side is <grad, taken>.
    """
    h = float(epsilon * max(1.0, float(np.max(np.abs(x), initial=0.0))))
    m = len(units)
    numeric = np.empty(m, dtype=np.float64)
    taken = np.empty(units.shape, dtype=np.float64)
    per = max(1, chunk // 2)
    for start in range(0, m, per):
        u = units[start:start + per].astype(x.dtype)
        c = len(u)
        plus = x + x.dtype.type(h) * u
        minus = x - x.dtype.type(h) * u
        values = np.asarray(loss(np.concatenate([plus, minus])), dtype=np.float64)
        numeric[start:start + c] = (values[:c] - values[c:]) / (2 * h)
        taken[start:start + c] = (plus.astype(np.float64) - minus.astype(np.float64)) / (2 * h)
        if progress:
            progress(c)
    return numeric, taken


def unit_directions(rng: np.random.Generator, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """``count`` random unit vectors (Frobenius norm 1) of the given shape, float64."""
    u = rng.standard_normal((count,) + tuple(shape))
    norms = np.sqrt(np.sum(u * u, axis=tuple(range(1, u.ndim)), keepdims=True))
    return u / norms
