"""The exit codes of ``attn-gradcheck``, in one table: the CLI, the console script and the Python API
(:class:`gradcheck_cli.api.RunOutcome`) use these names, and the ``--help`` epilogs are written from it."""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0             # every check passed
    FAILED = 1         # a check failed, or with --negative-controls an applicable fault went undetected
    BAD_INPUT = 2      # bad input or usage (nothing runs), or a report that could not be written
    INCONCLUSIVE = 3   # no failure, but some check could not decide
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
    BROKEN_PIPE = 141  # the reader of the output went away, ``| head`` (128 + SIGPIPE)
    TERMINATED = 143   # SIGTERM (128 + SIGTERM)

    @classmethod
    def of_verdict(cls, verdict: str) -> ExitCode:
        """The exit code of a report's verdict ("pass", "fail" or "inconclusive")."""
        return {"pass": cls.OK, "fail": cls.FAILED, "inconclusive": cls.INCONCLUSIVE}[verdict]


#: What each code means, in the words of the ``--help`` epilogs.
MEANING = {
    ExitCode.OK: "all checks passed",
    ExitCode.FAILED: "a check failed",
    ExitCode.BAD_INPUT: "bad input or usage",
    ExitCode.INCONCLUSIVE: "inconclusive (no failure, but some check could not decide; each says why)",
    ExitCode.INTERRUPTED: "interrupted",
    ExitCode.BROKEN_PIPE: "the reader of the output went away",
    ExitCode.TERMINATED: "terminated",
}


def epilog(*codes: ExitCode, **words: str) -> str:
    """The ``--help`` epilog listing ``codes``; ``words`` (by name, e.g. ``OK="ok"``) replace a meaning."""
    return "Exit codes: " + ", ".join(f"{int(c)} {words.get(c.name, MEANING[c])}" for c in codes) + "."


#: The epilog of the commands that check ('run', 'merge'), and of the other commands.
EPILOG = epilog(ExitCode.OK, ExitCode.FAILED, ExitCode.BAD_INPUT, ExitCode.INCONCLUSIVE, ExitCode.INTERRUPTED)
EPILOG_INFO = epilog(ExitCode.OK, ExitCode.BAD_INPUT, OK="ok")
