"""Run the scenarios of one file: in this process or in worker processes (``jobs``), always yielding
results in file order, each with its negative controls when asked; and the deterministic shard split.
Never prints; the CLI renders what it yields."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from . import checker, numeric
from .errors import GradcheckError
from .result import Check, ControlCell, Kind, ScenarioResult
from .scenario import Scenario


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

    A scenario that names an implementation always runs in a worker process of its own kind: the
    user's code can then neither end the run (``os._exit``, a crash, a kill: a failed check naming
    it) nor hang it (stopped after ``check.timeout`` seconds: a failed check). With ``jobs`` > 1 every
    scenario runs in one of that many worker processes (started fresh; each scenario is sent to it
    whole, ``config`` is never read again), and results are identical to a run in this process: every number depends only on the
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
                    torch=any(sc.backend == "torch" for sc in scenarios))
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
    pool = _Workers(1, os.cpu_count() or 1, torch=sc.backend == "torch")
    try:
        (outcome,) = pool.map(config, [sc], faults, controls, memory_budget, None)
        return outcome
    finally:
        pool.close()


def sweep_isolated(config: str, sc: Scenario, steps, samples: int):
    """``stepsweep.sweep`` of one scenario in a fresh worker process: its Sweep, or a sentence saying
    how the implementation failed (raised, ended the process, or outlived ``check.timeout``)."""
    worker = _Worker(_context(sc.backend == "torch"), os.cpu_count() or 1)
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


#: How often a waiting parent looks at its workers (seconds): the granularity of timeouts, deaths and
#: Ctrl-C.
POLL_S = 0.05


def _context(torch: bool):
    """Workers are forked from a fork server that imported this package (and torch, when a scenario
    uses it) once, so a fresh process per implementation costs milliseconds, not an interpreter start;
    where there is no fork server (Windows), they are spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    _start_fork_server(ctx, ["gradcheck_cli.runner", "gradcheck_cli.ops"] + (["torch"] if torch else []))
    return ctx


#: Set in the fork server's environment by this package (and removed again in each worker).
_SAFE_PATH_MARK = "ATTN_GRADCHECK_SAFE_PATH"


def _start_fork_server(ctx, preload: list[str]) -> None:
    """Start the fork server now, with Ctrl-C ignored (its workers inherit that, so a Ctrl-C to the
    process group never reaches one while it starts; the run itself stays interruptible while it waits
    for the server) and without the current folder on its module path: it is started with ``python
    -c``, which would put the current folder first, and a numpy.py or yaml.py there would then run in
    it. Python 3.10 has no way to say so (PYTHONSAFEPATH is 3.11's): there it preloads nothing, and
    each worker imports what it needs after taking the run's own module path."""
    from multiprocessing import forkserver
    safe = sys.version_info >= (3, 11)
    ctx.set_forkserver_preload(preload if safe else [])
    added = safe and "PYTHONSAFEPATH" not in os.environ
    if added:
        os.environ["PYTHONSAFEPATH"] = os.environ[_SAFE_PATH_MARK] = "1"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()  # returns at once when it runs; (re)starts it otherwise
    finally:
        signal.signal(signal.SIGINT, previous)
        if added:
            os.environ.pop("PYTHONSAFEPATH", None)
            os.environ.pop(_SAFE_PATH_MARK, None)


class _Workers:
    """``size`` worker processes (connected by pipes), each checking one scenario at a time. A worker
    that checked an implementation is never reused (the user's code may have changed its process:
    imports, monkeypatches, global settings, threads): the next scenario gets a fresh one. A worker that
    dies or outlives its scenario's timeout is replaced; its scenario is a failed check."""

    def __init__(self, size: int, threads: int, torch: bool = False):
        self.ctx = _context(torch)
        self.size, self.threads = size, threads
        self.idle: list[_Worker] = []

    def _get(self) -> "_Worker":
        return self.idle.pop() if self.idle else _Worker(self.ctx, self.threads)

    def map(self, config, scenarios, faults, controls, memory_budget, progress) -> Iterator[Outcome]:
        pending = list(scenarios)
        running: dict[int, tuple[_Worker, Scenario]] = {}
        done: dict[int, Outcome] = {}
        order = [sc.index for sc in scenarios]
        try:
            yield from self._loop(config, pending, running, done, order, faults, controls, memory_budget, progress)
        finally:  # Ctrl-C, an error, or the caller stopped early: nothing keeps running
            for worker, _ in running.values():
                worker.kill()

    def _loop(self, config, pending, running, done, order, faults, controls, memory_budget, progress):
        emitted = 0
        while emitted < len(order):
            while pending and len(running) < self.size:
                sc = pending.pop(0)
                worker = self._get()
                worker.send(("check", (sc, tuple(faults), controls, memory_budget)))
                worker.deadline = worker.started + sc.timeout if sc.implementation is not None else None
                running[sc.index] = (worker, sc)
            for index, (worker, sc) in list(running.items()):
                answer = worker.collect(worker.deadline)
                if answer is None:
                    continue
                del running[index]
                done[index] = _outcome(sc, *answer, time.monotonic() - worker.started)
                if worker.alive and sc.implementation is None:
                    self.idle.append(worker)
                else:
                    worker.stop()
                if progress:
                    progress(units(sc, controls))
            while emitted < len(order) and order[emitted] in done:
                yield done.pop(order[emitted])
                emitted += 1
            if running and emitted < len(order) and order[emitted] not in done:
                _wait([w for w, _ in running.values()], POLL_S)

    def close(self) -> None:
        for worker in self.idle:
            worker.stop()
        self.idle.clear()


def _outcome(sc: Scenario, kind: str, payload, elapsed: float) -> Outcome:
    if kind == "ok":
        result, cells = payload
        return Outcome(sc.index, result, cells)
    if kind == "bad":
        raise payload
    if kind == "error" and sc.implementation is None:  # not the user's code: an error of this tool
        raise GradcheckError(f"{sc.file}: scenario '{sc.name}': {payload}")
    return Outcome(sc.index, _failed(sc, _failure_text(sc, kind, payload), elapsed))


def _failure_text(sc: Scenario, kind: str, payload) -> str:
    if kind == "timeout":
        return (f"did not finish within {sc.timeout:g} s (check.timeout): the implementation hangs or is far "
                "slower than expected; it was stopped")
    if kind == "died":
        return (f"the process checking it {payload} before the scenario finished: the implementation (or a "
                "library it calls) ended the process (os._exit, sys.exit in a thread, a crash); an "
                "implementation must return")
    return (f"checking it raised {payload}, outside any single call of the implementation: its module or what "
            "it returned broke the process it runs in (e.g. a recursion limit, closed files, patched modules, a "
            "value whose methods raise)")


def _wait(workers, timeout: float) -> None:
    from multiprocessing.connection import wait
    wait([w.conn for w in workers] + [w.proc.sentinel for w in workers], timeout)


class _Worker:
    def __init__(self, ctx, threads: int):
        self.conn, child = ctx.Pipe()
        server = _server_pid(ctx)
        self.proc = ctx.Process(target=_serve, args=(child, threads, server), daemon=True)
        if server is not None:  # forked by the fork server, which started with Ctrl-C ignored
            self.proc.start()
        else:
            # A spawned worker starts with Ctrl-C ignored (the disposition survives exec, and Python
            # keeps it): a Ctrl-C that reaches the whole process group while it is still starting must
            # not make it print a traceback. The parent handles Ctrl-C and stops its workers.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self.proc.start()
            finally:
                signal.signal(signal.SIGINT, previous)
        child.close()
        self.alive = True
        self.started = time.monotonic()
        self.deadline: float | None = None

    def send(self, task) -> None:
        self.conn.send(task)
        self.started = time.monotonic()

    def collect(self, deadline: float | None):
        """(kind, payload) once the worker answered ("ok", "bad": bad input, "error": an exception's
        text), died ("died", how) or overran ``deadline`` ("timeout"); None while it is still working."""
        try:
            if self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):
            pass  # the worker is gone: below
        except Exception as exc:  # noqa: BLE001 -- an answer that cannot be unpickled
            self.kill()
            return "error", f"{type(exc).__name__}: {exc}"
        if self.proc.is_alive() and (deadline is None or time.monotonic() < deadline):
            return None
        if self.proc.is_alive():
            self.kill()
            return "timeout", None
        self.kill()
        code = self.proc.exitcode
        return "died", (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else
                        f"exited with code {code}")

    def kill(self) -> None:
        self.alive = False
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        _kill_group(self.proc.pid)
        self.conn.close()

    def stop(self) -> None:
        """Ask the worker to leave, and make sure it does."""
        if self.conn.closed:
            return
        self.alive = False
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        _kill_group(self.proc.pid)
        self.conn.close()


def _kill_group(pid: int | None) -> None:
    """Whatever the user's code forked and left running (the worker leads a process group of its
    own, so that is everything in it that did not leave it) goes with the worker."""
    if pid is None or not hasattr(os, "killpg"):
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # nothing left in the group (the usual case), or not ours
        pass


def _failed(sc: Scenario, detail: str, elapsed: float) -> ScenarioResult:
    check = Check(kind=Kind.IMPLEMENTATION, name="implementation runs", tensor="-", shape=None,
                  max_abs_error=float("inf"), relative_error=float("inf"), tolerance=0.0, noise_floor=0.0,
                  worst_index=None, passed=False, detail=detail)
    return ScenarioResult(name=sc.name, op=sc.op, dtype=sc.dtype, epsilon=sc.epsilon, tolerance=sc.tolerance,
                          mode=sc.mode, faults=(), checks=(check,), elapsed_s=elapsed, index=sc.index, engine=sc.engine)


def _server_pid(ctx) -> int | None:
    if ctx.get_start_method() != "forkserver":
        return None
    from multiprocessing import forkserver
    return forkserver._forkserver._forkserver_pid


def _serve(conn, threads: int, server: int | None = None) -> None:
    """A worker: runs the tasks it is sent until told to stop or its parent goes away, then leaves at
    once (os._exit: no atexit handler or finalizer of the user's code runs, none can print or hang)."""
    _init_worker(threads, server)
    while True:
        try:
            task = conn.recv()
        except BaseException:  # noqa: BLE001 -- the parent is gone, or the user's code closed the pipe
            break
        if task is None:
            break
        kind, args = task
        try:
            reply = ("ok", _TASKS[kind](*args))
        except GradcheckError as exc:
            reply = ("bad", exc)
        except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which says so
            reply = ("error", _describe(exc))
        try:
            conn.send(reply)
        except BaseException as exc:  # noqa: BLE001 -- an answer that cannot be pickled, or the pipe is gone
            try:
                conn.send(("error", f"its answer could not be sent back ({_describe(exc)})"))
            except BaseException:  # noqa: BLE001
                break
    _leave()


def _describe(exc: BaseException) -> str:
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 -- an exception whose __str__ raises
        text = "(its message cannot be shown)"
    return f"{type(exc).__name__}: {text[:500]}"


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(0)


def _drop_fork_server_fds() -> None:
    """A child of the fork server holds the write end of the pipe by which the server learns that the
    run is gone (and the resource tracker's): while it or any process the user's code forks holds it,
    the server would outlive a killed run, and so would the workers (they die with the server). Closed
    here, the chain holds: run killed -> server leaves -> workers are killed."""
    from multiprocessing import forkserver, resource_tracker
    for owner, attr in ((getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd"),
                        (getattr(resource_tracker, "_resource_tracker", None), "_fd")):
        fd = getattr(owner, attr, None)
        if isinstance(fd, int):
            try:
                os.close(fd)
            except OSError:
                pass
            setattr(owner, attr, None)


def _init_worker(threads: int, server: int | None = None) -> None:
    """Workers leave Ctrl-C to the parent (which stops them), die with it (Linux: the parent's death
    signals them), and share the cores: ``threads`` chunk threads and as many BLAS threads each, so N
    jobs do not oversubscribe the cores. A KeyboardInterrupt in a worker can only be raised by the
    implementation, so there it is the implementation's failure."""
    from threadpoolctl import threadpool_limits
    from . import implementation
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    implementation.CTRL_C_REACHES_HERE = False
    _drop_fork_server_fds()
    if hasattr(os, "setpgid"):
        try:
            os.setpgid(0, 0)  # a process group of its own: what user code forks is killed with it
        except OSError:
            pass
    if os.environ.pop(_SAFE_PATH_MARK, None):  # the fork server's setting, not the user's
        os.environ.pop("PYTHONSAFEPATH", None)
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the fork server's death kills us
    except (OSError, AttributeError, TypeError):
        pass
    if server is not None and os.getppid() != server:  # it left before the line above took effect
        os._exit(0)
    numeric.WORKERS = threads
    threadpool_limits(limits=threads, user_api="blas")  # for the life of the worker
    numeric.quiet_numpy_arithmetic()


def _work(sc: Scenario, faults: tuple[str, ...], controls: bool, memory_budget: int):
    """The task of a worker: the scenario arrives whole (pickled; its implementation still a
    ``module:attribute`` string, imported here), so a worker never reads the YAML again."""
    result, cells = _one(sc, faults, controls, memory_budget, None)
    return result, cells


def _sweep(sc: Scenario, steps: tuple[float, ...], samples: int):
    from . import stepsweep
    from .implementation import ImplementationFailure
    try:
        return stepsweep.sweep(sc, steps, samples)
    except ImplementationFailure as exc:
        return f"the implementation failed: {exc.message}"


_TASKS = {"check": _work, "sweep": _sweep}
