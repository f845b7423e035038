"""One scenario's merged keys -> a ``Scenario``: the op's keys, shapes and heads, backend, precision and
check, masks and memory, each checked with its file, line and key."""
from __future__ import annotations

import math
from pathlib import Path

from ..ops import DEFAULT_OP, OPS
from ..ops.attention.formulas import DEFAULT_BLOCK
from ..ops.convention import (
    interleaved_kv_map,
)
from ..ops.registry import IMPLEMENTATION_CHECK_KEYS
from .attention_keys import _convention, _conventions, _heads, _mask_keys, _visible_set
from .common_keys import _backend_and_device, _mode_applies, _precision_and_check, _user_code_policy
from .fields import (
    ATTENTION_KEYS,
    BACKEND_KEYS,
    COMMON_KEYS,
    MAX_SCALE,
    NAME_RE,
    _Fields,
    _read_param,
)
from .implementation_keys import _implementation, _with_module
from .model import Scenario, default_kv_map
from .resources import _Probe, need
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

    heads_kv, kv_map, kv_layout = _heads(f, heads_q)

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

    causal, window, key_lengths = _mask_keys(doc, f, batch, n_k)
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

    visible, source = _visible_set(doc, f, base_dir, batch, heads_q, n_q, n_k, causal, window, key_lengths)

    convention = _convention(f, visible, scale, d_head, op_spec)
    attention = {"batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "n_q": n_q, "n_k": n_k, "d_head": d_head,
                 "d_value": d_value, "mode": mode, "backend": backend, "dtype": dtype,
                 "implementation": spec is not None, "base_dir": Path(base_dir)}
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


