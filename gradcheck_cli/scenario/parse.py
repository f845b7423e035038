"""One scenario's merged keys -> a ``Scenario``: the op's keys, shapes and heads, backend, precision and
check, masks and memory, each checked with its file, line and key."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from .. import implementation, masks
from ..implementation import modules
from ..ops import DEFAULT_OP, OPS
from ..ops.attention.formulas import DEFAULT_BLOCK
from ..ops.convention import (
    KV_LAYOUTS,
    LAYOUTS,
    MASK_HEADS,
    MASKS,
    SCALES,
    Convention,
    interleaved_kv_map,
    shared_mask_problem,
)
from ..ops.registry import IMPLEMENTATION_CHECK_KEYS
from ..tolerance import DEFAULT_FACTOR, defaults_for, machine_epsilon
from .fields import (
    ATTENTION_KEYS,
    BACKEND_KEYS,
    COMMON_KEYS,
    DEFAULT_DIRECTIONS,
    DEFAULT_SAMPLES,
    DEVICES,
    LOW_PRECISION,
    MAX_DIRECTIONS,
    MAX_EPSILON,
    MAX_FACTOR,
    MAX_SCALE,
    MAX_SLACK,
    MAX_TOLERANCE,
    MIN_STEP_ULPS,
    MODES,
    NAME_RE,
    _Fields,
    _read_param,
)
from .model import Scenario, default_kv_map
from .resources import _Probe, need
from .visible import _load_visible
from .yaml_lines import _Doc, _show


def _parse_scenario(doc: _Doc, f: _Fields, base_dir: Path, memory_limit: int) -> Scenario:
    name = f.raw("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise f.error("name", f"expected a name of letters, digits, '.', '_' or '-', got {_show(name)}"
                      if name is not None else "is required", hint="e.g. 'name: causal-gqa'")
    op = f.choice("op", tuple(OPS), DEFAULT_OP)
    op_spec = OPS[op]
    common = COMMON_KEYS if op_spec.common_keys is None else op_spec.common_keys
    allowed = set(common) | set(op_spec.keys) | (set(ATTENTION_KEYS) if op_spec.attention_keys else set())
    allowed |= {key for key in BACKEND_KEYS if op_spec.takes(key)}
    allowed |= {"convention"} if _conventions(op_spec) else set()
    for key in f.values:
        top = key.split(".")[0]
        if top not in allowed or (key in IMPLEMENTATION_CHECK_KEYS and not op_spec.takes(key)):
            owners = [o.name for o in OPS.values() if top in o.keys or (top in ATTENTION_KEYS and o.attention_keys)
                      or o.takes(top) or (top == "check" and o.takes(key)) or (top == "convention" and _conventions(o))]
            raise f.error(key, f"does not apply to op {op}"
                          + (f" (it is a key of {', '.join(owners)})" if owners else ""),
                          hint=f"keys of op {op}: {', '.join(sorted(allowed - {'name', 'op'}))}")
    if not op_spec.attention_keys:
        return _parse_plain(doc, f, name, op, base_dir, memory_limit)
    batch = f.int("batch", 1)
    heads_q = f.int("heads_q", 1)
    n_q = f.int("n_q")
    n_k = f.int("n_k", n_q)
    d_head = f.int("d_head")
    d_value = f.int("d_value", d_head)

    if f.has("kv_map") and not isinstance(f.raw("kv_map"), str):
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
        kv_layout = _kv_layout(f)
        heads_kv = f.int("heads_kv", heads_q)
        if heads_q % heads_kv:
            raise f.error("heads_kv", f"{heads_kv} does not divide heads_q={heads_q}",
                          hint="use a divisor of heads_q, or give an explicit kv_map")
        kv_map = None  # built after the memory check (heads_q may be absurd)

    scale = f.float("scale", 1.0 / math.sqrt(d_head), positive=False)
    if scale == 0 or abs(scale) > MAX_SCALE:
        raise f.error("scale", f"must be non-zero and within +-{MAX_SCALE:g}, got {scale:g}",
                      hint="omit it for 1/sqrt(d_head)")

    dtype = f.choice("dtype", op_spec.dtypes, "float64")
    backend, device = _backend_and_device(f, op_spec, dtype)
    choices = op_spec.engine_choices or ("naive",)
    engine = f.choice("engine", choices, choices[0])
    block_q, block_k = f.int("block_q", DEFAULT_BLOCK), f.int("block_k", DEFAULT_BLOCK)
    if engine != choices[0] and (backend != "numpy" or f.has("implementation")):
        raise f.error("engine", f"engine: {engine} is the built-in NumPy engine's; it does not apply to "
                      + (f"backend: {backend}" if backend != "numpy" else "an implementation of yours"),
                      hint="remove engine, or the backend / implementation")
    for owner, spec in op_spec.engines.items():
        for key in spec.keys:
            if f.has(key) and engine != owner:
                raise f.error(key, f"{key} applies to engine: {owner}", hint=f"add 'engine: {owner}' or remove it")
    factor, slack, nondet_tol, timeout = _user_code_policy(f)
    dtype, epsilon, tolerance, seed, mode, samples, directions, colouring = _precision_and_check(
        f, dtype, op_spec.colouring)
    _mode_applies(f, op_spec, mode, engine if backend == "numpy" and not f.has("implementation") else None,
                 backend if f.has("implementation") else None, dtype)

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
    needed = need(op_spec, _Probe(batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, params, dtype, engine,
                                  block_q, block_k))
    sizes = [key for key, param in op_spec.keys.items() if param.kind == "int"]  # its weights' sizes
    if needed > memory_limit:
        raise doc.error(f.path, f"scenario '{name}' needs about {needed / 2**30:.1f} GiB "
                        f"({batch}x{heads_q}x{n_q}x{n_k} score blocks, d_head={d_head}, d_value={d_value}"
                        + (f", and the weights of op {op}" if sizes else "") + "), "
                        f"more than the {memory_limit / 2**30:.1f} GiB available",
                        hint="reduce batch, heads, n_q, n_k or the head dimensions"
                             + (f" (or {', '.join(sizes)})" if sizes else ""))
    if kv_map is None:
        kv_map = (interleaved_kv_map if kv_layout == "interleaved" else default_kv_map)(heads_q, heads_kv)

    spec, spec_line, module = _implementation(doc, f, base_dir)

    explicit, source = None, None
    if f.has("mask.visible"):
        explicit, source = _load_visible(f, base_dir, (batch, heads_q, n_q, n_k))
    visible = masks.build_visible(batch, heads_q, n_q, n_k, causal=causal, window=window,
                                  key_lengths=key_lengths, explicit=explicit)
    empty = masks.first_empty_row(visible)
    if empty is not None:
        b, h, i = empty
        given = [k for k in ("mask.visible", "mask.key_lengths", "mask.window", "mask.causal") if f.has(k)]
        swept = [k for k in given if "sweep" in f.where(k)]
        message, hint, culprit = _empty_row(masks.row_constraints(n_q, n_k, b, h, i, causal=causal, window=window,
                                                                  key_lengths=key_lengths, explicit=explicit), b, h,
                                            i, n_q, n_k)
        blamed = culprit if culprit in given else (swept or given or [None])[0]
        raise doc.error(f.where(blamed) if blamed else f.path, message, hint=hint)

    convention = _convention(f, visible, scale, d_head, op_spec)
    attention = {"batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "n_q": n_q, "n_k": n_k, "d_head": d_head,
                 "d_value": d_value, "mode": mode, "backend": backend, "dtype": dtype,
                 "implementation": spec is not None}
    for key, message, hint in (op_spec.validate(params, attention) if op_spec.validate else []):
        raise f.error(key, message, hint=hint)
    sc = Scenario(name=name, op=op, batch=batch, heads_q=heads_q, heads_kv=heads_kv, kv_map=tuple(kv_map),
                  n_q=n_q, n_k=n_k, d_head=d_head, d_value=d_value, scale=scale, causal=causal,
                  window=window, key_lengths=key_lengths, visible_source=source, loss_rows=loss_rows,
                  mode=mode, samples=samples, directions=directions, colouring=colouring, dtype=dtype,
                  epsilon=epsilon, tolerance=tolerance, seed=seed, file=doc.file, line=doc.line(f.path) or 0,
                  implementation=spec, backend=backend, device=device, factor=factor, slack=slack,
                  nondet_tol=nondet_tol, visible=visible, base_dir=str(base_dir), implementation_line=spec_line,
                  timeout=timeout, params=tuple(params.items()), engine=engine, block_q=block_q, block_k=block_k,
                  module=module, convention=convention)
    return _with_module(doc, f, sc)


def _conventions(op_spec) -> bool:
    """Whether ``convention:`` applies to an op (``Interface.conventions``: attention's implementations, and
    the mask keys for the layers')."""
    return op_spec.implementation is not None and bool(op_spec.implementation.conventions)


def _kv_layout(f: _Fields) -> str:
    """``kv_map`` given by name: contiguous (the default) or interleaved."""
    if f.has("kv_map") and f.raw("kv_map") not in KV_LAYOUTS:
        raise f.error("kv_map", f"expected a list of KV head indices or one of {', '.join(KV_LAYOUTS)}; got "
                      f"{_show(f.raw('kv_map'))}", hint="contiguous: query head r reads KV head r // (heads_q / "
                      "heads_kv) (repeat_kv's); interleaved: r % heads_kv (k.repeat(...)'s)")
    return f.raw("kv_map", KV_LAYOUTS[0])


def _convention(f: _Fields, visible, scale: float, d_head: int, op_spec) -> Convention:
    """The ``convention`` keys: how an implementation takes its arguments (``ops.convention``); an
    op takes those its interface names (``Interface.conventions``)."""
    given = [key for key in f.values if key.startswith("convention.") and f.has(key)]
    if not given:
        return Convention()
    takes = op_spec.implementation.conventions if op_spec.implementation else ()
    for key in given:
        if key.split(".", 1)[1] not in takes:
            raise f.error(key, f"does not apply to op {op_spec.name}: its implementation takes "
                          + (f"convention: {{{', '.join(takes)}}} only" if takes else "no convention keys"),
                          hint="the layout and the scale are attention's: a layer gets x and its weights")
    if not f.has("implementation"):
        for key in given:
            if f.where(key)[0] != "defaults":
                raise f.error(key, "applies to a scenario with an implementation: it says how your code takes its "
                              "arguments", hint="remove it, or add 'implementation: module:attribute'")
        return Convention()
    values = {"layout": LAYOUTS, "mask": MASKS, "mask_heads": MASK_HEADS, "scale": SCALES}
    convention = Convention(**{key: f.choice(f"convention.{key}", choices, choices[0])
                               for key, choices in values.items()})
    if convention.mask_heads == "shared":
        row = shared_mask_problem(visible)
        if row is not None:
            b, h, i = row
            raise f.error("convention.mask_heads", f"shared passes one mask [B, 1, n_q, n_k] for every head, but the "
                          f"visible set differs between heads (batch {b}, head {h}, query row {i} sees other keys "
                          "than head 0)", hint="use mask_heads: per-head, or a mask the same for every head")
    if convention.scale == "omitted" and f.has("scale") and scale != 1.0 / math.sqrt(d_head):
        raise f.error("convention.scale", f"omitted means the implementation uses 1/sqrt(d_head) = "
                      f"{1 / math.sqrt(d_head):.6g} itself, but the scenario's scale is {scale:g}",
                      hint="remove scale, or use convention: {scale: passed}")
    return convention


def _user_code_policy(f: _Fields) -> tuple[float, float | None, float, float]:
    """The ``check`` keys of an op that accepts an implementation: (factor, slack, nondet_tol, timeout)."""
    factor = f.float("check.factor", DEFAULT_FACTOR)
    if factor > MAX_FACTOR:
        raise f.error("check.factor", f"{factor:g} would accept an implementation {factor:g} times as wrong as a plain "
                      f"computation in the same precision: a check that blind passes real bugs; at most {MAX_FACTOR:g}",
                      hint=f"omit it for the default ({DEFAULT_FACTOR:g}, FlashAttention's)")
    slack = f.float("check.slack", None, positive=False)
    if slack is not None and slack < 0:
        raise f.error("check.slack", f"must be >= 0, got {slack}")
    if slack is not None and slack > MAX_SLACK:
        raise f.error("check.slack", f"{slack:g} would accept any error of that absolute size in results of order 1; "
                      f"at most {MAX_SLACK:g}", hint="omit it for the default (1e-5 in half precision, else 0)")
    nondet_tol = f.float("check.nondet_tol", 0.0, positive=False)
    if f.has("check.nondet_tol") and not f.has("implementation") and f.where("check.nondet_tol")[0] != "defaults":
        raise f.error("check.nondet_tol", "applies to a scenario with an implementation: the built-in engines are "
                      "deterministic and are not run twice",
                      hint="remove it, or add 'implementation: module:attribute'")
    if nondet_tol < 0:
        raise f.error("check.nondet_tol", f"must be >= 0, got {nondet_tol}",
                      hint="0 (the default) requires two calls on the same inputs to agree bit for bit")
    if nondet_tol > MAX_TOLERANCE:
        raise f.error("check.nondet_tol", f"{nondet_tol:g} would accept two calls on the same inputs that differ by "
                      f"{nondet_tol:.0%} of their size; at most {MAX_TOLERANCE:g}",
                      hint="0 (the default) requires two calls on the same inputs to agree bit for bit")
    timeout = f.float("check.timeout", 900.0)
    if f.has("check.timeout") and not f.has("implementation") and f.where("check.timeout")[0] != "defaults":
        raise f.error("check.timeout", "applies to a scenario with an implementation (run in a process of its own, "
                      "stopped after this many seconds)", hint="remove it, or add 'implementation: module:attribute'")
    return factor, slack, nondet_tol, timeout


def _implementation(doc: _Doc, f: _Fields, base_dir: Path) -> tuple[str | None, int, modules.ModuleSpec | None]:
    """The ``implementation`` key: (its 'module:attribute', its line, None), located but not imported; or, in
    its mapping form (``implementation.modules``), (the factory's 'module:attribute', its line, the parsed
    form, its ``call`` resolved later by :func:`_with_module`)."""
    if not f.has("implementation"):
        return None, 0, None
    raw, where = f.raw("implementation"), f.where("implementation")
    module = None
    if isinstance(raw, dict):
        for key in raw:
            if key not in modules.KEYS:
                raise doc.error(where + (key,), f"unknown key '{key}'{modules.suggest(str(key), modules.KEYS)}",
                                hint="the mapping form takes factory, weights and call")
        if "factory" not in raw:
            raise doc.error(where, "the mapping form needs 'factory: module:attribute' (a function that builds "
                                   "your module)", hint="or give 'implementation: module:attribute' for a function")
        spec = raw["factory"]
        module = _module_spec(doc, where, raw)
        where = where + ("factory",)
    else:
        spec = raw
    if not isinstance(spec, str):
        raise doc.error(where, f"expected 'module:attribute', got {_show(spec)}")
    try:
        implementation.locate(spec, base_dir)  # found, not run: the loader never runs user code
    except implementation.LoadError as exc:
        raise doc.error(where, str(exc)) from None
    return spec, doc.line(where) or 0, module


def _module_spec(doc: _Doc, where: tuple, raw: dict) -> modules.ModuleSpec:
    """The ``weights`` and ``call`` of the mapping form, their spelling checked (their names are checked
    against the op's tensors once the scenario is built)."""
    weights = raw.get("weights") or {}
    if not isinstance(weights, dict):
        raise doc.error(where + ("weights",), f"expected a mapping of module parameter -> expression, got "
                        f"{_show(weights)}", hint="e.g. weights: {gate_proj.weight: w1.T}")
    parsed = []
    for path, text in weights.items():
        if not isinstance(path, str) or not path:
            raise doc.error(where + ("weights",), f"a parameter name must be a string, got {_show(path)}")
        try:
            parsed.append((path, modules.parse_expr(text)))
        except ValueError as exc:
            raise doc.error(where + ("weights", path), str(exc),
                            hint="e.g. w1, w1.T or concat(w_q.T, w_k.T, w_v.T)") from None
    call = raw.get("call")
    keywords = None
    if isinstance(call, dict):
        keywords, call = tuple(call), tuple(call.values())
    elif isinstance(call, list):
        call = tuple(call)
    elif call is not None:
        raise doc.error(where + ("call",), f"expected a list of names (positional) or a mapping keyword -> name, "
                        f"got {_show(call)}", hint="e.g. call: [x] or call: {hidden_states: x}")
    for i, name in enumerate(call or ()):
        if not isinstance(name, str):
            raise doc.error(where + ("call", keywords[i] if keywords else i), f"expected a tensor or argument "
                            f"name, got {_show(name)}")
    return modules.ModuleSpec(factory=raw["factory"], weights=tuple(parsed), call=call, keywords=keywords)


def _with_module(doc: _Doc, f: _Fields, sc: Scenario) -> Scenario:
    """``sc`` with the mapping form of its implementation checked against its op: a backend with modules
    (torch or JAX), an op with weights, names that exist, every tensor reaching the module; ``call`` defaults
    to the tensors no weight uses, in the op's order."""
    module = sc.module
    if module is None:
        return sc
    spec = OPS[sc.op]
    where = f.where("implementation")
    if not spec.implementation.modules:
        raise doc.error(where, f"the mapping form (factory, weights) applies to ops with weights; op {sc.op} has "
                               "none", hint="give 'implementation: module:attribute'")
    if sc.backend not in ("torch", "jax"):
        raise doc.error(where, "the mapping form (factory, weights) builds a torch or JAX module",
                        hint="add 'backend: torch' or 'backend: jax'")
    tensors = tuple(spec.shapes(sc)) if spec.shapes else spec.tensors
    if module.call is None:
        module = dataclasses.replace(module, call=tuple(t for t in tensors if t not in module.mapped))
    for key, message in modules.check_names(module, tensors, spec.implementation.args):
        path = where + tuple(key.split(".", 1)) if key != "call" or f.raw("implementation").get("call") else where
        raise doc.error(path, message)
    return dataclasses.replace(sc, module=module)


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
    if epsilon < MIN_STEP_ULPS * resolution and dtype not in LOW_PRECISION:  # no finite differences in half precision
        raise f.error("epsilon", f"{epsilon:g} is below what {dtype} can resolve ({resolution:.2g}): the "
                      "perturbed values would round back", hint=f"use at least {MIN_STEP_ULPS * resolution:.2g}")
    tolerance = f.float("tolerance", dflt["tolerance"])
    if tolerance > MAX_TOLERANCE:
        raise f.error("tolerance", f"{tolerance:g} would accept gradients wrong by {tolerance:.0%} of their size (a "
                      f"zero gradient at 1): a check that blind cannot pass anything; at most {MAX_TOLERANCE:g}",
                      hint=f"omit it for the {dtype} default ({dflt['tolerance']:g}); for float16/bfloat16 the "
                           "check.factor / check.slack policy applies")
    seed = f.int("seed", 0, minimum=0)
    mode = f.choice("check.mode", MODES, "full")
    samples = f.int("check.samples", DEFAULT_SAMPLES)
    directions = f.int("check.directions", DEFAULT_DIRECTIONS)
    if directions > MAX_DIRECTIONS:
        raise f.error("check.directions", f"at most {MAX_DIRECTIONS:,} directions, got {directions:,}",
                      hint="use mode: full to check every element")
    for key, applies in (("check.samples", "sample"), ("check.directions", "directional")):
        if mode in ("jvp", "hvp") and f.has(key):  # their directions are fixed: a random one, then per input
            raise f.error(key, f"{key.split('.')[1]} applies to mode {applies}; mode {mode} checks a random "
                          "direction of every input" + (" and then each input's alone" if mode == "jvp" else ""),
                          hint=f"remove {key.split('.')[1]}")
    colouring = f.raw("check.colouring", mode == "full" and colouring_default)
    if not isinstance(colouring, bool):
        raise f.error("check.colouring", f"expected true or false, got {_show(colouring)}")
    if colouring and mode != "full" and f.has("check.colouring"):
        raise f.error("check.colouring", f"colouring applies to mode full only (mode is {mode})",
                      hint="remove colouring, or use mode: full")
    if colouring and not colouring_default:
        raise f.error("check.colouring", "this op has no independent output blocks to colour",
                      hint="remove colouring (it applies to op "
                           + ", ".join(o.name for o in OPS.values() if o.colouring) + ")")
    return dtype, epsilon, tolerance, seed, mode, samples, directions, colouring and mode == "full"


#: What each mode of a directional derivative checks, for messages.
_DERIVATIVE = {"jvp": "a forward-mode derivative (JVP)", "hvp": "a double backward (Hessian-vector product)"}


def _empty_row(allowed: dict, b: int, h: int, i: int, n_q: int, n_k: int) -> tuple[str, str, str | None]:
    """(message, hint, the mask key to blame or None) of the error for query row ``i`` seeing no key: the
    constraint that hides every key on its own, or the keys each allows when only their combination leaves none,
    with the remedy that fits."""
    alone = [name for name, keys in allowed.items() if not keys.any()]

    def keys(mask) -> str:
        idx = [int(j) for j, on in enumerate(mask) if on]
        if len(idx) == 1:
            return f"key {idx[0]}"
        return f"keys {idx[0]}-{idx[-1]}" if idx[-1] - idx[0] + 1 == len(idx) else f"keys {', '.join(map(str, idx))}"

    where = f"query row {i} of batch {b}, head {h} sees no key"
    if alone:
        name = alone[0]
        if name.startswith("causal"):
            why = (f"{name} alone hides every key of it: with n_q = {n_q} > n_k = {n_k} the lower-right diagonal "
                   f"of row {i} is key {i + n_k - n_q}" if "lower-right" in name else f"{name} alone hides every key")
            hint = ("with n_q > n_k, lower-right rows before the first key see nothing: use causal: upper-left, or "
                    "n_k >= n_q") if "lower-right" in name else "check the causal alignment"
        elif name.startswith("window"):
            why, hint = f"{name} alone hides every key of it", "widen the window"
        elif name.startswith("key_lengths"):
            why, hint = f"{name} alone hides every key", "every batch element needs a key: raise it to 1 or more"
        else:
            why, hint = (f"{name} has no True in this row", "give the explicit visible array at least one True in "
                         "every query row (True = key visible)")
        key = "mask." + next(k for k in ("causal", "window", "key_lengths", "visible") if name.startswith(k))
        return f"{where}: {why}", hint, key
    parts = "; ".join(f"{name} allows {keys(mask)}" for name, mask in allowed.items())
    return (f"{where}: each constraint leaves it some key, but not the same one ({parts})",
            "the row's visible set is the AND of the constraints: make them overlap (widen the window, raise "
            "key_lengths, or change the causal alignment)", None)


def _mode_applies(f: _Fields, spec, mode: str, engine: str | None, flavour: str | None = None,
                  dtype: str = "float64") -> None:
    """``check: {mode: jvp}`` and ``{mode: hvp}`` need an engine that computes that derivative or an implementation
    of a flavour whose derivative the op can take (``Op.directional_derivative``), in float64 or float32;
    ``engine`` is the built-in engine that would check the scenario, None for a backend or an implementation of
    the user's (``flavour``: its backend)."""
    computes = spec.directional_derivative(mode)
    if computes is None:
        return
    engines, flavours = computes
    if flavour is not None and flavour in flavours:
        if dtype not in ("float64", "float32"):
            differenced = "forward" if mode == "jvp" else "gradients"
            raise f.error("check.mode", f"mode {mode} differences the {differenced}: it needs dtype float64 or "
                          f"float32, not {dtype}", hint="use dtype: float32 (or float64)")
        return
    if engine is not None and engine in engines:
        return
    places = [f"engine: {e}" for e in engines] + [f"a {fl} implementation" for fl in flavours]
    which = f"has one on: {', '.join(places)}" if places else "has none"
    if flavour is not None:
        runs = f" (this scenario's implementation is {flavour})"
        hint = (f"write it for backend: {' or '.join(flavours)}, or use another check.mode" if flavours else
                "use another check.mode")
    elif engine is not None:
        runs, hint = f" (this scenario runs engine: {engine})", "use another check.mode" + (
            f", or engine: {engines[0]}" if engines else "")
    else:
        runs = " (this scenario runs a backend's own closed forms)"
        hint = ("remove backend (the built-in engines compute it: " + ", ".join(engines) + "), or use another "
                "check.mode") if engines else "use another check.mode"
    raise f.error("check.mode", f"mode {mode} checks {_DERIVATIVE[mode]}; op {spec.name} {which}{runs}", hint=hint)


def _parse_plain(doc: _Doc, f: _Fields, name: str, op: str, base_dir: Path, memory_limit: int) -> Scenario:
    """A scenario of an op without attention keys: the shared keys, then the op's own (``Op.keys``)."""
    spec = OPS[op]
    batch = f.int("batch", 1)
    dtype = f.choice("dtype", spec.dtypes, "float64")
    dtype, epsilon, tolerance, seed, mode, samples, directions, _ = _precision_and_check(f, dtype, spec.colouring)
    user = f.has("implementation")
    _mode_applies(f, spec, mode, spec.engine_choices[0] if spec.engine_choices and not user and not f.has("backend")
                 else None, str(f.raw("backend", "numpy")) if user else None)
    params = {key: _read_param(f, key, param) for key, param in spec.keys.items()}
    for key, message, hint in (spec.validate(params, {"batch": batch}) if spec.validate else []):
        raise f.error(key, message, hint=hint)
    factor, slack, nondet_tol, timeout = _user_code_policy(f)
    impl, impl_line, module = _implementation(doc, f, base_dir)
    backend, device = _backend_and_device(f, spec, dtype)
    sc = Scenario(name=name, op=op, batch=batch, heads_q=1, heads_kv=1, kv_map=(0,), n_q=0, n_k=0, d_head=0,
                  d_value=0, scale=1.0, causal="none", window=None, key_lengths=None, visible_source=None,
                  loss_rows=None, mode=mode, samples=samples, directions=directions, colouring=False, dtype=dtype,
                  epsilon=epsilon, tolerance=tolerance, seed=seed, file=doc.file, line=doc.line(f.path) or 0,
                  params=tuple(params.items()), implementation=impl, implementation_line=impl_line, module=module,
                  base_dir=str(base_dir), factor=factor, slack=slack, nondet_tol=nondet_tol, timeout=timeout,
                  backend=backend, device=device)
    if spec.shapes:
        needed = need(spec, sc)
        if needed > memory_limit:
            raise doc.error(f.path, f"scenario '{name}' needs about {needed / 2**30:.1f} GiB, more than the "
                            f"{memory_limit / 2**30:.1f} GiB available", hint="reduce its sizes")
    return _with_module(doc, f, sc)


def _backend_and_device(f: _Fields, spec, dtype: str) -> tuple[str, str]:
    """``backend`` and ``device``: a backend none of the op's built-in engines runs on applies to an
    implementation of yours; JAX runs on its default device (in float16/bfloat16 where the op's
    ``low_precision_backends`` name it); a NumPy implementation never runs in half precision; torch (and a
    GPU for cuda) must be there."""
    backend = f.choice("backend", spec.backends, spec.backends[0])
    device = f.choice("device", DEVICES, "cpu")
    if backend not in spec.built_in_backends and not f.has("implementation"):
        raise f.error("backend", f"backend: {backend} applies to an implementation of yours (op {spec.name}'s "
                      f"built-in engines run on {' and '.join(spec.built_in_backends)})",
                      hint="add 'implementation: module:attribute' or remove it")
    low = dtype in LOW_PRECISION
    if backend == "jax":
        if low and backend not in spec.low_precision_backends:
            raise f.error("dtype", f"dtype {dtype} with backend: jax is not supported for op {spec.name} (it runs "
                          f"on {' and '.join(spec.low_precision_backends)})", hint="use float64 or float32 with JAX")
        _require_jax(f, device)
    elif backend == "numpy" and low and f.has("implementation") and "jax" in spec.low_precision_backends:
        raise f.error("dtype", f"dtype {dtype} needs backend: torch or backend: jax: a NumPy implementation is "
                      "checked by finite differences, which mean nothing in half precision",
                      hint="write it in torch or JAX (backend: torch / backend: jax), or use float64 or float32")
    elif backend == "torch" or device != "cpu" or low:
        _require_torch(f, backend, device, dtype)
    return backend, device


def _require_jax(f: _Fields, device: str) -> None:
    """JAX scenarios need JAX, on its default device."""
    if device != "cpu":
        raise f.error("device", "device applies to backend: torch (JAX runs on its default device)",
                      hint="remove device")
    try:
        import jax  # noqa: F401
    except ImportError:
        raise f.error("backend", "this scenario needs JAX, which is not installed",
                      hint="pip install 'attn-gradcheck[jax]', or pip install 'jax[cpu]'") from None


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

