"""Negative controls' arithmetic: which faults apply to a scenario, how large a sized fault is made, how
much a fault changes the output or a gradient, and why one is not applicable."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..numeric import SeedStream
from ..ops import OPS
from ..result import ScenarioResult
from ..scenario import Scenario
from ..tolerance import machine_epsilon, relative_error

#: A fault is applicable to a scenario when it changes the output or a gradient by more than this
#: many tolerances (relative to the larger magnitude).
APPLICABLE_FACTOR = 10.0


def applicable_faults(sc: Scenario) -> tuple[str, ...]:
    """The faults of the scenario's op that apply to what it checks: the built-in engine's, or their
    interface variants on a user's implementation (``Fault.user``). A fault of a variant (``Fault.scenario``:
    soft-capping's, a packed batch's) applies only to scenarios that use it (``Op.sets`` for a shared key);
    ``Fault.backends`` limits the built-in engines'."""
    derivatives, params, op = sc.derivatives, dict(sc.params), OPS[sc.op]

    def sets(key: str) -> bool:
        return params[key] is not None if key in params else op.sets is None or op.sets(sc, key)
    faults = {name: f for name, f in op.faults.items() if (f.forward or f.derivative in derivatives)
              and all(sets(key) for key, _ in f.scenario)}
    if sc.implementation is None:
        return tuple(name for name, f in faults.items() if f.engine and (not f.backends or sc.backend in f.backends))
    return tuple(name for name, f in faults.items() if f.user is not None)

def build(sc: Scenario, active: Sequence[str], sizes: dict[str, float] | None):
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

def fault_effect(sc: Scenario, fault: str, sizes: dict[str, float] | None = None) -> float:
    """Largest relative change the fault makes to the output or to an analytic gradient. A gradient
    far smaller than the scenario's largest (zero to rounding, e.g. a saturated softmax row) is
    measured against the tolerance (at least sqrt(eps)) times that largest one: rounding noise
    changing is not an effect."""
    sizes = {fault: sizes[fault]} if sizes and fault in sizes else None
    if sizes and not np.isfinite(sizes[fault]):
        return 0.0
    from ..implementation import ImplementationFailure
    try:
        clean = build(sc, (), None)
    except ImplementationFailure:  # the clean run fails: no fault can be told apart from that
        return 0.0
    try:
        broken = build(sc, (fault,), sizes)
    except ImplementationFailure:  # the fault makes the code fail: it changes everything
        return float("inf")
    largest = max([float(np.abs(g).max(initial=0.0)) for g in clean.gradients.values()] + [0.0])
    least = largest * max(float(np.sqrt(machine_epsilon(sc.dtype))), sc.tolerance)
    effects = [relative_error(clean.output, broken.output)[1]] if clean.output is not None else []
    changed = dict(clean.gradients), dict(broken.gradients)
    if "jvp" in sc.derivatives and clean.tangents is not None:  # the change to the output's tangent
        draw = np.random.default_rng([sc.seed, SeedStream.DIFFERENCES])  # a random tangent of every input
        tangent = {name: draw.standard_normal(x.shape).astype(x.dtype) for name, x in clean.inputs.items()}
        changed[0]["jvp"], changed[1]["jvp"] = clean.tangents.jvp(tangent), broken.tangents.jvp(tangent)
    if "hvp" in sc.derivatives and clean.second is not None:  # the change to the Hessian-vector product
        draw = np.random.default_rng([sc.seed, SeedStream.DIFFERENCES])
        direction = {name: draw.standard_normal(x.shape).astype(x.dtype) for name, x in clean.inputs.items()}
        for side, problem in zip(changed, (clean, broken)):
            side.update({f"hvp {n}": h for n, h in problem.second.hvp(direction).items()})
    for t in changed[0]:
        a, b = changed[0][t], changed[1][t]
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
    op = OPS[sc.op]
    if op.why_not and op.why_not(sc, fault):  # the op knows it cannot apply here (whatever it changes)
        return False
    effect = fault_effect(sc, fault, sizes)
    return effect > 0 if OPS[sc.op].faults[fault].sized else effect > APPLICABLE_FACTOR * sc.tolerance


def not_applicable_reason(sc: Scenario, fault: str, sizes: dict[str, float]) -> str:
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
