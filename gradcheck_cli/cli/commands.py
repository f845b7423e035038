"""Command line: a thin shell over the Python API. The only module that prints errors or picks exit codes.

Exit codes: 0 every check passed, 1 a check failed (or a negative control was missed), 2 bad input or usage,
3 inconclusive (no failure, but some check could not decide), 130 interrupted.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time

from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import __version__, checker, files, report, runner
from .errors import GradcheckError, Terminated
from .ops import FAULTS, OPS
from .scenario import json_schema, load, read_files, select, with_engine

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 3, 130, 141
EXIT_TERMINATED = 143
EPILOG = ("Exit codes: 0 all checks passed, 1 a check failed, 2 bad input or usage, 3 inconclusive "
          "(no failure, but some check could not decide; each says why), 130 interrupted.")
EPILOG_INFO = "Exit codes: 0 ok, 2 bad input or usage."


class _Console(Console):
    """rich's Console, but a reader that goes away (``| head``) ends the run with 141 (128 + SIGPIPE),
    as a piped tool does, not with 1, which means "a check failed" here."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.file.fileno())
        raise SystemExit(EXIT_BROKEN_PIPE)


def _console(stderr: bool = False) -> Console:
    """Rich console: styled on a terminal; off a terminal plain text that never wraps, whatever COLUMNS
    says (CI logs, pipes). NO_COLOR is honoured by rich."""
    file = sys.stderr if stderr else sys.stdout
    tty = file.isatty()
    return _Console(file=file, stderr=stderr, highlight=False, markup=False, soft_wrap=not tty,
                    width=None if tty else 200)


def _error(message: str) -> None:
    """One line on stderr: control characters of a path or value are shown escaped."""
    text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in message)
    click.echo(f"error: {text}", err=True)


def _fail(message: str) -> "click.exceptions.Exit":
    """Print the one-line error and return the exit (2) to raise."""
    _error(message)
    return click.exceptions.Exit(EXIT_BAD_INPUT)


#: Seconds a run must last before the progress bar appears (short runs print nothing extra).
PROGRESS_DELAY_S = 1.0


class _ProgressBar:
    """An ETA bar on stderr, shown once a run has lasted PROGRESS_DELAY_S and only on a terminal.
    ``advance`` is the checker's progress callback; ``hidden()`` clears the bar while results print."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                            console=_console(stderr=True), transient=True,
                            redirect_stdout=False, redirect_stderr=False)
        self.task = self.bar.add_task(label, total=total)
        self.start = time.monotonic()
        self.lock = threading.RLock()  # --jobs advances from the pool's result thread
        self.paused = False

    def advance(self, n: int) -> None:
        with self.lock:
            self.bar.advance(self.task, n)
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, prog_name="attn-gradcheck")
def main() -> None:
    """Prove hand-derived attention gradients right: analytic gradients against central finite
    differences, semantic invariants, and negative controls (faults that must be caught)."""


class _Shard(click.ParamType):
    """I/N with 1 <= I <= N: this run takes shard I of N (``runner.shard``)."""
    name = "I/N"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        i, sep, n = str(value).partition("/")
        try:
            index, count = int(i), int(n)
        except ValueError:
            index = count = 0
        if not sep or not 1 <= index <= count:
            self.fail(f"{value!r} is not I/N with 1 <= I <= N (e.g. 2/4)", param, ctx)
        return index, count


@main.command(epilog=EPILOG, short_help="Check every scenario of a YAML file.")
@click.argument("config", type=click.Path(path_type=str))
@click.option("--fault", "faults", multiple=True, type=click.Choice(tuple(FAULTS)),
              help="Inject a named fault into the op (repeatable); see 'attn-gradcheck faults'.")
@click.option("--break-softmax-term", is_flag=True, help="Same as --fault softmax-term.")
@click.option("--select", "selects", multiple=True, metavar="GLOB",
              help="Run only scenarios whose name matches (repeatable; globs over whole names, e.g. '*gqa*').")
@click.option("--deselect", "deselects", multiple=True, metavar="GLOB", help="Skip scenarios whose name matches.")
@click.option("--negative-controls", is_flag=True,
              help="Also run every fault on every scenario and print a scenario x fault table; "
                   "exit 1 if an applicable fault goes undetected.")
@click.option("--engine", type=click.Choice(("naive", "tiled")), default=None,
              help="Run op attention's built-in scenarios on this engine (overrides 'engine:'); tiled is the "
                   "FlashAttention-style engine (online softmax, log-sum-exp, no n_q x n_k arrays).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes; scenarios are spread over them, results print in file order and are "
                   "identical to --jobs 1.")
@click.option("--shard", type=_Shard(), default=None,
              help="Run only shard I of N (1-based; every N-th selected scenario from the I-th), for CI "
                   "matrices; combine the JSON reports with 'attn-gradcheck merge'.")
@click.option("--json", "json_path", type=click.Path(path_type=str),
              help="Write the JSON report here (folders are created; written atomically).")
@click.option("--junit", "junit_path", type=click.Path(path_type=str), help="Write a JUnit XML report here.")
@click.option("--save-arrays", "arrays_dir", type=click.Path(path_type=str),
              help="Write <scenario>.npz with inputs, output and gradients into this folder (created if missing).")
@click.option("--memory-budget", type=click.IntRange(min=1), default=checker.DEFAULT_MEMORY_BUDGET // 2**20,
              show_default=True, help="MiB of perturbed copies evaluated in one vectorised call (per job).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar with ETA on stderr (only when stderr is a terminal).")
def run(config, faults, break_softmax_term, selects, deselects, negative_controls, engine, jobs, shard, json_path,
        junit_path, arrays_dir, memory_budget, progress):
    """Check every scenario of CONFIG (a YAML file; format in the README, 'Scenario files').

    Prints a table per scenario as it finishes. Exit 0: every check passed; 1: a check failed, or
    with --negative-controls an applicable fault went undetected; 2: bad input or usage (nothing runs);
    3: no failure, but some check could not decide (finite differences too inaccurate, no power, code that
    computes in a lower precision than its dtype, or with --negative-controls a scenario no fault applies
    to); 130: interrupted (the reports
    hold the scenarios that finished and say "interrupted": true).
    """
    faults = tuple(dict.fromkeys(faults + (("softmax-term",) if break_softmax_term else ())))
    if faults and negative_controls:
        raise _fail("--negative-controls runs every fault itself; do not combine it with --fault")
    try:
        scenarios = with_engine(select(load(config), selects, deselects), engine)
        shard_info = None
        if shard:
            shard_info = {"index": shard[0], "count": shard[1], "of": len(scenarios), "select": list(selects),
                          "deselect": list(deselects)}
            scenarios = runner.shard(scenarios, *shard)
        report.prepare_outputs({"--json": json_path, "--junit": junit_path}, {"--save-arrays": arrays_dir},
                               {"--save-arrays": [f"{sc.name}.npz" for sc in scenarios]},
                               inputs=[config, *read_files(scenarios)])
    except GradcheckError as exc:
        raise _fail(str(exc)) from None

    out = _console()
    if shard and not scenarios:
        out.print(f"shard {shard[0]}/{shard[1]} of {config}: no scenario falls in this shard")
    bar = _ProgressBar(progress, sum(runner.units(sc, negative_controls) for sc in scenarios), "checking")
    results, cells, interrupted, stop_code = [], [] if negative_controls else None, False, EXIT_INTERRUPTED
    try:
        for outcome in runner.run(config, scenarios, faults, controls=negative_controls, jobs=jobs,
                                  memory_budget=memory_budget * 2**20, progress=bar.advance):
            result = outcome.result
            results.append(result)
            if cells is not None:
                cells.extend(outcome.cells)
            sc = scenarios[len(results) - 1]
            with bar.hidden():
                report.render_scenario(out, result, sc.describe(),
                                       report.reproduce_command(config, sc.name, faults, engine))
                for fault in faults:
                    if fault not in OPS[sc.op].faults:
                        owners = ", ".join(op.name for op in OPS.values() if fault in op.faults)
                        out.print(f"  note: fault {fault} is a fault of op {owners}, not of op {sc.op}: not injected "
                                  "here (see 'attn-gradcheck faults')\n")
                        continue
                    if fault not in checker.applicable_faults(sc):
                        kind = "your implementation" if sc.implementation else "the built-in engine"
                        out.print(f"  note: fault {fault} does not apply to {kind} (see 'attn-gradcheck faults')\n")
                    elif fault not in result.faults or (not OPS[sc.op].faults[fault].sized
                                                         and not checker.fault_applies(sc, fault)):
                        out.print(f"  note: fault {fault} has no effect on this scenario (not applicable)\n")
    except KeyboardInterrupt as exc:
        interrupted = True
        stop_code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    except MemoryError:
        bar.close()
        name = scenarios[len(results)].name if len(results) < len(scenarios) else "negative controls"
        raise _fail(f"{config}: scenario '{name}' ran out of memory; lower --memory-budget "
                    f"(now {memory_budget} MiB) or the scenario's shapes; no report written") from None
    except GradcheckError as exc:  # a worker could not load the file (changed while running)
        bar.close()
        raise _fail(str(exc)) from None
    except Exception as exc:  # Ctrl-C inside a lazy import or a pool comes wrapped: still a Ctrl-C
        from .console import _caused_by_interrupt
        if not _caused_by_interrupt(exc):
            raise
        interrupted = True
    bar.close()

    report.render_summary(out, results, len(scenarios) if interrupted else None)
    if cells:
        out.print()
        report.render_controls(out, cells)
    data = report.json_report(config, faults, results, cells, shard=shard_info, interrupted=interrupted, engine=engine)
    try:
        report.write_reports(json_path, data, junit_path,
                             report.junit_xml(data) if junit_path else None, arrays_dir, results)
    except OSError as exc:
        raise _fail(f"cannot write the reports: {_unwritten(exc)}") from None
    except KeyboardInterrupt as exc:  # a second Ctrl-C while writing: nothing half-written stays behind
        written = getattr(exc, "written", [])
        pending = getattr(exc, "pending", None)
        click.echo("interrupted while writing the reports; " + (
            f"written: {', '.join(written) or 'none'}; not written (the old files, if any, are as they were): "
            f"{', '.join(pending)}" if pending is not None else "none written"), err=True)
        terminated = isinstance(exc, Terminated) or getattr(exc, "terminated", False)
        raise click.exceptions.Exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED) from None
    if interrupted:
        written = [p for p in (json_path, junit_path) if p] + ([f"{arrays_dir}/"] if arrays_dir else [])
        click.echo(f"{'terminated' if stop_code == EXIT_TERMINATED else 'interrupted'} after {len(results)} of "
                   f"{len(scenarios)} scenario(s)"
                   + (f"; partial report(s) written: {', '.join(written)}" if written else ""), err=True)
        raise click.exceptions.Exit(stop_code)
    codes = {"pass": EXIT_OK, "fail": EXIT_FAILED, "inconclusive": EXIT_INCONCLUSIVE}
    raise click.exceptions.Exit(codes[data["verdict"]])


@main.command(epilog=EPILOG, short_help="Combine JSON reports (e.g. the shards of a CI matrix) into one verdict.")
@click.argument("reports", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--json", "json_path", type=click.Path(path_type=str),
              help="Write the merged JSON report here (written atomically).")
@click.option("--junit", "junit_path", type=click.Path(path_type=str), help="Write a JUnit XML report of the merge here.")
def merge(reports, json_path, junit_path):
    """Combine the JSON REPORTS of several runs into one report and one verdict.

    Scenarios keep their file order; counts, verdict and negative controls are recomputed. Refused
    (exit 2): a file that is not an attn-gradcheck JSON report, a report of an interrupted run, shards
    of one config that are missing or given twice, a scenario present in two reports. The exit code is
    the merged verdict's, as for 'run'.
    """
    loaded = []
    for path in reports:
        try:
            text = files.read_regular(path, files.MAX_REPORT_BYTES).decode("utf-8")
        except files.FileProblem as exc:
            raise _fail(f"{path}: {exc}") from None
        except UnicodeDecodeError:
            raise _fail(f"{path}: not UTF-8 text, so not a JSON report") from None
        try:
            data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
            json.dumps(data, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape is no text
            loaded.append((path, data))
        except UnicodeEncodeError:
            raise _fail(f"{path}: not an attn-gradcheck JSON report (it holds a lone surrogate escape such as "
                        "\\ud800, which is not text)") from None
        except json.JSONDecodeError as exc:
            raise _fail(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # NaN, nesting or integers beyond what a report holds
            raise _fail(f"{path}: not an attn-gradcheck JSON report ({str(exc)[:120] or type(exc).__name__})") from None
    try:
        report.prepare_outputs({"--json": json_path, "--junit": junit_path}, {}, inputs=list(reports))
        data = report.merge_reports(loaded)
    except GradcheckError as exc:
        raise _fail(str(exc)) from None
    report.render_merged(_console(), data)
    try:
        report.write_reports(json_path, data, junit_path, report.junit_xml(data) if junit_path else None)
    except OSError as exc:
        raise _fail(f"cannot write the report: {_unwritten(exc)}") from None
    codes = {"pass": EXIT_OK, "fail": EXIT_FAILED, "inconclusive": EXIT_INCONCLUSIVE}
    raise click.exceptions.Exit(codes[data["verdict"]])


def _unwritten(exc: OSError) -> str:
    """What a failed write left: a failure while staging leaves every file as it was."""
    from .errors import ReportsFailed
    return str(exc) if isinstance(exc, ReportsFailed) else f"{exc}; none written (every file is as it was)"


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"it holds the number {text[:40]}, beyond float64 (a report holds finite numbers or null)")
    return value


def _no_constant(name: str):
    raise ValueError(f"it holds {name}, which a report never does (non-finite numbers are written as null)")


@main.command("sweep-eps", epilog=EPILOG_INFO, short_help="Error against the finite-difference step (the V curve).")
@click.argument("config", type=click.Path(path_type=str))
@click.option("--select", "selects", multiple=True, metavar="GLOB", help="Only scenarios whose name matches.")
@click.option("--deselect", "deselects", multiple=True, metavar="GLOB", help="Skip scenarios whose name matches.")
@click.option("--samples", type=click.IntRange(min=1), default=32, show_default=True,
              help="Elements per input differenced at every step.")
@click.option("--steps", "step_range", default="1e-1:1e-12", show_default=True, metavar="HI:LO[:N]",
              help="Steps from HI down to LO, N per decade (default 1).")
@click.option("--plot", "plot_path", type=click.Path(path_type=str),
              help="Also draw the curves, log-log, into this .png/.pdf/.svg (needs matplotlib: "
                   "pip install 'attn-gradcheck[plot]').")
@click.option("--json", "json_path", type=click.Path(path_type=str), help="Write the sweep as JSON here.")
def sweep_eps(config, selects, deselects, samples, step_range, plot_path, json_path):
    """Sweep the finite-difference step for every scenario of CONFIG: the relative error of the sampled
    elements at each step, as a table per scenario. The curve is V-shaped: truncation error (~h^2) on
    the large-step side, rounding (~eps/h) on the small one. The step the run uses is marked '<- run',
    the best one '*'. An implementation runs in a process of its own (as in 'run'); one that raises,
    ends that process or outlives check.timeout is named and not swept. Exit 0; 1 when an
    implementation failed so; 2 on bad input."""
    from . import stepsweep
    try:
        steps = _parse_steps(step_range)
        scenarios = [sc for sc in select(load(config), selects, deselects) if OPS[sc.op].tensors]
        if not scenarios:
            raise GradcheckError(f"{config}: no selected scenario has gradients to sweep")
        report.prepare_outputs({"--json": json_path, "--plot": plot_path}, {}, inputs=[config])
        if plot_path:
            _require_matplotlib()
            if Path(plot_path).suffix.lower() not in (".png", ".pdf", ".svg"):
                raise GradcheckError(f"--plot {plot_path}: name a .png, .pdf or .svg file")
    except GradcheckError as exc:
        raise _fail(str(exc)) from None
    from .runner import sweep_isolated
    out, sweeps, failed = _console(), [], False
    for sc in scenarios:
        try:  # an implementation runs in a process of its own, as in 'run'
            result = sweep_isolated(config, sc, steps, samples) if sc.implementation else stepsweep.sweep(sc, steps, samples)
        except GradcheckError as exc:
            raise _fail(str(exc)) from None
        if isinstance(result, str):
            _error(f"{sc.file}: scenario '{sc.name}': not swept: {result}")
            failed = True
            continue
        sweeps.append(result)
        report.render_sweep(out, result, sc.describe())
    try:
        with report.StagedWrites() as stage:
            if json_path:
                data = (json.dumps({"tool": "attn-gradcheck", "config": config, "samples": samples,
                                    "sweeps": [s.to_json() for s in sweeps]}, indent=2) + "\n").encode()
                stage.add(json_path, lambda fh: fh.write(data))
            if plot_path:
                stage.add(plot_path, lambda fh: report.plot_sweeps(sweeps, fh, Path(plot_path).suffix[1:].lower()))
    except OSError as exc:
        raise _fail(f"cannot write the outputs: {_unwritten(exc)}") from None
    if failed:
        raise click.exceptions.Exit(EXIT_FAILED)


def _parse_steps(text: str) -> tuple[float, ...]:
    """HI:LO[:N] -> steps from HI down to LO (both included), N per decade."""
    bad = GradcheckError(f"--steps {text!r}: expected HI:LO[:N] with 0 < LO < HI <= 1 and N an integer from 1 "
                         "to 20 per decade, e.g. 1e-1:1e-12")
    parts = text.split(":")
    try:
        hi, lo = float(parts[0]), float(parts[1])
        per = float(parts[2]) if len(parts) > 2 else 1.0
    except (ValueError, IndexError):
        raise bad from None
    if len(parts) > 3 or not (0 < lo < hi <= 1) or not per.is_integer() or not 1 <= per <= 20:
        raise bad
    count = max(2, int(np.ceil(np.log10(hi / lo) * per - 1e-9)) + 1)
    if count > 200:
        raise GradcheckError(f"--steps {text!r}: {count} steps; at most 200")
    return tuple(float(x) for x in np.geomspace(hi, lo, count))


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GradcheckError("--plot needs matplotlib, which is not installed: pip install 'attn-gradcheck[plot]'") \
            from None


@main.command(epilog=EPILOG_INFO, short_help="List the named faults and the checks that catch them.")
def faults():
    """List the named faults: what each breaks and which checks are expected to catch it."""
    out = _console()
    for name, f in FAULTS.items():
        ops = [op.name for op in OPS.values() if name in op.faults]
        out.print(f"{f.name}  (op {ops[0]}{', changes the forward' if f.forward else ''})",
                  style="bold" if out.is_terminal else None)
        out.print(f"    breaks:    {f.breaks}")
        out.print(f"    caught by: {'; '.join(f.caught_by)}")
        out.print("    on your implementation: " + (f.user if f.user else "does not apply (built-in engines only)")
                  + ("" if f.engine else "; not a fault of the built-in engines"))
        if len(ops) > 1:
            out.print(f"    also in:   {', '.join(ops[1:])} (same name, same bug)")


@main.command(epilog=EPILOG_INFO, short_help="Print the JSON Schema of the scenario format (or of the report).")
@click.option("--report", "of_report", is_flag=True,
              help="The schema of the --json report instead (shipped as schema/report.schema.json).")
def schema(of_report):
    """Print the JSON Schema of scenario files (shipped as schema/scenario.schema.json for editors), or
    with --report that of the JSON report (what 'merge' checks its inputs against)."""
    from .report_schema import report_schema
    click.echo(json.dumps(report_schema() if of_report else json_schema(), indent=2))


@main.command(epilog=EPILOG_INFO, short_help="Check scenario files without running them.")
@click.argument("configs", nargs=-1, required=True, type=click.Path(path_type=str))
def validate(configs):
    """Check each CONFIG without running it: every key, shape and mask row (all files are read; the
    exit code is 2 if any is wrong)."""
    out, bad = _console(), False
    for config in configs:
        try:
            scenarios = load(config)
        except GradcheckError as exc:
            _error(str(exc))
            bad = True
            continue
        for sc in scenarios:
            out.print(f"{sc.name}: {sc.op} {sc.describe()}", highlight=False)
        out.print(f"{config}: {len(scenarios)} scenario(s) valid", highlight=False)
    if bad:
        raise click.exceptions.Exit(EXIT_BAD_INPUT)
