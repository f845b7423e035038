"""The problem of an op without attention's block structure: L = sum(out * G) over the output's own
axes, every input differenced as a black box. Perturbed copies add leading axes to one input; ``lift``
says how many singleton axes to put after them so the copy broadcasts against the other inputs (a
weight [d, f] multiplying x [B, n, d] needs one: copies [C, 1, d, f] @ x -> [C, B, n, f])."""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from .registry import Problem, Structure


def seeded(sc, shapes: Mapping[str, tuple[int, ...]], scales: Mapping[str, float] | None = None,
           stream: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal inputs in the scenario's dtype from its seed (times ``scales[name]``)."""
    rng = np.random.default_rng([sc.seed, stream])
    dt = np.dtype(sc.dtype)
    return {name: (rng.standard_normal(shape) * (scales or {}).get(name, 1.0)).astype(dt)
            for name, shape in shapes.items()}


def problem(sc, inputs: dict[str, np.ndarray], forward: Callable[..., np.ndarray], gradients: dict[str, np.ndarray],
            g: np.ndarray, *, lift: Mapping[str, int] | None = None, invariants: Callable[[], list] = list,
            magnitude: np.ndarray | None = None, rounding: dict[str, np.ndarray] | None = None,
            work_factor: float = 4.0, structure: dict[str, Structure] | None = None,
            arrays: dict | None = None) -> Problem:
    """``forward(**inputs) -> out`` (copies broadcast), analytic ``gradients`` of L = sum(out * g).

    magnitude: a bound on the sum of absolute terms behind each output element (default |out|): the
    rounding of one forward is about eps x magnitude, so eps x sum(|g| x magnitude) bounds the
    rounding of L. ``rounding`` may refine that per input element (the terms that move with it);
    without it every element is charged all of L's terms (safe, a little less power).
    work_factor: how many output-sized arrays one copy needs while the forward runs.
    """
    out = forward(**inputs)
    axes = tuple(range(-out.ndim, 0))
    lift = dict(lift or {})
    terms = np.abs(g).astype(np.float64) * (np.abs(out) if magnitude is None else magnitude).astype(np.float64)
    total = float(terms.sum())

    def loss(name: str, x: np.ndarray) -> np.ndarray:
        base = inputs[name]
        extra = x.ndim - base.ndim
        if extra and lift.get(name):
            x = x.reshape(x.shape[:extra] + (1,) * lift[name] + base.shape)
        return np.sum(forward(**{**inputs, name: x}) * g, axis=axes, dtype=np.float64)

    per = {name: np.full(x.shape, total) for name, x in inputs.items()}
    per.update(rounding or {})
    itemsize = np.dtype(sc.dtype).itemsize
    return Problem(
        inputs=inputs, loss=loss, gradients=gradients, rounding=per, rounding_total=total,
        copy_bytes=int(work_factor * out.size * itemsize + max(x.size for x in inputs.values()) * itemsize),
        invariants=invariants,
        arrays={**inputs, "grad_output": g, "output": out, **{f"analytic_{t}": v for t, v in gradients.items()},
                **(arrays or {})},
        output=out, structure=structure)
