"""Worker processes for the runner: forked from a fork server (so a fresh process per implementation costs
milliseconds), each leading its own process group, stopped with its scenario's timeout, and dying with the
run. A worker runs ``tasks.TASKS`` on the scenarios it is sent; what it answers, or how it died, becomes an
``Outcome``."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence

from .errors import GradcheckError
from .ops import OPS
from .result import Check, Kind, ScenarioResult
from .scenario import Scenario
from .tasks import Outcome, units
from .worker_process import _SAFE_PATH_MARK, _serve

#: How often a waiting parent looks at its workers (seconds): the granularity of timeouts, deaths and
#: Ctrl-C.
POLL_S = 0.05


#: What a worker of each backend would import for its first scenario, imported once in the fork server
#: instead (imports only: nothing that starts a thread or a framework's runtime, which a fork would break).
#: torch's first backward through SDPA's math path imports torch.fx's symbolic shapes, and with them sympy
#: (about 1 s in every fresh worker); JAX's own import takes 2-4 s.
BACKEND_PRELOAD = {
    "torch": ("torch", "torch.fx.experimental.symbolic_shapes", "gradcheck_cli.flavours.torch"),
    "jax": ("jax", "jax.numpy", "gradcheck_cli.flavours.jax"),
}


def preload(scenarios: Sequence[Scenario]) -> list[str]:
    """The modules the fork server imports for the workers of ``scenarios``: this package, NumPy's random
    generators and masked arrays (imported lazily; np.unique takes numpy.ma), the engine module of each
    scenario and its backend's framework."""
    modules = ["gradcheck_cli.worker_process", "gradcheck_cli.ops", "numpy.random", "numpy.ma"]
    for sc in scenarios:
        op = OPS.get(sc.op)
        if op is not None and op.engines:
            modules.append(op.engines[op.engine_for(sc)].target.split(":")[0])
        modules.extend(BACKEND_PRELOAD.get(sc.backend, ()))
    return list(dict.fromkeys(modules))


def _context(scenarios: Sequence[Scenario] = ()):
    """Workers are forked from a fork server that imported this package, and what the workers of
    ``scenarios`` need (``preload``), once, so a fresh process per implementation costs milliseconds, not an
    interpreter start and its imports; where there is no fork server (Windows), they are spawned. A fork
    server already running keeps what it preloaded."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    _start_fork_server(ctx, preload(scenarios))
    return ctx


def _start_fork_server(ctx, preload: list[str]) -> None:
    """Start the fork server now, with Ctrl-C ignored in it from its first instruction (its workers
    inherit that, so a Ctrl-C to the process group never reaches one while it starts) while the run itself
    stays interruptible throughout (ignoring Ctrl-C in this process, even for the moment of the fork, loses
    a Ctrl-C that arrives then: any thread may take a process's signal), and without the current folder on
    its module path: it is started with ``python -c``, which would put the current folder first, and a
    numpy.py or yaml.py there would then run in it. Python 3.10 has no way to say so (PYTHONSAFEPATH is
    3.11's): there it preloads nothing, and each worker imports what it needs after taking the run's own
    module path."""
    from multiprocessing import forkserver, util
    safe = sys.version_info >= (3, 11)
    ctx.set_forkserver_preload(preload if safe else [])
    added = safe and "PYTHONSAFEPATH" not in os.environ
    if added:
        os.environ["PYTHONSAFEPATH"] = os.environ[_SAFE_PATH_MARK] = "1"
    original = util.spawnv_passfds
    util.spawnv_passfds = _spawn_ignoring_ctrl_c  # the fork server's and the resource tracker's spawn
    try:
        forkserver.ensure_running()  # returns at once when it runs; (re)starts it otherwise
    finally:
        util.spawnv_passfds = original
        if added:
            os.environ.pop("PYTHONSAFEPATH", None)
            os.environ.pop(_SAFE_PATH_MARK, None)


#: The helper processes started here, kept so that ``subprocess`` never reaps them (multiprocessing does).
_SPAWNED: list = []


def _spawn_ignoring_ctrl_c(path, args, passfds) -> int:
    """``multiprocessing.util.spawnv_passfds`` with SIGINT ignored in the child before it executes: Python
    then leaves it ignored, so a Ctrl-C while the helper starts neither kills it nor prints its traceback."""
    import subprocess
    proc = subprocess.Popen(list(args), executable=path, pass_fds=sorted(passfds), close_fds=True,
                            preexec_fn=_ignore_ctrl_c)  # noqa: PLW1509 -- only signal() runs there
    _SPAWNED.append(proc)
    return proc.pid


def _ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Workers:
    """``size`` worker processes (connected by pipes), each checking one scenario at a time. A worker
    that checked an implementation is never reused (the user's code may have changed its process:
    imports, monkeypatches, global settings, threads): the next scenario gets a fresh one. A worker that
    dies or outlives its scenario's timeout is replaced; its scenario is a failed check."""

    def __init__(self, size: int, threads: int, scenarios: Sequence[Scenario] = ()):
        self.ctx = _context(scenarios)
        self.size, self.threads = size, threads
        self.idle: list[_Worker] = []

    def _get(self) -> _Worker:
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
                # (a distributed check's ranks run code too, the built-in ring's included)
                timed = sc.implementation is not None or dict(sc.params).get("distributed") is not None
                worker.deadline = worker.started + sc.timeout if timed else None
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
    if "gradcheck_cli" in str(payload).rsplit(" (at ", 1)[-1]:  # raised in this tool's own code
        return (f"checking it raised {payload}, outside any single call of the implementation, in attn-gradcheck's "
                "own code: most likely a bug of this tool (please report it with the scenario), or an "
                "implementation that broke the process it runs in (patched modules, closed files)")
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
