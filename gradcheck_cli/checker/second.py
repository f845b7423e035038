"""The double-backward checks (``check: {mode: hvp}``): the analytic Hessian-vector product H u of L = sum(O * G)
(an engine's closed form, or autograd/JAX differentiating a user's gradients again) against central differences
of the engine's own first-order gradients along u, every gradient element at once: one pair of backwards for
the direction (as ``torch.autograd.gradgradcheck`` does, but along one random direction, with the noise floor,
Richardson's estimate and verdict of the gradient checks); and the Hessian's symmetry <w, H u> = <u, H w> as an
invariant."""
from __future__ import annotations

import numpy as np

from .. import numeric
from ..result import Check, Kind
from ..scenario import Scenario
from ..tolerance import EPS64, INVARIANT_ULPS, machine_epsilon
from .tangents import judge, largest


def _difference(second, inputs: dict, draws: dict, h: float):
    """(numeric H u by input name, in float64; the direction really taken): (grad(x + h u) - grad(x - h u)) / 2h,
    with u the move that rounding left ((x + h u) - (x - h u)) / 2h."""
    plus, minus, taken = {}, {}, {}
    for n, x in inputs.items():
        step = (h * draws[n]).astype(x.dtype)
        plus[n], minus[n] = x + step, x - step
        taken[n] = (plus[n].astype(np.float64) - minus[n].astype(np.float64)) / (2 * h)
    up, down = second.gradients(**plus), second.gradients(**minus)
    num = {n: (up[n].astype(np.float64) - down[n].astype(np.float64)) / (2 * h) for n in inputs}
    return num, taken


def _unit(rng, inputs: dict) -> dict:
    out = {}
    for n, x in inputs.items():
        t = rng.standard_normal(x.shape)
        out[n] = t / max(float(np.max(np.abs(t))), 1e-300)  # every element moves by h at most
    return out


def hvp_checks(sc: Scenario, problem, rng: np.random.Generator, progress=None) -> list[Check]:
    """``hvp <input>`` (tensor ``h<input>``) for each input (the part of H u that is the derivative of that input's
    gradient; all from
    the same random direction u of every input, one pair of backwards), and the invariant ``Hessian is
    symmetric``. The differences at h/2 are taken only when a part is out of tolerance (then once, for all)."""
    second, inputs = problem.second, problem.inputs
    eps_m = machine_epsilon(problem.compute_dtype or sc.dtype)
    size_of = problem.step_sizes or {}
    h = max(float(numeric.step_size(float(np.max(np.abs(x))), sc.epsilon, size_of.get(n, 1.0)))
            for n, x in inputs.items())
    draws = _unit(rng, inputs)
    num, taken = _difference(second, inputs, draws, h)
    u = {n: taken[n].astype(x.dtype) for n, x in inputs.items()}
    ana = {n: np.asarray(a, dtype=np.float64) for n, a in second.hvp(u).items()}
    terms = second.hvp_terms(u)
    halves: dict = {}

    def halved(name):
        if not halves:
            halves.update(_difference(second, inputs, draws, h / 2)[0])
        return halves[name]

    checks = []
    scale = largest(*((ana[n], num[n]) for n in inputs))
    for n in inputs:
        floor = eps_m * second.gradient_terms[n] / h + EPS64 * np.abs(num[n]) + eps_m * terms[n]
        checks.append(judge(sc, problem, f"hvp {n}", f"h{n}", ana[n], num[n], lambda n=n: halved(n), floor, rng,
                            unit="backward", axes_of=n, scale=scale))
    if progress:
        progress(len(inputs))
    checks.append(symmetry(sc, second, u, ana, terms, _unit(rng, inputs), inputs, eps_m))
    if second.agreement is not None:
        checks.extend(second.agreement(u, ana))
    return checks


def symmetry(sc, second, u: dict, hu: dict, u_terms: dict, draws: dict, inputs: dict, eps_m: float) -> Check:
    """<w, H u> = <u, H w> for a second random direction w: a Hessian is symmetric, so a double backward whose
    paths disagree with each other (one term's transpose wrong) breaks it; to INVARIANT_ULPS x eps x the terms
    both sides sum."""
    w = {n: draws[n].astype(x.dtype) for n, x in inputs.items()}
    hw = second.hvp(w)
    w_terms = second.hvp_terms(w)
    f64 = {n: (w[n].astype(np.float64), u[n].astype(np.float64)) for n in inputs}
    lhs = float(sum(np.sum(f64[n][0] * hu[n]) for n in inputs))
    rhs = float(sum(np.sum(f64[n][1] * np.asarray(hw[n], dtype=np.float64)) for n in inputs))
    size = float(sum(np.sum(np.abs(f64[n][0]) * u_terms[n]) + np.sum(np.abs(f64[n][1]) * w_terms[n])
                     for n in inputs))
    bound = INVARIANT_ULPS * (eps_m + EPS64) * size
    gap = abs(lhs - rhs)
    return Check(kind=Kind.INVARIANT, name="Hessian is symmetric", tensor="-", shape=None,
                 max_abs_error=gap, relative_error=gap / max(abs(lhs), abs(rhs), 1e-300), tolerance=bound,
                 noise_floor=0.0, worst_index=None, passed=bool(gap <= bound),
                 detail=f"<w, H u> = {lhs:.12g} and <u, H w> = {rhs:.12g} for two random directions u, w; allowed "
                        f"{INVARIANT_ULPS} ulps of {sc.dtype} of the terms ({bound:.2g})")
