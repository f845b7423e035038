"""Frozen result records: what the checker returns and the reports render. Imports nothing of ours."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class _Word(str, Enum):
    """A word of the reports that compares, hashes, formats and serialises as its text."""
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__


class Verdict(_Word):
    """A check's, a scenario's, a control matrix's or a run's verdict (exit codes 0, 1 and 3)."""
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"  # the evidence cannot decide (e.g. differences too noisy)
    NOT_APPLICABLE = "not applicable"  # a check this code cannot have (a setting fixed inside it); counts as neither

    @classmethod
    def combine(cls, verdicts: Iterable[str]) -> Verdict:
        """fail if any is; else inconclusive if any is; else pass (also for none, and for checks that are not
        applicable: they neither pass nor fail, and are counted apart)."""
        seen = set(verdicts)
        return cls.FAIL if cls.FAIL in seen else cls.INCONCLUSIVE if cls.INCONCLUSIVE in seen else cls.PASS


#: The summary's count of each check verdict (the JSON report's ``summary``), in report order.
COUNTS = {Verdict.PASS: "passed", Verdict.FAIL: "failed", Verdict.INCONCLUSIVE: "inconclusive",
          Verdict.NOT_APPLICABLE: "not_applicable"}


def counts(verdicts: Iterable[str]) -> dict[str, int]:
    """How many of ``verdicts`` (check verdicts) are of each kind, by ``COUNTS``' names."""
    seen = list(verdicts)
    return {key: sum(v == verdict for v in seen) for verdict, key in COUNTS.items()}


def passes(verdict: str) -> bool:
    """What a check's ``passed`` is for its verdict: it neither failed nor was inconclusive."""
    return verdict in (Verdict.PASS, Verdict.NOT_APPLICABLE)


class Kind(_Word):
    """What a check compares."""
    GRADIENT = "gradient"              # analytic gradient vs finite differences
    INVARIANT = "invariant"            # a semantic identity finite differences cannot see
    REFERENCE = "reference"            # an implementation vs the float64 reference
    IMPLEMENTATION = "implementation"  # the user's code ran, deterministically, with finite values
    EXPERIMENT = "experiment"          # a statistical experiment (logit-scale)


@dataclass(frozen=True, kw_only=True)
class Check:
    """One gradient check (analytic vs finite differences) or one invariant.

    ``kind`` is a :class:`Kind`; built by keyword. For a gradient check
    ``tensor`` names the input, ``worst_index`` is the index of the worst element (in directional mode:
    ``[direction]``), ``fd_error`` the estimated error of the finite differences themselves, and
    ``verdict`` one of pass / fail / inconclusive (the differences too noisy to decide).
    ``detectable`` (gradient and reference checks): the smallest uniform relative error of the tensor
    the check would have caught (docs/verdicts.md "How verdicts, power and precision work").
    """
    kind: Kind
    name: str
    tensor: str | None
    shape: tuple[int, ...] | None
    max_abs_error: float
    relative_error: float
    tolerance: float
    noise_floor: float
    worst_index: tuple[int, ...] | None
    passed: bool
    detail: str = ""
    verdict: Verdict | str = ""
    fd_error: float | None = None
    diagnosis: dict | None = field(default=None, compare=False)
    detectable: float | None = None
    #: what the check found, as data for the hints (``computes_in``, ``differing``, ``non_finite``, ``on_copies``):
    #: hints read these, never ``detail``'s text. Not in the JSON report (its ``detail`` says the same in words).
    facts: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.verdict:
            object.__setattr__(self, "verdict", Verdict.PASS if self.passed else Verdict.FAIL)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "tensor": self.tensor,
            "shape": list(self.shape) if self.shape is not None else None,
            "max_abs_error": self.max_abs_error,
            "relative_error": self.relative_error,
            "tolerance": self.tolerance,
            "noise_floor": self.noise_floor,
            "worst_index": list(self.worst_index) if self.worst_index is not None else None,
            "passed": self.passed,
            "verdict": self.verdict,
            "fd_error": self.fd_error,
            "detectable": self.detectable,
            "detail": self.detail,
            "diagnosis": self.diagnosis,
        }


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    op: str
    dtype: str
    epsilon: float
    tolerance: float
    mode: str
    faults: tuple[str, ...]
    checks: tuple[Check, ...]
    elapsed_s: float
    arrays: dict = field(default_factory=dict, compare=False, repr=False)
    hints: tuple[str, ...] = ()
    index: int = 0  # the scenario's position in its file (reports keep file order; merge restores it)
    engine: str = "naive"
    compile_s: float = 0.0  # of elapsed_s, the time jax.jit spent compiling a user's JAX code (0: none)
    variants: tuple[str, ...] = ()  # the attention variants (score stages) the scenario checks, e.g. "softcap 30"

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def verdict(self) -> Verdict:
        """fail if any check fails; else inconclusive if any is; else pass."""
        return Verdict.combine(c.verdict for c in self.checks)

    @property
    def detectable(self) -> dict[str, float]:
        """Per tensor, the smallest uniform relative error some passing check of it would have caught
        (the run's power; docs/verdicts.md "How verdicts, power and precision work")."""
        out: dict[str, float] = {}
        for c in self.checks:
            if c.detectable is not None and c.tensor and c.verdict == "pass":
                out[c.tensor] = min(out.get(c.tensor, float("inf")), c.detectable)
        return dict(sorted(out.items(), key=lambda item: item[0] == "o"))  # the inputs first, then the output

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "op": self.op,
            "engine": self.engine,
            "dtype": self.dtype,
            "epsilon": self.epsilon,
            "tolerance": self.tolerance,
            "mode": self.mode,
            "faults": list(self.faults),
            "passed": self.passed,
            "verdict": self.verdict,
            "elapsed_s": round(self.elapsed_s, 6),
            **({"compile_s": round(self.compile_s, 6)} if self.compile_s else {}),
            **({"variants": list(self.variants)} if self.variants else {}),
            "checks": [c.to_json() for c in self.checks],
            "hints": list(self.hints),
            "detectable": self.detectable,
        }


def controls_verdict(cells) -> tuple[str, list[str]]:
    """(pass | fail | inconclusive, the scenarios no fault applies to) of negative-control cells
    (``ControlCell`` or their JSON): fail if an applicable fault was missed; inconclusive if some
    scenario had no applicable fault at all (its controls prove nothing); else pass."""
    status = [(c.scenario, c.status) if isinstance(c, ControlCell) else (c["scenario"], c["status"]) for c in cells]
    scenarios = list(dict.fromkeys(s for s, _ in status))
    powerless = [s for s in scenarios if all(st == "not applicable" for t, st in status if t == s)]
    if any(st == "missed" for _, st in status):
        return Verdict.FAIL, powerless
    return (Verdict.INCONCLUSIVE if powerless else Verdict.PASS), powerless


def run_verdict(verdicts: Iterable[str], controls: Iterable | None = None, interrupted: bool = False) -> str:
    """The verdict of a run, the one rule the JSON report, ``merge``, the terminal and the exit code share:
    ``verdicts`` (its checks' or its scenarios') and, with ``controls`` (its negative-control cells, or None
    when it ran none), their ``controls_verdict``, combined fail first (``Verdict.combine``). A run stopped
    before its end that has not failed is ``interrupted`` (what did not run cannot have passed)."""
    seen = list(verdicts)
    if controls is not None:
        seen.append(controls_verdict(controls)[0])
    combined = Verdict.combine(seen)
    return "interrupted" if interrupted and combined != Verdict.FAIL else combined


@dataclass(frozen=True)
class ControlCell:
    """One (fault, scenario) cell of the negative-control matrix.

    status: ``detected`` (the run failed), ``missed`` (applicable but every check passed) or
    ``not applicable`` (``reason`` says why: e.g. the fault changes neither the output nor a gradient
    by more than 10x the tolerance on this scenario). ``effect`` is that largest relative change.
    """
    fault: str
    scenario: str
    status: str
    effect: float
    caught_by: tuple[str, ...]
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"fault": self.fault, "scenario": self.scenario, "status": self.status,
                "effect": self.effect, "caught_by": list(self.caught_by), "reason": self.reason}
