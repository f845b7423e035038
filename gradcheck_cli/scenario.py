"""YAML scenario files -> frozen ``Scenario`` records. Every error names the file, line and key.

Format (the key names are the contract):

    defaults: {...}          # optional: any scenario key except name; scenarios inherit them
    scenarios:
      - name: ...            # unique, [A-Za-z0-9._-]
        op: attention
        batch, heads_q, heads_kv, kv_map, n_q, n_k, d_head, d_value, scale
        mask: {causal, window, key_lengths, visible}
        loss_rows: [...]
        check: {mode, samples, directions}
        dtype, epsilon, tolerance, seed
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from . import files, implementation, masks
from .errors import GradcheckError, ScenarioError
from .ops import OPS
from .ops.registry import REQUIRED, Param
from .tolerance import DTYPES, defaults_for, machine_epsilon

MODES = ("full", "sample", "directional")
#: Keys every op takes.
COMMON_KEYS = ("name", "op", "batch", "check", "dtype", "epsilon", "tolerance", "seed")
#: Keys of ops that contain attention (``Op.attention_keys``).
ATTENTION_KEYS = ("heads_q", "heads_kv", "kv_map", "n_q", "n_k", "d_head", "d_value", "scale", "mask", "loss_rows")
#: Keys of op ``attention`` only: other implementations and backends.
BACKEND_KEYS = ("implementation", "backend", "device", "engine", "block_q", "block_k")
ENGINES = ("naive", "tiled")
SCENARIO_KEYS = tuple(dict.fromkeys(COMMON_KEYS[:2] + BACKEND_KEYS + COMMON_KEYS[2:3] + ATTENTION_KEYS + COMMON_KEYS[3:]
                                    + tuple(k for op in OPS.values() for k in op.keys)))
MASK_KEYS = ("causal", "window", "key_lengths", "visible")
CHECK_KEYS = ("mode", "samples", "directions", "colouring", "factor", "slack", "nondet_tol", "timeout")
BACKENDS = ("numpy", "torch")
DEVICES = ("cpu", "cuda")
LOW_PRECISION = ("float16", "bfloat16")
NESTED = {"mask": MASK_KEYS, "check": CHECK_KEYS}
TOP_KEYS = ("defaults", "scenarios")
#: The largest finite-difference step (relative to the inputs' scale) a scenario may ask for.
MAX_EPSILON = 0.1
#: The largest relative tolerance: a check blind to errors of this fraction of a gradient has no power
#: (verdict.POWER_LIMIT).
MAX_TOLERANCE = 0.25
#: Larger scales only saturate the softmax (and overflow the logits near 1e300).
MAX_SCALE = 1e6
#: More random directions than this cost more than checking every element would.
MAX_DIRECTIONS = 100_000
#: A document may hold at most this many values once YAML aliases are expanded.
MAX_VALUES = 1_000_000
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Scenario:
    name: str
    op: str
    batch: int
    heads_q: int
    heads_kv: int
    kv_map: tuple[int, ...]
    n_q: int
    n_k: int
    d_head: int
    d_value: int
    scale: float
    causal: str
    window: tuple[int | None, int | None] | None
    key_lengths: tuple[int, ...] | None
    visible_source: str | None
    loss_rows: tuple[int, ...] | None
    mode: str
    samples: int
    directions: int
    colouring: bool
    dtype: str
    epsilon: float
    tolerance: float
    seed: int
    file: str = ""
    line: int = 0
    index: int = 0  # position in the file's list of scenarios, after sweeps expand
    params: tuple = ()  # the op's own keys (``Op.keys``) as (key, value) pairs
    engine: str = "naive"
    block_q: int = 64
    block_k: int = 64
    implementation: str | None = None
    backend: str = "numpy"
    device: str = "cpu"
    factor: float = 2.0
    slack: float | None = None  # None: the dtype's default (tolerance.DEFAULT_SLACK)
    nondet_tol: float = 0.0
    visible: np.ndarray = field(default=None, repr=False, compare=False)
    base_dir: str = "."          # the YAML's folder: where ``implementation`` and mask files are found
    implementation_line: int = 0  # the line of the ``implementation`` key
    timeout: float = 900.0       # seconds an isolated run of an implementation may take (``check.timeout``)

    def p(self, key: str):
        """The value of the op-specific key ``key``."""
        return dict(self.params)[key]

    @property
    def implementation_object(self):
        """The user's implementation, imported on first use (in the process that checks it: the loader
        never runs user code). Raises ScenarioError, placed at the ``implementation`` key, when it
        cannot be imported or used."""
        if self.implementation is None:
            return None
        try:
            return implementation.load(self.implementation, Path(self.base_dir), flavour=self.backend)
        except implementation.LoadError as exc:
            raise ScenarioError(str(exc), file=self.file, line=self.implementation_line or self.line,
                                key=f"scenarios[{self.index}].implementation") from None

    def describe(self) -> str:
        spec = OPS[self.op]
        if spec.describe:
            return spec.describe(self)
        contiguous = self.heads_q % self.heads_kv == 0 and self.kv_map == default_kv_map(self.heads_q, self.heads_kv)
        kv = f"{self.heads_kv}" + ("" if contiguous else f" map={list(self.kv_map)}")
        if self.dtype in LOW_PRECISION:
            how = f"factor {self.factor:g} policy"
        else:
            how = f"{self.mode}{' coloured' if self.colouring else ''}"
        where = f" torch/{self.device}" if self.backend == "torch" else ""
        if self.engine == "tiled":
            where += f" tiled {self.block_q}x{self.block_k}"
        return (f"B={self.batch} Hq={self.heads_q} Hkv={kv} n_q={self.n_q} n_k={self.n_k} "
                f"d={self.d_head}/{self.d_value} {self.dtype}{where} {how}")


def default_kv_map(heads_q: int, heads_kv: int) -> tuple[int, ...]:
    """Contiguous groups: query head r reads KV head r // (heads_q / heads_kv)."""
    group = heads_q // heads_kv
    return tuple(r // group for r in range(heads_q))


# --------------------------------------------------------------------------------------------------
# YAML with line numbers

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 3


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _show(value: Any) -> str:
    """A value as error messages echo it: its repr, cut to a readable length (a 10 MB string is not
    repeated back)."""
    return _SHORT.repr(value)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        return f"unacceptable character {exc.character!r} (only printable UTF-8 text is allowed)"
    return getattr(exc, "problem", None) or str(exc).splitlines()[0]


def _yaml_line(exc: yaml.YAMLError, text: str) -> int | None:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return mark.line + 1
    position = getattr(exc, "position", None)
    return text.count("\n", 0, position) + 1 if position is not None else None


def _key(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


#: The tags of YAML's core schema (and the merge key '<<', and timestamps, which YAML 1.1 resolves
#: plain dates to: the field readers refuse them by type). Any other tag is refused where it stands.
SAFE_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "str", "seq", "map",
                                                          "merge", "timestamp"))


class _Doc:
    """A parsed YAML document and the line of every key and item in it."""

    def __init__(self, text: str, file: str):
        self.file = file
        self.lines: dict[tuple, int] = {}
        self.values = 0
        self._constructor = yaml.SafeLoader("")
        try:
            node = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            self.value = self._convert(node, ()) if node is not None else None
        except yaml.YAMLError as exc:
            raise ScenarioError(f"not valid YAML: {_yaml_problem(exc)}", file=file, line=_yaml_line(exc, text)) from None
        except RecursionError:
            raise ScenarioError("the YAML is nested too deeply to be a scenario file", file=file) from None

    def _convert(self, node, path: tuple) -> Any:
        if node.tag not in SAFE_TAGS:  # explicit tags outside YAML's core schema (!!python/object, !custom, ...)
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ScenarioError(f"the YAML tag {_show(tag)} is not allowed: scenario files hold plain "
                                "mappings, lists, strings, numbers, booleans and nulls", file=self.file,
                                line=node.start_mark.line + 1, key=_key(path) or None,
                                hint="remove the tag")
        self.values += 1
        if self.values > MAX_VALUES:
            raise ScenarioError(f"the document expands to more than {MAX_VALUES:,} values (YAML aliases?)",
                                file=self.file, line=node.start_mark.line + 1)
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict = {}
            merged: dict = {}
            for k_node, v_node in node.value:
                if k_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges, explicit keys win
                    sources = v_node.value if isinstance(v_node, yaml.SequenceNode) else [v_node]
                    for source in sources:
                        value = self._convert(source, path)
                        if not isinstance(value, dict):
                            raise self.error(path, "'<<' must merge a mapping")
                        merged = {**value, **merged}
                    continue
                if not isinstance(k_node, yaml.ScalarNode):  # a list or mapping as a key
                    kind = "a list" if isinstance(k_node, yaml.SequenceNode) else "a mapping"
                    raise ScenarioError(f"keys must be names, got {kind}", file=self.file,
                                        line=k_node.start_mark.line + 1, key=_key(path) or None)
                key = self._constructor.construct_object(k_node)
                if not isinstance(key, str):
                    raise ScenarioError(f"keys must be names, got {_show(key)}", file=self.file,
                                        line=k_node.start_mark.line + 1, key=_key(path) or None)
                if key in out:
                    raise ScenarioError(f"duplicate key '{key}'", file=self.file,
                                        line=k_node.start_mark.line + 1, key=_key(path + (key,)),
                                        hint="give each key once")
                self.lines[path + (key,)] = k_node.start_mark.line + 1
                out[key] = self._convert(v_node, path + (key,))
            return {**merged, **out}
        if isinstance(node, yaml.SequenceNode):
            return [self._convert(item, path + (i,)) for i, item in enumerate(node.value)]
        return self._constructor.construct_object(node)

    def line(self, path: tuple) -> int | None:
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path)

    def error(self, path: tuple, message: str, hint: str | None = None) -> ScenarioError:
        return ScenarioError(message, file=self.file, line=self.line(path), key=_key(path) or None, hint=hint)


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
    """Flatten defaults then the scenario into {'key' or 'mask.causal': (value, path)}."""
    out: dict[str, tuple[Any, tuple]] = {}
    for source, base in ((defaults, ("defaults",)), (scenario, ("scenarios", index))):
        for key, value in source.items():
            if key == "sweep":
                continue
            path = base + (key,)
            allowed = SCENARIO_KEYS if source is scenario else tuple(k for k in SCENARIO_KEYS if k != "name")
            if key not in allowed:
                owner = next((n for n, subkeys in NESTED.items() if key in subkeys), None)
                hint = f"'{key}' belongs under '{owner}:' ({owner}: {{{key}: ...}})" if owner else _suggest(key, allowed)
                raise doc.error(path, f"unknown key '{key}'", hint=hint)
            if key in NESTED:
                if value is not None:
                    out.update(_nested(doc, key, value, path))
            else:
                out[key] = (value, path)
    return out


def _nested(doc: _Doc, key: str, value: Any, path: tuple) -> dict[str, tuple[Any, tuple]]:
    """A ``mask`` or ``check`` mapping flattened to {'mask.causal': (value, path)}, its keys checked."""
    if not isinstance(value, dict):
        raise doc.error(path, f"expected a mapping with keys {', '.join(NESTED[key])}, got {_show(value)}")
    out = {}
    for sub, subvalue in value.items():
        if sub not in NESTED[key]:
            raise doc.error(path + (sub,), f"unknown key '{sub}'", hint=_suggest(sub, NESTED[key]))
        out[f"{key}.{sub}"] = (subvalue, path + (sub,))
    return out


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


def _suggest(key: str, allowed: tuple[str, ...]) -> str:
    import difflib
    close = difflib.get_close_matches(key, allowed, n=1)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(allowed)}"


# --------------------------------------------------------------------------------------------------

def cgroup_room(root: str | os.PathLike = "/sys/fs/cgroup") -> list[int]:
    """Bytes left under the cgroup's memory limit: v2's memory.max - memory.current, v1's
    memory/memory.limit_in_bytes - memory/memory.usage_in_bytes (each where it is set)."""
    root = Path(root)
    out = []
    for cap_file, used_file in (("memory.max", "memory.current"),
                                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = (root / cap_file).read_text().strip()
            if cap != "max" and int(cap) < 2**60:  # v1 writes "no limit" as a number near 2^63
                out.append(int(cap) - int((root / used_file).read_text()))
        except (OSError, ValueError):
            pass
    return out


def available_memory() -> int:
    """Bytes this process may still use: the least of MemAvailable, the cgroup's limit minus what the
    cgroup uses (cgroup v2's memory.max, or v1's memory.limit_in_bytes), and the address-space rlimit
    (where each is known)."""
    limits = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limits += cgroup_room()
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return max(0, min(limits))


def _parse_scenario(doc: _Doc, f: _Fields, base_dir: Path, memory_limit: int) -> Scenario:
    name = f.raw("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise f.error("name", f"expected a name of letters, digits, '.', '_' or '-', got {_show(name)}"
                      if name is not None else "is required", hint="e.g. 'name: causal-gqa'")
    op = f.choice("op", tuple(OPS), "attention")
    op_spec = OPS[op]
    common = COMMON_KEYS if op_spec.common_keys is None else op_spec.common_keys
    allowed = set(common) | set(op_spec.keys) | (set(ATTENTION_KEYS) if op_spec.attention_keys else set())
    allowed |= set(BACKEND_KEYS) if op == "attention" else set()
    for key in f.values:
        top = key.split(".")[0]
        if top not in allowed or (op != "attention" and key in ("check.factor", "check.slack", "check.nondet_tol",
                                                               "check.timeout")):
            owners = [o.name for o in OPS.values() if top in o.keys or (top in ATTENTION_KEYS and o.attention_keys)
                      or (top in BACKEND_KEYS + ("check",) and o.name == "attention")]
            raise f.error(key, f"does not apply to op {op}" + (f" (it is a key of {', '.join(owners)})" if owners else ""),
                          hint=f"keys of op {op}: {', '.join(sorted(allowed - {'name', 'op'}))}")
    if not op_spec.attention_keys:
        return _parse_plain(doc, f, name, op, base_dir, memory_limit)
    batch = f.int("batch", 1)
    heads_q = f.int("heads_q", 1)
    n_q = f.int("n_q")
    n_k = f.int("n_k", n_q)
    d_head = f.int("d_head")
    d_value = f.int("d_value", d_head)

    if f.has("kv_map"):
        kv_map = f.int_list("kv_map", 0, heads_q - 1, "a KV head index (every KV head serves a query head, so "
                                                      "there are at most heads_q of them)")
        if len(kv_map) != heads_q:
            raise f.error("kv_map", f"has {len(kv_map)} entries but heads_q is {heads_q}",
                          hint="give one KV head index per query head")
        heads_kv = f.int("heads_kv", max(kv_map) + 1)
        bad = [g for g in kv_map if g >= heads_kv]
        if bad:
            raise f.error("kv_map", f"KV head {bad[0]} is out of range for heads_kv={heads_kv}",
                          hint=f"use indices 0..{heads_kv - 1} or raise heads_kv")
        if heads_kv > heads_q:  # checked before anything of size heads_kv is built
            raise f.error("heads_kv", f"{heads_kv} KV heads for {heads_q} query heads: some KV head would serve no "
                          "query head", hint="every KV head must serve at least one query head; lower heads_kv")
        unused = sorted(set(range(heads_kv)) - set(kv_map))
        if unused:
            raise f.error("kv_map", f"KV head {unused[0]} of heads_kv={heads_kv} is read by no query head",
                          hint="every KV head must serve at least one query head; lower heads_kv")
    else:
        heads_kv = f.int("heads_kv", heads_q)
        if heads_q % heads_kv:
            raise f.error("heads_kv", f"{heads_kv} does not divide heads_q={heads_q}",
                          hint="use a divisor of heads_q, or give an explicit kv_map")
        kv_map = None  # built after the memory check (heads_q may be absurd)

    scale = f.float("scale", 1.0 / math.sqrt(d_head), positive=False)
    if scale == 0 or abs(scale) > MAX_SCALE:
        raise f.error("scale", f"must be non-zero and within +-{MAX_SCALE:g}, got {scale:g}",
                      hint="omit it for 1/sqrt(d_head)")

    backend = f.choice("backend", BACKENDS, "numpy")
    device = f.choice("device", DEVICES, "cpu")
    dtype = f.choice("dtype", DTYPES + (LOW_PRECISION if op == "attention" else ()), "float64")
    if backend == "torch" or device != "cpu" or dtype in LOW_PRECISION:
        _require_torch(f, backend, device, dtype)
    engine = f.choice("engine", ENGINES, "naive")
    block_q, block_k = f.int("block_q", 64), f.int("block_k", 64)
    if engine == "tiled" and (backend != "numpy" or f.has("implementation")):
        raise f.error("engine", "engine: tiled is the built-in NumPy engine's; it does not apply to "
                      + ("backend: torch" if backend != "numpy" else "an implementation of yours"),
                      hint="remove engine, or the backend / implementation")
    for key in ("block_q", "block_k"):
        if f.has(key) and engine != "tiled":
            raise f.error(key, "block sizes apply to engine: tiled", hint="add 'engine: tiled' or remove it")
    factor = f.float("check.factor", 2.0)
    slack = f.float("check.slack", None, positive=False)
    if slack is not None and slack < 0:
        raise f.error("check.slack", f"must be >= 0, got {slack}")
    nondet_tol = f.float("check.nondet_tol", 0.0, positive=False)
    if f.has("check.nondet_tol") and not f.has("implementation") and f.where("check.nondet_tol")[0] != "defaults":
        raise f.error("check.nondet_tol", "applies to a scenario with an implementation: the built-in engines are "
                      "deterministic and are not run twice", hint="remove it, or add 'implementation: module:attribute'")
    if nondet_tol < 0:
        raise f.error("check.nondet_tol", f"must be >= 0, got {nondet_tol}",
                      hint="0 (the default) requires two calls on the same inputs to agree bit for bit")
    timeout = f.float("check.timeout", 900.0)
    if f.has("check.timeout") and not f.has("implementation") and f.where("check.timeout")[0] != "defaults":
        raise f.error("check.timeout", "applies to a scenario with an implementation (run in a process of its own, "
                      "stopped after this many seconds)", hint="remove it, or add 'implementation: module:attribute'")
    dtype, epsilon, tolerance, seed, mode, samples, directions, colouring = _precision_and_check(
        f, dtype, op == "attention")

    causal = "none" if f.raw("mask.causal") in (None, "none") else f.choice("mask.causal", masks.CAUSAL, "none")
    window = None
    if f.has("mask.window"):
        w = f.raw("mask.window")
        if not isinstance(w, list) or len(w) != 2:
            raise f.error("mask.window", f"expected [left, right], got {_show(w)}",
                          hint="e.g. window: [4, 0]; null or -1 means unbounded on that side")
        sides = []
        for i, x in enumerate(w):
            if x is None or x == -1:
                sides.append(None)
            elif isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise doc.error(f.where("mask.window") + (i,), f"expected an integer >= 0, null or -1, got {_show(x)}")
            else:
                sides.append(x)
        window = (sides[0], sides[1])
    key_lengths = f.int_list("mask.key_lengths", 0, n_k, "a key length")
    if key_lengths is not None and len(key_lengths) != batch:
        raise f.error("mask.key_lengths", f"has {len(key_lengths)} entries but batch is {batch}",
                      hint="give one valid-key count per batch element")
    loss_rows = f.int_list("loss_rows", 0, n_q - 1, "a query row", unique=True)

    # Estimate memory before allocating anything of size n_q x n_k: about ten score-sized arrays for
    # the forward, backward and invariants, plus one (+h, -h) pair of perturbed copies (see numeric.plan).
    # The tensors (q, k, v, o and their gradients, analytic and numeric) count about a dozen times.
    params = {key: _read_param(f, key, param) for key, param in op_spec.keys.items()}
    need = attention_need(batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, dtype, engine, block_q, block_k)
    if op_spec.shapes and op != "attention":  # the op's own weights and activations, counted like a plain op's
        need += _plain_need(op_spec, _Probe(batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, params))
    if need > memory_limit:
        raise doc.error(f.path, f"scenario '{name}' needs about {need / 2**30:.1f} GiB "
                        f"({batch}x{heads_q}x{n_q}x{n_k} score blocks, d_head={d_head}, d_value={d_value}"
                        + ("" if op == "attention" else f", and the weights of op {op}") + "), "
                        f"more than the {memory_limit / 2**30:.1f} GiB available",
                        hint="reduce batch, heads, n_q, n_k or the head dimensions"
                             + ("" if op == "attention" else " (or d_model, d_ff)"))
    if kv_map is None:
        kv_map = default_kv_map(heads_q, heads_kv)

    spec, spec_line = None, 0
    if f.has("implementation"):
        spec = f.raw("implementation")
        if not isinstance(spec, str):
            raise f.error("implementation", f"expected 'module:attribute', got {_show(spec)}")
        try:
            implementation.locate(spec, base_dir)  # found, not run: the loader never runs user code
        except implementation.LoadError as exc:
            raise f.error("implementation", str(exc)) from None
        spec_line = doc.line(f.where("implementation")) or 0

    explicit, source = None, None
    if f.has("mask.visible"):
        explicit, source = _load_visible(f, base_dir, (batch, heads_q, n_q, n_k))
    visible = masks.build_visible(batch, heads_q, n_q, n_k, causal=causal, window=window,
                                  key_lengths=key_lengths, explicit=explicit)
    empty = masks.first_empty_row(visible)
    if empty is not None:
        b, h, i = empty
        constraints = [c for c, on in (("causal", causal != "none"), ("window", window is not None),
                                       ("key_lengths", key_lengths is not None), ("visible", explicit is not None)) if on]
        given = [k for k in ("mask.visible", "mask.key_lengths", "mask.window", "mask.causal") if f.has(k)]
        swept = [k for k in given if "sweep" in f.where(k)]
        raise doc.error(f.where((swept or given)[0]) if given else f.path,
                        f"query row {i} of batch {b}, head {h} sees no key (mask: {', '.join(constraints)})",
                        hint="every query row needs at least one visible key; widen the window, raise "
                             "key_lengths, or check the causal alignment for n_q != n_k")

    attention = {"batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "n_q": n_q, "n_k": n_k, "d_head": d_head,
                 "d_value": d_value}
    for key, message, hint in (op_spec.validate(params, attention) if op_spec.validate else []):
        raise f.error(key, message, hint=hint)
    return Scenario(name=name, op=op, batch=batch, heads_q=heads_q, heads_kv=heads_kv, kv_map=tuple(kv_map),
                    n_q=n_q, n_k=n_k, d_head=d_head, d_value=d_value, scale=scale, causal=causal,
                    window=window, key_lengths=key_lengths, visible_source=source, loss_rows=loss_rows,
                    mode=mode, samples=samples, directions=directions, colouring=colouring, dtype=dtype, epsilon=epsilon,
                    tolerance=tolerance, seed=seed, file=doc.file, line=doc.line(f.path) or 0,
                    implementation=spec, backend=backend, device=device, factor=factor, slack=slack, nondet_tol=nondet_tol,
                    visible=visible, base_dir=str(base_dir), implementation_line=spec_line, timeout=timeout, params=tuple(params.items()), engine=engine,
                    block_q=block_q, block_k=block_k)


def _precision_and_check(f: _Fields, dtype: str, colouring_default: bool = True):
    """The keys every op shares: (dtype, epsilon, tolerance, seed, mode, samples, directions, colouring)."""
    dflt = defaults_for(dtype)
    epsilon = f.float("epsilon", dflt["epsilon"])
    if epsilon > MAX_EPSILON:
        raise f.error("epsilon", f"{epsilon:g} is too large a step: central differences converge only as the step "
                      f"shrinks (error ~ step^2), and beyond {MAX_EPSILON:g} x the inputs' scale they estimate nothing "
                      "a verdict could rest on", hint=f"omit it for the {dtype} default ({dflt['epsilon']:g}); "
                      "'attn-gradcheck sweep-eps' shows the error against the step")
    resolution = machine_epsilon(dtype)
    if epsilon < 8 * resolution and dtype not in LOW_PRECISION:  # no finite differences in half precision
        raise f.error("epsilon", f"{epsilon:g} is below what {dtype} can resolve ({resolution:.2g}): the "
                      "perturbed values would round back", hint=f"use at least {8 * resolution:.2g}")
    tolerance = f.float("tolerance", dflt["tolerance"])
    if tolerance > MAX_TOLERANCE:
        raise f.error("tolerance", f"{tolerance:g} would accept gradients wrong by {tolerance:.0%} of their size (a "
                      f"zero gradient at 1): a check that blind cannot pass anything; at most {MAX_TOLERANCE:g}",
                      hint=f"omit it for the {dtype} default ({dflt['tolerance']:g}); for float16/bfloat16 the "
                           "check.factor / check.slack policy applies")
    seed = f.int("seed", 0, minimum=0)
    mode = f.choice("check.mode", MODES, "full")
    samples = f.int("check.samples", 256)
    directions = f.int("check.directions", 16)
    if directions > MAX_DIRECTIONS:
        raise f.error("check.directions", f"at most {MAX_DIRECTIONS:,} directions, got {directions:,}",
                      hint="use mode: full to check every element")
    colouring = f.raw("check.colouring", mode == "full" and colouring_default)
    if not isinstance(colouring, bool):
        raise f.error("check.colouring", f"expected true or false, got {_show(colouring)}")
    if colouring and mode != "full" and f.has("check.colouring"):
        raise f.error("check.colouring", f"colouring applies to mode full only (mode is {mode})",
                      hint="remove colouring, or use mode: full")
    if colouring and not colouring_default:
        raise f.error("check.colouring", "this op has no independent output blocks to colour",
                      hint="remove colouring (it applies to op attention)")
    return dtype, epsilon, tolerance, seed, mode, samples, directions, colouring and mode == "full"


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
    raise AssertionError(f"unknown Param kind {kind}")


def _parse_plain(doc: _Doc, f: _Fields, name: str, op: str, base_dir: Path, memory_limit: int) -> Scenario:
    """A scenario of an op without attention keys: the shared keys, then the op's own (``Op.keys``)."""
    spec = OPS[op]
    batch = f.int("batch", 1)
    dtype = f.choice("dtype", DTYPES, "float64")
    dtype, epsilon, tolerance, seed, mode, samples, directions, _ = _precision_and_check(f, dtype, False)
    params = {key: _read_param(f, key, param) for key, param in spec.keys.items()}
    for key, message, hint in (spec.validate(params, {"batch": batch}) if spec.validate else []):
        raise f.error(key, message, hint=hint)
    sc = Scenario(name=name, op=op, batch=batch, heads_q=1, heads_kv=1, kv_map=(0,), n_q=0, n_k=0, d_head=0,
                  d_value=0, scale=1.0, causal="none", window=None, key_lengths=None, visible_source=None,
                  loss_rows=None, mode=mode, samples=samples, directions=directions, colouring=False, dtype=dtype,
                  epsilon=epsilon, tolerance=tolerance, seed=seed, file=doc.file, line=doc.line(f.path) or 0,
                  params=tuple(params.items()))
    if spec.shapes:
        need = _plain_need(spec, sc)
        if need > memory_limit:
            raise doc.error(f.path, f"scenario '{name}' needs about {need / 2**30:.1f} GiB, more than the "
                            f"{memory_limit / 2**30:.1f} GiB available", hint="reduce its sizes")
    return sc


def attention_need(batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, dtype, engine="naive", block_q=64,
                   block_k=64) -> int:
    """Bytes attention needs before anything of size n_q x n_k is allocated: about ten score-sized
    arrays for the naive engine's forward, backward and invariants plus one (+h, -h) pair of copies
    (see numeric.plan); for the tiled engine only the visible set (bytes) and block-sized scores. The
    tensors (q, k, v, o and their gradients, analytic and numeric) count about a dozen times."""
    itemsize = {"float16": 2, "bfloat16": 2}.get(dtype) or np.dtype(dtype).itemsize
    scores = batch * heads_q * n_q * n_k
    tensors = batch * (heads_q * n_q * (d_head + d_value) + heads_kv * n_k * (d_head + d_value))
    if engine == "tiled":
        return (scores * 2 + batch * heads_q * min(block_q, n_q) * min(block_k, n_k) * 16 * itemsize
                + batch * heads_q * 256 * n_k * 3 * 8 + tensors * 12 * 8)
    return scores * (16 * itemsize + 2) + tensors * 12 * 8


def _plain_need(spec, sc) -> int:
    """Bytes an op without attention's estimate needs: its tensors about 64 times over (inputs,
    gradients, copies, the wider-type forward) and what it declares beyond them."""
    elements = sum(math.prod(shape) for shape in spec.shapes(sc).values())
    return elements * 64 * 8 + (spec.memory(sc) if spec.memory else 0)


class _Probe:
    """Enough of a Scenario for ``Op.shapes`` before the Scenario exists (attention-keyed ops)."""

    def __init__(self, batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, params: dict):
        self.batch, self.heads_q, self.heads_kv, self.n_q, self.n_k = batch, heads_q, heads_kv, n_q, n_k
        self.d_head, self.d_value = d_head, d_value
        self._params = params

    def p(self, key: str):
        return self._params[key]


def _require_torch(f: _Fields, backend: str, device: str, dtype: str) -> None:
    """Torch scenarios need torch (and cuda a GPU): say how to get it before anything runs."""
    key = "backend" if f.has("backend") else ("device" if f.has("device") else "dtype")
    if backend != "torch":
        what = f"device {device}" if device != "cpu" else f"dtype {dtype}"
        raise f.error(key, f"{what} needs backend: torch", hint="add 'backend: torch'")
    try:
        import torch
    except ImportError:
        raise f.error(key, "this scenario needs torch, which is not installed",
                      hint="pip install 'attn-gradcheck[torch]', or pin a build, e.g. pip install torch==2.13.0; "
                           "an unpinned torch may pull a large CUDA build") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise f.error("device", "device cuda was asked for but torch sees no CUDA device",
                      hint="use device: cpu, or run on a machine with a GPU and a CUDA build of torch")


def _load_visible(f: _Fields, base_dir: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    raw = f.raw("mask.visible")
    if isinstance(raw, str):
        path = base_dir / raw
        try:
            arr = files.load_npy(path, max_elements=math.prod(shape))
        except files.FileProblem as exc:
            raise f.error("mask.visible", f"{_show(raw)} {exc}",
                          hint="give a .npy file of booleans, relative to the YAML file, written with "
                               "numpy.save(path, mask.astype(bool))") from None
        source = raw
    elif isinstance(raw, list):
        depth, inner = 0, raw
        while isinstance(inner, list) and depth <= 4:
            depth, inner = depth + 1, inner[0] if inner else None
        if depth > 4:
            raise f.error("mask.visible", "an inline mask is nested more than 4 lists deep; a mask has at most 4 "
                                          "dimensions ([batch, heads_q, n_q, n_k])")
        try:
            arr = np.array(raw)
        except ValueError:
            raise f.error("mask.visible", "inline mask rows must all have the same length") from None
        source = "inline"
    else:
        raise f.error("mask.visible", f"expected a .npy path or a nested list of booleans, got {_show(raw)}")
    if arr.ndim > 4:
        raise f.error("mask.visible", f"has {arr.ndim} dimensions; a mask has at most 4 ([batch, heads_q, n_q, n_k])")
    if arr.dtype != bool:
        if arr.dtype.kind in "iu" and arr.size and np.isin(arr, (0, 1)).all():
            arr = arr.astype(bool)
        else:
            raise f.error("mask.visible", f"expected booleans (True = visible) or the integers 0 and 1, got dtype "
                                          f"{arr.dtype}" + (" with other values" if arr.dtype.kind in "iu" else ""))
    try:
        np.broadcast_shapes(arr.shape, shape)
        if np.broadcast_shapes(arr.shape, shape) != shape:
            raise ValueError
    except ValueError:
        raise f.error("mask.visible", f"shape {list(arr.shape)} does not broadcast to "
                      f"[batch, heads_q, n_q, n_k] = {list(shape)}",
                      hint="use [n_q, n_k] or a shape broadcastable to [batch, heads_q, n_q, n_k]") from None
    return arr, source


def load(path: str | os.PathLike, *, memory_limit: int | None = None) -> list[Scenario]:
    """Read and validate every scenario of a YAML file; raises ``ScenarioError`` on the first problem."""
    if "\x00" in os.fspath(path):
        raise ScenarioError("the path contains a NUL byte", file=repr(os.fspath(path)))
    path = Path(path)
    try:  # a folder, a FIFO, a device, a name too long: one message each
        data = files.read_regular(path, files.MAX_CONFIG_BYTES)
    except files.FileProblem as exc:
        raise ScenarioError(str(exc), file=str(path), hint="give a YAML scenario file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError("not UTF-8 text", file=str(path), line=data.count(b"\n", 0, exc.start) + 1,
                            hint="save the file as UTF-8") from None
    return loads(text, file=str(path), base_dir=path.parent, memory_limit=memory_limit)


def loads(text: str, *, file: str = "<string>", base_dir: str | os.PathLike = ".",
          memory_limit: int | None = None) -> list[Scenario]:
    """Like :func:`load`, from a string."""
    doc = _Doc(text, file)
    top = doc.value
    if not isinstance(top, dict):
        raise doc.error((), "expected a mapping with a 'scenarios' list at the top level",
                        hint="see configs/quickstart.yaml")
    for key in top:
        if key not in TOP_KEYS and not key.startswith("x-"):
            raise doc.error((key,), f"unknown top-level key '{key}'",
                            hint=_suggest(key, TOP_KEYS) + "; keys starting with 'x-' are ignored (for YAML anchors)")
    defaults = top.get("defaults")
    defaults = {} if defaults is None else defaults  # 'defaults:' with nothing under it
    if not isinstance(defaults, dict):
        raise doc.error(("defaults",), f"expected a mapping, got {_show(defaults)}")
    items = top.get("scenarios")
    if not isinstance(items, list) or not items:
        raise doc.error(("scenarios",), "expected a non-empty list of scenarios",
                        hint="add 'scenarios:' with at least one '- name: ...' item")
    limit = available_memory() if memory_limit is None else memory_limit
    seen: dict[str, int] = {}
    out = []
    held = 0  # bytes of the masks the scenarios loaded so far hold (a sweep of cases that each fit may not)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise doc.error(("scenarios", i), f"expected a mapping, got {_show(item)}")
        flat = _merge(doc, defaults, item, i)
        cases: dict = {}
        for suffix, case in _sweep_cases(doc, flat, _sweep_axes(doc, defaults, item, i), i):
            try:
                sc = _parse_scenario(doc, _Fields(doc, case, ("scenarios", i)), Path(base_dir), limit)
            except ScenarioError as exc:
                if suffix:
                    exc.message += f" (in the sweep case {item.get('name')}{suffix})"
                raise
            sc = dataclasses.replace(sc, name=sc.name + suffix, index=len(out))
            held += sc.visible.nbytes if sc.visible is not None else 0
            if held > limit // 2:
                raise doc.error(("scenarios", i), f"the scenarios up to {sc.name} hold masks of {_size(held)} "
                                f"together, more than half of the {_size(limit)} available",
                                hint="sweep fewer cases or smaller shapes, or split the file")
            if suffix:  # two spellings of one value (1e-6 and 1.0e-6) make the same scenario twice
                digest = hashlib.sha256(sc.visible.tobytes()).hexdigest() if sc.visible is not None else ""
                same = (dataclasses.replace(sc, name="", index=0), digest)
                if same in cases:
                    raise doc.error(("scenarios", i, "sweep"), f"the sweep cases {cases[same]} and {sc.name} are the "
                                    "same scenario", hint="list each value once")
                cases[same] = sc.name
            if sc.name in seen:
                raise doc.error(("scenarios", i, "name"), f"duplicate scenario name '{sc.name}' "
                                f"(first at scenarios[{seen[sc.name]}])", hint="names must be unique")
            seen[sc.name] = i
            out.append(sc)
    return out


def read_files(scenarios: list[Scenario]) -> list[str]:
    """The files checking these scenarios reads besides the scenario file: mask files and the modules of
    implementations (a run never writes a report over any of them)."""
    out: list[str] = []
    for sc in scenarios:
        if sc.visible_source and sc.visible_source != "inline":
            out.append(str(Path(sc.base_dir) / sc.visible_source))
        if sc.implementation:
            out += [str(p) for p in implementation.source_files(sc.implementation, Path(sc.base_dir))]
    return list(dict.fromkeys(out))


def with_engine(scenarios: list[Scenario], engine: str | None, *, memory_limit: int | None = None) -> list[Scenario]:
    """The scenarios with ``engine`` where it applies (op attention on the NumPy engine, not a user's
    implementation); the others unchanged."""
    if engine is None:
        return list(scenarios)
    out, limit = [], memory_limit
    for sc in scenarios:
        if sc.op == "attention" and sc.backend == "numpy" and sc.implementation is None:
            if engine == "naive" and sc.engine == "tiled":  # the naive engine needs the n x n arrays
                limit = available_memory() if limit is None else limit
                need = attention_need(sc.batch, sc.heads_q, sc.heads_kv, sc.n_q, sc.n_k, sc.d_head, sc.d_value,
                                      sc.dtype)
                if need > limit:
                    raise ScenarioError(f"--engine naive: scenario '{sc.name}' needs about {need / 2**30:.1f} GiB "
                                        f"on the naive engine, more than the {limit / 2**30:.1f} GiB available",
                                        file=sc.file, line=sc.line, hint="keep its engine: tiled")
            sc = dataclasses.replace(sc, engine=engine)
        out.append(sc)
    return out


def select(scenarios: list[Scenario], include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[Scenario]:
    """Scenarios whose name matches any ``include`` glob (all when none is given) and no ``exclude``
    glob. Globs match the whole name (``fnmatch``): a plain name selects exactly that scenario (also a
    generated sweep name such as ``causal[n_q=1]``, whose brackets would otherwise be a glob class),
    ``'*gqa*'`` every name containing gqa."""
    import fnmatch
    def matches(name: str, patterns) -> bool:
        return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)

    chosen = [sc for sc in scenarios if (not include or matches(sc.name, include)) and not matches(sc.name, exclude)]
    if not chosen:
        names = ", ".join(sc.name for sc in scenarios)
        given = " ".join([f"--select '{p}'" for p in include] + [f"--deselect '{p}'" for p in exclude])
        raise GradcheckError(f"no scenario is left by {given} (scenarios: {names}); patterns are globs over "
                             f"whole names, e.g. '*gqa*'")
    return chosen


def json_schema() -> dict:
    """A JSON Schema (draft 2020-12) of the scenario file, for editors (yaml-language-server) and CI.
    The loader stays the authority: it also checks what a schema cannot (shapes, masks, memory)."""
    pos = {"type": "integer", "minimum": 1}
    ints = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    side = {"oneOf": [{"type": "null"}, {"type": "integer", "minimum": -1}]}
    number = {"oneOf": [{"type": "number"}, {"type": "string"}]}
    mask = {"type": "object", "additionalProperties": False, "properties": {
        "causal": {"enum": list(masks.CAUSAL) + [None], "description": "upper-left: j <= i; lower-right: j <= i + n_k - n_q"},
        "window": {"type": "array", "items": side, "minItems": 2, "maxItems": 2,
                   "description": "(left, right) around the diagonal, as FlashAttention's window_size"},
        "key_lengths": {**ints, "description": "valid keys per batch element"},
        "visible": {"oneOf": [{"type": "string"}, {"type": "array"}],
                    "description": ".npy path (relative to the YAML) or nested list; True = visible"}}}
    check = {"type": "object", "additionalProperties": False, "properties": {
        "mode": {"enum": list(MODES)}, "samples": pos, "directions": {**pos, "maximum": MAX_DIRECTIONS},
        "colouring": {"type": "boolean"}, "factor": number, "slack": number, "nondet_tol": number,
        "timeout": number}}
    fields = {
        "name": {"type": "string", "pattern": NAME_RE.pattern},
        "op": {"enum": sorted(OPS)},
        "implementation": {"type": "string", "pattern": implementation.SPEC_RE.pattern},
        "backend": {"enum": list(BACKENDS)}, "device": {"enum": list(DEVICES)},
        "batch": pos, "heads_q": pos, "heads_kv": pos, "kv_map": ints, "n_q": pos, "n_k": pos,
        "d_head": pos, "d_value": pos, "scale": number, "mask": mask, "loss_rows": ints, "check": check,
        "dtype": {"enum": list(DTYPES) + list(LOW_PRECISION)}, "epsilon": {**number, "maximum": MAX_EPSILON},
        "tolerance": {**number, "maximum": MAX_TOLERANCE},
        "seed": {"type": "integer", "minimum": 0},
        "engine": {"enum": list(ENGINES), "description": "naive (default) or tiled (FlashAttention-style: online "
                   "softmax, log-sum-exp, no n_q x n_k arrays)"},
        "block_q": {**pos, "description": "engine tiled: query rows per block (default 64)"},
        "block_k": {**pos, "description": "engine tiled: key rows per block (default 64)"},
    }
    for op in OPS.values():
        for key, param in op.keys.items():
            if key in fields:
                continue
            low = int(param.minimum if param.minimum is not None else 1)
            kind = {"int": {"type": "integer", "minimum": low},
                    "float": number, "bool": {"type": "boolean"}, "choice": {"enum": list(param.choices)},
                    "ints": {"type": "array", "items": {"type": "integer", "minimum": low}, "minItems": 1,
                             "uniqueItems": True}}[param.kind]
            if param.kind == "int" and param.default is None:
                kind = {"oneOf": [{"type": "null"}, kind]}
            helps = {o.name: o.keys[key].help for o in OPS.values() if key in o.keys}
            fields[key] = {**kind, "description": "; ".join(f"op {name}: {text}" for name, text in helps.items())}
    assert set(fields) == set(SCENARIO_KEYS), "the schema must list every scenario key"
    sweepable = [k for k in SCENARIO_KEYS if k != "name"] + [f"{n}.{k}" for n, keys in NESTED.items() for k in keys]
    fields["sweep"] = {"type": "object", "minProperties": 1, "propertyNames": {"enum": sweepable},
                       "additionalProperties": {"type": "array", "minItems": 1},
                       "description": "lists of values; the scenario expands to their cartesian product, "
                                      "named like name[n_q=1,mask.causal=upper-left]"}
    defaults = {k: v for k, v in fields.items() if k != "name"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "attn-gradcheck scenario file",
        "type": "object",
        "additionalProperties": False,
        "patternProperties": {"^x-": {}},
        "required": ["scenarios"],
        "properties": {
            "defaults": {"type": "object", "additionalProperties": False, "properties": defaults},
            "scenarios": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name"], "properties": fields}},
        },
    }
