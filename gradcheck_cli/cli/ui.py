"""What the command line shows besides the results: the console (styled on a terminal, plain text off
one, NO_COLOR honoured by rich), the one-line error messages and the progress bar."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import ScenarioErrors
from ..exitcodes import ExitCode
from ..text import visible


class _Console(Console):
    """rich's Console, but a reader that goes away (``| head``) ends the run with 141 (128 + SIGPIPE),
    as a piped tool does, not with 1, which means "a check failed" here."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.file.fileno())
        raise SystemExit(ExitCode.BROKEN_PIPE)


def _console(stderr: bool = False) -> Console:
    """Rich console: styled on a terminal; off a terminal plain text that never wraps, whatever COLUMNS
    says (CI logs, pipes). NO_COLOR is honoured by rich."""
    file = sys.stderr if stderr else sys.stdout
    tty = file.isatty()
    return _Console(file=file, stderr=stderr, highlight=False, markup=False, soft_wrap=not tty,
                    width=None if tty else 200)


def _error(problem: str | BaseException) -> None:
    """One line per problem on stderr (``ScenarioErrors`` holds several: one line each, capped and counted);
    control characters of a path or value are shown escaped (``text.visible``), so a problem never spans lines."""
    for line in problem.lines() if isinstance(problem, ScenarioErrors) else [str(problem)]:
        click.echo(f"error: {visible(line)}", err=True)


def _fail(problem: str | BaseException) -> click.exceptions.Exit:
    """Print the error (``_error``) and return the exit (2) to raise."""
    _error(problem)
    return click.exceptions.Exit(ExitCode.BAD_INPUT)


#: Seconds a run must last before the progress bar appears (short runs print nothing extra).
PROGRESS_DELAY_S = 1.0


class Eta:
    """The progress of a run and its estimated time left, from the measured rate of finite-difference work: units
    done over the time since the first unit, the rate of the whole run so far (every scenario weighted by its work
    units), never a recent window, so that one slow or fast scenario moves it by its own share only. ``clock`` is
    injectable (tests run it on a fake one)."""

    def __init__(self, total: int, clock=time.monotonic):
        self.total, self.done, self.clock = max(int(total), 0), 0, clock
        self.start = clock()

    def advance(self, n: int) -> None:
        self.done = min(self.total, self.done + max(int(n), 0))

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0

    def remaining_s(self) -> float | None:
        """Seconds left at the rate so far; None before any work has finished (nothing measured yet)."""
        elapsed = self.clock() - self.start
        if self.done == 0 or elapsed <= 0:
            return None
        return elapsed / self.done * (self.total - self.done)

    def describe(self) -> str:
        left = self.remaining_s()
        if left is None:
            return "eta -:--:--"
        left = int(round(left))
        return f"eta {left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}"


class _ProgressBar:
    """A bar on stderr, shown once a run has lasted PROGRESS_DELAY_S and only on a terminal: the scenario
    running (``running``) and the time left at the run's measured rate of work (``Eta``). ``advance`` is the
    checker's progress callback; ``hidden()`` clears the bar while results print."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled = enabled and sys.stderr.isatty()
        self.eta = Eta(total)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                            TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), TextColumn("{task.fields[now]}"),
                            console=_console(stderr=True), transient=True,
                            redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task(label, total=total, eta=self.eta.describe(), now="")
        self.start = time.monotonic()
        self.lock = threading.RLock()  # --jobs advances from the pool's result thread
        self.paused = False

    def running(self, name: str | None) -> None:
        """The scenario now running (the first not yet finished, in file order)."""
        with self.lock:
            self.bar.update(self.task, now=visible(name or ""))

    def advance(self, n: int) -> None:
        with self.lock:
            self.eta.advance(n)
            self.bar.update(self.task, completed=self.eta.done, eta=self.eta.describe())
            if (self.enabled and not self.paused and not self.bar.live.is_started
                    and time.monotonic() - self.start > PROGRESS_DELAY_S):
                self.bar.start()

    @contextlib.contextmanager
    def hidden(self):
        with self.lock:
            running, self.paused = self.bar.live.is_started, True
            if running:
                self.bar.stop()
        try:
            yield
        finally:
            with self.lock:
                self.paused = False
                if running:
                    self.bar.start()

    def close(self) -> None:
        with self.lock:
            self.paused = True
            if self.bar.live.is_started:
                self.bar.stop()


def _unwritten(exc: OSError) -> str:
    """What a failed write left: a failure while staging leaves every file as it was."""
    from ..errors import ReportsFailed
    return str(exc) if isinstance(exc, ReportsFailed) else f"{exc}; none written (every file is as it was)"

