"""The scenario keys and their limits, and the typed readers of their values. Every error names the
file, line and key; an unknown key gets a did-you-mean."""
from __future__ import annotations

import math
import re
from typing import Any

from ..errors import ScenarioError, ScenarioErrors
from ..ops import OPS
from ..ops.registry import REQUIRED, Param
from .yaml_lines import _Doc, _show

MODES = ("full", "sample", "directional", "jvp", "hvp")
#: Elements differenced per tensor in mode sample, and random directions in mode directional, when unset.
DEFAULT_SAMPLES, DEFAULT_DIRECTIONS = 256, 16
#: Keys every op takes.
COMMON_KEYS = ("name", "op", "batch", "check", "dtype", "epsilon", "tolerance", "seed")
#: Keys of ops that contain attention (``Op.attention_keys``).
ATTENTION_KEYS = ("heads_q", "heads_kv", "kv_map", "n_q", "n_k", "d_head", "d_value", "scale", "mask", "loss_rows")
#: Keys of the ops that accept them (``Op.takes``): implementations, backends, engines and the engines' own.
BACKEND_KEYS = ("implementation", "backend", "device", "engine", "block_q", "block_k")
#: The engines ``engine:`` chooses between, over every op (``Op.engine_choices``).
ENGINES = tuple(dict.fromkeys(name for op in OPS.values() for name in op.engine_choices))
#: The calling convention of an attention implementation (``ops.convention``): op attention,
#: with an implementation only.
CONVENTION_KEYS = ("layout", "mask", "mask_heads", "scale")
SCENARIO_KEYS = tuple(dict.fromkeys(COMMON_KEYS[:2] + BACKEND_KEYS + ("convention",) + COMMON_KEYS[2:3]
                                    + ATTENTION_KEYS + COMMON_KEYS[3:]
                                    + tuple(k for op in OPS.values() for k in op.keys)))
MASK_KEYS = ("causal", "window", "key_lengths", "visible")
CHECK_KEYS = ("mode", "samples", "directions", "colouring", "factor", "slack", "nondet_tol", "timeout")
#: The values of ``backend:``, over every op (``Op.backends``).
BACKENDS = tuple(dict.fromkeys(b for op in OPS.values() for b in op.backends))
DEVICES = ("cpu", "cuda")
LOW_PRECISION = ("float16", "bfloat16")
NESTED = {"mask": MASK_KEYS, "check": CHECK_KEYS, "convention": CONVENTION_KEYS}
TOP_KEYS = ("defaults", "scenarios")
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
#: Larger scales only saturate the softmax (and overflow the logits near 1e300).
MAX_SCALE = 1e6
#: More random directions than this cost more than checking every element would.
MAX_DIRECTIONS = 100_000
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------------
# Typed readers: each returns the value or raises with the file, line and key.

class _Fields:
    """One scenario's keys merged over the defaults, each remembering the path it came from."""

    def __init__(self, doc: _Doc, values: dict[str, tuple[Any, tuple]], path: tuple):
        self.doc, self.values, self.path = doc, values, path

    def has(self, key: str) -> bool:
        return key in self.values and self.values[key][0] is not None

    def where(self, key: str) -> tuple:
        return self.values[key][1] if key in self.values else self.path + tuple(key.split("."))

    def error(self, key: str, message: str, hint: str | None = None) -> ScenarioError:
        return self.doc.error(self.where(key), message, hint)

    def raw(self, key: str, default: Any = None) -> Any:
        return self.values[key][0] if self.has(key) else default

    def int(self, key: str, default: Any = None, minimum: int = 1) -> int:
        if not self.has(key):
            if default is None:
                raise self.error(key, "is required", hint=f"add '{key.split('.')[-1]}: <integer >= {minimum}>'")
            return default
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"expected an integer, got {_show(v)}")
        if v < minimum:
            raise self.error(key, f"must be >= {minimum}, got {v}")
        return v

    def float(self, key: str, default: float, positive: bool = True) -> float:
        if not self.has(key):
            return default
        v = self.raw(key)
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise self.error(key, f"expected a number, got {_show(v)}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, f"expected a finite number, got {_show(v)}")
        if positive and v <= 0:
            raise self.error(key, f"must be > 0, got {v}")
        return float(v)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        if not self.has(key):
            return default
        v = self.raw(key)
        if v not in choices:
            import difflib
            close = difflib.get_close_matches(str(v), choices, n=1) if isinstance(v, str) else []
            raise self.error(key, f"expected one of {', '.join(choices)}; got {_show(v)}",
                             hint=f"did you mean '{close[0]}'?" if close else None)
        return v

    def int_list(self, key: str, lo: int, hi: int | None, what: str, unique: bool = False) -> tuple[int, ...] | None:
        if not self.has(key):
            return None
        v = self.raw(key)
        if not isinstance(v, list) or not v:
            raise self.error(key, f"expected a non-empty list of integers, got {_show(v)}")
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int):
                raise self.doc.error(self.where(key) + (i,), f"expected an integer, got {_show(x)}")
            if x < lo or (hi is not None and x > hi):
                bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise self.doc.error(self.where(key) + (i,), f"{x} is out of range: {what} must be {bounds}")
            if unique and x in v[:i]:
                raise self.doc.error(self.where(key) + (i,), f"{x} is listed twice", hint="list each once")
        return tuple(v)


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
            return tuple(_positive_float(f, key, i, x) for i, x in enumerate(v)) if v else _empty(f, key)
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


def _positive_float(f: _Fields, key: str, i: int, x) -> float:
    if isinstance(x, str):  # YAML 1.1 reads 1e300 (no dot) as a string, as the scalar keys accept it
        try:
            x = float(x)
        except ValueError:
            pass
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise f.doc.error(f.where(key) + (i,), f"expected a number > 0, got {_show(x)}")
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

