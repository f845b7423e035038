"""attn-gradcheck: prove hand-derived attention gradients right (finite differences, invariants, faults).

Python API (what the CLI calls)::

    from gradcheck_cli import load, run_scenario, negative_controls, check, run, RunOptions
    results = check("configs/quickstart.yaml")                 # list of ScenarioResult
    assert all(r.passed for r in results)
    outcome = run(RunOptions("configs/quickstart.yaml", json_path="r.json"))   # as 'attn-gradcheck run'
    outcome.exit_code                                          # an ExitCode, as the command's

The names are imported on first use, so that starting the command (and a Ctrl-C while it starts)
does not wait for NumPy.
"""
from __future__ import annotations

import importlib
import warnings

__version__ = "0.1.0"

# The checks do arithmetic on whatever an implementation returns, overflowing values included, and
# judge the numbers: NumPy's overflow/invalid-value warnings from this package's own lines are noise
# (the user's code keeps its warnings).
warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"gradcheck_cli(\.|$)")

_API = {
    "negative_controls": "checker", "run_scenario": "checker",
    "GradcheckError": "errors", "ScenarioError": "errors",
    "Check": "result", "ControlCell": "result", "ScenarioResult": "result",
    "Scenario": "scenario", "load": "scenario", "loads": "scenario",
    "run": "api", "RunOptions": "api", "RunOutcome": "api", "ExitCode": "exitcodes",
}


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check(path, faults=(), **options) -> list:
    """Run every scenario of a YAML file with the given faults; ``options`` go to :func:`run_scenario`."""
    from .checker import run_scenario
    from .scenario import load
    return [run_scenario(sc, faults, **options) for sc in load(path)]


__all__ = ["check", *_API, "__version__"]
