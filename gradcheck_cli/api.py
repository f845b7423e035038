"""What ``attn-gradcheck run`` does, as a library: :class:`RunOptions` in, :class:`RunOutcome` out.

Loads and selects the scenarios, runs them (through ``runner``), builds the report and writes the
requested files; never prints and never exits. The CLI (``gradcheck_cli.cli``) calls the steps one by
one (:func:`prepare`, :func:`execute`, :func:`write_reports`) to render between them; :func:`run` is
the three in a row::

    from gradcheck_cli.api import RunOptions, run
    outcome = run(RunOptions("configs/quickstart.yaml", negative_controls=True))
    outcome.exit_code, outcome.report["verdict"]
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from . import checker, report, runner
from .errors import GradcheckError, Terminated, caused_by_interrupt
from .exitcodes import ExitCode
from .ops import OPS
from .result import ControlCell, ScenarioResult, run_verdict
from .scenario import Scenario, load, read_files, select, with_engine


@dataclass(frozen=True)
class RunOptions:
    """The options of one run (those of ``attn-gradcheck run``).

    ``faults`` are injected into every scenario; ``negative_controls`` runs every fault on every
    scenario instead (the two do not combine). ``engine`` overrides op attention's ``engine:``;
    ``shard`` is (I, N), 1-based; ``memory_budget_mib`` is per job. The paths name the reports to write
    (None: not written)."""
    config: str
    faults: tuple[str, ...] = ()
    selects: tuple[str, ...] = ()
    deselects: tuple[str, ...] = ()
    negative_controls: bool = False
    engine: str | None = None
    jobs: int = 1
    shard: tuple[int, int] | None = None
    json_path: str | None = None
    junit_path: str | None = None
    html_path: str | None = None
    arrays_dir: str | None = None
    memory_budget_mib: int = checker.DEFAULT_MEMORY_BUDGET // 2**20


@dataclass
class RunPlan:
    """What :func:`prepare` selected: the scenarios this run (or shard) checks, in file order."""
    options: RunOptions
    scenarios: list[Scenario]
    shard_info: dict | None = None

    @property
    def units(self) -> int:
        """Progress units of the whole run (what ``progress`` callbacks add up to)."""
        return sum(runner.units(sc, self.options.negative_controls) for sc in self.scenarios)


@dataclass
class RunOutcome:
    """The results of a run, its JSON report (``report``) and its exit code. ``interrupted``: Ctrl-C or
    SIGTERM stopped it (``results`` holds the scenarios that finished; ``exit_code`` is 130 or 143)."""
    plan: RunPlan
    results: list[ScenarioResult] = field(default_factory=list)
    cells: list[ControlCell] | None = None
    interrupted: bool = False
    exit_code: ExitCode = ExitCode.OK
    report: dict = field(default_factory=dict)


class OutOfMemory(GradcheckError):
    """A scenario (or the negative controls) ran out of memory; no report is written."""

    def __init__(self, config: str, scenario: str):
        super().__init__(f"{config}: scenario '{scenario}' ran out of memory")
        self.config, self.scenario = config, scenario


def prepare(options: RunOptions) -> RunPlan:
    """Load, select and shard the scenarios and check the report paths; nothing runs yet.
    Raises GradcheckError on bad input (including faults combined with negative controls)."""
    o = options
    if o.faults and o.negative_controls:
        raise GradcheckError("--negative-controls runs every fault itself; do not combine it with --fault")
    scenarios = with_engine(select(load(o.config, include=o.selects, exclude=o.deselects), o.selects, o.deselects),
                            o.engine)
    shard_info = None
    if o.shard:
        shard_info = {"index": o.shard[0], "count": o.shard[1], "of": len(scenarios), "select": list(o.selects),
                      "deselect": list(o.deselects)}
        scenarios = runner.shard(scenarios, *o.shard)
    report.prepare_outputs({"--json": o.json_path, "--junit": o.junit_path, "--html": o.html_path},
                           {"--save-arrays": o.arrays_dir},
                           {"--save-arrays": [f"{sc.name}.npz" for sc in scenarios]},
                           inputs=[o.config, *read_files(scenarios)])
    return RunPlan(o, scenarios, shard_info)


def execute(plan: RunPlan, progress: Callable[[int], None] | None = None,
            on_result: Callable[[Scenario, ScenarioResult], None] | None = None) -> RunOutcome:
    """Run the planned scenarios; ``on_result(scenario, result)`` is called as each finishes, in file
    order. Ctrl-C or SIGTERM (in a check or in ``on_result``) stops the run: the outcome is then
    ``interrupted``. Raises OutOfMemory, or GradcheckError when a worker cannot load the file (it
    changed while running). Writes nothing: see :func:`write_reports`."""
    o, scenarios = plan.options, plan.scenarios
    outcome = RunOutcome(plan, cells=[] if o.negative_controls else None)
    results, cells, stop_code = outcome.results, outcome.cells, ExitCode.INTERRUPTED
    try:
        for item in runner.run(o.config, scenarios, o.faults, controls=o.negative_controls, jobs=o.jobs,
                               memory_budget=o.memory_budget_mib * 2**20, progress=progress):
            result = item.result
            results.append(result)
            if cells is not None:
                cells.extend(item.cells or ())  # none when the implementation broke its worker
            if on_result is not None:
                on_result(scenarios[len(results) - 1], result)
    except KeyboardInterrupt as exc:
        outcome.interrupted = True
        stop_code = ExitCode.TERMINATED if isinstance(exc, Terminated) else ExitCode.INTERRUPTED
    except MemoryError:
        name = scenarios[len(results)].name if len(results) < len(scenarios) else "negative controls"
        raise OutOfMemory(o.config, name) from None
    except GradcheckError:
        raise
    except Exception as exc:  # Ctrl-C inside a lazy import or a pool comes wrapped: still a Ctrl-C
        if not caused_by_interrupt(exc):
            raise
        outcome.interrupted = True
    outcome.report = report.json_report(o.config, o.faults, results, cells, shard=plan.shard_info,
                                        interrupted=outcome.interrupted, engine=o.engine)
    verdict = run_verdict((r.verdict for r in results), cells)  # the rule the report's verdict follows too
    outcome.exit_code = stop_code if outcome.interrupted else ExitCode.of_verdict(verdict)
    return outcome


def fault_notes(sc: Scenario, result: ScenarioResult, faults) -> list[str]:
    """Why a requested fault was not injected into scenario ``sc`` (or had no effect): one line each."""
    notes = []
    for fault in faults:
        if fault not in OPS[sc.op].faults:
            owners = ", ".join(op.name for op in OPS.values() if fault in op.faults)
            notes.append(f"  note: fault {fault} is a fault of op {owners}, not of op {sc.op}: not injected "
                         "here (see 'attn-gradcheck faults')\n")
            continue
        if fault not in checker.applicable_faults(sc):
            record = OPS[sc.op].faults[fault]
            if not record.forward and record.derivative not in sc.derivatives:
                wanted = {"vjp": "mode full, sample or directional (the gradients)", "jvp": "check: {mode: jvp}",
                          "hvp": "check: {mode: hvp}"}[record.derivative]
                notes.append(f"  note: fault {fault} breaks the {record.derivative.upper()}, which this scenario "
                             f"(mode {sc.mode}) does not check: not injected here; it needs {wanted}\n")
                continue
            kind = "your implementation" if sc.implementation else "the built-in engine"
            notes.append(f"  note: fault {fault} does not apply to {kind} (see 'attn-gradcheck faults')\n")
        elif fault not in result.faults or (not OPS[sc.op].faults[fault].sized
                                             and not checker.fault_applies(sc, fault)):
            notes.append(f"  note: fault {fault} has no effect on this scenario (not applicable)\n")
    return notes


def write_reports(outcome: RunOutcome) -> None:
    """Write the reports the options name, all or none: raises OSError (``errors.ReportsFailed`` says
    which are new) when one cannot be written, ``errors.ReportsInterrupted`` on Ctrl-C meanwhile."""
    o, data = outcome.plan.options, outcome.report
    report.write_reports(o.json_path, data, o.junit_path,
                         report.junit_xml(data) if o.junit_path else None, o.arrays_dir, outcome.results,
                         html_path=o.html_path)


def run(options: RunOptions, progress: Callable[[int], None] | None = None) -> RunOutcome:
    """Run as ``attn-gradcheck run`` does, without printing: prepare, execute, write the reports."""
    outcome = execute(prepare(options), progress)
    write_reports(outcome)
    return outcome
