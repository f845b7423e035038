"""The ``hunt:`` list of a scenario file (run by the pytest plugin, one test per entry), read with the file, line
and key of every problem::

    hunt:
      - {select: mine, budget: 30, seed: 0, space: {n_k: 1..64, dtype: float64}}
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import files
from ..scenario.fields import HUNT_KEYS, _suggest
from ..scenario.yaml_lines import _Doc, _show
from .plan import HuntOptions


@dataclass(frozen=True)
class Entry:
    """One ``hunt:`` entry: its options (no files written, no database kept) and its line."""
    options: HuntOptions
    line: int

    @property
    def name(self) -> str:
        return f"hunt[{self.options.select}]"


def read(path: str) -> list[Entry]:
    """The ``hunt:`` entries of a scenario file (none when it has no ``hunt:``). Raises ScenarioError."""
    text = files.read_regular(Path(path), files.MAX_CONFIG_BYTES).decode("utf-8")
    doc = _Doc(text, str(path))
    items = doc.value.get("hunt") if isinstance(doc.value, dict) else None
    if items is None:
        return []
    if not isinstance(items, list):
        raise doc.error(("hunt",), f"expected a list of hunts, got {_show(items)}",
                        hint="e.g. 'hunt: [{select: mine, budget: 30}]'")
    return [_entry(doc, item, i, str(path)) for i, item in enumerate(items)]


def _entry(doc: _Doc, item, i: int, path: str) -> Entry:
    where = ("hunt", i)
    if not isinstance(item, dict):
        raise doc.error(where, f"expected a mapping, got {_show(item)}", hint="e.g. '{select: mine, budget: 30}'")
    for key in item:
        if key not in HUNT_KEYS:
            raise doc.error(where + (key,), f"unknown key '{key}'", hint=_suggest(str(key), HUNT_KEYS))
    select = item.get("select")
    if not isinstance(select, str) or not select:
        raise doc.error(where + ("select",) if "select" in item else where,
                        "is required: the scenario to start from" if "select" not in item
                        else f"expected a scenario name, got {_show(select)}")

    def number(key, kind, low, default, strict=False):
        value = item.get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) \
                or value < low or (strict and value <= low):
            raise doc.error(where + (key,), f"expected {'a number' if kind is float else 'a whole number'} "
                            f"{'>' if strict else '>='} {low}, got {_show(value)}")
        return kind(value)

    space = item.get("space", {})
    if not isinstance(space, dict):
        raise doc.error(where + ("space",), f"expected a mapping of axes to ranges, got {_show(space)}",
                        hint="e.g. 'space: {n_k: 1..64, d_head: [16, 64, 160]}'")
    ranges = []
    for key, value in space.items():
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        ranges.append(f"{key}={'none' if value is None else text}")
    options = HuntOptions(path, select, budget_s=number("budget", float, 0, 60.0, strict=True),
                          examples=number("examples", int, 1, None), seed=number("seed", int, 0, 0),
                          space=tuple(ranges), max_elements=number("max_elements", int, 1, 4096),
                          database=None)
    return Entry(options, doc.lines.get(where, 0))
