"""pytest plugin (registered through the ``pytest11`` entry point): every ``*.gradcheck.yaml`` file is
collected, one test item per scenario; a failing item shows the failed checks with their worst
elements and the command that reproduces just that scenario. A scenario that names an implementation
runs in a worker process, as the command runs it."""
from __future__ import annotations

import pytest

from .checker import run_scenario
from .errors import GradcheckError
from .report import diagnosis_lines, failure_message, reproduce_command
from .scenario import load

SUFFIX = ".gradcheck.yaml"


def pytest_collect_file(parent, file_path):
    if file_path.name.endswith(SUFFIX):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    def collect(self):
        try:
            scenarios = load(self.path)
        except GradcheckError as exc:
            raise self.CollectError(str(exc)) from None
        for sc in scenarios:
            yield ScenarioItem.from_parent(self, name=sc.name, scenario=sc)


class ScenarioFailed(Exception):
    pass


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario, **kwargs):
        super().__init__(**kwargs)
        self.scenario = scenario

    def runtest(self):
        if self.scenario.implementation is not None:  # user code runs where it cannot end pytest itself
            from .runner import check_isolated
            result = check_isolated(str(self.path), self.scenario).result
        else:
            result = run_scenario(self.scenario)
        if not result.passed:
            lines = []
            for c in result.checks:
                if not c.passed:
                    lines.append(f"{'FAIL' if c.verdict == 'fail' else c.verdict.upper()} {failure_message(c)}")
                    lines += diagnosis_lines(c, indent="  ")
            lines += [f"hint: {h}" for h in result.hints]
            lines.append("reproduce: " + reproduce_command(str(self.path), self.scenario.name))
            raise ScenarioFailed("\n".join(lines))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ScenarioFailed):
            return f"scenario {self.scenario.name} ({self.scenario.describe()}):\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, self.scenario.line - 1, f"gradcheck: {self.scenario.name}"
