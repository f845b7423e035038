"""The ``attn-gradcheck`` console script: the click command, with Ctrl-C ending every command the same
way at any moment (while starting, loading or checking): one line, exit 130, no traceback; SIGTERM
the same way with exit 143, whichever command it stops (``run``, ``merge``, ``sweep-eps``, ...).

After a Ctrl-C the process leaves with ``os._exit`` once its output is flushed and any report is
written: worker threads still finishing a chunk of finite differences are not waited for.
"""
from __future__ import annotations

import os
import sys

from .errors import caused_by_interrupt as _caused_by_interrupt
from .exitcodes import ExitCode


def _leave(code: int, message: str | None = None) -> None:
    try:
        if message:
            sys.stderr.write(message + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _stopped(exc: BaseException) -> None:
    """Leave after a Ctrl-C (130) or a SIGTERM (143), however it reached here: as itself, wrapped in click's
    Abort, or as the cause of another exception."""
    from .errors import caused_by_sigterm
    terminated = caused_by_sigterm(exc)
    _leave(ExitCode.TERMINATED if terminated else ExitCode.INTERRUPTED, "terminated" if terminated else "interrupted")


def _terminate(signum, frame) -> None:
    from .errors import Terminated
    raise Terminated()


def _standard_streams() -> None:
    """Standard input, output or error closed (``>&-``): /dev/null in its place, so the run goes on
    with that output discarded (its exit code and reports unchanged), and no file opened later takes
    descriptor 1 or 2 and receives what was meant for the terminal."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        new = os.open(os.devnull, os.O_RDWR)
        if new != fd:
            os.dup2(new, fd)
            os.close(new)
        setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8", errors="replace"))


def main() -> None:
    import signal
    _standard_streams()
    signal.signal(signal.SIGTERM, _terminate)  # SIGTERM stops a run as Ctrl-C does (exit 143)
    try:
        import click

        from .numeric import quiet_numpy_arithmetic
        quiet_numpy_arithmetic()

        from .cli import main as command
        code = command.main(prog_name="attn-gradcheck", standalone_mode=False)
    except KeyboardInterrupt as exc:
        _stopped(exc)
    except click.exceptions.Abort as exc:  # click's own reading of Ctrl-C or SIGTERM (and of EOF at a prompt)
        _stopped(exc)
    except click.exceptions.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except BrokenPipeError:  # the reader went away (`| head`): stop as a piped tool does, 128 + SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _leave(ExitCode.BROKEN_PIPE)
    except SystemExit as exc:  # the console's own exit on a broken pipe (cli.ui._Console)
        if exc.code == ExitCode.BROKEN_PIPE:
            _leave(ExitCode.BROKEN_PIPE)
        raise
    except Exception as exc:  # Ctrl-C inside a class body while importing comes wrapped (RuntimeError
        if _caused_by_interrupt(exc):  # from __set_name__): it is still a Ctrl-C (or a SIGTERM)
            _stopped(exc)
        raise
    if code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
        _leave(code)
    sys.exit(code or 0)
