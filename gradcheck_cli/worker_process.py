"""What runs inside a worker process (``workers``): take the run's settings, drop the fork server's
descriptors, lead a process group that dies with the run, then answer ``tasks.TASKS`` one at a time."""
from __future__ import annotations

import os
import signal
import sys

from . import numeric
from .errors import GradcheckError
from .tasks import TASKS

#: Set in the fork server's environment by this package (and removed again in each worker).
_SAFE_PATH_MARK = "ATTN_GRADCHECK_SAFE_PATH"


def _quiet_when_the_run_is_gone(kind, value, tb) -> None:
    """The fork server's excepthook (its children inherit it): a worker being forked when the run stops
    (Ctrl-C) finds its pipe closed before it gets its task; that is no error of anyone's to print."""
    if isinstance(value, (EOFError, BrokenPipeError, ConnectionResetError)):
        return
    sys.__excepthook__(kind, value, tb)


if os.environ.get(_SAFE_PATH_MARK):  # imported as the fork server preloads this package
    sys.excepthook = _quiet_when_the_run_is_gone


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
            reply = ("ok", TASKS[kind](*args))
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
    from .implementation import raised_at
    return f"{type(exc).__name__}: {text[:500]}{raised_at(exc)}"


def _leave() -> None:
    # os._exit skips atexit: what a scenario started beside it (a distributed check's ranks, their folder) is
    # stopped here
    ranks = sys.modules.get("gradcheck_cli.ops.attention.distributed.proxy")
    if ranks is not None:
        try:
            ranks.stop_all()
        except BaseException:  # noqa: BLE001 -- leaving anyway; the ranks die with the process group
            pass
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
