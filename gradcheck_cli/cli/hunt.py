"""``attn-gradcheck hunt``: parse the options, call ``gradcheck_cli.hunt``, show the progress and the result."""
from __future__ import annotations

import contextlib
import sys
import time

import click

from .. import checker, hunt, report
from ..errors import GradcheckError
from ..exitcodes import ExitCode, epilog
from ..text import visible
from .commands import _stopped_writing, main
from .ui import _console, _fail, _unwritten

#: The hunt's exit codes, in its words.
HUNT_EPILOG = epilog(ExitCode.OK, ExitCode.FAILED, ExitCode.BAD_INPUT, ExitCode.INCONCLUSIVE, ExitCode.INTERRUPTED,
                     OK="no failure found", FAILED="a failure found, shrunk and written",
                     INCONCLUSIVE="only inconclusive scenarios (or none checked)")


@main.command("hunt", epilog=HUNT_EPILOG, short_help="Search the scenario space around one scenario for a failure, "
                                                "and shrink it.")
@click.argument("config", type=click.Path(path_type=str))
@click.option("--select", "select", required=True, metavar="NAME",
              help="The scenario to start from (its whole name, or a glob that matches it alone).")
@click.option("--budget", "budget_s", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              metavar="SECONDS", help="Seconds to search for a failure (shrinking one has --shrink-budget more).")
@click.option("--examples", type=click.IntRange(min=1), default=None, metavar="N",
              help="Check at most N scenarios (within --budget).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the search (the same seed draws the same scenarios).")
@click.option("--out", type=click.Path(path_type=str), default=None,
              help="Write the smallest failing scenario here [default: hunt-<name>.yaml beside CONFIG].")
@click.option("--space", "space", multiple=True, metavar="KEY=RANGE",
              help="Narrow or widen one axis (repeatable): n_k=1..300, d_head=16,64,128,160, dtype=float32, "
                   "mask.causal=none,lower-right; 'none' leaves a key out. The axes: docs/hunt.md.")
@click.option("--max-elements", type=click.IntRange(min=1), default=hunt.DEFAULT_MAX_ELEMENTS, show_default=True,
              help="Skip drawn scenarios whose inputs have more elements than this (the time each check takes).")
@click.option("--shrink-budget", "shrink_s", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, metavar="SECONDS", help="Seconds to shrink a failure once one is found.")
@click.option("--json", "json_path", type=click.Path(path_type=str),
              help="Write the JSON record of the search here (written atomically).")
@click.option("--database", type=click.Path(path_type=str), default=hunt.DEFAULT_DATABASE, show_default=True,
              help="Folder of hypothesis's example database: a rerun of the same hunt starts from its last failure.")
@click.option("--no-database", is_flag=True, help="Keep no database (every run starts afresh).")
@click.option("--memory-budget", type=click.IntRange(min=1), default=checker.DEFAULT_MEMORY_BUDGET // 2**20,
              show_default=True, help="MiB of perturbed copies evaluated in one vectorised call.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Scenarios tried and the smallest failure so far, on stderr (only when it is a terminal).")
def hunt_command(config, select, budget_s, examples, seed, out, space, max_elements, shrink_s, json_path, database,
                 no_database, memory_budget, progress):
    """Hunt for the scenarios where an implementation breaks: start from scenario NAME of CONFIG, draw
    scenarios across the space its op declares (sizes with block edges and primes, n_q != n_k, GQA ratios,
    every mask kind, padding, windows, scales, float64 and float32, the values of its variants), check each as
    'run' does, and shrink the first failure to the smallest scenario that fails the same check for the same
    cause. That scenario is written as a scenario file with the command that reproduces it.

    Exit 1: a failure was found (its checks and hints are shown); 0: none within the budget (the scenarios
    tried and the ranges they covered are shown); 3: only inconclusive scenarios; 2: bad input; 130: interrupted
    (the smallest failure so far is still written).
    """
    options = hunt.HuntOptions(config, select, budget_s=budget_s, examples=examples, seed=seed, out=out,
                               space=space, max_elements=max_elements, shrink_s=shrink_s, json_path=json_path,
                               database=None if no_database else database, memory_budget_mib=memory_budget)
    try:
        plan = hunt.prepare(options)
    except GradcheckError as exc:
        raise _fail(exc) from None
    out_console = _console()
    sc = plan.start.scenario
    out_console.print(f"hunting around {visible(sc.name)} ({visible(sc.describe())}) for "
                      + (f"{examples} scenario(s) or " if examples else "") + f"{budget_s:g} s, seed {seed}")
    try:
        with _Status(progress) as status:
            outcome = hunt.execute(plan, status.update)
    except GradcheckError as exc:
        raise _fail(exc) from None
    _render(out_console, outcome)
    try:
        hunt.write(outcome)
    except OSError as exc:
        raise _fail(f"cannot write the results: {_unwritten(exc)}") from None
    except KeyboardInterrupt as exc:
        raise _stopped_writing(exc, "results") from None
    if outcome.written:
        out_console.print(f"written: {visible(outcome.written)}")
    raise click.exceptions.Exit(outcome.exit_code)


def _render(console, outcome: hunt.HuntOutcome) -> None:
    found, plan = outcome.hunt, outcome.plan
    if found.start_failed:
        console.print(f"note: the starting scenario {visible(plan.start.scenario.name)} fails itself ('attn-gradcheck "
                      "run' shows why); the hunt shrinks the first failure it draws")
    console.print(f"{found.tried} scenario(s) checked in {found.search_s + found.shrink_s:.1f} s"
                  + (f" ({found.skipped} drawn but skipped: refused by the loader or over --max-elements)"
                     if found.skipped else "") + ("; interrupted" if found.interrupted else ""))
    if found.smallest is not None:
        first, smallest = found.first, found.smallest
        console.print(f"FAILED first at {first.elements} input elements after {found.tried_to_first} scenario(s) in "
                      f"{found.search_s:.1f} s ({visible(first.scenario.describe())}); shrunk to {smallest.elements} "
                      f"in {found.shrink_s:.1f} s" + (" (its time limit reached)" if found.stopped == "shrink time"
                                                      else "") + ":")
        console.print(f"  its keys: {visible(hunt.record.keys_text(smallest))}")
        report.render_scenario(console, smallest.result, smallest.scenario.describe(), hunt.record.reproduce(plan))
        extra = [h for h in first.result.hints if h not in smallest.result.hints]
        if extra and first is not smallest:
            console.print(f"  the first failure ({first.elements} input elements) had these hints too, which its "
                          "larger shapes allow:")
            for h in extra:
                console.print(f"  hint: {visible(h)}")
        return
    covered = outcome.record["covered"]
    if covered:
        console.print("covered:")
    for key, span in covered.items():
        drawn = [v for v in span.get("values", ()) if v.startswith("[")]
        text = (f"{span['min']}..{span['max']} ({span['distinct']} distinct)" if "min" in span
                else ", ".join([v for v in span["values"] if not v.startswith("[")]
                               + ([f"{len(drawn)} drawn lists"] if drawn else [])))
        console.print(f"  {key}: {visible(text)}")
    for key, why in plan.space.fixed:
        console.print(f"  {key}: kept ({why})")
    for value, why in found.left_out.items():
        console.print(f"  {visible(value)}: left out ({visible(why)})")
    if found.first_inconclusive is not None:
        f = found.first_inconclusive
        console.print(f"{found.inconclusive} scenario(s) INCONCLUSIVE, none failed; the smallest:")
        report.render_scenario(console, f.result, f.scenario.describe())
        if found.inconclusive_float32 == found.inconclusive:
            console.print("every inconclusive scenario was float32, whose finite differences cannot decide every "
                          "scenario; --space dtype=float64 hunts in float64 only")
    elif not found.tried:
        console.print("no scenario was checked within the budget: nothing is decided (INCONCLUSIVE)")
    else:
        console.print("no failure found" + (f" ({found.other_failures} other failure(s))" if found.other_failures
                                             else ""))


class _Status:
    """One line on stderr (a terminal only) with the scenarios tried and the smallest failure so far."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()
        self.status = None
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> _Status:
        if self.enabled:
            self.status = self.stack.enter_context(_console(stderr=True).status("hunting"))
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    def update(self, found: hunt.Hunt) -> None:
        if self.status is None:
            return
        text = f"hunting: {found.tried} scenario(s) checked, {time.monotonic() - self.started:.0f} s"
        if found.smallest is not None:
            text += f"; shrinking: smallest failure so far {found.smallest.elements} input elements"
        self.status.update(text)


__all__ = ["HUNT_EPILOG", "hunt_command"]
