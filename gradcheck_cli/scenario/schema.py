"""The JSON Schema of scenario files (``attn-gradcheck schema``, shipped as schema/scenario.schema.json)."""
from __future__ import annotations

from .. import implementation
from ..ops import OPS
from ..ops.attention.formulas import DEFAULT_BLOCK
from .fields import (
    BACKENDS,
    DEVICES,
    ENGINES,
    KEY_GROUPS,
    MAX_DIRECTIONS,
    MAX_EPSILON,
    MAX_FACTOR,
    MAX_SLACK,
    MAX_TOLERANCE,
    MODES,
    NAME_RE,
    NESTED,
    SCENARIO_KEYS,
)


def json_schema() -> dict:
    """A JSON Schema (draft 2020-12) of the scenario file, for editors (yaml-language-server) and CI.
    The loader stays the authority: it also checks what a schema cannot (shapes, masks, memory)."""
    pos = {"type": "integer", "minimum": 1}
    number = {"oneOf": [{"type": "number"}, {"type": "string"}]}
    check = {"type": "object", "additionalProperties": False, "properties": {
        "mode": {"enum": list(MODES)}, "samples": pos, "directions": {**pos, "maximum": MAX_DIRECTIONS},
        "colouring": {"type": "boolean"}, "factor": {**number, "maximum": MAX_FACTOR},
        "slack": {**number, "minimum": 0, "maximum": MAX_SLACK},
        "nondet_tol": {**number, "minimum": 0, "maximum": MAX_TOLERANCE},
        "timeout": number}}
    fields = {
        "name": {"type": "string", "pattern": NAME_RE.pattern},
        "op": {"enum": sorted(OPS)},
        "implementation": {"oneOf": [
            {"type": "string", "pattern": implementation.SPEC_RE.pattern,
             "description": "module:attribute of your function (torch, JAX) or forward/backward object (NumPy)"},
            {"type": "object", "additionalProperties": False, "required": ["factory"],
             "description": "a module with weights: factory builds it from the sizes it names, weights map its "
                            "parameters to the op's tensors, call says what it is called with",
             "properties": {
                 "factory": {"type": "string", "pattern": implementation.SPEC_RE.pattern},
                 "weights": {"type": "object", "additionalProperties": {"type": "string"},
                             "description": "parameter path -> expression: w1, w1.T, concat(w_q.T, w_k.T, w_v.T)"},
                 "call": {"oneOf": [{"type": "array", "items": {"type": "string"}},
                                    {"type": "object", "additionalProperties": {"type": "string"}}],
                          "description": "tensor and argument names, positional (a list) or keyword (a mapping)"}}}]},
        "backend": {"enum": list(BACKENDS)}, "device": {"enum": list(DEVICES)}, "batch": pos, "check": check,
        "dtype": {"enum": list(dict.fromkeys(d for op in OPS.values() for d in op.dtypes))},
        "epsilon": {**number, "maximum": MAX_EPSILON},
        "tolerance": {**number, "maximum": MAX_TOLERANCE},
        "seed": {"type": "integer", "minimum": 0},
        "engine": {"enum": list(ENGINES), "description": "naive (default) or tiled (FlashAttention-style: online "
                   "softmax, log-sum-exp, no n_q x n_k arrays)"},
        "block_q": {**pos, "description": f"engine tiled: query rows per block (default {DEFAULT_BLOCK})"},
        "block_k": {**pos, "description": f"engine tiled: key rows per block (default {DEFAULT_BLOCK})"},
    }
    for group in KEY_GROUPS:  # the keys ops share and parse themselves (attention's heads, sizes, masks, ...)
        fields.update(group.schema())
    for op in OPS.values():
        for key, param in op.keys.items():
            if key in fields:
                continue
            kind = _param_schema(param, number)
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
            "hunt": {"type": "array", "description": "hunts the pytest plugin runs, one test each",
                     "items": {"type": "object", "additionalProperties": False, "required": ["select"], "properties": {
                         "select": {"type": "string", "description": "the scenario to start from"},
                         "budget": {"type": "number", "exclusiveMinimum": 0, "description": "seconds to search"},
                         "examples": {"type": "integer", "minimum": 1, "description": "most scenarios to check"},
                         "seed": {"type": "integer", "minimum": 0},
                         "max_elements": {"type": "integer", "minimum": 1},
                         "space": {"type": "object", "description": "axis: range ('1..300') or list of values",
                                   "additionalProperties": {"type": ["string", "number", "array"]}}}}},
        },
    }


def _param_schema(param, number: dict) -> dict:
    """The JSON Schema of one op key (``ops.registry.Param``)."""
    low = int(param.minimum) if param.minimum is not None and abs(param.minimum) != float("inf") else 1
    floats = {"type": "array", "items": {"type": "number", "exclusiveMinimum": 0}, "minItems": 1}
    if param.kind == "mapping":
        return {"type": "object", "additionalProperties": False,
                "properties": {name: {**_param_schema(sub, number), "description": sub.help}
                               for name, sub in param.fields}}
    return {"int": {"type": "integer", "minimum": low},
            "float": number, "bool": {"type": "boolean"},
            "path": {"type": "string", "minLength": 1}, "choice": {"enum": list(param.choices)},
            "ints": {"type": "array", "items": {"type": "integer", "minimum": low}, "minItems": 1,
                     "uniqueItems": True},
            "sizes": {"type": "array", "items": {"type": "integer", "minimum": low}, "minItems": 1},
            "choice-list": {"type": "array", "items": {"enum": list(param.choices)}, "minItems": 1,
                            "uniqueItems": True},
            "choice-or-floats": {"oneOf": [{"enum": list(param.choices)},
                                           floats if param.minimum is None else
                                           {"type": "array", "items": {"type": "number"}, "minItems": 1}]}}[param.kind]
