"""Central differences of a scalar loss, batched: perturbed copies are stacked on a leading axis and
evaluated in one vectorised call per chunk, each chunk bounded by a memory budget.

``loss(x)`` takes ``x`` with extra leading copy axes and returns L per copy.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from threadpoolctl import threadpool_limits

Loss = Callable[[np.ndarray], np.ndarray]
Progress = Callable[[int], None]


def perturb(x: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """The one step policy: h = epsilon * max(1, |x|), and the perturbed values x + h, x - h.

    The difference quotient divides by (x + h) - (x - h), the step that was actually taken in
    floating point, not by the nominal 2h.
    """
    h = (epsilon * np.maximum(1.0, np.abs(x))).astype(x.dtype)
    return x + h, x - h


#: Chunks evaluated concurrently. NumPy's elementwise passes (the softmax) run on one core and
#: release the GIL, so two chunks in flight keep both cores of a small machine busy.
WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class Chunking:
    """How finite differences are batched: ``pairs`` (+h, -h) pairs of copies per vectorised call,
    ``workers`` calls in flight at once."""
    pairs: int
    workers: int = 1


def plan(copy_bytes: int, budget_bytes: int) -> Chunking:
    """Fit the calls in flight into the memory budget; at least one pair, on one worker, always runs."""
    pair = 2 * max(1, copy_bytes)
    workers = WORKERS if WORKERS * pair <= budget_bytes else 1
    return Chunking(pairs=max(1, int(budget_bytes // (workers * pair))), workers=workers)


def _in_chunks(work: Callable[[int, int], object], total: int, chunking: Chunking) -> Iterator[tuple[int, int, object]]:
    """Yield (start, stop, work(start, stop)) over [0, total) in order, ``chunking.pairs`` at a time."""
    bounds = [(a, min(a + chunking.pairs, total)) for a in range(0, total, chunking.pairs)]
    if chunking.workers == 1 or len(bounds) == 1:
        for a, b in bounds:
            yield a, b, work(a, b)
        return
    # One BLAS thread per worker: the workers already fill the cores, and nested BLAS threads would
    # oversubscribe them.
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(max_workers=chunking.workers) as pool:
        for (a, b), value in zip(bounds, pool.map(lambda ab: work(*ab), bounds)):
            yield a, b, value


def elements(loss: Loss, x: np.ndarray, indices: np.ndarray, epsilon: float, chunking: Chunking,
             progress: Progress | None = None) -> np.ndarray:
    """dL/dx at the given flat indices by central differences: one +h and one -h copy each."""
    flat_x = x.ravel()
    out = np.empty(len(indices), dtype=np.float64)

    def work(start: int, stop: int) -> np.ndarray:
        idx = indices[start:stop]
        c = len(idx)
        copies = np.broadcast_to(x, (2 * c,) + x.shape).copy()
        flat = copies.reshape(2 * c, -1)
        plus, minus = perturb(flat_x[idx], epsilon)
        rows = np.arange(c)
        flat[rows, idx] = plus
        flat[c + rows, idx] = minus
        values = np.asarray(loss(copies), dtype=np.float64)
        return (values[:c] - values[c:]) / (plus.astype(np.float64) - minus.astype(np.float64))

    for start, stop, value in _in_chunks(work, len(indices), chunking):
        out[start:stop] = value
        if progress:
            progress(stop - start)
    return out


def directions(loss: Loss, x: np.ndarray, units: np.ndarray, epsilon: float, chunking: Chunking,
               progress: Progress | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Directional derivatives along unit directions ``units`` [m, *x.shape].

    Returns (numeric [m], taken [m, *x.shape]) where ``taken`` is the direction actually stepped
    ((x + h u) - (x - h u)) / 2h, so the analytic side is <grad, taken>.
    """
    h = float(epsilon * max(1.0, float(np.max(np.abs(x), initial=0.0))))
    numeric = np.empty(len(units), dtype=np.float64)
    taken = np.empty(units.shape, dtype=np.float64)
    step = x.dtype.type(h)

    def work(start: int, stop: int):
        u = units[start:stop].astype(x.dtype)
        plus, minus = x + step * u, x - step * u
        values = np.asarray(loss(np.concatenate([plus, minus])), dtype=np.float64)
        c = stop - start
        return ((values[:c] - values[c:]) / (2 * h),
                (plus.astype(np.float64) - minus.astype(np.float64)) / (2 * h))

    for start, stop, (num, tk) in _in_chunks(work, len(units), chunking):
        numeric[start:stop], taken[start:stop] = num, tk
        if progress:
            progress(stop - start)
    return numeric, taken


def unit_directions(rng: np.random.Generator, count: int, shape: tuple[int, ...]) -> np.ndarray:
    """``count`` random unit vectors (Frobenius norm 1) of the given shape, float64."""
    u = rng.standard_normal((count,) + tuple(shape))
    norms = np.sqrt(np.sum(u * u, axis=tuple(range(1, u.ndim)), keepdims=True))
    return u / norms
