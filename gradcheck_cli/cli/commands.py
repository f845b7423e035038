"""The click group and its commands: each parses its options, calls the Python API (``api``, ``report``,
``scenario``), renders what it returns, and maps errors to one-line messages and exit codes (``ExitCode``).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from .. import __version__, api, checker, report, stepsweep
from ..errors import GradcheckError, caused_by_sigterm
from ..exitcodes import EPILOG, EPILOG_INFO, ExitCode
from ..ops import FAULTS, OPS
from ..scenario import ENGINES, json_schema, load, select
from ..text import visible
from .params import FAULT_CHOICE, _parse_steps, _require_matplotlib, _Shard
from .ui import _console, _error, _fail, _ProgressBar, _unwritten


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.version_option(__version__, prog_name="attn-gradcheck")
def main() -> None:
    """Prove hand-derived attention gradients right: analytic gradients against central finite
    differences, semantic invariants, and negative controls (faults that must be caught)."""


@main.command(epilog=EPILOG, short_help="Check every scenario of a YAML file.")
@click.argument("config", type=click.Path(path_type=str))
@click.option("--fault", "faults", multiple=True, type=FAULT_CHOICE,
              help="Inject a named fault into the op (repeatable); see 'attn-gradcheck faults'.")
@click.option("--break-softmax-term", is_flag=True, help="Same as --fault softmax-term.")
@click.option("--select", "selects", multiple=True, metavar="GLOB",
              help="Run only scenarios whose name matches (repeatable; globs over whole names, e.g. '*gqa*').")
@click.option("--deselect", "deselects", multiple=True, metavar="GLOB",
              help="Skip scenarios whose name matches (one left out needs no torch or JAX installed).")
@click.option("--negative-controls", is_flag=True,
              help="Also run every fault on every scenario and print a scenario x fault table; "
                   "exit 1 if an applicable fault goes undetected.")
@click.option("--engine", type=click.Choice(ENGINES), default=None,
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
@click.option("--html", "html_path", type=click.Path(path_type=str),
              help="Write a self-contained HTML report here (tables, heat maps of where errors are, the controls).")
@click.option("--save-arrays", "arrays_dir", type=click.Path(path_type=str),
              help="Write <scenario>.npz with inputs, output and gradients into this folder (created if missing).")
@click.option("--memory-budget", type=click.IntRange(min=1), default=checker.DEFAULT_MEMORY_BUDGET // 2**20,
              show_default=True, help="MiB of perturbed copies evaluated in one vectorised call (per job).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar with ETA on stderr (only when stderr is a terminal).")
def run(config, faults, break_softmax_term, selects, deselects, negative_controls, engine, jobs, shard, json_path,
        junit_path, html_path, arrays_dir, memory_budget, progress):
    """Check every scenario of CONFIG (a YAML file; format in docs/scenarios.md, 'Scenario files').

    Prints a table per scenario as it finishes. Exit 0: every check passed; 1: a check failed, or
    with --negative-controls an applicable fault went undetected; 2: bad input or usage (nothing runs);
    3: no failure, but some check could not decide (finite differences too inaccurate, no power, code that
    computes in a lower precision than its dtype, or with --negative-controls a scenario no fault applies
    to); 130: interrupted (the reports
    hold the scenarios that finished and say "interrupted": true).
    """
    faults = tuple(dict.fromkeys(faults + (("softmax-term",) if break_softmax_term else ())))
    options = api.RunOptions(config, faults, selects=selects, deselects=deselects, negative_controls=negative_controls,
                             engine=engine, jobs=jobs, shard=shard, json_path=json_path, junit_path=junit_path,
                             html_path=html_path, arrays_dir=arrays_dir, memory_budget_mib=memory_budget)
    try:
        plan = api.prepare(options)
    except GradcheckError as exc:
        raise _fail(exc) from None

    out, scenarios = _console(), plan.scenarios
    if shard and not scenarios:
        out.print(f"shard {shard[0]}/{shard[1]} of {visible(config)}: no scenario falls in this shard")
    bar = _ProgressBar(progress, plan.units, "checking")
    finished = [0]
    bar.running(scenarios[0].name if scenarios else None)

    def show(sc, result):
        finished[0] += 1
        bar.running(scenarios[finished[0]].name if finished[0] < len(scenarios) else None)
        with bar.hidden():
            report.render_scenario(out, result, sc.describe(),
                                   report.reproduce_command(config, sc.name, faults, engine))
            for note in api.fault_notes(sc, result, faults):
                out.print(note)

    try:
        outcome = api.execute(plan, bar.advance, show)
    except api.OutOfMemory as exc:
        bar.close()
        raise _fail(f"{exc}; lower --memory-budget (now {memory_budget} MiB) or the scenario's shapes; "
                    "no report written") from None
    except GradcheckError as exc:  # a worker could not load the file (changed while running)
        bar.close()
        raise _fail(exc) from None
    bar.close()

    results, interrupted = outcome.results, outcome.interrupted
    report.render_summary(out, results, len(scenarios) if interrupted else None)
    if outcome.cells:
        out.print()
        report.render_controls(out, outcome.cells)
    try:
        api.write_reports(outcome)
    except OSError as exc:
        raise _fail(f"cannot write the reports: {_unwritten(exc)}") from None
    except KeyboardInterrupt as exc:  # a second Ctrl-C while writing: nothing half-written stays behind
        raise _stopped_writing(exc, "reports") from None
    if interrupted:
        written = [p for p in (json_path, junit_path, html_path) if p] + ([f"{arrays_dir}/"] if arrays_dir else [])
        click.echo(f"{'terminated' if outcome.exit_code == ExitCode.TERMINATED else 'interrupted'} after "
                   f"{len(results)} of {len(scenarios)} scenario(s)"
                   + (f"; partial report(s) written: {visible(', '.join(written))}" if written else ""), err=True)
    raise click.exceptions.Exit(outcome.exit_code)


def _stopped_writing(exc: KeyboardInterrupt, what: str) -> click.exceptions.Exit:
    """Say what a Ctrl-C or SIGTERM while the outputs were put in place left (nothing half-written stays
    behind), and the exit that follows: 130, or 143 for SIGTERM."""
    written = getattr(exc, "written", [])
    pending = getattr(exc, "pending", None)
    terminated = caused_by_sigterm(exc)
    click.echo(f"{'terminated' if terminated else 'interrupted'} while writing the {what}; " + (
        f"written: {visible(', '.join(written)) or 'none'}; not written (the old files, if any, are as they were): "
        f"{visible(', '.join(pending))}" if pending is not None else "none written"), err=True)
    return click.exceptions.Exit(ExitCode.TERMINATED if terminated else ExitCode.INTERRUPTED)


@main.command(epilog=EPILOG, short_help="Combine JSON reports (e.g. the shards of a CI matrix) into one verdict.")
@click.argument("reports", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--json", "json_path", type=click.Path(path_type=str),
              help="Write the merged JSON report here (written atomically).")
@click.option("--junit", "junit_path", type=click.Path(path_type=str),
              help="Write a JUnit XML report of the merge here.")
@click.option("--html", "html_path", type=click.Path(path_type=str),
              help="Write a self-contained HTML report of the merge here.")
def merge(reports, json_path, junit_path, html_path):
    """Combine the JSON REPORTS of several runs into one report and one verdict.

    Scenarios keep their file order; counts, verdict and negative controls are recomputed. Refused
    (exit 2): a file that is not an attn-gradcheck JSON report (a key given twice in one object, nesting
    deeper than a report's included), a report of an interrupted run, shards of one config that are
    missing or given twice, a scenario present in two reports. The exit code is the merged verdict's, as
    for 'run'; 130 on Ctrl-C, 143 on SIGTERM.
    """
    try:
        loaded = [(path, report.read_report(path)) for path in reports]
    except GradcheckError as exc:
        raise _fail(exc) from None
    try:
        report.prepare_outputs({"--json": json_path, "--junit": junit_path, "--html": html_path}, {},
                               inputs=list(reports))
        data = report.merge_reports(loaded)
    except GradcheckError as exc:
        raise _fail(exc) from None
    report.render_merged(_console(), data)
    try:
        report.write_reports(json_path, data, junit_path, report.junit_xml(data) if junit_path else None,
                             html_path=html_path)
    except OSError as exc:
        raise _fail(f"cannot write the report: {_unwritten(exc)}") from None
    except KeyboardInterrupt as exc:
        raise _stopped_writing(exc, "reports") from None
    raise click.exceptions.Exit(ExitCode.of_verdict(data["verdict"]))


@main.command("sweep-eps", epilog=EPILOG_INFO, short_help="Error against the finite-difference step (the V curve).")
@click.argument("config", type=click.Path(path_type=str))
@click.option("--select", "selects", multiple=True, metavar="GLOB", help="Only scenarios whose name matches.")
@click.option("--deselect", "deselects", multiple=True, metavar="GLOB", help="Skip scenarios whose name matches.")
@click.option("--samples", type=click.IntRange(min=1), default=stepsweep.DEFAULT_SAMPLES, show_default=True,
              help="Elements per input differenced at every step.")
@click.option("--steps", "step_range", default="1e-1:1e-12", show_default=True, metavar="HI:LO[:N]",
              help="Steps from HI down to LO, N per decade (default 1).")
@click.option("--plot", "plot_path", type=click.Path(path_type=str),
              help="Also draw the curves, log-log, into this .png/.pdf/.svg (needs matplotlib: "
                   "pip install 'attn-gradcheck[plot]').")
@click.option("--json", "json_path", type=click.Path(path_type=str), help="Write the sweep as JSON here.")
@click.option("--html", "html_path", type=click.Path(path_type=str),
              help="Write the sweep as a self-contained HTML page here (a V curve and a table per scenario).")
def sweep_eps(config, selects, deselects, samples, step_range, plot_path, json_path, html_path):
    """Sweep the finite-difference step for every scenario of CONFIG: the relative error of the sampled
    elements at each step, as a table per scenario. The curve is V-shaped: truncation error (~h^2) on
    the large-step side, rounding (~eps/h) on the small one. The step the run uses is marked '<- run',
    the best one '*'. An implementation runs in a process of its own (as in 'run'); one that raises,
    ends that process or outlives check.timeout is named and not swept. Exit 0; 1 when an
    implementation failed so; 2 on bad input."""

    try:
        steps = _parse_steps(step_range)
        scenarios = [sc for sc in select(load(config, include=selects, exclude=deselects), selects, deselects)
                     if OPS[sc.op].tensors]
        if not scenarios:
            raise GradcheckError(f"{config}: no selected scenario has gradients to sweep")
        report.prepare_outputs({"--json": json_path, "--plot": plot_path, "--html": html_path}, {}, inputs=[config])
        if plot_path:
            _require_matplotlib()
            if Path(plot_path).suffix.lower() not in (".png", ".pdf", ".svg"):
                raise GradcheckError(f"--plot {plot_path}: name a .png, .pdf or .svg file")
    except GradcheckError as exc:
        raise _fail(exc) from None
    from ..runner import sweep_isolated
    out, sweeps, failed = _console(), [], False
    for sc in scenarios:
        try:  # an implementation runs in a process of its own, as in 'run'
            result = (sweep_isolated(config, sc, steps, samples) if sc.implementation
                      else stepsweep.sweep(sc, steps, samples))
        except GradcheckError as exc:
            raise _fail(exc) from None
        if isinstance(result, str):
            _error(f"{sc.file}: scenario '{sc.name}': not swept: {result}")
            failed = True
            continue
        sweeps.append(result)
        report.render_sweep(out, result, sc.describe())
    try:
        with report.StagedWrites() as stage:
            document = {"tool": "attn-gradcheck", "config": config, "samples": samples,
                        "sweeps": [s.to_json() for s in sweeps]}
            if json_path:
                data = (json.dumps(document, indent=2) + "\n").encode()
                stage.add(json_path, lambda fh: fh.write(data))
            if html_path:
                page = report.sweeps_html(document)
                stage.add(html_path, lambda fh: fh.write(page))
            if plot_path:
                stage.add(plot_path, lambda fh: report.plot_sweeps(sweeps, fh, Path(plot_path).suffix[1:].lower()))
    except OSError as exc:
        raise _fail(f"cannot write the outputs: {_unwritten(exc)}") from None
    except KeyboardInterrupt as exc:
        raise _stopped_writing(exc, "outputs") from None
    if failed:
        raise click.exceptions.Exit(ExitCode.FAILED)


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


@main.command(epilog=EPILOG_INFO, short_help="List the ops: their tensors, keys, engines and the code they accept.")
def ops():
    """List the ops (``op:``): what each checks, its own keys, its engines and backends, and the
    implementation of yours it accepts (``implementation:``), with a scenario to start from."""
    out = _console()
    for name, op in OPS.items():
        out.print(f"{name}  {op.summary}", style="bold" if out.is_terminal else None, highlight=False)
        out.print(f"    tensors:   {', '.join(op.tensors) or '-'}", highlight=False)
        keys = list(op.keys) + ([op.shared_keys.summary] if op.shared_keys else [])
        out.print(f"    keys:      {', '.join(keys)}", highlight=False)
        low = [d for d in op.dtypes if d in ("float16", "bfloat16")]
        only = f" ({', '.join(low)}: backend {' or '.join(op.low_precision_backends)})" if low else ""
        out.print(f"    engines:   {', '.join(op.engine_choices) or 'naive'}; backends: {', '.join(op.backends)}; "
                  f"dtypes: {', '.join(op.dtypes)}{only}", highlight=False)
        out.print("    your code: " + (f"{op.implementation.signature}" if op.implementation
                                       else "not accepted (the built-in formulas only)"), highlight=False)
        if op.implementation and op.implementation.modules:
            out.print("    a module:  implementation: {factory: module:attribute, weights: {parameter: expression of "
                      f"{', '.join(op.tensors)}}}, call: [...]}} with backend torch or jax (call may pass "
                      f"{', '.join(op.implementation.args) or 'no arguments'} too)", highlight=False)
        for key, what in op.variants:  # attention's score stages: a user's code is passed the key as a keyword
            out.print(f"    variant:   {key}: {what}", highlight=False)
        for mode, what in (("jvp", "the JVP"), ("hvp", "the double backward")):
            engines, flavours = op.directional_derivative(mode)
            if engines or flavours:
                where = ([f"engine {', '.join(engines)}"] if engines else []) + \
                    ([f"your {', '.join(flavours)} code"] if flavours else [])
                out.print(f"    mode {mode}:  {what}, on {'; '.join(where)}", highlight=False)
        for limit in op.limits:
            out.print(f"    not yet:   {limit}", highlight=False)
        if op.implementation and op.implementation.conventions:
            out.print(f"    convention: {', '.join(op.implementation.conventions)} (how your code takes its arguments)",
                      highlight=False)
        if op.example:
            example = ", ".join(f"{k}: {json.dumps(v)}" for k, v in op.example.items())
            out.print(f"    example:   {{op: {name}, {example}}}", highlight=False)


@main.command(epilog=EPILOG_INFO, short_help="Print the JSON Schema of the scenario format (or of the report).")
@click.option("--report", "of_report", is_flag=True,
              help="The schema of the --json report instead (shipped as schema/report.schema.json).")
def schema(of_report):
    """Print the JSON Schema of scenario files (shipped as schema/scenario.schema.json for editors), or
    with --report that of the JSON report (what 'merge' checks its inputs against)."""
    from ..report.schema import report_schema
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
            _error(exc)
            bad = True
            continue
        for sc in scenarios:
            out.print(visible(f"{sc.name}: {sc.op} {sc.describe()}"), highlight=False)
        out.print(f"{visible(config)}: {len(scenarios)} scenario(s) valid", highlight=False)
    if bad:
        raise click.exceptions.Exit(ExitCode.BAD_INPUT)
