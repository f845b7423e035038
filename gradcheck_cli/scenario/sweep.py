"""Sweeps: the ``sweep:`` lists of a scenario (or ``defaults``), expanded to one scenario per
combination of their values."""
from __future__ import annotations

import re
from typing import Any

from .fields import NESTED, SCENARIO_KEYS, _nested, _suggest
from .yaml_lines import _Doc, _show

#: Most scenarios one sweep may expand to.
MAX_SWEEP_CASES = 4096
_UNSAFE = re.compile(r"[^A-Za-z0-9._=,:+\-\[\]{}]")


def _sweep_value_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return "[" + ",".join(_sweep_value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_sweep_value_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def _sweep_axes(doc: _Doc, defaults: dict, scenario: dict, index: int) -> list[tuple[str, list[tuple[Any, tuple]]]]:
    """[(key, [(value, path), ...])] of the ``sweep:`` mappings (defaults' first; a scenario's entry
    for the same key replaces the default's). Keys are scenario keys, dotted for nested ones
    ('mask.causal'), or a nested key itself ('mask') whose values are whole mappings."""
    axes: dict[str, list[tuple[Any, tuple]]] = {}
    for source, base in ((defaults, ("defaults", "sweep")), (scenario, ("scenarios", index, "sweep"))):
        sweep = source.get("sweep")
        if sweep is None:
            continue
        if not isinstance(sweep, dict) or not sweep:
            raise doc.error(base, f"expected a mapping of keys to lists of values, got {_show(sweep)}",
                            hint="e.g. 'sweep: {n_q: [1, 17, 64], mask.causal: [upper-left, lower-right]}'")
        for key, values in sweep.items():
            path = base + (key,)
            top, dot, sub = str(key).partition(".")
            known = (top in NESTED and sub in NESTED[top]) if dot else (top in SCENARIO_KEYS and top not in ("name",))
            if not known:
                allowed = tuple(k for k in SCENARIO_KEYS if k != "name") + tuple(
                    f"{n}.{k}" for n, keys in NESTED.items() for k in keys)
                raise doc.error(path, f"cannot sweep '{key}'", hint=_suggest(str(key), allowed))
            if not isinstance(values, list) or not values:
                raise doc.error(path, f"expected a non-empty list of values, got {_show(values)}",
                                hint=f"list the values to try, e.g. '{key}: [a, b]'")
            for i, v in enumerate(values):
                if any(type(w) is type(v) and w == v for w in values[:i]):  # True == 1 in Python: not a repeat
                    raise doc.error(path + (i,), f"{_sweep_value_text(v)} is listed twice", hint="list each value once")
            axes[key] = [(v, path + (i,)) for i, v in enumerate(values)]
    for nest in NESTED:
        parts = [k for k in axes if str(k).startswith(nest + ".")]
        if nest in axes and parts:
            raise doc.error(axes[nest][0][1][:-1], f"sweeps '{nest}' (whole mappings) and '{parts[0]}' at once",
                            hint=f"sweep either whole '{nest}' mappings or its keys, not both")
    total = 1
    for values in axes.values():
        total *= len(values)
        if total > MAX_SWEEP_CASES:
            where = ("scenarios", index, "sweep") if "sweep" in scenario else ("defaults", "sweep")
            raise doc.error(where, f"expands to more than {MAX_SWEEP_CASES} scenarios",
                            hint="sweep fewer values, or split the scenario")
    return list(axes.items())


def _sweep_cases(doc: _Doc, flat: dict, axes, index: int):
    """Yield (suffix, flat fields) for each combination of the sweep axes (one case when none)."""
    import itertools
    if not axes:
        yield "", flat
        return
    for combo in itertools.product(*(values for _, values in axes)):
        case = dict(flat)
        labels = []
        for (key, _), (value, path) in zip(axes, combo):
            if key in NESTED:  # a whole nested mapping replaces the merged one
                case = {k: v for k, v in case.items() if not k.startswith(key + ".")}
                case.update(_nested(doc, key, value, path))
            else:
                case[key] = (value, path)
            labels.append(f"{key}={_sweep_value_text(value)}")
        yield _UNSAFE.sub("_", "[" + ",".join(labels) + "]"), case

