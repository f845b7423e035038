"""Run scenarios: analytic gradients against central differences, then the invariants.
Returns frozen results; never prints and never exits.

The parts: ``gradients`` (one input's gradient check, the noise floor, the verdict, colouring's
independence test) and ``controls`` (which faults apply, their sizes and effects); this module runs a
scenario through them, and the negative controls through it."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from .. import diagnose, numeric
from ..errors import GradcheckError
from ..implementation import ImplementationFailure, failure_check
from ..ops import OPS
from ..ops.registry import NonFinite
from ..result import Check, ControlCell, Kind, ScenarioResult
from ..scenario import Scenario
from .controls import (
    APPLICABLE_FACTOR,
    SIZED_FACTOR,
    applicable_faults,
    build,
    fault_applies,
    fault_effect,
    fault_sizes,
    not_applicable_reason,
)
from .gradients import Progress, coloured, gradient_check, independence_checks
from .second import hvp_checks
from .tangents import jvp_checks

__all__ = ["APPLICABLE_FACTOR", "DEFAULT_MEMORY_BUDGET", "SIZED_FACTOR", "Progress", "applicable_faults",
           "fault_applies", "fault_effect", "fault_sizes", "negative_controls", "run_scenario", "work_units"]

#: Default bytes of perturbed copies evaluated in one vectorised call.
DEFAULT_MEMORY_BUDGET = 32 * 2**20


def work_units(sc: Scenario) -> int:
    """Number of perturbed elements / directions a scenario's gradient checks evaluate (for progress)."""
    op = OPS[sc.op]
    sizes = {t: math.prod(shape) for t, shape in op.shapes(sc).items()} if op.shapes else {}
    per = {"full": lambda n: n, "sample": lambda n: min(sc.samples, n), "directional": lambda n: sc.directions,
           "jvp": lambda n: 2, "hvp": lambda n: 1}[sc.mode]
    return sum(per(n) for n in sizes.values())


def run_scenario(sc: Scenario, faults: Sequence[str] = (), *, memory_budget: int = DEFAULT_MEMORY_BUDGET,
                 progress: Progress | None = None, numeric_cache: dict | None = None,
                 sizes: dict[str, float] | None = None) -> ScenarioResult:
    """Check one scenario with the given faults injected (faults that do not apply to it, of other ops
    or of the other kind, built-in engine or implementation, are ignored). Sized faults take their size
    from ``sizes`` or, without it, from a clean run of the scenario first.

    ``numeric_cache`` lets several runs of the same scenario share finite differences when their
    faults leave the forward unchanged (negative controls use it).
    """
    op = OPS[sc.op]
    elements = sum(math.prod(shape) for shape in op.shapes(sc).values()) if op.shapes else 0
    with numeric.serial_blas(elements):  # a small scenario's products on one BLAS thread
        return _run(sc, faults, memory_budget, progress, numeric_cache, sizes)


def _run(sc: Scenario, faults: Sequence[str], memory_budget: int, progress: Progress | None,
         numeric_cache: dict | None, sizes: dict[str, float] | None) -> ScenarioResult:
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
                              index=sc.index, engine=sc.engine, variants=_variants(sc), **extra)

    try:
        problem = build(sc, active, sizes)
    except ImplementationFailure as exc:
        return result((failure_check("implementation runs", exc),),
                      hints=(exc.hint,) if exc.hint else ((_range_hint(sc),) if exc.non_finite else ()))
    missing = {"jvp": problem.tangents, "hvp": problem.second}.get(sc.mode, True) is None
    if missing:  # the loader refuses such scenarios; one built by hand (dataclasses.replace) lands here
        raise GradcheckError(f"scenario '{sc.name}': engine {sc.engine} of op {sc.op} computes no derivative for "
                             f"check mode {sc.mode}")
    broken = _non_finite(sc, problem)
    if broken:  # differences of NaN/inf say nothing: report where they first appear, and stop there
        return result(broken, arrays=dict(problem.arrays), hints=(_range_hint(sc),))
    rng = np.random.default_rng([sc.seed, numeric.SeedStream.DIFFERENCES])
    chunking = numeric.plan(problem.copy_bytes, memory_budget, problem.serial)
    checks: list[Check] = []
    evidence: dict[str, diagnose.Evidence] = {}
    arrays = dict(problem.arrays)
    # Colouring rests on the blocks' independence: tested first, and a tensor whose blocks are not
    # independent is differenced one element at a time instead.
    independence: list[Check] = []
    if coloured(sc, problem):
        try:
            moves = np.random.default_rng([sc.seed, numeric.SeedStream.INDEPENDENCE])
            independence = independence_checks(sc, problem, moves, chunking)
        except ImplementationFailure as exc:
            independence = [failure_check("perturbations stay in their block", exc)]
    coupled = {c.tensor for c in independence if not c.passed}
    if sc.mode == "jvp":  # the forward-mode derivative instead of the gradients
        try:
            checks.extend(jvp_checks(sc, problem, rng, progress))
        except ImplementationFailure as exc:
            checks.append(failure_check("jvp", exc, "o_dot", "while computing or differencing the JVP: "))
    if sc.mode == "hvp":  # the double backward instead of the gradients
        try:
            checks.extend(hvp_checks(sc, problem, rng, progress))
        except ImplementationFailure as exc:
            checks.append(failure_check("hvp", exc, None, "while computing the double backward or differencing the "
                                        "gradients: "))
    for name, x in (problem.inputs.items() if sc.mode not in ("jvp", "hvp") else ()):
        try:
            check, numeric_values, evidence[name] = gradient_check(sc, problem, name, x, active, rng, chunking,
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
    # NaN only on the stacked copies (in_copies says so)
    if not hints and any(c.facts.get("non_finite") and c.facts.get("on_copies") for c in checks):
        hints = [_copies_hint(sc)]
    compiling = problem.compile_s() if problem.compile_s else 0.0
    return result(checks, arrays=arrays, hints=tuple(hints), compile_s=compiling)

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
        if ev is not None and c.verdict == "fail" and sc.mode not in ("directional", "jvp", "hvp"):
            c = dataclasses.replace(c, diagnosis=diagnose.breakdown(c.tensor, ev, structure.get(c.tensor)))
        out.append(c)
    found = {name: ev for name, ev in evidence.items() if ev is not None}
    hints = list(problem.hints(found, out)) if problem.hints else []
    tangents = problem.tangents if sc.mode == "jvp" else None
    if tangents is not None and tangents.explain and any(c.name.startswith("jvp") and c.verdict == "fail" for c in out):
        hints.extend(tangents.explain(out))
    second = problem.second if sc.mode == "hvp" else None
    if second is not None and second.explain and any(c.name in ("hvp q", "hvp k", "hvp v") and c.verdict == "fail"
                                                     for c in out):
        hints.extend(second.explain(out))
    if sc.mode == "directional" and any(c.kind == "gradient" and c.verdict == "fail" for c in out):
        hints.append("directional mode cannot say which element is wrong: rerun with check: {mode: sample} "
                     "or {mode: full} to see where")
    return out, hints

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
                                         not_applicable_reason(sc, fault, sizes)))
                if progress:
                    progress(work_units(sc))
                continue
            effect = fault_effect(sc, fault, sizes)
            res = run_scenario(sc, (fault,), memory_budget=memory_budget, progress=progress, numeric_cache=cache,
                               sizes=sizes)
            failed = tuple(dict.fromkeys(c.name for c in res.checks if c.verdict == "fail"))
            cells.append(ControlCell(fault, sc.name, "detected" if failed else "missed", effect, failed))
    return cells


def _variants(sc) -> tuple[str, ...]:
    """The variants a scenario checks (``Op.variant_labels``: attention's score stages), for its report."""
    labels = OPS[sc.op].variant_labels
    return labels(sc) if labels and sc.params else ()
