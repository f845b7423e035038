"""The ``implementation`` key: a 'module:attribute' located (never run), or its mapping form (factory,
weights, call) checked against the op's tensors."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .. import implementation
from ..implementation import modules
from ..ops import OPS
from .fields import _Fields
from .model import Scenario
from .yaml_lines import _Doc, _show


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
