"""The search: hypothesis draws scenarios from the space, each is checked as ``attn-gradcheck run`` checks it (an
implementation in a worker process of its own), and the first failure is shrunk by hypothesis to the smallest
scenario that still fails the same check for the same cause. Hypothesis's example database keeps the failure,
so a rerun of the same hunt starts from it."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
from .space import Space
from .start import Start, candidate, elements, with_values

#: A named cause in a hint: "... a known mistake: ... (`softmax-term`)".
_CAUSE = re.compile(r"\(`([A-Za-z0-9_.-]+)`\)")
#: A size in a cause's name: ``-96``, ``-0.5``.
_NUMBER = re.compile(r"-\d+(\.\d+)?(?=-|$)")


@dataclass(frozen=True)
class Finding:
    """A failing scenario: its keys, the loaded record, its result, its size and what failed (``signature``: the
    failed checks' names, and the causes its hints name)."""
    mapping: dict
    scenario: Scenario
    result: ScenarioResult
    elements: int
    signature: tuple[frozenset, frozenset]
    values: dict = field(default_factory=dict)  # the draw (axis key: value) it was made from

    def same_failure(self, other: Finding) -> bool:
        """Whether ``other`` fails as this does: the first check this one failed fails there too, and so does
        every cause this one's hints name."""
        failed, causes = self.signature
        first = next((c.name for c in self.result.checks if c.verdict == "fail"), None)
        if first is None:  # no check named as failed: the same failed checks, exactly
            return bool(failed) and failed == other.signature[0] and causes <= other.signature[1]
        return first in other.signature[0] and causes <= other.signature[1]


@dataclass
class Hunt:
    """What a hunt did: scenarios checked (``tried``), drawn but skipped (values the loader refuses together, or
    over the size limit), inconclusive ones, the values each axis took (``covered``), the first failure and the
    smallest scenario that fails the same way (``smallest``), each failing scenario's size as shrinking went
    (``path``), and how it stopped."""
    start: Start
    space: Space
    seed: int
    tried: int = 0
    skipped: int = 0
    inconclusive: int = 0
    inconclusive_float32: int = 0
    other_failures: int = 0
    covered: dict = field(default_factory=dict)
    first: Finding | None = None
    smallest: Finding | None = None
    first_inconclusive: Finding | None = None
    path: list = field(default_factory=list)
    search_s: float = 0.0
    shrink_s: float = 0.0
    stopped: str = ""
    interrupted: bool = False
    left_out: dict = field(default_factory=dict)  # values of the space the code does not run in, and why
    start_failed: bool = False  # the starting scenario itself fails
    tried_to_first: int = 0  # scenarios checked up to the first failure, it included

    @property
    def verdict(self) -> str:
        """fail (a failure found), inconclusive (only inconclusive scenarios, or none checked: nothing is decided)
        or pass."""
        if self.smallest:
            return "fail"
        return "inconclusive" if self.inconclusive or not self.tried else "pass"


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
        mapping, sc, size = made or _made(start, space, values)
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
            _ascend(hunt, start, space, evaluate, deadline[0])
            _polish(hunt, space, evaluate, deadline[0])
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
        sc = candidate(start, with_values(start.mapping, space.scenario_values(values, start)))
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


#: Most scenarios the ascending search after hypothesis checks (``_ascend``).
ASCEND_CHECKS = 150
#: Most scenarios it loads to order them (refused ones included: where most are, it stops sooner).
ASCEND_LOADS = 3000


def _made(start: Start, space: Space, values: dict) -> tuple:
    """(mapping, scenario or None when the loader refuses it, input elements) of a draw."""
    mapping = with_values(start.mapping, space.scenario_values(values, start))
    sc = candidate(start, mapping)
    return mapping, sc, elements(sc) if sc is not None else 0


def _ascend(hunt: Hunt, start: Start, space: Space, evaluate: Callable, deadline: float) -> None:
    """The sizes below the smallest failure, in ascending input elements (best first from every size at its lowest,
    each size growing by one), the other keys as they are: the first that fails the same way is the smallest for
    those keys. At most ASCEND_CHECKS are checked: a failure that needs large sizes keeps what hypothesis found.
    (Varying the choices too, one at a time, spread the checks over nine times as many scenarios and found less.)"""
    base, limit = dict(hunt.smallest.values), hunt.smallest.elements
    sizes = [a for a in space.axes if a.kind == "int" and isinstance(base.get(a.key), int)]

    def made(vector: tuple) -> tuple:
        values = {**base, **{a.key: v for a, v in zip(sizes, vector)}}
        return values, _made(start, space, values)

    first = tuple(a.low for a in sizes)
    values, m = made(first)
    heap, seen, order, checks, loads = [(m[2], 0, first, values, m)], {first}, 0, 0, 1
    while heap and checks < ASCEND_CHECKS and loads < ASCEND_LOADS and time.monotonic() < deadline:
        size, _, vector, values, m = heapq.heappop(heap)
        if m[1] is not None:
            if size >= limit:
                return
            checks += 1
            if evaluate(values, m) is hunt.smallest:
                return
        for i, a in enumerate(sizes):
            step = vector[:i] + (vector[i] + 1,) + vector[i + 1:]
            if vector[i] < a.high and step not in seen:
                seen.add(step)
                order += 1
                values_, m_ = made(step)
                loads += 1
                # a refused size has no input elements to count: those of its parent, grown as this size grew
                grown = max(size + 1, -(-size * (vector[i] + 1) // max(vector[i], 1)))
                heapq.heappush(heap, (m_[2] if m_[1] is not None else grown, order, step, values_, m_))


def _polish(hunt: Hunt, space: Space, evaluate: Callable[[dict], Finding | None], deadline: float) -> None:
    """After hypothesis: each size of the smallest failure tried at every smaller value, one size at a time, the
    first that still fails the same way taken, until none does or the time is spent. Hypothesis's shrinker halves
    and steps; a failure that depends on the drawn values (an overflow at one input) can hide between its steps."""
    improved = True
    while improved:
        improved = False
        for axis in (a for a in space.axes if a.kind == "int"):
            current = hunt.smallest.values.get(axis.key)
            for value in range(axis.low, current if isinstance(current, int) else axis.low):
                if time.monotonic() > deadline:
                    return
                finding = evaluate({**hunt.smallest.values, axis.key: value})
                if finding is not None and hunt.smallest is finding:
                    improved = True
                    break
            if improved:
                break


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
