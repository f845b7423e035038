"""The options of a hunt and what :func:`gradcheck_cli.hunt.prepare` makes of them."""
from __future__ import annotations

from dataclasses import dataclass

from .. import checker
from .space import Space
from .start import Start

#: Input elements a drawn scenario may have at most, by default (``--max-elements``): about a second of checking.
DEFAULT_MAX_ELEMENTS = 4096
#: Where hypothesis keeps the failures of past hunts (``--database``), under the current folder.
DEFAULT_DATABASE = ".attn-gradcheck/hunt"


@dataclass(frozen=True)
class HuntOptions:
    """The options of one hunt (those of ``attn-gradcheck hunt``). ``out``: the scenario file to write a failure
    to (None: ``hunt-<name>.yaml`` beside ``config``); ``database``: None keeps none."""
    config: str
    select: str
    budget_s: float = 120.0
    examples: int | None = None
    seed: int = 0
    out: str | None = None
    space: tuple[str, ...] = ()
    max_elements: int = DEFAULT_MAX_ELEMENTS
    shrink_s: float = 120.0
    json_path: str | None = None
    database: str | None = DEFAULT_DATABASE
    memory_budget_mib: int = checker.DEFAULT_MEMORY_BUDGET // 2**20


@dataclass
class HuntPlan:
    """What :func:`prepare` found: the starting scenario, the space and the file a failure goes to."""
    options: HuntOptions
    start: Start
    space: Space
    out: str


