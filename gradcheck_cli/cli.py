"""Command line: a thin shell over the Python API. The only module that prints errors or picks exit codes.

Exit codes: 0 every check passed, 1 a check failed (or a negative control was missed), 2 bad input or usage.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import __version__, checker, report
from .errors import GradcheckError
from .ops import FAULTS, OPS
from .scenario import load

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
EPILOG = "Exit codes: 0 all checks passed, 1 a check failed, 2 bad input or usage."


def _console(stderr: bool = False) -> Console:
    """Rich console: styled on a terminal, plain text otherwise; NO_COLOR is honoured by rich."""
    file = sys.stderr if stderr else sys.stdout
    width = None if file.isatty() or os.environ.get("COLUMNS") else 200
    return Console(file=file, width=width, stderr=stderr, highlight=False)


def _fail(message: str) -> "click.exceptions.Exit":
    click.echo(f"error: {message}", err=True)
    return click.exceptions.Exit(EXIT_BAD_INPUT)


def _check_output_path(option: str, path: str | None, is_dir: bool = False) -> None:
    if path is None:
        return
    p = Path(path)
    parent = p if is_dir else p.parent
    if is_dir and p.exists() and not p.is_dir():
        raise _fail(f"{option} {path}: exists and is not a folder")
    if not is_dir and p.is_dir():
        raise _fail(f"{option} {path}: is a folder; give a file path")
    if not is_dir and not (parent if str(parent) else Path(".")).is_dir():
        raise _fail(f"{option} {path}: folder {parent} does not exist (create it first)")


#: Seconds a run must last before the progress bar appears (short runs print nothing extra).
PROGRESS_DELAY_S = 1.0


@contextlib.contextmanager
def _progress(enabled: bool, total: int, label: str):
    """Yields an ``advance(n)`` callback; once a run has lasted PROGRESS_DELAY_S, draws a bar with an
    ETA on stderr when stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                   console=_console(stderr=True), transient=True)
    task = bar.add_task(label, total=total)
    start = time.monotonic()

    def advance(n: int) -> None:
        bar.advance(task, n)
        if not bar.live.is_started and time.monotonic() - start > PROGRESS_DELAY_S:
            bar.start()

    try:
        yield advance
    finally:
        if bar.live.is_started:
            bar.stop()


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, prog_name="attn-gradcheck")
def main() -> None:
    """Prove hand-derived attention gradients right: analytic gradients against central finite
    differences, semantic invariants, and negative controls (faults that must be caught)."""


@main.command(epilog=EPILOG)
@click.argument("config", type=click.Path(path_type=str))
@click.option("--fault", "faults", multiple=True, type=click.Choice(tuple(FAULTS)),
              help="Inject a named fault into the op (repeatable); see 'attn-gradcheck faults'.")
@click.option("--break-softmax-term", is_flag=True, help="Same as --fault softmax-term.")
@click.option("--negative-controls", is_flag=True,
              help="Also run every fault on every scenario and print a fault x scenario table; "
                   "exit 1 if an applicable fault goes undetected.")
@click.option("--json", "json_path", type=click.Path(path_type=str), help="Write the JSON report here.")
@click.option("--junit", "junit_path", type=click.Path(path_type=str), help="Write a JUnit XML report here.")
@click.option("--save-arrays", "arrays_dir", type=click.Path(path_type=str),
              help="Write <scenario>.npz with inputs, output and gradients into this folder.")
@click.option("--memory-budget", type=click.IntRange(min=1), default=checker.DEFAULT_MEMORY_BUDGET // 2**20,
              show_default=True, help="MiB of perturbed copies evaluated in one vectorised call.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar with ETA on stderr (only when stderr is a terminal).")
def run(config, faults, break_softmax_term, negative_controls, json_path, junit_path, arrays_dir,
        memory_budget, progress):
    """Check every scenario of CONFIG (a YAML file)."""
    faults = tuple(dict.fromkeys(faults + (("softmax-term",) if break_softmax_term else ())))
    if faults and negative_controls:
        raise _fail("--negative-controls runs every fault itself; do not combine it with --fault")
    _check_output_path("--json", json_path)
    _check_output_path("--junit", junit_path)
    _check_output_path("--save-arrays", arrays_dir, is_dir=True)
    try:
        scenarios = load(config)
    except GradcheckError as exc:
        raise _fail(str(exc)) from None

    budget = memory_budget * 2**20
    total = sum(checker.work_units(sc) for sc in scenarios) * (1 + (len(FAULTS) if negative_controls else 0))
    with _progress(progress, total, "checking") as advance:
        results = [checker.run_scenario(sc, faults, memory_budget=budget, progress=advance) for sc in scenarios]
        cells = checker.negative_controls(scenarios, memory_budget=budget, progress=advance) if negative_controls else None

    out = _console()
    report.render_results(out, results, {sc.name: sc.describe() for sc in scenarios})
    for fault in faults:
        for sc in scenarios:
            if fault in OPS[sc.op].faults and checker.fault_effect(sc, fault) <= checker.APPLICABLE_FACTOR * sc.tolerance:
                out.print(f"note: fault {fault} has no effect on scenario {sc.name} (not applicable there)")
    if cells is not None:
        out.print()
        report.render_controls(out, cells)

    data = report.json_report(config, faults, results, cells)
    if json_path:
        report.write_json(json_path, data)
    if junit_path:
        report.write_junit(junit_path, report.junit_xml(results, cells))
    if arrays_dir:
        report.save_arrays(arrays_dir, results)
    raise click.exceptions.Exit(EXIT_OK if data["passed"] else EXIT_FAILED)


@main.command(epilog=EPILOG)
def faults():
    """List the named faults: what each breaks and which checks are expected to catch it."""
    out = _console()
    for op in OPS.values():
        for f in op.faults.values():
            out.print(f"{f.name}  (op {op.name}{', changes the forward' if f.forward else ''})",
                      style="bold" if out.is_terminal else None, markup=False)
            out.print(f"    breaks:    {f.breaks}", markup=False)
            out.print(f"    caught by: {'; '.join(f.caught_by)}", markup=False)


@main.command(epilog=EPILOG)
@click.argument("config", type=click.Path(path_type=str))
def validate(config):
    """Check CONFIG without running it: every key, shape and mask row."""
    try:
        scenarios = load(config)
    except GradcheckError as exc:
        raise _fail(str(exc)) from None
    out = _console()
    for sc in scenarios:
        out.print(f"{sc.name}: {sc.op} {sc.describe()}", highlight=False)
    out.print(f"{config}: {len(scenarios)} scenario(s) valid", highlight=False)
