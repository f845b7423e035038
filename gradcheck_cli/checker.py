"""Run scenarios: analytic gradients against central differences, then the invariants.
Returns frozen results; never prints and never exits."""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterable, Sequence

import numpy as np

from . import diagnose, numeric, verdict
from .implementation import ImplementationFailure, failure_check
from .ops import FAULTS, OPS
from .ops.registry import NonFinite
from .result import Check, ControlCell, Kind, ScenarioResult
from .scenario import Scenario
from .tolerance import EPS64, INVARIANT_ULPS, defaults_for, machine_epsilon, passes, relative_error

#: Default bytes of perturbed copies evaluated in one vectorised call.
DEFAULT_MEMORY_BUDGET = 32 * 2**20

#: A fault is applicable to a scenario when it changes the output or a gradient by more than this
#: many tolerances (relative to the larger magnitude).
APPLICABLE_FACTOR = 10.0

Progress = Callable[[int], None]


def work_units(sc: Scenario) -> int:
    """Number of perturbed elements / directions a scenario's gradient checks evaluate (for progress)."""
    op = OPS[sc.op]
    sizes = {t: math.prod(shape) for t, shape in op.shapes(sc).items()} if op.shapes else {}
    per = {"full": lambda n: n, "sample": lambda n: min(sc.samples, n), "directional": lambda n: sc.directions}[sc.mode]
    return sum(per(n) for n in sizes.values())


def _forward_faults(faults: Iterable[str]) -> frozenset[str]:
    return frozenset(f for f in faults if FAULTS[f].forward)


def applicable_faults(sc: Scenario) -> tuple[str, ...]:
    """The faults of the scenario's op that apply to what it checks: the built-in engine's, or their
    interface variants on a user's implementation (``Fault.user``)."""
    faults = OPS[sc.op].faults
    if sc.implementation is None:
        return tuple(name for name, f in faults.items() if f.engine)
    return tuple(name for name, f in faults.items() if f.user is not None)


def _build(sc: Scenario, active: Sequence[str], sizes: dict[str, float] | None):
    return OPS[sc.op].problem(sc, active, sizes)


def fault_sizes(clean: ScenarioResult, faults: Iterable[str]) -> dict[str, float]:
    """The size of each sized fault from the clean run: ``scale-dX`` is 10 x the smallest relative error
    the clean run would have caught in X (inf when it could catch none: the fault cannot apply)."""
    sizes = {}
    for fault in faults:
        tensor = fault.rsplit("-d", 1)[-1]
        powers = [c.detectable for c in clean.checks if c.tensor == tensor and c.detectable is not None]
        sizes[fault] = SIZED_FACTOR * min(powers) if powers else float("inf")
    return sizes


#: A sized fault is this many times the smallest error the clean run would have caught.
SIZED_FACTOR = 10.0


def run_scenario(sc: Scenario, faults: Sequence[str] = (), *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
                 progress: Progress | None = None, numeric_cache: dict | None = None,
                 sizes: dict[str, float] | None = None) -> ScenarioResult:
    """Check one scenario with the given faults injected (faults that do not apply to it, of other ops
    or of the other kind, built-in engine or implementation, are ignored). Sized faults take their size
    from ``sizes`` or, without it, from a clean run of the scenario first.

    ``numeric_cache`` lets several runs of the same scenario share finite differences when their
    faults leave the forward unchanged (negative controls use it).
    """
    start = time.perf_counter()
    op = OPS[sc.op]
    active = tuple(f for f in faults if f in applicable_faults(sc))
    sized = [f for f in active if op.faults[f].sized and f not in (sizes or {})]
    if sized:
        clean = run_scenario(sc, (), memory_budget=memory_budget, numeric_cache=numeric_cache)
        sizes = {**(sizes or {}), **fault_sizes(clean, sized)}
    sizes = {f: v for f, v in (sizes or {}).items() if f in active}

    def result(checks, **extra) -> ScenarioResult:
        return ScenarioResult(name=sc.name, op=sc.op, dtype=sc.dtype, epsilon=sc.epsilon, tolerance=sc.tolerance,
                              mode=sc.mode, faults=active, checks=tuple(checks), elapsed_s=time.perf_counter() - start,
                              index=sc.index, engine=sc.engine, **extra)

    try:
        problem = _build(sc, active, sizes)
    except ImplementationFailure as exc:
        return result((failure_check("implementation runs", exc),),
                      hints=(_range_hint(sc),) if "non-finite" in exc.message else ())
    broken = _non_finite(sc, problem)
    if broken:  # differences of NaN/inf say nothing: report where they first appear, and stop there
        return result(broken, arrays=dict(problem.arrays), hints=(_range_hint(sc),))
    rng = np.random.default_rng([sc.seed, 2])
    chunking = numeric.plan(problem.copy_bytes, memory_budget)
    checks: list[Check] = []
    evidence: dict[str, diagnose.Evidence] = {}
    arrays = dict(problem.arrays)
    # Colouring rests on the blocks' independence: tested first, and a tensor whose blocks are not
    # independent is differenced one element at a time instead.
    independence: list[Check] = []
    if _coloured(sc, problem):
        try:
            independence = _independence(sc, problem, np.random.default_rng([sc.seed, 3]), chunking)
        except ImplementationFailure as exc:
            independence = [failure_check("perturbations stay in their block", exc)]
    coupled = {c.tensor for c in independence if not c.passed}
    for name, x in problem.inputs.items():
        try:
            check, numeric_values, evidence[name] = _gradient_check(sc, problem, name, x, active, rng, chunking,
                                                                    progress, numeric_cache, name not in coupled)
        except ImplementationFailure as exc:
            checks.append(failure_check(f"gradient {name}", exc, name, "while differencing its forward: "))
            continue
        checks.append(check)
        if sc.mode == "full":
            arrays[f"numeric_{name}"] = numeric_values.reshape(x.shape)
    checks.extend(independence)
    try:
        checks.extend(problem.invariants())
    except ImplementationFailure as exc:
        checks.append(failure_check("invariants", exc))
    checks, hints = _diagnose(sc, problem, checks, evidence)
    if not hints and any(c.kind == "implementation" and "non-finite" in c.detail for c in checks):
        hints = [_copies_hint(sc)]
    return result(checks, arrays=arrays, hints=tuple(hints))


def _non_finite(sc: Scenario, problem) -> list[Check]:
    """A failed check for each input, output or analytic gradient holding NaN or inf, naming the
    first bad element; [] when every value is finite."""
    arrays = [("inputs are finite", name, x) for name, x in problem.inputs.items()]
    if problem.output is not None:
        arrays.append(("output is finite", "o", problem.output))
    arrays += [("analytic gradient is finite", name, g) for name, g in problem.gradients.items()]
    checks = []
    for what, name, x in arrays:
        bad = ~np.isfinite(x)
        if bad.any():
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))
            where = f"{name}[{', '.join(map(str, index))}]" if index else name
            checks.append(Check(kind=Kind.IMPLEMENTATION, name=what, tensor=name, shape=tuple(x.shape),
                                max_abs_error=float("inf"), relative_error=float("inf"), tolerance=0.0,
                                noise_floor=0.0, worst_index=index, passed=False,
                                detail=f"{x[index]} at {where} (first of {int(bad.sum())} non-finite "
                                f"element(s) of {x.size}) in {sc.dtype}"))
    return checks


def _non_finite_words(sc: Scenario) -> NonFinite:
    op = OPS[sc.op]
    return op.non_finite(sc) if op.non_finite else NonFinite()


def _range_hint(sc: Scenario) -> str:
    words = _non_finite_words(sc)
    if words.hint:
        return words.hint
    top = float(np.finfo(np.float16).max) if sc.dtype == "float16" else None
    return ("NaN or inf before any difference is taken: the computation leaves the range of " + sc.dtype
            + (f" (largest finite {top:g})" if top else "") + words.cause)


def _copies_hint(sc: Scenario) -> str:
    return ("NaN or inf only on perturbed copies stacked along the batch axis, while the inputs alone give finite "
            f"values: the forward is unstable to small moves (near the range of {sc.dtype}: "
            + _non_finite_words(sc).unstable + "), or it mixes batch elements "
            "(a max or sum over the batch axis, which the stacked copies then share)")


def _diagnose(sc: Scenario, problem, checks: list[Check], evidence: dict) -> tuple[list[Check], list[str]]:
    """When something failed: each failed gradient check gets its breakdown (full and sample mode),
    and the op names likely causes from the pattern."""
    if all(c.passed for c in checks):
        return checks, []
    structure = problem.structure or {}
    out = []
    for c in checks:
        ev = evidence.get(c.tensor) if c.kind == "gradient" else None
        if ev is not None and c.verdict == "fail" and sc.mode != "directional":
            c = dataclasses.replace(c, diagnosis=diagnose.breakdown(c.tensor, ev, structure.get(c.tensor)))
        out.append(c)
    found = {name: ev for name, ev in evidence.items() if ev is not None}
    hints = list(problem.hints(found, out)) if problem.hints else []
    if sc.mode == "directional" and any(c.kind == "gradient" and c.verdict == "fail" for c in out):
        hints.append("directional mode cannot say which element is wrong: rerun with check: {mode: sample} "
                     "or {mode: full} to see where")
    return out, hints


def _gradient_check(sc: Scenario, problem, name: str, x: np.ndarray, active, rng, chunking, progress,
                    numeric_cache, colour: bool = True) -> tuple[Check, np.ndarray, diagnose.Evidence | None]:
    """The analytic gradient of input ``name`` against central differences: (check, numeric values,
    the evidence element by element for a diagnosis; None in directional mode)."""
    computes_in = problem.compute_dtype or sc.dtype
    eps_m = machine_epsilon(computes_in)
    grad = problem.gradients[name]
    colour = colour and _coloured(sc, problem)
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
        detail += (f"; no power: the largest noise floor ({float(np.max(floor)):.2g}) is over {verdict.POWER_LIMIT:.0%} of "
                   f"the largest gradient ({size:.2g}), so errors that size would pass unseen: use {remedy}")
    elif outcome == "pass" and resolvable and negligible:
        detail += (f"; zero to within the noise floor ({top_floor:.2g}), which is small against the largest "
                   f"gradient of the problem ({problem_scale:.2g}): verified negligible, not to "
                   f"{sc.tolerance:g} relative")
    if not colour and _coloured(sc, problem):
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
        num_half, _ = numeric.directions(lambda c: problem.loss(name, c), x, grad, probe, direction_seed, half, chunking,
                                         size=_size(problem, name))
    else:
        num_half = numeric.elements(lambda c: problem.loss(name, c), x, sites[probe], half, chunking,
                                    size=_size(problem, name))
    with np.errstate(invalid="ignore"):
        fd_err = 4.0 / 3.0 * np.abs(num[probe] - num_half)
    if not np.isfinite(fd_err).all():
        return ("pass" if ok else "fail"), float("inf"), np.full(len(num), np.inf)
    moving = (num[probe] != 0) | (num_half != 0)  # an element L does not depend on says nothing of rounding
    pooled = verdict.pooled_scale(fd_err[moving], floor[probe][moving])
    estimate = pooled * floor
    estimate[probe] = verdict.estimate(fd_err, floor[probe], pooled)
    fd_error = float(fd_err.max(initial=0.0))
    if ok:
        return "pass", fd_error, estimate
    return verdict.decide(disc[probe], allowed[probe], estimate[probe]), fd_error, estimate


def _coloured(sc: Scenario, problem) -> bool:
    return sc.mode == "full" and sc.colouring and problem.loss_parts is not None


def _independence(sc: Scenario, problem, rng: np.random.Generator, chunking: numeric.Chunking) -> list[Check]:
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
                            f"{name}[{', '.join(map(str, index))}] (batch element {index[0]}) changed by {leak:.3g} "
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


def fault_effect(sc: Scenario, fault: str, sizes: dict[str, float] | None = None) -> float:
    """Largest relative change the fault makes to the output or to an analytic gradient. A gradient
    far smaller than the scenario's largest (zero to rounding, e.g. a saturated softmax row) is
    measured against the tolerance (at least sqrt(eps)) times that largest one: rounding noise
    changing is not an effect."""
    sizes = {fault: sizes[fault]} if sizes and fault in sizes else None
    if sizes and not np.isfinite(sizes[fault]):
        return 0.0
    clean, broken = _build(sc, (), None), _build(sc, (fault,), sizes)
    largest = max([float(np.abs(g).max(initial=0.0)) for g in clean.gradients.values()] + [0.0])
    least = largest * max(float(np.sqrt(machine_epsilon(sc.dtype))), sc.tolerance)
    effects = [relative_error(clean.output, broken.output)[1]] if clean.output is not None else []
    for t in clean.gradients:
        a, b = clean.gradients[t], broken.gradients[t]
        max_abs = relative_error(a, b)[0]
        size = max(float(np.abs(a).max(initial=0.0)), float(np.abs(b).max(initial=0.0)), least)
        effects.append(max_abs / size if size > 0 else (0.0 if max_abs == 0 else float("inf")))
    return max(effects, default=0.0)


def fault_applies(sc: Scenario, fault: str, sizes: dict[str, float] | None = None) -> bool:
    """True when the fault applies to what the scenario checks and changes its output or a gradient:
    by more than APPLICABLE_FACTOR tolerances, or, for a sized fault, at all (its size is set from what
    the clean run can detect)."""
    if fault not in applicable_faults(sc):
        return False
    effect = fault_effect(sc, fault, sizes)
    return effect > 0 if OPS[sc.op].faults[fault].sized else effect > APPLICABLE_FACTOR * sc.tolerance


def _not_applicable_reason(sc: Scenario, fault: str, sizes: dict[str, float]) -> str:
    op = OPS[sc.op]
    why = op.why_not(sc, fault) if op.why_not else None
    if why:
        return why
    if op.faults[fault].sized:
        return ("no check of that tensor passed in the clean run (inconclusive or failed), so no error size is "
                "known to be detectable there" if not np.isfinite(sizes.get(fault, np.inf)) else
                "it changes nothing here")
    return (f"it changes neither the output nor any gradient by more than {APPLICABLE_FACTOR:g}x the tolerance "
            "on this scenario")


def negative_controls(scenarios: Sequence[Scenario], *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
                      progress: Progress | None = None, numeric_cache: dict | None = None,
                      clean: dict[str, ScenarioResult] | None = None) -> list[ControlCell]:
    """Every fault that applies to each scenario (``applicable_faults``), injected alone: detected, missed
    or not applicable. ``clean`` (scenario name -> its clean result) sets the sized faults; missing
    ones are run."""
    cache = {} if numeric_cache is None else numeric_cache
    cells = []
    for sc in scenarios:
        faults = applicable_faults(sc)
        sizes: dict[str, float] = {}
        sized = [f for f in faults if OPS[sc.op].faults[f].sized]
        if sized:
            base = (clean or {}).get(sc.name) or run_scenario(sc, (), memory_budget=memory_budget,
                                                              numeric_cache=cache)
            sizes = fault_sizes(base, sized)
        for fault in faults:
            if not fault_applies(sc, fault, sizes):
                cells.append(ControlCell(fault, sc.name, "not applicable", fault_effect(sc, fault, sizes), (),
                                         _not_applicable_reason(sc, fault, sizes)))
                if progress:
                    progress(work_units(sc))
                continue
            effect = fault_effect(sc, fault, sizes)
            res = run_scenario(sc, (fault,), memory_budget=memory_budget, progress=progress, numeric_cache=cache,
                               sizes=sizes)
            failed = tuple(dict.fromkeys(c.name for c in res.checks if c.verdict == "fail"))
            cells.append(ControlCell(fault, sc.name, "detected" if failed else "missed", effect, failed))
    return cells
