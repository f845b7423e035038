"""What a hunt finds: a failing scenario (``Finding``) and the record of the whole hunt (``Hunt``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..result import ScenarioResult
from ..scenario import Scenario
from .space import Space
from .start import Start


@dataclass(frozen=True)
class Finding:
    """A failing scenario: its keys, the loaded record, its result, its size and what failed (``signature``: the
    failed checks' names, and the causes its hints name)."""
    mapping: dict
    scenario: Scenario
    result: ScenarioResult
    elements: int
    signature: tuple[frozenset, frozenset]
    values: dict = field(default_factory=dict)  # the draw (axis key: value) it was made from

    def same_failure(self, other: Finding) -> bool:
        """Whether ``other`` fails as this does: the first check this one failed fails there too, and so does
        every cause this one's hints name."""
        failed, causes = self.signature
        first = next((c.name for c in self.result.checks if c.verdict == "fail"), None)
        if first is None:  # no check named as failed: the same failed checks, exactly
            return bool(failed) and failed == other.signature[0] and causes <= other.signature[1]
        return first in other.signature[0] and causes <= other.signature[1]


@dataclass
class Hunt:
    """What a hunt did: scenarios checked (``tried``), drawn but skipped (values the loader refuses together, or
    over the size limit), inconclusive ones, the values each axis took (``covered``), the first failure and the
    smallest scenario that fails the same way (``smallest``), each failing scenario's size as shrinking went
    (``path``), and how it stopped."""
    start: Start
    space: Space
    seed: int
    tried: int = 0
    skipped: int = 0
    inconclusive: int = 0
    inconclusive_float32: int = 0
    other_failures: int = 0
    covered: dict = field(default_factory=dict)
    first: Finding | None = None
    smallest: Finding | None = None
    first_inconclusive: Finding | None = None
    path: list = field(default_factory=list)
    search_s: float = 0.0
    shrink_s: float = 0.0
    stopped: str = ""
    interrupted: bool = False
    left_out: dict = field(default_factory=dict)  # values of the space the code does not run in, and why
    start_failed: bool = False  # the starting scenario itself fails
    tried_to_first: int = 0  # scenarios checked up to the first failure, it included

    @property
    def verdict(self) -> str:
        """fail (a failure found), inconclusive (only inconclusive scenarios, or none checked: nothing is decided)
        or pass."""
        if self.smallest:
            return "fail"
        return "inconclusive" if self.inconclusive or not self.tried else "pass"
