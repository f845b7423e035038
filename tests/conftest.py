import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

settings.register_profile("default", deadline=None, max_examples=40)
settings.register_profile("ci", deadline=None, max_examples=60)
settings.load_profile("ci" if os.environ.get("CI") else "default")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture
def root() -> Path:
    return ROOT


def load_config(path):
    """A shipped config's scenarios; skips the test when it needs torch and torch is not installed."""
    from gradcheck_cli import scenario
    from gradcheck_cli.errors import ScenarioError
    try:
        return scenario.load(path)
    except ScenarioError as exc:
        if "not installed" in str(exc):
            pytest.skip(f"{path.name} needs torch")
        raise
