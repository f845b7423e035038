"""The double-backward checks (``check: {mode: hvp}``): the analytic Hessian-vector product H u of L = sum(O * G)
(an engine's closed form, or autograd/JAX differentiating a user's gradients again) against central differences
of the engine's own first-order gradients along u, every gradient element at once: one pair of backwards for
the direction (as ``torch.autograd.gradgradcheck`` does, but along one random direction, with the noise floor,
Richardson's estimate and verdict of the gradient checks); and the Hessian's symmetry <w, H u> = <u, H w> as an
invariant."""
from __future__ import annotations

import numpy as np

from ..result import Check, Kind
from ..scenario import Scenario
from ..tolerance import EPS64, INVARIANT_ULPS, machine_epsilon
from .tangents import central, judge, largest, steps, unit_directions


def hvp_checks(sc: Scenario, problem, rng: np.random.Generator, progress=None) -> list[Check]:
    """``hvp <input>`` (tensor ``h<input>``) for each input (the part of H u that is the derivative of that input's
    gradient; all from the same random direction u of every input, one pair of backwards), and the invariant
    ``Hessian is symmetric``. The differences at h/2 are taken only when a part is out of tolerance (then once,
    for all)."""
    second, inputs = problem.second, problem.inputs
    eps_m = machine_epsilon(problem.compute_dtype or sc.dtype)
    h = steps(sc, problem)
    draws = unit_directions(rng, inputs)
    other = unit_directions(rng, inputs)  # w of the symmetry check, drawn before any probe takes from rng
    num, taken = central(second.gradients, inputs, draws, tuple(inputs), h)
    u = {n: taken[n].astype(x.dtype) for n, x in inputs.items()}
    ana = {n: np.asarray(a, dtype=np.float64) for n, a in second.hvp(u).items()}
    terms = second.hvp_terms(u)
    halves: dict = {}

    def halved(name):
        if not halves:
            halves.update(central(second.gradients, inputs, draws, tuple(inputs), h / 2)[0])
        return halves[name]

    checks = []
    scale = largest(*((ana[n], num[n]) for n in inputs))
    for n in inputs:
        floor = eps_m * second.gradient_terms[n] / h + EPS64 * np.abs(num[n]) + eps_m * terms[n]
        checks.append(judge(sc, problem, f"hvp {n}", f"h{n}", ana[n], num[n], lambda n=n: halved(n), floor, rng,
                            unit="backward", axes_of=n, scale=scale))
    if progress:
        progress(len(inputs))
    checks.append(symmetry(sc, second, u, ana, terms, other, inputs, eps_m))
    if second.agreement is not None:
        checks.extend(second.agreement(u, ana))
    return checks


def symmetry(sc, second, u: dict, hu: dict, u_terms: dict, draws: dict, inputs: dict, eps_m: float) -> Check:
    """<w, H u> = <u, H w> for a second random direction w: a Hessian is symmetric, so a double backward whose
    paths disagree with each other (one term's transpose wrong) breaks it; to INVARIANT_ULPS x eps x the root sum
    of squares of the terms both sides sum (their elements' rounding errors are independent: the plain sum of the
    terms, the worst case, is hundreds of times the gaps measured and left float32 without power)."""
    w = {n: draws[n].astype(x.dtype) for n, x in inputs.items()}
    hw = second.hvp(w)
    w_terms = second.hvp_terms(w)
    f64 = {n: (w[n].astype(np.float64), u[n].astype(np.float64)) for n in inputs}
    lhs = float(sum(np.sum(f64[n][0] * hu[n]) for n in inputs))
    rhs = float(sum(np.sum(f64[n][1] * np.asarray(hw[n], dtype=np.float64)) for n in inputs))
    size = float(np.sqrt(sum(np.sum((f64[n][0] * u_terms[n]) ** 2) + np.sum((f64[n][1] * w_terms[n]) ** 2)
                             for n in inputs)))
    bound = INVARIANT_ULPS * (eps_m + EPS64) * size
    gap = abs(lhs - rhs)
    return Check(kind=Kind.INVARIANT, name="Hessian is symmetric", tensor="-", shape=None,
                 max_abs_error=gap, relative_error=gap / max(abs(lhs), abs(rhs), 1e-300), tolerance=bound,
                 noise_floor=0.0, worst_index=None, passed=bool(gap <= bound),
                 detail=f"<w, H u> = {lhs:.12g} and <u, H w> = {rhs:.12g} for two random directions u, w; allowed "
                        f"{INVARIANT_ULPS} ulps of {sc.dtype} of the terms' root sum of squares ({bound:.2g})")
