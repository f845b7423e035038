"""The step sweep behind ``attn-gradcheck sweep-eps``: the same sampled elements differenced at many
steps, to show the V-shaped curve of error against epsilon (truncation error ~ h^2 on the right,
rounding error ~ eps_machine / h on the left) and where the run's own epsilon sits on it.
Returns plain records; never prints."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import numeric
from .checker import DEFAULT_MEMORY_BUDGET
from .ops import OPS
from .scenario import Scenario
from .tolerance import relative_error

#: Default steps: one per decade from 1e-1 to 1e-12.
DEFAULT_STEPS = tuple(10.0 ** -e for e in range(1, 13))
#: Elements of every input differenced at each step, when the caller names no number (``sweep-eps
#: --samples`` has the same default): a sample, as the check's sample mode takes, not every element.
DEFAULT_SAMPLES = 32


@dataclass(frozen=True)
class Sweep:
    """One scenario's sweep: for each input, the relative error max|a - n| over the sampled elements
    divided by the largest analytic value of the whole input (as the run's relative error is), at each
    step (inf where the step is lost to rounding), the step the run uses and the smallest error's."""
    name: str
    dtype: str
    chosen: float
    steps: tuple[float, ...]
    errors: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def best(self, tensor: str) -> float:
        values = np.asarray(self.errors[tensor])
        return float(self.steps[int(np.argmin(np.where(np.isfinite(values), values, np.inf)))])

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "chosen": self.chosen, "steps": list(self.steps),
                "errors": {t: [e if np.isfinite(e) else None for e in v] for t, v in self.errors.items()},
                "best": {t: self.best(t) for t in self.errors}}


def sweep(sc: Scenario, steps=DEFAULT_STEPS, samples: int = DEFAULT_SAMPLES,
          memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Sweep:
    """Difference ``samples`` elements of every input at each step (the scenario's own seed picks them)."""
    problem = OPS[sc.op].problem(sc)
    steps = tuple(sorted(set(float(s) for s in steps) | {float(sc.epsilon)}, reverse=True))
    chunking = numeric.plan(problem.copy_bytes, memory_budget, problem.serial)
    rng = np.random.default_rng([sc.seed, numeric.SeedStream.STEP_SWEEP])
    errors = {}
    for name, x in problem.inputs.items():
        sites = np.sort(rng.choice(x.size, size=min(samples, x.size), replace=False))
        analytic = problem.gradients[name].ravel()[sites].astype(np.float64)
        scale = float(np.abs(problem.gradients[name]).max(initial=0.0))
        size = (problem.step_sizes or {}).get(name, 1.0)
        row = []
        for h in steps:
            num = numeric.elements(lambda c, name=name: problem.loss(name, c), x, sites, h, chunking, size=size)
            max_abs = relative_error(analytic, num)[0]
            row.append(max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")))
        errors[name] = tuple(row)
    return Sweep(sc.name, sc.dtype, float(sc.epsilon), steps, errors)
