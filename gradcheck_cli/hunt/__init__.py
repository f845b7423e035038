"""What ``attn-gradcheck hunt`` does, as a library: :class:`HuntOptions` in, :class:`HuntOutcome` out.

Starts from one scenario of a YAML file, draws scenarios across the space its op declares (``Op.space``: sizes with
block edges and primes, n_q != n_k, GQA ratios, masks, padding, windows, scales, dtypes), checks each as ``run``
does, and shrinks the first failure (with hypothesis) to the smallest scenario that fails the same check for the
same cause; that scenario is written as a scenario file. The parts: ``start`` (the starting scenario as a mapping,
candidates loaded as if written), ``space`` (the axes and ``--space``, as a hypothesis strategy), ``search`` (the
hunt) and ``record`` (the scenario file and the JSON record)::

    from gradcheck_cli.hunt import HuntOptions, hunt
    outcome = hunt(HuntOptions("examples/attention.yaml", "mine", budget_s=30))
    outcome.exit_code, outcome.record["verdict"]
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import report
from ..errors import GradcheckError
from ..exitcodes import ExitCode
from ..scenario import read_files
from . import record
from .found import Finding, Hunt
from .plan import DEFAULT_DATABASE, DEFAULT_MAX_ELEMENTS, HuntOptions, HuntPlan
from .space import Space, parse_overrides, space_of
from .start import Start, starting_point


@dataclass
class HuntOutcome:
    plan: HuntPlan
    hunt: Hunt
    exit_code: ExitCode = ExitCode.OK
    record: dict = field(default_factory=dict)
    written: str | None = None


def prepare(options: HuntOptions) -> HuntPlan:
    """Load the starting scenario and the space, and check where the results go; nothing runs yet. Raises
    GradcheckError on bad input."""
    o = options
    start = starting_point(o.config, o.select)
    space = space_of(start, parse_overrides(o.space), o.max_elements)
    out = o.out or str(Path(o.config).parent / record.default_name(start.scenario.name))
    here = Path(out).parent.resolve()
    local = [f for f in read_files([start.scenario]) if Path(f).resolve().parent == start.base_dir.resolve()]
    if here != start.base_dir.resolve() and (local or start.scenario.implementation):
        raise GradcheckError(f"--out {out}: the scenario file must go in {start.base_dir}, the folder of "
                             f"{o.config}, where its implementation and files are found")
    report.prepare_outputs({"--out": out, "--json": o.json_path}, {}, inputs=[o.config, *read_files([start.scenario])],
                           replaceable=[out] if record.written_by_hunt(out) else [])
    return HuntPlan(o, start, space, out)


def execute(plan: HuntPlan, progress: Callable[[Hunt], None] | None = None) -> HuntOutcome:
    """Run the hunt; writes nothing (see :func:`write`)."""
    from . import search  # hypothesis is imported when a hunt runs, not with the command line
    o = plan.options
    found = search.run(plan.start, plan.space, seed=o.seed, examples=o.examples, budget_s=o.budget_s,
                       shrink_s=o.shrink_s, database=o.database, memory_budget=o.memory_budget_mib * 2**20,
                       progress=progress)
    code = ExitCode.INTERRUPTED if found.interrupted else ExitCode.of_verdict(found.verdict)
    outcome = HuntOutcome(plan, found, code)
    outcome.record = record.json_record(plan, found)
    return outcome


def write(outcome: HuntOutcome) -> None:
    """Write the smallest failing scenario (``--out``) and the JSON record (``--json``), all or none; raises
    OSError."""
    plan, found = outcome.plan, outcome.hunt
    with report.StagedWrites() as stage:
        if found.smallest is not None:
            text = record.scenario_file(plan, found).encode()
            stage.add(plan.out, lambda fh: fh.write(text))
            outcome.written = plan.out
        if plan.options.json_path:
            data = report.json_bytes(outcome.record)
            stage.add(plan.options.json_path, lambda fh: fh.write(data))


def hunt(options: HuntOptions, progress: Callable[[Hunt], None] | None = None) -> HuntOutcome:
    """Hunt as ``attn-gradcheck hunt`` does, without printing: prepare, execute, write."""
    outcome = execute(prepare(options), progress)
    write(outcome)
    return outcome


__all__ = ["DEFAULT_DATABASE", "DEFAULT_MAX_ELEMENTS", "Finding", "Hunt", "HuntOptions", "HuntOutcome", "HuntPlan",
           "Space", "Start", "execute", "hunt", "prepare", "write"]
