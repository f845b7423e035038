"""What a worker process does for the runner (and what the runner does in-process): check one scenario,
with its negative controls when asked, or sweep its finite-difference step."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import checker
from .result import ControlCell, ScenarioResult
from .scenario import Scenario


@dataclass(frozen=True)
class Outcome:
    """One scenario's result, its position in the file (``index``) and, with negative controls, its
    row of the fault x scenario matrix."""
    index: int
    result: ScenarioResult
    cells: tuple[ControlCell, ...] | None = None


def units(sc: Scenario, controls: bool) -> int:
    """Progress units of one scenario (its finite-difference work, times the faults it runs)."""
    return checker.work_units(sc) * (1 + (len(checker.applicable_faults(sc)) if controls else 0))


def one(sc: Scenario, faults: Sequence[str], controls: bool, memory_budget: int,
        progress: Callable[[int], None] | None) -> tuple[ScenarioResult, tuple[ControlCell, ...] | None]:
    cache: dict = {}  # the controls reuse the clean run's finite differences
    result = checker.run_scenario(sc, faults, memory_budget=memory_budget, progress=progress, numeric_cache=cache)
    cells = None
    if controls:
        cells = tuple(checker.negative_controls([sc], memory_budget=memory_budget, progress=progress,
                                                numeric_cache=cache, clean={sc.name: result}))
    return result, cells


def _work(sc: Scenario, faults: tuple[str, ...], controls: bool, memory_budget: int):
    """The task of a worker: the scenario arrives whole (pickled; its implementation still a
    ``module:attribute`` string, imported here), so a worker never reads the YAML again."""
    result, cells = one(sc, faults, controls, memory_budget, None)
    return result, cells


def _sweep(sc: Scenario, steps: tuple[float, ...], samples: int):
    from . import stepsweep
    from .implementation import ImplementationFailure
    try:
        return stepsweep.sweep(sc, steps, samples)
    except ImplementationFailure as exc:
        return f"the implementation failed: {exc.message}"


#: The tasks a worker runs, by name.
TASKS = {"check": _work, "sweep": _sweep}
