"""The JVP checks (``check: {mode: jvp}``): the analytic output tangent of an engine against central differences
of its forward along the same tangent, all output elements at once (one pair of forwards per direction), with
the noise floor, Richardson's estimate and verdict of the gradient checks; and the adjoint identity between the
JVP and the VJP."""
from __future__ import annotations

import numpy as np

from .. import diagnose, numeric, verdict
from ..result import Check, Kind
from ..scenario import Scenario
from ..tolerance import EPS64, INVARIANT_ULPS, machine_epsilon, passes, relative_error
from .gradients import richardson


def directions(names) -> list[tuple[str, tuple[str, ...]]]:
    """The directions checked: a random tangent of every input at once, then each input's alone (so that a
    wrong path of the JVP is located)."""
    return [("jvp (random tangent)", tuple(names))] + [(f"jvp {n}", (n,)) for n in names]


#: Probes of the Richardson estimate: the worst margins and as many at random.
PROBES = 8


def steps(sc: Scenario, problem) -> float:
    """The step h of a direction of every input: the largest of the inputs' step policies."""
    size_of = problem.step_sizes or {}
    return max(float(numeric.step_size(float(np.max(np.abs(x))), sc.epsilon, size_of.get(n, 1.0)))
               for n, x in problem.inputs.items())


def unit_directions(rng: np.random.Generator, inputs: dict) -> dict:
    """A standard normal direction of each input scaled to max |element| = 1 (every element moves by h at most)."""
    out = {}
    for n, x in inputs.items():
        t = rng.standard_normal(x.shape)
        out[n] = t / max(float(np.max(np.abs(t))), 1e-300)
    return out


def central(evaluate, inputs: dict, draws: dict, names, h: float):
    """(f(x + h t) - f(x - h t)) / 2h in float64 for ``evaluate(**moved)`` returning an array or a dict of arrays
    (each side called on its own), and the direction really taken, ((x + h t) - (x - h t)) / 2h by input."""
    plus, minus, taken = {}, {}, {}
    for n in names:
        x = inputs[n]
        step = (h * draws[n]).astype(x.dtype)
        plus[n], minus[n] = x + step, x - step
        taken[n] = (plus[n].astype(np.float64) - minus[n].astype(np.float64)) / (2 * h)
    up, down = evaluate(**plus), evaluate(**minus)
    if isinstance(up, dict):
        return {n: (up[n].astype(np.float64) - down[n].astype(np.float64)) / (2 * h) for n in up}, taken
    return (up.astype(np.float64) - down.astype(np.float64)) / (2 * h), taken


def _forward_once(tangents):
    """The engine's forward of one moved copy (a leading copies axis of 1): at scale, two calls of one copy beat
    one call of two, whose blocks no longer fit the caches (tiled engine, n = 512: 0.16 s against 0.25 s)."""
    return lambda **moved: tangents.forward(**{n: x[None] for n, x in moved.items()})[0]


def jvp_checks(sc: Scenario, problem, rng: np.random.Generator, progress=None) -> list[Check]:
    """One gradient-kind check per direction (tensor ``o_dot``, the output's tangent), and the invariant
    ``adjoint identity``.

    Each direction costs one pair of forwards and one JVP: a direction that passes its tolerance with the
    pair at step h is settled there (its power rests on the a-priori floor); only one out of tolerance takes a
    second pair at h/2, for Richardson's estimate to tell FAIL from inconclusive. The noise floor's JVP terms
    are computed once, for the random tangent: each input's own direction is part of the same tangent, so
    its terms are bounded by those."""
    tangents, inputs = problem.tangents, problem.inputs
    eps_m = machine_epsilon(problem.compute_dtype or sc.dtype)
    h = steps(sc, problem)
    draws = unit_directions(rng, inputs)
    forward = _forward_once(tangents)
    found, terms, first = [], None, None
    for label, names in directions(inputs):
        num, taken = central(forward, inputs, draws, names, h)
        t_dtype = {n: taken[n].astype(inputs[n].dtype) for n in names}
        ana = tangents.jvp(t_dtype).astype(np.float64)
        if terms is None:  # the random tangent of every input comes first
            terms, first = tangents.jvp_terms(t_dtype), (t_dtype, ana)
        floor = eps_m * tangents.output_terms / h + EPS64 * np.abs(num) + eps_m * terms
        found.append((label, names, ana, num, floor))
        if progress:
            progress(len(names))
    scale = largest(*((ana, num) for _, _, ana, num, _ in found))
    checks = [judge(sc, problem, label, "o_dot", ana, num, lambda names=names: central(
        forward, inputs, draws, names, h / 2)[0], floor, rng, scale=scale) for label, names, ana, num, floor in found]
    checks.append(adjoint_identity(sc, problem, *first, terms, eps_m))
    if tangents.agreement is not None:
        checks.append(tangents.agreement(*first))
    return checks


def largest(*pairs) -> float:
    """The largest |value| over (analytic, numeric) pairs: the scale against which a result that is zero to
    rounding is negligible."""
    return max((float(np.abs(x).max(initial=0.0)) for pair in pairs for x in pair), default=0.0)


def judge(sc, problem, label: str, tensor: str, ana, num, halved, floor, rng, unit: str = "forward",
          axes_of: str = "q", scale: float = 0.0) -> Check:
    """The verdict of one direction's result ``ana`` (the JVP: tensor ``o_dot``; a part of a Hessian-vector product:
    ``hq``, ``hk``, ``hv``) against its differences ``num`` at step h, each a difference of two ``unit`` calls
    (forward or backward); ``halved()`` takes the differences at h/2 (only when out of tolerance). ``axes_of``:
    the input whose axes (``Problem.structure``) the result shares, for a diagnosis. ``scale``: the largest value
    of the scenario's other results of the same kind (``largest``): a result zero to rounding (both sides within
    a floor that is small against it, or both exactly zero) passes instead of being without power, as a
    negligible gradient does."""
    shape = ana.shape
    ana, num, floor = (np.ravel(x) for x in (ana, num, floor))
    max_abs, rel, worst = relative_error(ana, num)
    ok, noise = passes(ana, num, sc.tolerance, floor)
    size = max(float(np.abs(ana).max(initial=0.0)), float(np.abs(num).max(initial=0.0)))
    allowed = sc.tolerance * size + floor
    disc = np.abs(ana - num)
    if ok:  # settled by the first pair: the a-priori floor stands for the differences' error
        outcome, fd_error, estimate = "pass", None, floor
        how = f"one pair of {unit}s"
    else:
        order = np.argsort(allowed - disc)
        probe = np.unique(np.concatenate([order[:PROBES], rng.choice(len(num), size=min(PROBES, len(num)),
                                                                     replace=False)]))
        num_half = np.ravel(halved())
        outcome, fd_error, estimate = richardson(num[probe], num_half[probe], probe, disc, allowed, floor, ok)
        how = f"two pairs of {unit}s (h, h/2); finite-difference error ~{fd_error:.2g}"
    top_floor = float(np.max(floor, initial=0.0))
    negligible = size == 0.0 or size <= top_floor <= verdict.POWER_LIMIT * scale
    blind = outcome == "pass" and not negligible and top_floor > verdict.POWER_LIMIT * size
    if blind:
        outcome = "inconclusive"
    power = verdict.detectable(ana, num, allowed, estimate) if outcome == "pass" else None
    index = tuple(int(i) for i in np.unravel_index(int(worst), shape))
    detail = (f"worst at {tensor}[{', '.join(map(str, index))}]: analytic {ana[worst]:.9g}, numeric "
              f"{num[worst]:.9g}; {len(num)} elements, {how}")
    remedy = "use" if (problem.compute_dtype or sc.dtype) == "float64" else "use float64 or"
    if outcome == "pass" and negligible and top_floor > verdict.POWER_LIMIT * size:
        detail += (f"; zero to rounding: every value is within the noise floor ({top_floor:.2g}), which is small "
                   f"against this scenario's largest ({scale:.2g})" if size else "; zero on both sides")
    if blind:
        detail += (f"; no power: the largest noise floor ({top_floor:.2g}) is over {verdict.POWER_LIMIT:.0%} of the "
                   f"largest value ({size:.2g}): {remedy} a larger epsilon")
    elif outcome == "inconclusive":
        detail += f"; the finite differences are too inaccurate here to decide: {remedy} another epsilon"
    diagnosis = None
    if outcome == "fail":
        structure = (problem.structure or {}).get(axes_of)
        ev = diagnose.Evidence(ana.reshape(shape), num.reshape(shape), allowed.reshape(shape))
        diagnosis = diagnose.breakdown(tensor, ev, structure)
    return Check(kind=Kind.GRADIENT, name=label, tensor=tensor, shape=tuple(shape), max_abs_error=max_abs,
                 relative_error=rel, tolerance=sc.tolerance, noise_floor=noise, worst_index=index,
                 passed=outcome == "pass", detail=detail, verdict=outcome, fd_error=fd_error, detectable=power,
                 diagnosis=diagnosis)


def adjoint_identity(sc, problem, tangent: dict, o_dot: np.ndarray, terms: np.ndarray, eps_m: float) -> Check:
    """<dO, G> = sum over inputs of <dX, G_X>: the JVP ``o_dot`` along ``tangent`` against the VJP of the upstream
    G (``Problem.gradients``), to INVARIANT_ULPS x eps x the terms both sides sum (``terms``: the JVP's)."""
    g = problem.tangents.upstream.astype(np.float64)
    lhs = float(np.sum(o_dot * g))
    rhs = float(sum(np.sum(tangent[n].astype(np.float64) * problem.gradients[n].astype(np.float64))
                    for n in tangent))
    terms = float(np.sum(terms * np.abs(g)))
    bound = INVARIANT_ULPS * (eps_m + EPS64) * terms
    gap = abs(lhs - rhs)
    return Check(kind=Kind.INVARIANT, name="adjoint identity", tensor="o_dot", shape=tuple(g.shape),
                 max_abs_error=gap, relative_error=gap / max(abs(lhs), abs(rhs), 1e-300), tolerance=bound,
                 noise_floor=0.0, worst_index=None, passed=bool(gap <= bound),
                 detail=f"<dO, G> = {lhs:.12g} and <dQ, G_Q> + <dK, G_K> + <dV, G_V> = {rhs:.12g} along a random "
                        f"tangent (the JVP against the VJP); allowed {INVARIANT_ULPS} ulps of {sc.dtype} of the "
                        f"terms ({bound:.2g})")
