"""The check of one input's analytic gradient against central differences: the differences themselves
(element by element, coloured or along random directions), the noise floor (a priori, or measured when
that leaves the check without power), Richardson's verdict, and the independence test colouring rests on."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from .. import diagnose, numeric, verdict
from ..ops import FAULTS
from ..result import Check, Kind
from ..scenario import Scenario
from ..tolerance import EPS64, INVARIANT_ULPS, defaults_for, machine_epsilon, passes, relative_error

Progress = Callable[[int], None]


def _forward_faults(faults: Iterable[str]) -> frozenset[str]:
    return frozenset(f for f in faults if FAULTS[f].forward)

def gradient_check(sc: Scenario, problem, name: str, x: np.ndarray, active, rng, chunking, progress,
                    numeric_cache, colour: bool = True) -> tuple[Check, np.ndarray, diagnose.Evidence | None]:
    """The analytic gradient of input ``name`` against central differences: (check, numeric values,
    the evidence element by element for a diagnosis; None in directional mode)."""
    computes_in = problem.compute_dtype or sc.dtype
    eps_m = machine_epsilon(computes_in)
    grad = problem.gradients[name]
    colour = colour and coloured(sc, problem)
    key = (sc, name, _forward_faults(active), colour)
    direction_seed = int(rng.integers(2**32))
    if sc.mode == "directional":  # the analytic side depends on the gradient: never cached
        num, ana = numeric.directions(lambda c, name=name: problem.loss(name, c), x, grad, np.arange(sc.directions),
                                      direction_seed, sc.epsilon, chunking, progress, size=_size(problem, name))
        sites, step = None, float(numeric.step_size(float(np.max(np.abs(x))), sc.epsilon, _size(problem, name)))
    elif numeric_cache is not None and key in numeric_cache:
        num, sites, step = numeric_cache[key]
        if progress:
            progress(len(sites))
    else:
        num, sites, step = _differences(sc, problem, name, x, rng, chunking, progress, colour)
        if numeric_cache is not None:
            numeric_cache[key] = (num, sites, step)
    if sc.mode != "directional":
        ana = grad.ravel()[sites].astype(np.float64)
    # Noise floor per element: the rounding of the terms that move (in the precision the forward really
    # computes in), and of the float64 sum of L; plus the rounding of the analytic side where known.
    if sc.mode == "directional":
        floor = np.full(len(num), (eps_m + EPS64) * problem.rounding_total / step)
    else:
        floor = (eps_m * problem.rounding[name].ravel()[sites] + EPS64 * problem.rounding_total) / step
        if problem.analytic_rounding and name in problem.analytic_rounding:
            floor = floor + problem.analytic_rounding[name].ravel()[sites]
    if computes_in != sc.dtype:
        # code that computes in a lower precision rounds the perturbed input itself: x +- h moves by h plus
        # up to half an ulp of x in that precision at each end, so the quotient is off by |G| eps |x| / (2 h)
        size = np.abs(x).max(initial=0.0) if sc.mode == "directional" else np.abs(x.ravel()[sites])
        floor = floor + eps_m * size / step * np.abs(ana)
    max_abs, rel, worst = relative_error(ana, num)
    ok, noise = passes(ana, num, sc.tolerance, floor)
    size = max(float(np.abs(ana).max(initial=0.0)), float(np.abs(num).max(initial=0.0)))
    allowed = sc.tolerance * size + floor  # per element, as ``passes`` judges it
    outcome, fd_error, fd_estimate = _verdict(sc, problem, name, x, ana, num, allowed, floor, sites, ok,
                                              direction_seed, rng, chunking)
    # A floor near the gradient's size leaves a pass without power, except for a gradient that is
    # zero to rounding: below the rounding of L itself (floor x step = eps x the terms that move), or
    # (analytic and numeric alike) below the floor where that floor is small against the problem's
    # largest gradient, i.e. verified negligible, whichever side is right.
    top_floor = float(np.max(floor, initial=0.0))
    resolvable = size > float(np.max(floor * step, initial=0.0))
    problem_scale = _problem_scale(problem)
    negligible = size <= top_floor <= verdict.POWER_LIMIT * problem_scale
    blind = outcome == "pass" and resolvable and not negligible and top_floor > verdict.POWER_LIMIT * size
    measured = False
    if blind:  # the a-priori floor is a bound: the differences may be far more accurate than it says
        refined = _measured_floor(sc, problem, name, x, num, floor, sites, direction_seed, rng, chunking)
        allowed_m = sc.tolerance * size + refined
        if float(refined.max(initial=0.0)) <= verdict.POWER_LIMIT * size and (np.abs(ana - num) <= allowed_m).all():
            blind, measured, floor, allowed = False, True, refined, allowed_m
            noise = passes(ana, num, sc.tolerance, floor)[1]
            top_floor = float(np.max(floor, initial=0.0))
    if blind:  # passing says nothing when the noise floor is as large as the gradient
        outcome = "inconclusive"
    power = verdict.detectable(ana, num, allowed, fd_estimate) if outcome == "pass" else None
    if sc.mode == "directional":
        index = (worst,)
        where = f"direction {worst}"
    else:
        index = tuple(int(i) for i in np.unravel_index(int(sites[worst]), x.shape))
        where = f"{name}[{', '.join(map(str, index))}]" if index else name
    detail = (f"worst at {where}: analytic {ana[worst]:.9g}, numeric {num[worst]:.9g}; "
              f"{len(num)} {'directions' if sc.mode == 'directional' else 'elements'} checked; "
              f"finite-difference error ~{fd_error:.2g}")
    lower = computes_in != sc.dtype
    if measured:
        detail += (f"; noise floor measured: the a-priori bound on rounding was over {verdict.POWER_LIMIT:.0%} of "
                   f"the gradient, the finite differences of {MEASURED_PROBES} random elements show it "
                   f"{MEASURED_MARGIN:g}x their median error at most ({top_floor:.2g})")
    # flat: every gradient of the problem is below sqrt(eps) x the size of the terms of L that move (a
    # function that barely depends on its inputs), not merely below a floor that a small step inflated
    flat = max(size, problem_scale) <= float(np.max(floor * step, initial=0.0)) / np.sqrt(eps_m)
    if blind and flat:
        detail += (f"; both sides are below the noise floor ({top_floor:.2g}), and the problem's largest gradient "
                   f"({problem_scale:.2g}) is below sqrt(eps) x the size of the terms of L: nothing here is large "
                   "enough to check (L barely depends on this input)")
    elif blind:
        usual = defaults_for(sc.dtype)["epsilon"]
        if lower:
            remedy = f"dtype {computes_in} (the forward computes in about {computes_in})"
        else:
            remedy = (f"a larger epsilon (now {sc.epsilon:g}; the {sc.dtype} default is {usual:g}), "
                      if sc.epsilon < usual else "") + ("float64, or smaller shapes" if sc.dtype != "float64"
                                                         else "smaller shapes")
        detail += (f"; no power: the largest noise floor ({float(np.max(floor)):.2g}) is over "
                   f"{verdict.POWER_LIMIT:.0%} of "
                   f"the largest gradient ({size:.2g}), so errors that size would pass unseen: use {remedy}")
    elif outcome == "pass" and resolvable and negligible:
        detail += (f"; zero to within the noise floor ({top_floor:.2g}), which is small against the largest "
                   f"gradient of the problem ({problem_scale:.2g}): verified negligible, not to "
                   f"{sc.tolerance:g} relative")
    if not colour and coloured(sc, problem):
        detail += f"; differenced one element at a time: the blocks of {name} are not independent"
    if outcome == "inconclusive" and problem.nondeterministic:
        detail += ("; the finite differences mean nothing here: the forward's output changes from call to call "
                   "(see the check 'deterministic')")
    elif outcome == "inconclusive" and not blind and not measured:
        detail += "; the finite differences are too inaccurate here to decide: " + (
            f"the forward computes in about {computes_in}: run it with dtype {computes_in}" if lower else
            "use dtype float64 (or a smaller epsilon on peaked rows)" if sc.dtype != "float64" else
            f"try another epsilon (now {sc.epsilon:g}); attn-gradcheck cannot tell a bug from noise")
    evidence = None
    if sc.mode != "directional":
        evidence = diagnose.Evidence.from_sites(grad, sites, num, allowed)
    return Check(kind=Kind.GRADIENT, name=f"gradient {name}", tensor=name, shape=tuple(x.shape),
                 max_abs_error=max_abs, relative_error=rel, tolerance=sc.tolerance, noise_floor=noise,
                 worst_index=index, passed=outcome == "pass", detail=detail, verdict=outcome, fd_error=fd_error,
                 detectable=power), num, evidence


def _problem_scale(problem) -> float:
    """The largest analytic gradient of any input: the size a bug would have to reach to matter."""
    return max((float(np.max(np.abs(g), initial=0.0)) for g in problem.gradients.values()), default=0.0)


#: A check whose a-priori noise floor leaves it without power re-takes this many random elements (or
#: directions) at half the step; its floor becomes MEASURED_MARGIN x their median error, in units of the
#: a-priori floor, when that is smaller.
MEASURED_PROBES = 8
MEASURED_MARGIN = 10.0


def _measured_floor(sc, problem, name, x, num, floor, sites, direction_seed, rng, chunking) -> np.ndarray:
    """The noise floor as the finite differences themselves measure it (never above the a-priori one)."""
    candidates = np.flatnonzero(num != 0)  # elements L depends on: the others say nothing of rounding
    if len(candidates) < MEASURED_PROBES // 2:
        return floor
    probe = np.sort(rng.choice(candidates, size=min(MEASURED_PROBES, len(candidates)), replace=False))
    half = sc.epsilon / 2
    if sc.mode == "directional":
        num_half, _ = numeric.directions(lambda c: problem.loss(name, c), x, problem.gradients[name], probe,
                                         direction_seed, half, chunking, size=_size(problem, name))
    else:
        num_half = numeric.elements(lambda c: problem.loss(name, c), x, sites[probe], half, chunking,
                                    size=_size(problem, name))
    with np.errstate(invalid="ignore"):
        fd_err = 4.0 / 3.0 * np.abs(num[probe] - num_half)
    moving = (num[probe] != 0) | (num_half != 0)  # an element L does not depend on says nothing of rounding
    if not np.isfinite(fd_err).all() or moving.sum() < MEASURED_PROBES // 2:
        return floor
    return np.minimum(floor, MEASURED_MARGIN * verdict.pooled_scale(fd_err[moving], floor[probe][moving]) * floor)


#: Elements (or directions) whose finite differences are re-taken at half the step to estimate their
#: error: the worst by margin, and as many at random.
RICHARDSON_PROBES = 8
#: The same for a check that passes: its estimate sets the check's power (``detectable``).
RICHARDSON_PROBES_PASSING = 2


def _verdict(sc, problem, name, x, ana, num, allowed, floor, sites, ok, direction_seed, rng, chunking):
    """(pass | fail | inconclusive, the largest estimated finite-difference error of the probes, the
    estimate for every element): Richardson's estimate from the step h and h/2,
    error(D_h) ~ 4/3 |D_h - D_h/2|, on the worst elements and a few random ones, pooled over the
    probes (``verdict``)."""
    disc = np.abs(ana - num)
    order = np.argsort(allowed - disc)  # tightest margins first
    # A failing check needs a careful estimate (it decides fail or inconclusive); a passing one only
    # its power, from fewer probes (at training scale each probe is two whole forwards).
    count = RICHARDSON_PROBES if not ok else RICHARDSON_PROBES_PASSING
    extra = rng.choice(len(num), size=min(count, len(num)), replace=False)
    probe = np.unique(np.concatenate([order[:count], extra]))
    half = sc.epsilon / 2
    if sc.mode == "directional":
        grad = problem.gradients[name]
        num_half, _ = numeric.directions(lambda c: problem.loss(name, c), x, grad, probe, direction_seed, half,
                                         chunking, size=_size(problem, name))
    else:
        num_half = numeric.elements(lambda c: problem.loss(name, c), x, sites[probe], half, chunking,
                                    size=_size(problem, name))
    return richardson(num[probe], num_half, probe, disc, allowed, floor, ok)


def richardson(num, num_half, probe, disc, allowed, floor, ok):
    """(verdict, the largest estimated finite-difference error, the estimate for every element) from the
    differences ``num`` and ``num_half`` (steps h and h/2) at the ``probe`` elements: error(D_h) ~
    4/3 |D_h - D_h/2| there, pooled over the probes in units of each one's floor (``verdict``) for the rest;
    ``disc``, ``allowed`` and ``floor`` are per element, ``ok`` whether every element is within allowed."""
    with np.errstate(invalid="ignore"):
        fd_err = 4.0 / 3.0 * np.abs(num - num_half)
    if not np.isfinite(fd_err).all():
        return ("pass" if ok else "fail"), float("inf"), np.full(len(floor), np.inf)
    moving = (num != 0) | (num_half != 0)  # an element L does not depend on says nothing of rounding
    pooled = verdict.pooled_scale(fd_err[moving], floor[probe][moving])
    estimate = pooled * floor
    estimate[probe] = verdict.estimate(fd_err, floor[probe], pooled)
    fd_error = float(fd_err.max(initial=0.0))
    if ok:
        return "pass", fd_error, estimate
    return verdict.decide(disc[probe], allowed[probe], estimate[probe]), fd_error, estimate


def coloured(sc: Scenario, problem) -> bool:
    return sc.mode == "full" and sc.colouring and problem.loss_parts is not None


def independence_checks(sc: Scenario, problem, rng: np.random.Generator, chunking: numeric.Chunking) -> list[Check]:
    """The assumption colouring rests on, verified on this very forward for every block: moving the
    elements of one block changes no other block's part of L beyond the rounding of that part's own
    terms (in the precision the forward computes in)."""
    checks = []
    precision = problem.compute_dtype or sc.dtype
    eps = machine_epsilon(precision)
    for name, x in problem.inputs.items():
        parts = problem.parts[name]
        change, scale = numeric.leakage_by_block(lambda c, name=name: problem.loss_parts(name, c), x, parts, rng,
                                                 chunking)
        blocks = int(parts.max()) + 1
        terms = np.zeros(blocks)  # each block's rounding scale: the size of the terms of its part of L
        np.maximum.at(terms, parts.ravel(), np.broadcast_to(problem.rounding[name], x.shape).ravel())
        bound = INVARIANT_ULPS * eps * terms + INVARIANT_ULPS * EPS64 * max(scale, 1.0)
        worst = int(np.argmax(change / bound))
        index = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(parts.ravel() == worst)[0]), x.shape))
        leak = float(change[worst])
        checks.append(Check(kind=Kind.INVARIANT, name="perturbations stay in their block", tensor=name,
                            shape=tuple(x.shape), max_abs_error=leak, relative_error=leak,
                            tolerance=float(bound[worst]), noise_floor=0.0, worst_index=index,
                            passed=bool((change <= bound).all()),
                            detail=f"colouring assumes each block of {name} feeds only its own block of O; "
                            f"{blocks} blocks, every ordered pair tested; worst: the block of "
                            f"{name}[{', '.join(map(str, index))}]"
                            + (f" (batch element {index[0]})" if x.ndim >= 3 else "") + f" changed by {leak:.3g} "
                            f"while it stood still (allowed {INVARIANT_ULPS} ulps of {precision} of its terms)"))
    return checks


def _differences(sc: Scenario, problem, name: str, x: np.ndarray, rng: np.random.Generator, chunking: numeric.Chunking,
                 progress: Progress | None, colour: bool = True):
    """(numeric values, sites, steps) for full and sample mode: sites are flat indices."""
    def loss(copies):
        return problem.loss(name, copies)

    if sc.mode == "full":
        sites = np.arange(x.size)
    else:
        sites = np.sort(rng.choice(x.size, size=min(sc.samples, x.size), replace=False))
    steps = numeric.step_size(np.abs(x.ravel()[sites]).astype(np.float64), sc.epsilon, _size(problem, name))
    if colour:
        num = numeric.coloured(lambda c: problem.loss_parts(name, c), x, problem.parts[name], sc.epsilon,
                               chunking, progress)
        return num, sites, steps
    return numeric.elements(loss, x, sites, sc.epsilon, chunking, progress, size=_size(problem, name)), sites, steps


def _size(problem, name: str) -> float:
    return (problem.step_sizes or {}).get(name, 1.0)
