"""Where a hunt starts: one scenario of a YAML file as a plain mapping (its defaults merged, its sweep case
applied), and the scenarios made from it with some keys changed, each validated by the loader as if written."""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import files
from ..errors import GradcheckError, ScenarioError
from ..ops import OPS
from ..scenario import Scenario, load, loads, select
from ..scenario.fields import _merge
from ..scenario.sweep import _sweep_axes, _sweep_cases
from ..scenario.yaml_lines import _Doc

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: Where a value is left out of a candidate (the key's default).
ABSENT = None


@dataclass(frozen=True)
class Start:
    """The starting scenario: its file and folder, its keys as one mapping (``mapping``), and the loaded record."""
    file: str
    base_dir: Path
    mapping: dict
    scenario: Scenario

    def get(self, key: str):
        """The value of a key of the starting scenario, dotted for a nested one (``mask.causal``, ``bias.shape``);
        None when it is not set."""
        value = self.mapping
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value


def starting_point(path: str, pattern: str) -> Start:
    """The one scenario of ``path`` that ``pattern`` (a name or a glob) selects. Raises GradcheckError when it
    selects none or several, or the file is wrong."""
    scenarios = select(load(path, include=(pattern,)), (pattern,))
    if len(scenarios) > 1:
        names = ", ".join(sc.name for sc in scenarios[:8]) + (", ..." if len(scenarios) > 8 else "")
        raise GradcheckError(f"--select '{pattern}' chooses {len(scenarios)} scenarios of {path} ({names}); a hunt "
                             "starts from one: give its whole name")
    sc = scenarios[0]
    text = files.read_regular(Path(path), files.MAX_CONFIG_BYTES).decode("utf-8")
    doc = _Doc(text, str(path))
    defaults = doc.value.get("defaults") or {}
    for i, item in enumerate(doc.value["scenarios"]):
        flat = _merge(doc, defaults, item, i)
        for suffix, case in _sweep_cases(doc, flat, _sweep_axes(doc, defaults, item, i), i):
            if f"{item.get('name')}{suffix}" == sc.name:
                return Start(str(path), Path(path).parent, _unflatten(case), sc)
    raise GradcheckError(f"{path}: scenario '{sc.name}' could not be found again in its file")  # pragma: no cover


def _unflatten(case: dict) -> dict:
    """The loader's flat {'key' or 'mask.causal': (value, path)} as a scenario mapping."""
    out: dict = {}
    for key, (value, _) in case.items():
        top, dot, sub = key.partition(".")
        if dot:
            out.setdefault(top, {})[sub] = copy.deepcopy(value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_values(mapping: dict, values: dict) -> dict:
    """``mapping`` with each key of ``values`` (dotted for a nested one) set, or removed where the value is
    ABSENT; a nested mapping left empty is removed."""
    out = copy.deepcopy(mapping)
    for key, value in values.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        if value is ABSENT:
            node.pop(last, None)
        else:
            node[last] = value
        if parents and not node:
            out.pop(parents[0], None)
    return out


def scenario_text(mapping: dict, name: str, header: str = "") -> str:
    """A scenario file holding ``mapping`` alone, named ``name``."""
    body = {"scenarios": [{"name": name, **{k: v for k, v in mapping.items() if k != "name"}}]}
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=120)


def found_name(scenario: str) -> str:
    """The name of a scenario a hunt makes from ``scenario``: ``hunt-<name>``, of letters, digits, '.', '_' and '-'
    only (a sweep case's brackets become '_')."""
    return "hunt-" + _UNSAFE.sub("_", scenario)


def candidate(start: Start, mapping: dict) -> Scenario | None:
    """The scenario ``mapping`` describes, loaded as if it were written beside the starting file (its
    implementation and files found there); None when the loader refuses it (values wrong together)."""
    try:
        (sc,) = loads(scenario_text(mapping, found_name(start.scenario.name)), file=start.file,
                      base_dir=start.base_dir)
    except ScenarioError:
        return None
    return sc


def refusal(start: Start, mapping: dict) -> str | None:
    """Why the loader refuses the scenario ``mapping`` describes (its message, without the file and line of the
    text it was given), or None when it takes it."""
    try:
        loads(scenario_text(mapping, found_name(start.scenario.name)), file=start.file, base_dir=start.base_dir)
    except ScenarioError as exc:
        first = exc.errors[0] if getattr(exc, "errors", None) else exc
        key = getattr(first, "key", None)
        key = key.split("].", 1)[-1] if key else None  # scenarios[0].scale -> scale
        return (f"{key}: " if key else "") + first.message
    return None


def elements(sc: Scenario) -> int:
    """The size of a scenario: the elements of the op's inputs, together (what a hunt shrinks)."""
    shapes = OPS[sc.op].shapes(sc) if OPS[sc.op].shapes else {}
    return int(sum(math.prod(shape) for shape in shapes.values()))
