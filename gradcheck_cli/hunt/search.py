"""The search: hypothesis draws scenarios from the space, each is checked as ``attn-gradcheck run`` checks it (an
implementation in a worker process of its own), and the first failure is shrunk by hypothesis to the smallest
scenario that still fails the same check for the same cause. Hypothesis's example database keeps the failure,
so a rerun of the same hunt starts from it."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Flaky, HypothesisException

from .. import checker, tasks
from ..errors import GradcheckError

try:
    BaseExceptionGroup  # noqa: B018 -- Python 3.11 and later
except NameError:  # pragma: no cover -- 3.10: hypothesis's own dependency provides it
    from exceptiongroup import BaseExceptionGroup
from ..result import ScenarioResult
from ..scenario import Scenario
from ..workers import _Workers
from . import shrink
from .found import Finding, Hunt
from .space import Space
from .start import Start

#: A named cause in a hint: "... a known mistake: ... (`softmax-term`)".
_CAUSE = re.compile(r"\(`([A-Za-z0-9_.-]+)`\)")
#: A size in a cause's name: ``-96``, ``-0.5``.
_NUMBER = re.compile(r"-\d+(\.\d+)?(?=-|$)")


class _Stop(BaseException):
    """The time is spent: ends hypothesis's run at once (a BaseException, so it does not count as a failure)."""


class _Failed(Exception):
    """The scenario fails as the first failure did: hypothesis shrinks it."""


def run(start: Start, space: Space, *, seed: int = 0, examples: int | None = None, budget_s: float = 120.0,
        shrink_s: float = 120.0, database: str | None = None, memory_budget: int = checker.DEFAULT_MEMORY_BUDGET,
        progress: Callable[[Hunt], None] | None = None) -> Hunt:
    """Hunt for a failure around ``start``: at most ``examples`` scenarios (None: no limit) within ``budget_s``
    seconds, then at most ``shrink_s`` seconds shrinking the first failure. ``database``: the folder of
    hypothesis's example database (None: none kept). ``progress(hunt)`` is called after each scenario."""
    hunt = Hunt(start, space, seed)
    began = time.monotonic()
    deadline = [began + budget_s]
    pool = _Workers(1, os.cpu_count() or 1, [start.scenario]) if start.scenario.implementation else None

    def check(sc: Scenario) -> ScenarioResult:
        if pool is None:
            return tasks.one(sc, (), False, memory_budget, None)[0]
        (outcome,) = pool.map(start.file, [sc], (), False, memory_budget, None)
        return outcome.result

    def evaluate(values: dict, made: tuple | None = None) -> Finding | None:
        """Check the scenario a draw describes (``made``: what ``_made`` made of it) and count it; None when it is
        skipped (refused, or too large)."""
        mapping, sc, size = made or shrink.made(start, space, values)
        if sc is None or size > space.max_elements:
            hunt.skipped += 1
            return None
        result = check(sc)
        hunt.tried += 1
        for key, value in values.items():
            hunt.covered.setdefault(key, []).append(value)
        finding = Finding(mapping, sc, result, size, _signature(result), dict(values))
        if result.verdict == "fail":
            if hunt.first is None:
                hunt.first, hunt.search_s, hunt.tried_to_first = finding, time.monotonic() - began, hunt.tried
                deadline[0] = time.monotonic() + shrink_s
            if hunt.first.same_failure(finding):
                hunt.path.append(size)
                if hunt.smallest is None or size <= hunt.smallest.elements:
                    hunt.smallest = finding
            else:
                hunt.other_failures += 1
        elif result.verdict == "inconclusive":
            hunt.inconclusive += 1
            hunt.inconclusive_float32 += sc.dtype == "float32"
            if hunt.first_inconclusive is None or size < hunt.first_inconclusive.elements:
                hunt.first_inconclusive = finding
        if progress is not None:
            progress(hunt)
        return finding

    def probe(values: dict) -> None:
        if time.monotonic() > deadline[0]:
            raise _Stop
        finding = evaluate(values)
        if finding is None:
            reject()
        if hunt.first is not None and hunt.first.same_failure(finding):
            raise _Failed

    space = _values_the_code_runs_in(hunt, start, space, check)
    # the seed first: ``seed`` turns the database off in the settings it finds, so the settings come after it
    test = hypothesis_seed(seed)(given(space.strategy(start))(probe))
    test = settings(max_examples=examples or 1_000_000, deadline=None, database=_database(database, start, space),
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False, verbosity=Verbosity.quiet,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink), print_blob=False,
                    derandomize=False)(test)
    try:
        with _hypothesis_home():
            _search(test, hunt, examples)
        if hunt.tried == 0 and hunt.stopped.startswith("hypothesis"):
            raise GradcheckError(f"{start.file}: no scenario drawn around '{start.scenario.name}' could be loaded "
                                 f"({hunt.skipped} drawn, each refused or over the size limit {space.max_elements}); "
                                 "widen --space or raise --max-elements")
        if hunt.smallest is not None and not hunt.interrupted:
            shrink.ascend(hunt, start, space, evaluate, deadline[0])
            shrink.polish(hunt, space, evaluate, deadline[0])
            if time.monotonic() > deadline[0]:
                hunt.stopped = "shrink time"
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the hunt so far is reported, its smallest failure written
        hunt.stopped, hunt.interrupted = "interrupted", True
    finally:
        if pool is not None:
            pool.close()
    end = time.monotonic() - began
    if hunt.first is None:
        hunt.search_s = end
    else:
        hunt.shrink_s = end - hunt.search_s
    return hunt


def _values_the_code_runs_in(hunt: Hunt, start: Start, space: Space, check: Callable) -> Space:
    """The space without the values the code does not run in, each tried on the starting scenario first (the
    check 'implementation runs' fails there: the code raises, returns another dtype, or does not take a key):

    - a dtype of the space other than the starting scenario's is left out, with the reason (``hunt.left_out``);
      one ``--space`` named is refused (GradcheckError);
    - an optional axis ``--space`` turns on (``softcap`` on a scenario without it) is refused.

    Any other failure there keeps the value: the hunt will find it. The starting scenario itself is checked too;
    ``hunt.start_failed`` says whether it fails."""
    def cannot_run(values: dict) -> str | None:
        sc = shrink.made(start, space, values)[1]
        result = check(sc) if sc is not None else None
        failed = [c for c in result.checks if c.verdict == "fail"] if result is not None else []
        return failed[0].detail if failed and all(c.name == "implementation runs" for c in failed) else None

    hunt.start_failed = check(start.scenario).verdict == "fail"
    axes = list(space.axes)
    for i, axis in enumerate(axes):
        if axis.key == "dtype":
            kept = []
            for dtype in axis.choices:
                why = cannot_run({"dtype": dtype}) if dtype != start.scenario.dtype else None
                if why and "dtype" in space.named:
                    raise GradcheckError(f"--space dtype={dtype}: the code does not run in it (on the starting "
                                         f"scenario: {why})")
                if why:
                    hunt.left_out[f"dtype={dtype}"] = f"the starting scenario does not run in it: {why}"
                    continue
                kept.append(dtype)
            axes[i] = dataclasses.replace(axis, choices=tuple(kept))
        elif axis.when_set and axis.key in space.named and start.get(axis.key) is None:
            value = axis.choices[0] if axis.kind == "choice" else axis.low
            why = cannot_run({axis.key: value})
            if why:
                raise GradcheckError(f"--space {axis.key}: the starting scenario has no {axis.key}, and its code does "
                                     f"not run with one ({axis.key}={value}: {why})")
    return dataclasses.replace(space, axes=tuple(axes))


@contextlib.contextmanager
def _hypothesis_home() -> Iterator[None]:
    """Hypothesis's own files (a cache of the constants in local modules) in a folder of their own for the hunt,
    removed after it, not a '.hypothesis' folder in the current one; the home before is restored (a pytest run's
    own hypothesis tests keep theirs)."""
    from hypothesis import configuration
    before = configuration.__dict__.get("__hypothesis_home_directory")
    with tempfile.TemporaryDirectory(prefix="attn-gradcheck-hunt-") as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(before)


def _search(test: Callable[[], None], hunt: Hunt, examples: int | None) -> None:
    """Run hypothesis's search and shrinking; ``hunt.stopped`` says how it ended."""
    try:
        test()
        hunt.stopped = "examples" if examples else "exhausted"
    except _Stop:
        hunt.stopped = "time"
    except (_Failed, Flaky):
        hunt.stopped = "shrunk"
    except HypothesisException as exc:  # every draw refused (Unsatisfiable): the space holds no valid scenario
        hunt.stopped = f"hypothesis: {type(exc).__name__}"
    except BaseExceptionGroup as group:  # hypothesis's failures, several at once
        if group.subgroup((_Failed, Flaky)) is None:
            raise
        hunt.stopped = "shrunk"


def _signature(result: ScenarioResult) -> tuple[frozenset, frozenset]:
    """The failed checks' names and the causes the hints name, a cause's sizes left out (``backward-skips-key-
    tail-96`` and ``-16`` are one cause: the tail of keys, whatever its length)."""
    failed = frozenset(c.name for c in result.checks if c.verdict == "fail")
    causes = frozenset(_NUMBER.sub("", m) for h in result.hints for m in _CAUSE.findall(h))
    return failed, causes


def _database(folder: str | None, start: Start, space: Space):
    """Hypothesis's example database for this hunt: a folder of its own under ``folder`` per starting scenario and
    space (another hunt's failures would be replayed in the wrong space)."""
    if folder is None:
        return None
    what = repr((str(Path(start.file).resolve()), start.scenario.name, space.axes, space.max_elements))
    return DirectoryBasedExampleDatabase(str(Path(folder) / hashlib.sha256(what.encode()).hexdigest()[:16]))
