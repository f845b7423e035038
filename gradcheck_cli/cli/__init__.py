"""Command line: a thin shell over the Python API (``gradcheck_cli.api``). The only package that prints
errors or exits; the exit codes are ``gradcheck_cli.exitcodes.ExitCode``.

``commands`` (the click group ``main`` and its commands; ``hunt`` adds its own) uses ``params``
(parameter types and value checks) and ``ui`` (console, error lines, progress bar); no other module
imports this package but ``gradcheck_cli.console``.
"""
from . import hunt  # noqa: F401  (registers 'attn-gradcheck hunt')
from .commands import main

__all__ = ["main"]
