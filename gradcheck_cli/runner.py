"""Run the scenarios of one file: in this process or in worker processes (``jobs``), always yielding
results in file order, each with its negative controls when asked; and the deterministic shard split.
Never prints; the CLI renders what it yields."""
from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import signal
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from . import checker, numeric
from .result import ControlCell, ScenarioResult
from .scenario import Scenario, load


@dataclass(frozen=True)
class Outcome:
    """One scenario's result, its position in the file (``index``) and, with negative controls, its
    row of the fault x scenario matrix."""
    index: int
    result: ScenarioResult
    cells: tuple[ControlCell, ...] | None = None


def shard(scenarios: Sequence[Scenario], index: int, count: int) -> list[Scenario]:
    """Shard ``index`` of ``count`` (1-based): every count-th scenario of the list, starting at the
    index-th. The same list always splits the same way, and the shards together hold each once."""
    return [sc for k, sc in enumerate(scenarios) if k % count == index - 1]


def units(sc: Scenario, controls: bool) -> int:
    """Progress units of one scenario (its finite-difference work, times the faults it runs)."""
    return checker.work_units(sc) * (1 + (len(checker.applicable_faults(sc)) if controls else 0))


def _one(sc: Scenario, faults: Sequence[str], controls: bool, memory_budget: int,
         progress: Callable[[int], None] | None) -> tuple[ScenarioResult, tuple[ControlCell, ...] | None]:
    cache: dict = {}  # the controls reuse the clean run's finite differences
    result = checker.run_scenario(sc, faults, memory_budget=memory_budget, progress=progress, numeric_cache=cache)
    cells = None
    if controls:
        cells = tuple(checker.negative_controls([sc], memory_budget=memory_budget, progress=progress,
                                                numeric_cache=cache, clean={sc.name: result}))
    return result, cells


def run(config: str, scenarios: Sequence[Scenario], faults: Sequence[str] = (), *, controls: bool = False,
        jobs: int = 1, memory_budget: int = checker.DEFAULT_MEMORY_BUDGET,
        progress: Callable[[int], None] | None = None) -> Iterator[Outcome]:
    """Check ``scenarios`` (loaded from ``config``), yielding outcomes in their order.

    With ``jobs`` > 1 the scenarios run in that many worker processes (started fresh, each loading
    ``config`` itself), and results are identical to a run in this process: every number depends only
    on the scenario and its seeds. Closing the generator early (Ctrl-C) stops the workers at once.
    """
    if jobs <= 1 or len(scenarios) <= 1:
        for sc in scenarios:
            result, cells = _one(sc, faults, controls, memory_budget, progress)
            yield Outcome(sc.index, result, cells)
        return
    threads = max(1, (os.cpu_count() or 1) // jobs)
    pool = multiprocessing.get_context("spawn").Pool(min(jobs, len(scenarios)), initializer=_init_worker,
                                                     initargs=(threads,))
    try:
        def done(n: int):
            return (lambda _: progress(n)) if progress else None

        pending = [pool.apply_async(_work, (config, sc.name, sc.engine, tuple(faults), controls, memory_budget),
                                    callback=done(units(sc, controls))) for sc in scenarios]
        for sc, job in zip(scenarios, pending):
            result, cells = job.get()
            yield Outcome(sc.index, result, cells)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _init_worker(threads: int) -> None:
    """Workers leave Ctrl-C to the parent (which terminates them) and share the cores between them:
    ``threads`` chunk threads and as many BLAS threads each, so N jobs do not oversubscribe the cores."""
    from threadpoolctl import threadpool_limits
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    numeric.WORKERS = threads
    threadpool_limits(limits=threads, user_api="blas")  # for the life of the worker


@functools.lru_cache(maxsize=4)
def _scenarios(config: str) -> dict[str, Scenario]:
    return {sc.name: sc for sc in load(config)}


def _work(config: str, name: str, engine: str, faults: tuple[str, ...], controls: bool, memory_budget: int):
    sc = _scenarios(config)[name]
    if sc.engine != engine:  # --engine given to the parent
        sc = dataclasses.replace(sc, engine=engine)
    result, cells = _one(sc, faults, controls, memory_budget, None)
    return result, cells
