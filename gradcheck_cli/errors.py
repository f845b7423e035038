"""Errors the tool reports to people. Only the CLI turns them into exit codes."""
from __future__ import annotations


class GradcheckError(Exception):
    """Any error that is the user's input, not a bug: the CLI prints it and exits 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (partial reports, workers stopped), ending with exit 143."""


def caused_by_interrupt(exc: BaseException) -> bool:
    """``exc`` is a Ctrl-C, or was raised while handling one (a lazy import wraps it, e.g. a RuntimeError
    from ``__set_name__``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def caused_by_sigterm(exc: BaseException) -> bool:
    """``exc`` is SIGTERM's ``Terminated``, or was raised while handling one (click turns a KeyboardInterrupt
    into its ``Abort``; the reports' writer into ``ReportsInterrupted`` with ``terminated`` set)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, Terminated) or getattr(exc, "terminated", False) is True:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class ReportsInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) while the reports were being put in place: which are new and which are not."""

    def __init__(self, written: list[str], pending: list[str], terminated: bool = False):
        super().__init__()
        self.written, self.pending, self.terminated = written, pending, terminated


class ReportsFailed(OSError):
    """A report could not be put in place: which are new (``written``: a device or FIFO already sent
    to, or a file whose old version could not be put back) and which are as they were (``pending``)."""

    def __init__(self, written: list[str], pending: list[str], cause: BaseException):
        super().__init__(getattr(cause, "errno", None), str(cause))
        self.written, self.pending, self.cause = written, pending, cause

    def __str__(self) -> str:
        return (f"{self.cause}; " + (f"written: {', '.join(self.written)}; as they were: {', '.join(self.pending)}"
                                    if self.written else "none written (every report is as it was)"))


class ScenarioError(GradcheckError):
    """A scenario file is wrong: names the file, the line and the key, and suggests a fix.

    ``key`` is a dotted path such as ``scenarios[0].mask.window``; ``line`` is 1-based.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None, hint: str | None = None):
        self.message = message
        self.file = file
        self.line = line
        self.key = key
        self.hint = hint
        self.final = False  # no later scenario of the file can load either (the masks held so far fill memory)
        self.missing: str | None = None  # the optional library the scenario needs and this machine lacks
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "") + ": "
        key = f"{self.key}: " if self.key else ""
        hint = f" ({self.hint})" if self.hint else ""
        return f"{where}{key}{self.message}{hint}"


class ScenarioErrors(ScenarioError):
    """Every problem found in one file (the first of each scenario, and the file's own), in the order found: the
    first one's place and message are this error's (``file``, ``line``, ``key``, ...), ``errors`` holds them all,
    and it prints one per line, at most SHOWN, then how many more."""

    #: Most problems printed; the rest are counted.
    SHOWN = 20

    def __init__(self, errors: list[ScenarioError]):
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.message, file=first.file, line=first.line, key=first.key, hint=first.hint)

    def lines(self) -> list[str]:
        """One line per problem, at most SHOWN, then how many more."""
        out = [str(e) for e in self.errors[:self.SHOWN]]
        if len(self.errors) > self.SHOWN:
            out.append(f"... and {len(self.errors) - self.SHOWN} more problem(s) in {self.file}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())
