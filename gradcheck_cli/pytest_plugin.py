"""pytest plugin (registered through the ``pytest11`` entry point): every ``*.gradcheck.yaml`` file is
collected, one test item per scenario (and one per ``hunt:`` entry: ``attn-gradcheck hunt`` as a test); a failing
item shows the failed checks with their worst elements and the command that reproduces just that scenario. A
scenario that names an implementation runs in a worker process, as the command runs it.

An inconclusive scenario (exit code 3 on the command line) fails its item by default, so that a suite gates
as the command does; ``--gradcheck-inconclusive=skip|xfail`` (or the ini option ``gradcheck_inconclusive``)
reports it as skipped or xfailed instead, with the reason. Each item carries its op, mode, dtype, engine and
backend as keywords (``-k "jvp and float32"``); items are independent, so ``pytest -n N`` (pytest-xdist)
spreads them over workers."""
from __future__ import annotations

import pytest

from .checker import run_scenario
from .errors import GradcheckError
from .report import diagnosis_lines, failure_message, reproduce_command
from .scenario import load
from .text import visible

SUFFIX = ".gradcheck.yaml"

#: How an inconclusive scenario's item ends (``--gradcheck-inconclusive``); the first is the default.
INCONCLUSIVE = ("fail", "skip", "xfail")


def pytest_addoption(parser):
    help_text = ("how a scenario whose verdict is inconclusive (exit code 3 on the command line) ends: fail (the "
                 "default, as a CI gate on the command would), skip or xfail, with the reason")
    parser.addoption("--gradcheck-inconclusive", choices=INCONCLUSIVE, default=None, help=help_text)
    parser.addini("gradcheck_inconclusive", help_text, default=INCONCLUSIVE[0])


def _inconclusive_policy(config) -> str:
    value = config.getoption("--gradcheck-inconclusive") or config.getini("gradcheck_inconclusive")
    if value not in INCONCLUSIVE:
        raise pytest.UsageError(f"gradcheck_inconclusive = {value!r}: expected one of {', '.join(INCONCLUSIVE)}")
    return value


def pytest_configure(config):
    _inconclusive_policy(config)  # a bad ini value is a usage error (exit 4) before anything runs


def pytest_collect_file(parent, file_path):
    if file_path.name.endswith(SUFFIX):
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    def collect(self):
        from .hunt import entries
        try:
            scenarios = load(self.path)
            hunts = entries.read(str(self.path))
        except GradcheckError as exc:
            raise self.CollectError(visible(str(exc))) from None
        for sc in scenarios:
            yield ScenarioItem.from_parent(self, name=sc.name, scenario=sc)
        for entry in hunts:
            yield HuntItem.from_parent(self, name=entry.name, entry=entry)


class ScenarioFailed(Exception):
    pass


def _check_lines(result, diagnosis: bool) -> list[str]:
    """A result's checks that did not pass (FAIL or their verdict, and what they say; ``diagnosis``: where and the
    worst elements too) and its hints, a line each."""
    lines = []
    for c in result.checks:
        if not c.passed:
            lines.append(f"{'FAIL' if c.verdict == 'fail' else c.verdict.upper()} {failure_message(c)}")
            lines += diagnosis_lines(c, indent="  ") if diagnosis else []
    return lines + [f"hint: {h}" for h in result.hints]


def _end_inconclusive(config, reason: str) -> None:
    """An inconclusive item ends as ``--gradcheck-inconclusive`` says: skipped or xfailed here with ``reason``, or
    (fail, the default) it returns and the caller fails it."""
    policy = _inconclusive_policy(config)
    if policy == "skip":
        pytest.skip(visible(reason))
    if policy == "xfail":
        pytest.xfail(visible(reason))


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario, **kwargs):
        super().__init__(**kwargs)
        self.scenario = scenario
        # -k "attention and jvp", -k float32, -k tiled: what -k matches besides the names
        self.extra_keyword_matches.update({scenario.op, scenario.mode, scenario.dtype, scenario.engine,
                                           scenario.backend})

    def runtest(self):
        if self.scenario.implementation is not None:  # user code runs where it cannot end pytest itself
            from .runner import check_isolated
            result = check_isolated(str(self.path), self.scenario).result
        else:
            result = run_scenario(self.scenario)
        if result.passed:
            return
        lines = _check_lines(result, diagnosis=True)
        lines.append("reproduce: " + reproduce_command(str(self.path), self.scenario.name))
        if result.verdict == "inconclusive":
            undecided = [c for c in result.checks if c.verdict == "inconclusive"]
            names = ", ".join(dict.fromkeys(c.name for c in undecided))
            _end_inconclusive(self.config, f"inconclusive: {names} ({undecided[0].detail[:160]})")
        raise ScenarioFailed("\n".join(map(visible, lines)))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ScenarioFailed):
            return f"scenario {visible(self.scenario.name)} ({visible(self.scenario.describe())}):\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, self.scenario.line - 1, f"gradcheck: {self.scenario.name}"


class HuntItem(pytest.Item):
    """One ``hunt:`` entry: passes when the hunt finds no failure within its budget; fails with the smallest failing
    scenario (as a scenario file's text), its failed checks and hints, and the command that repeats the hunt. Writes
    nothing and keeps no database (a test's hunt is the same every run)."""

    def __init__(self, *, entry, **kwargs):
        super().__init__(**kwargs)
        self.entry = entry
        self.extra_keyword_matches.add("hunt")

    def runtest(self):
        from . import hunt
        try:
            outcome = hunt.execute(hunt.prepare(self.entry.options))
        except GradcheckError as exc:
            raise ScenarioFailed(visible(str(exc))) from None
        found, plan = outcome.hunt, outcome.plan
        if found.smallest is None and found.first_inconclusive is None:
            return
        shown = found.smallest or found.first_inconclusive
        lines = [f"{found.tried} scenario(s) checked; " + (
            f"FAILED, shrunk from {found.first.elements} to {found.smallest.elements} input elements:"
            if found.smallest else f"{found.inconclusive} INCONCLUSIVE, none failed; the smallest:")]
        lines += hunt.record.scenario_file(plan, found).splitlines() if found.smallest else [shown.scenario.describe()]
        lines += _check_lines(shown.result, diagnosis=False)
        lines.append("repeat: " + hunt.record.command(plan))
        if found.smallest is None:
            _end_inconclusive(self.config, f"hunt inconclusive: {found.inconclusive} scenario(s), none failed")
        raise ScenarioFailed("\n".join(map(visible, lines)))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ScenarioFailed):
            return f"{visible(self.entry.name)}:\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, max(self.entry.line - 1, 0), f"gradcheck: {self.entry.name}"
