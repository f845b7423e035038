"""The problem of an op without attention's block structure: L = sum(out * G) over the output's own
axes, every input differenced as a black box. Perturbed copies add leading axes to one input; ``lift``
says how many singleton axes to put after them so the copy broadcasts against the other inputs (a
weight [d, f] multiplying x [B, n, d] needs one: copies [C, 1, d, f] @ x -> [C, B, n, f])."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from ..numeric import SeedStream
from .registry import Problem, Structure

#: The noise floor charges this many root-sum-squares of the output terms' rounding (a safety factor on
#: the statistical size of a sum of independent rounding errors).
RSS_FACTOR = 8.0

#: Bytes per element of an op's tensors in the load-time memory estimate: each is held about 64 times
#: over (inputs, gradients analytic and numeric, perturbed copies, the wider-type forward), in float64.
TENSOR_BYTES = 64 * 8


def tensor_need(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The default ``Op.memory``: the bytes of an op's tensors, ``TENSOR_BYTES`` per element."""
    return sum(math.prod(shape) for shape in shapes.values()) * TENSOR_BYTES


def seeded(sc, shapes: Mapping[str, tuple[int, ...]], scales: Mapping[str, float] | None = None,
           stream: int = SeedStream.INPUTS) -> dict[str, np.ndarray]:
    """Standard-normal inputs in the scenario's dtype from its seed (times ``scales[name]``)."""
    rng = np.random.default_rng([sc.seed, stream])
    dt = np.dtype(sc.dtype)
    return {name: (rng.standard_normal(shape) * (scales or {}).get(name, 1.0)).astype(dt)
            for name, shape in shapes.items()}


def _wider(dtype: str):
    """A wider float type to measure the forward's own rounding against, or None when there is none
    (long double is float64 itself on some platforms)."""
    if dtype == "float32":
        return np.float64
    if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:
        return np.longdouble
    return None


def rounding_errors(forward: Callable[..., np.ndarray], inputs: dict, out: np.ndarray, dtype: str,
                    magnitude: np.ndarray | None) -> np.ndarray:
    """Per output element, the rounding one forward puts in it: measured as |out - the same forward in
    a wider type| when there is one, else eps x magnitude (a bound on the absolute terms behind it)."""
    wide = _wider(dtype)
    if wide is None:
        return float(np.finfo(np.dtype(dtype)).eps) * np.asarray(np.abs(out) if magnitude is None else magnitude,
                                                                 dtype=np.float64)
    exact = forward(**{k: np.asarray(v).astype(wide) for k, v in inputs.items()})
    return np.abs(out.astype(wide) - exact).astype(np.float64)


def rss(t: np.ndarray, axis=None) -> np.ndarray:
    """Root sum of squares (of independent rounding errors); never below sum / sqrt(count), which the
    squares of terms under ~1e-154 would otherwise underflow to."""
    count = t.size if axis is None else np.prod([t.shape[a] for a in np.atleast_1d(axis)])
    return np.maximum(np.sqrt(np.sum(t * t, axis=axis)), np.sum(np.abs(t), axis=axis) / np.sqrt(max(count, 1)))


def problem(sc, inputs: dict[str, np.ndarray], forward: Callable[..., np.ndarray], gradients: dict[str, np.ndarray],
            g: np.ndarray, *, lift: Mapping[str, int] | None = None, invariants: Callable[[], list] = list,
            magnitude: np.ndarray | None = None, rounding: Callable[[np.ndarray], dict] | None = None,
            work_factor: float = 4.0, structure: dict[str, Structure] | None = None,
            arrays: dict | None = None, step_sizes: dict[str, float] | None = None,
            analytic_rounding: dict[str, np.ndarray] | None = None,
            rounding_forward: Callable[..., np.ndarray] | None = None,
            forward_bound: np.ndarray | None = None) -> Problem:
    """``forward(**inputs) -> out`` (copies broadcast), analytic ``gradients`` of L = sum(out * g).

    The noise floor: each output's rounding is measured against the same forward in a wider type
    (``rounding_errors``); the errors of different outputs are independent, so a difference of L
    carries about their root sum of squares, weighted by |g|, and the floor charges RSS_FACTOR times
    that (a worst-case linear sum, or a bound on every term, grows with the output until it hides
    every bug). By default every input element is charged all of L's outputs; ``rounding(terms)``
    may return per-element sums over the outputs it really moves (e.g. its row), from the weighted
    errors ``terms``. ``magnitude`` is only the fallback bound where no wider type exists.
    work_factor: how many output-sized arrays one copy needs while the forward runs.
    analytic_rounding: per input, the rounding allowed in each element of the analytic gradient (where
    it cancels to nothing, e.g. RMSNorm's G_x with d_model = 1).
    rounding_forward: the forward whose rounding is measured, when ``forward`` is a user's implementation
    (which need not run in a wider type): the built-in one, on the same inputs.
    forward_bound: with ``rounding_forward``, the size of the terms behind each output. A user's forward may
    round more than the built-in one (InfoNCE's l = lse - z_pos cancels what log1p keeps, and its finite
    differences then see a flat loss): each output is also charged its distance from the built-in one, up to eps
    x this bound, so that a wrong forward cannot raise the floor past rounding.
    """
    out = forward(**inputs)
    axes = tuple(range(-out.ndim, 0))
    lift = dict(lift or {})
    eps = float(np.finfo(np.dtype(sc.dtype)).eps)
    measured = rounding_forward or forward
    own = out if rounding_forward is None else rounding_forward(**inputs)
    errors = rounding_errors(measured, inputs, own, sc.dtype, magnitude)
    if rounding_forward is not None and forward_bound is not None:
        errors = errors + np.minimum(np.abs(np.asarray(out, np.float64) - np.asarray(own, np.float64)),
                                     eps * np.asarray(forward_bound, np.float64))
    terms = np.abs(g).astype(np.float64) * errors / eps
    total = min(RSS_FACTOR * float(rss(terms)), float(terms.sum()))  # never more than the worst case

    def loss(name: str, x: np.ndarray) -> np.ndarray:
        base = inputs[name]
        extra = x.ndim - base.ndim
        if extra and lift.get(name):
            x = x.reshape(x.shape[:extra] + (1,) * lift[name] + base.shape)
        return np.sum(forward(**{**inputs, name: x}) * g, axis=axes, dtype=np.float64)

    per = {name: np.full(x.shape, total) for name, x in inputs.items()}
    per.update({name: RSS_FACTOR * v for name, v in (rounding(terms) if rounding else {}).items()})
    itemsize = np.dtype(sc.dtype).itemsize
    return Problem(
        inputs=inputs, loss=loss, gradients=gradients, rounding=per,
        rounding_total=max(total, float(np.sum(np.abs(g) * np.abs(out)))),
        copy_bytes=int(work_factor * out.size * itemsize + max(x.size for x in inputs.values()) * itemsize),
        invariants=invariants,
        arrays={**inputs, "grad_output": g, "output": out, **{f"analytic_{t}": v for t, v in gradients.items()},
                **(arrays or {})},
        output=out, structure=structure, step_sizes=step_sizes, analytic_rounding=analytic_rounding)
