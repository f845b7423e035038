"""Run the scenarios of one file: in this process or in worker processes (``jobs``), always yielding
results in file order, each with its negative controls when asked; and the deterministic shard split.
Never prints; the CLI renders what it yields."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

from . import checker
from .scenario import Scenario
from .tasks import Outcome, units  # noqa: F401  (re-exported: the API and CLI count progress by units)
from .tasks import one as _one
from .workers import POLL_S, _context, _failure_text, _wait, _Worker, _Workers


def shard(scenarios: Sequence[Scenario], index: int, count: int) -> list[Scenario]:
    """Shard ``index`` of ``count`` (1-based): every count-th scenario of the list, starting at the
    index-th. The same list always splits the same way, and the shards together hold each once."""
    return [sc for k, sc in enumerate(scenarios) if k % count == index - 1]


def run(config: str, scenarios: Sequence[Scenario], faults: Sequence[str] = (), *, controls: bool = False,
        jobs: int = 1, memory_budget: int = checker.DEFAULT_MEMORY_BUDGET,
        progress: Callable[[int], None] | None = None) -> Iterator[Outcome]:
    """Check ``scenarios`` (loaded from ``config``), yielding outcomes in their order.

    A scenario that names an implementation always runs in a worker process of its own kind: the
    user's code can then neither end the run (``os._exit``, a crash, a kill: a failed check naming
    it) nor hang it (stopped after ``check.timeout`` seconds: a failed check). With ``jobs`` > 1 every
    scenario runs in one of that many worker processes (started fresh; each scenario is sent to it
    whole, ``config`` is never read again), and results are identical to a run in this process:
    every number depends only on the
    scenario and its seeds. Closing the generator early (Ctrl-C) stops the workers at once.
    """
    isolated = [sc.implementation is not None for sc in scenarios]
    if jobs <= 1 and not any(isolated):
        for sc in scenarios:
            result, cells = _one(sc, faults, controls, memory_budget, progress)
            yield Outcome(sc.index, result, cells)
        return
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    pool = _Workers(max(1, min(jobs, len(scenarios))), threads,
                    [sc for sc, alone in zip(scenarios, isolated) if alone or jobs > 1])
    try:
        if jobs <= 1:  # built-in scenarios here, implementations one at a time in a worker
            for sc in scenarios:
                if sc.implementation is None:
                    result, cells = _one(sc, faults, controls, memory_budget, progress)
                    yield Outcome(sc.index, result, cells)
                    continue
                (outcome,) = pool.map(config, [sc], faults, controls, memory_budget, progress)
                yield outcome
        else:
            yield from pool.map(config, scenarios, faults, controls, memory_budget, progress)
    finally:
        pool.close()


def check_isolated(config: str, sc: Scenario, faults: Sequence[str] = (), *, controls: bool = False,
                   memory_budget: int = checker.DEFAULT_MEMORY_BUDGET) -> Outcome:
    """One scenario in a worker process of its own (as ``run`` checks an implementation)."""
    pool = _Workers(1, os.cpu_count() or 1, [sc])
    try:
        (outcome,) = pool.map(config, [sc], faults, controls, memory_budget, None)
        return outcome
    finally:
        pool.close()


def sweep_isolated(config: str, sc: Scenario, steps, samples: int):
    """``stepsweep.sweep`` of one scenario in a fresh worker process: its Sweep, or a sentence saying
    how the implementation failed (raised, ended the process, or outlived ``check.timeout``)."""
    worker = _Worker(_context([sc]), os.cpu_count() or 1)
    try:
        worker.send(("sweep", (sc, tuple(steps), samples)))
        deadline = worker.started + sc.timeout
        while True:
            answer = worker.collect(deadline)
            if answer is None:
                _wait([worker], POLL_S)
                continue
            kind, payload = answer
            if kind == "ok":
                return payload
            if kind == "bad":
                raise payload
            return _failure_text(sc, kind, payload)
    finally:
        worker.stop()
