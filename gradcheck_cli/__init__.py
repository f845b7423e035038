"""attn-gradcheck: prove hand-derived attention gradients right (finite differences, invariants, faults).

Python API (what the CLI calls)::

    from gradcheck_cli import load, run_scenario, negative_controls, check
    results = check("configs/quickstart.yaml")                 # list of ScenarioResult
    assert all(r.passed for r in results)
"""
__version__ = "0.1.0"

from .checker import negative_controls, run_scenario  # noqa: E402
from .errors import GradcheckError, ScenarioError  # noqa: E402
from .result import Check, ControlCell, ScenarioResult  # noqa: E402
from .scenario import Scenario, load, loads  # noqa: E402


def check(path, faults=(), **options) -> list[ScenarioResult]:
    """Run every scenario of a YAML file with the given faults; ``options`` go to :func:`run_scenario`."""
    return [run_scenario(sc, faults, **options) for sc in load(path)]


__all__ = ["check", "load", "loads", "run_scenario", "negative_controls", "Scenario", "ScenarioResult",
           "Check", "ControlCell", "GradcheckError", "ScenarioError", "__version__"]
