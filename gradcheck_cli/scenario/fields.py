"""The scenario keys and their limits, and the typed readers of their values. Every error names the
file, line and key; an unknown key gets a did-you-mean."""
from __future__ import annotations

import math
import re
from typing import Any

from ..errors import ScenarioErrors
from ..keys import Fields as _Fields
from ..ops import OPS
from ..ops.attention import scenario_keys
from ..ops.registry import REQUIRED, Param
from .yaml_lines import _Doc, _show

MODES = ("full", "sample", "directional", "jvp", "hvp")
#: Elements differenced per tensor in mode sample, and random directions in mode directional, when unset.
DEFAULT_SAMPLES, DEFAULT_DIRECTIONS = 256, 16
#: Keys every op takes.
COMMON_KEYS = ("name", "op", "batch", "check", "dtype", "epsilon", "tolerance", "seed")
#: The key groups ops share and parse themselves (``Op.shared_keys``: attention's heads, sizes, masks, ...).
KEY_GROUPS = tuple({op.shared_keys.name: op.shared_keys for op in OPS.values() if op.shared_keys}.values())
#: Keys of ops that contain attention (``ops.attention.scenario_keys``).
ATTENTION_KEYS = scenario_keys.KEYS
#: Keys of the ops that accept them (``Op.takes``): implementations, backends, engines and the engines' own.
BACKEND_KEYS = ("implementation", "backend", "device", "engine", "block_q", "block_k")
#: The engines ``engine:`` chooses between, over every op (``Op.engine_choices``).
ENGINES = tuple(dict.fromkeys(name for op in OPS.values() for name in op.engine_choices))
CONVENTION_KEYS, MASK_KEYS = scenario_keys.CONVENTION_KEYS, scenario_keys.MASK_KEYS
SCENARIO_KEYS = tuple(dict.fromkeys(COMMON_KEYS[:2] + BACKEND_KEYS + COMMON_KEYS[2:3]
                                    + tuple(k for group in KEY_GROUPS for k in group.keys) + COMMON_KEYS[3:]
                                    + tuple(k for op in OPS.values() for k in op.keys)))
CHECK_KEYS = ("mode", "samples", "directions", "colouring", "factor", "slack", "nondet_tol", "timeout")
#: The values of ``backend:``, over every op (``Op.backends``).
BACKENDS = tuple(dict.fromkeys(b for op in OPS.values() for b in op.backends))
DEVICES = ("cpu", "cuda")
LOW_PRECISION = ("float16", "bfloat16")
NESTED = {"check": CHECK_KEYS, **{key: sub for group in KEY_GROUPS for key, sub in group.nested.items()}}
#: Nested mappings a scenario replaces as a whole (a packed batch's seqlens_q and seqlens_k go together).
WHOLE = tuple(key for group in KEY_GROUPS for key in group.whole)
TOP_KEYS = ("defaults", "scenarios", "hunt")
#: The keys of one ``hunt:`` entry (the pytest plugin runs each as one test; ``attn-gradcheck run`` ignores them).
HUNT_KEYS = ("select", "budget", "examples", "seed", "space", "max_elements")
#: The smallest step, in units of the dtype's resolution: a smaller one rounds back to the input.
MIN_STEP_ULPS = 8
#: The largest finite-difference step (relative to the inputs' scale) a scenario may ask for.
MAX_EPSILON = 0.1
#: The largest relative tolerance: a check blind to errors of this fraction of a gradient has no power
#: (verdict.POWER_LIMIT).
MAX_TOLERANCE = 0.25
#: The largest ``check.factor``: an implementation may err by this many times the plain computations' error
#: (FlashAttention's tests use 2, a few 3 or 4); more accepts code that is wrong by far more than rounding.
MAX_FACTOR = 10.0
#: The largest ``check.slack``, an absolute allowance on results of order 1 (the inputs are standard normal).
MAX_SLACK = 1e-2
MAX_SCALE = scenario_keys.MAX_SCALE
#: More random directions than this cost more than checking every element would.
MAX_DIRECTIONS = 100_000
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _merge(doc: _Doc, defaults: dict, scenario: dict, index: int) -> dict[str, tuple[Any, tuple]]:
    """Flatten defaults then the scenario into {'key' or 'mask.causal': (value, path)}. Every unknown key (top
    level or nested) is reported at once (``ScenarioErrors``)."""
    out: dict[str, tuple[Any, tuple]] = {}
    unknown: list = []
    for source, base in ((defaults, ("defaults",)), (scenario, ("scenarios", index))):
        for key, value in source.items():
            if key == "sweep":
                continue
            path = base + (key,)
            allowed = SCENARIO_KEYS if source is scenario else tuple(k for k in SCENARIO_KEYS if k != "name")
            if key not in allowed:
                owner = next((n for n, subkeys in NESTED.items() if key in subkeys), None)
                hint = (f"'{key}' belongs under '{owner}:' ({owner}: {{{key}: ...}})" if owner
                        else _suggest(key, allowed))
                unknown.append(doc.error(path, f"unknown key '{key}'", hint=hint))
            elif key in NESTED:
                if key in WHOLE:  # the scenario's replaces the defaults' whole
                    out = {k: v for k, v in out.items() if not k.startswith(key + ".")}
                if value is not None:
                    out.update(_nested(doc, key, value, path, unknown))
            else:
                out[key] = (value, path)
    if len(unknown) == 1:
        raise unknown[0]
    if unknown:
        raise ScenarioErrors(unknown)
    return out


def _nested(doc: _Doc, key: str, value: Any, path: tuple, unknown: list | None = None) -> dict[str, tuple[Any, tuple]]:
    """A ``mask`` or ``check`` mapping flattened to {'mask.causal': (value, path)}, its keys checked (an unknown
    one is appended to ``unknown`` where given, else raised)."""
    if not isinstance(value, dict):
        raise doc.error(path, f"expected a mapping with keys {', '.join(NESTED[key])}, got {_show(value)}")
    out = {}
    for sub, subvalue in value.items():
        if sub not in NESTED[key]:
            problem = doc.error(path + (sub,), f"unknown key '{sub}'", hint=_suggest(sub, NESTED[key]))
            if unknown is None:
                raise problem
            unknown.append(problem)
            continue
        out[f"{key}.{sub}"] = (subvalue, path + (sub,))
    return out


def _suggest(key: str, allowed: tuple[str, ...]) -> str:
    import difflib
    close = difflib.get_close_matches(key, allowed, n=1)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(allowed)}"


def _read_param(f: _Fields, key: str, param: Param):
    """One op-specific key (``ops.registry.Param``)."""
    required = param.default is REQUIRED
    if not f.has(key):
        if required:
            raise f.error(key, "is required", hint=param.help or None)
        return param.default
    kind = param.kind
    if kind == "int":
        return f.int(key, None, minimum=int(param.minimum if param.minimum is not None else 1))
    if kind == "float":
        v = f.float(key, 0.0, positive=param.minimum is None)
        if param.minimum is not None and v < param.minimum:
            raise f.error(key, f"must be >= {param.minimum:g}, got {v:g}", hint=param.help or None)
        return v
    if kind == "choice":
        return f.choice(key, param.choices, param.choices[0])
    if kind == "bool":
        v = f.raw(key)
        if not isinstance(v, bool):
            raise f.error(key, f"expected true or false, got {_show(v)}")
        return v
    if kind == "ints":
        return f.int_list(key, int(param.minimum if param.minimum is not None else 1), None, f"each {key} entry",
                          unique=True)
    if kind == "sizes":
        return f.int_list(key, int(param.minimum if param.minimum is not None else 1), None, f"each {key} entry")
    if kind == "choice-list":
        v = f.raw(key)
        if not isinstance(v, list) or not v:
            raise f.error(key, f"expected a non-empty list of {', '.join(param.choices)}, got {_show(v)}")
        for i, x in enumerate(v):
            if x not in param.choices:
                import difflib
                close = difflib.get_close_matches(str(x), param.choices, n=1)
                raise f.doc.error(f.where(key) + (i,), f"expected one of {', '.join(param.choices)}; got {_show(x)}",
                                  hint=f"did you mean '{close[0]}'?" if close else None)
            if x in v[:i]:
                raise f.doc.error(f.where(key) + (i,), f"{x} is listed twice", hint="list each once")
        return tuple(v)
    if kind == "choice-or-floats":
        v = f.raw(key)
        if isinstance(v, list):
            return tuple(_positive_float(f, key, i, x, signed=param.minimum is not None)
                         for i, x in enumerate(v)) if v else _empty(f, key)
        return f.choice(key, param.choices, param.choices[0])
    if kind == "path":
        v = f.raw(key)
        if not isinstance(v, str) or not v.strip():
            raise f.error(key, f"expected a file path (relative to the YAML file), got {_show(v)}",
                          hint=param.help or None)
        return v
    if kind == "mapping":
        return _read_mapping(f, key, param)
    raise AssertionError(f"unknown Param kind {kind}")


def _positive_float(f: _Fields, key: str, i: int, x, signed: bool = False) -> float:
    """A list's float > 0 (``signed``: any finite float)."""
    if isinstance(x, str):  # YAML 1.1 reads 1e300 (no dot) as a string, as the scalar keys accept it
        try:
            x = float(x)
        except ValueError:
            pass
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or (x <= 0 and not signed):
        raise f.doc.error(f.where(key) + (i,), f"expected a {'finite number' if signed else 'number > 0'}, "
                                               f"got {_show(x)}")
    return float(x)


def _empty(f: _Fields, key: str):
    raise f.error(key, "expected a non-empty list")


def _read_mapping(f: _Fields, key: str, param: Param) -> tuple:
    """A ``mapping`` Param: each of its ``fields`` read with its own Param (unknown keys get a did-you-mean)."""
    v = f.raw(key)
    names = tuple(name for name, _ in param.fields)
    if not isinstance(v, dict):
        raise f.error(key, f"expected a mapping with keys {', '.join(names)}, got {_show(v)}",
                      hint=f"e.g. '{key}: {{{names[0]}: ...}}'" if names else None)
    for sub in v:
        if sub not in names:
            import difflib
            close = difflib.get_close_matches(str(sub), names, n=1)
            raise f.doc.error(f.where(key) + (sub,), f"unknown key '{sub}' (keys of {key}: {', '.join(names)})",
                              hint=f"did you mean '{close[0]}'?" if close else None)
    inner = _Fields(f.doc, {sub: (val, f.where(key) + (sub,)) for sub, val in v.items()}, f.where(key))
    return tuple((name, _read_param(inner, name, sub)) for name, sub in param.fields)

