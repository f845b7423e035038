"""The root conftest: hypothesis profiles and the shared fixtures. Helper modules (helpers.py,
reference.py, buggy_*.py) sit beside it and are importable from every subfolder: tests/ is on
pytest's ``pythonpath`` (pyproject.toml)."""
import os
from pathlib import Path

import pytest
from hypothesis import settings

from helpers import ROOT

# One torch (OpenMP) thread per test process, set before any test imports torch: the tests' tensors are tiny,
# and two OpenMP threads per process, each busy-waiting for the other, doubled the CPU time of the torch tests
# on a 2-core machine (more with two xdist workers, or when the cores are shared). Subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["pytester"]  # tests/test_pytest_plugin.py runs pytest in-process on scenario files

# dev (the default): quick enough to run on every change. ci: three times the examples, derandomized so that
# a CI failure reproduces with the same examples on any machine (the dev profile keeps exploring new ones).
# Fuzz tests scale their example counts with the profile's max_examples (helpers.examples).
settings.register_profile("dev", deadline=None, max_examples=40)
settings.register_profile("ci", deadline=None, max_examples=120, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def root() -> Path:
    return ROOT
