"""One scenario's merged keys -> a ``Scenario``: the op's keys, shapes and heads, backend, precision and
check, masks and memory, each checked with its file, line and key."""
from __future__ import annotations

from pathlib import Path

from ..ops import DEFAULT_OP, OPS
from ..ops.attention.formulas import DEFAULT_BLOCK
from ..ops.registry import IMPLEMENTATION_CHECK_KEYS
from .common_keys import _backend_and_device, _mode_applies, _precision_and_check, _user_code_policy
from .fields import BACKEND_KEYS, COMMON_KEYS, NAME_RE, _Fields, _read_param
from .implementation_keys import _implementation, _with_module
from .model import Scenario
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
    group = op_spec.shared_keys
    allowed = set(common) | set(op_spec.keys) | (set(group.takes(op_spec)) if group else set())
    allowed |= {key for key in BACKEND_KEYS if op_spec.takes(key)}
    for key in f.values:
        top = key.split(".")[0]
        if top not in allowed or (key in IMPLEMENTATION_CHECK_KEYS and not op_spec.takes(key)):
            owners = [o.name for o in OPS.values() if top in o.keys or o.takes(top) or (top == "check" and o.takes(key))
                      or (o.shared_keys and top in o.shared_keys.takes(o))]
            raise f.error(key, f"does not apply to op {op}"
                          + (f" (it is a key of {', '.join(owners)})" if owners else ""),
                          hint=f"keys of op {op}: {', '.join(sorted(allowed - {'name', 'op'}))}")
    if group is None:
        return _parse_plain(doc, f, name, op, base_dir, memory_limit)
    batch = f.int("batch", 1)
    shape = group.read(f, batch)  # the op's own keys: heads, sizes, scale, masks (ops.attention.scenario_keys)

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

    # Estimate memory before allocating anything of the keys' sizes (the op's estimate, ``Op.memory``).
    params = {key: _read_param(f, key, param) for key, param in op_spec.keys.items()}
    needed = need(op_spec, _Probe(params, dtype, engine, block_q, block_k, batch=batch, **shape))
    sizes = [key for key, param in op_spec.keys.items() if param.kind == "int"]  # its weights' sizes
    if needed > memory_limit:
        what, reduce = group.sizes(shape, batch)
        raise doc.error(f.path, f"scenario '{name}' needs about {needed / 2**30:.1f} GiB ({what}"
                        + (f", and the weights of op {op}" if sizes else "") + "), "
                        f"more than the {memory_limit / 2**30:.1f} GiB available",
                        hint=f"reduce {reduce}" + (f" (or {', '.join(sizes)})" if sizes else ""))
    spec, spec_line, module = _implementation(doc, f, base_dir)
    built = group.build(f, shape, batch, base_dir, op_spec)  # the KV map, the visible set, the convention
    context = {**shape, "batch": batch, "mode": mode, "backend": backend, "dtype": dtype, "device": device,
               "implementation": spec is not None, "base_dir": Path(base_dir), "built": built}
    for key, message, hint in (op_spec.validate(params, context) if op_spec.validate else []):
        raise f.error(key, message, hint=hint)
    sc = Scenario(name=name, op=op, batch=batch, **built, mode=mode, samples=samples, directions=directions,
                  colouring=colouring, dtype=dtype, epsilon=epsilon, tolerance=tolerance, seed=seed, file=doc.file,
                  line=doc.line(f.path) or 0, implementation=spec, backend=backend, device=device, factor=factor,
                  slack=slack, nondet_tol=nondet_tol, base_dir=str(base_dir), implementation_line=spec_line,
                  timeout=timeout, params=tuple(params.items()), engine=engine, block_q=block_q, block_k=block_k,
                  module=module)
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
    sc = Scenario(name=name, op=op, batch=batch, mode=mode, samples=samples, directions=directions, colouring=False,
                  dtype=dtype, epsilon=epsilon, tolerance=tolerance, seed=seed, file=doc.file,
                  line=doc.line(f.path) or 0, params=tuple(params.items()), implementation=impl,
                  implementation_line=impl_line, module=module, base_dir=str(base_dir), factor=factor, slack=slack,
                  nondet_tol=nondet_tol, timeout=timeout, backend=backend, device=device)
    if spec.shapes:
        needed = need(spec, sc)
        if needed > memory_limit:
            raise doc.error(f.path, f"scenario '{name}' needs about {needed / 2**30:.1f} GiB, more than the "
                            f"{memory_limit / 2**30:.1f} GiB available", hint="reduce its sizes")
    return _with_module(doc, f, sc)


