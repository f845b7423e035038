"""The JSON Schema (draft 2020-12) of the ``--json`` report, schema_version 3: published as
``schema/report.schema.json``, and what ``merge`` checks every input against before using it. Keys are
only added within a version, so objects admit keys this schema does not name. Imports nothing of ours."""
from __future__ import annotations

SCHEMA_VERSION = 3  # 3: a check's verdict may be "not applicable"; the summary counts not_applicable

_NUMBER = {"type": ["number", "null"]}  # non-finite numbers are written as null
_VERDICT = {"enum": ["pass", "fail", "inconclusive"]}
_CHECK_VERDICT = {"enum": ["pass", "fail", "inconclusive", "not applicable"]}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_INTS = {"type": "array", "items": {"type": "integer"}}

_COUNT = {"type": "integer", "minimum": 0}
_NUMBERS = {"type": "array", "items": _NUMBER}

_DIAGNOSIS = {
    "type": "object",
    "required": ["checked", "out_of_tolerance", "axes", "classes", "heat", "worst"],
    "properties": {
        "checked": _COUNT, "out_of_tolerance": _COUNT,
        "axes": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["max_abs_error", "out_of_tolerance"],
            "properties": {"max_abs_error": _NUMBERS, "out_of_tolerance": {"type": "array", "items": _COUNT}}}},
        "classes": {"type": "array", "items": {
            "type": "object", "required": ["label", "checked", "out_of_tolerance", "max_abs_error"],
            "properties": {"label": {"type": "string"}, "checked": _COUNT, "out_of_tolerance": _COUNT,
                           "max_abs_error": _NUMBER}}},
        "heat": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["rows", "columns", "bin", "levels"],
            "properties": {"rows": {"type": "string"}, "columns": {"type": "string"},
                           "bin": {"type": "array", "items": {"type": "integer", "minimum": 1},
                                   "minItems": 2, "maxItems": 2},
                           "levels": {"type": "array", "items": {"type": "array", "items": {
                               "type": "integer", "minimum": -1, "maximum": 9}}}}}]},
        "worst": {"type": "array", "items": {
            "type": "object", "required": ["index", "analytic", "numeric"],
            "properties": {"index": {"oneOf": [_INTS, {"type": "null"}]}, "analytic": _NUMBER,
                           "numeric": _NUMBER, "allowed": _NUMBER}}},
    },
}

_CHECK = {
    "type": "object",
    "required": ["kind", "name", "tensor", "shape", "max_abs_error", "relative_error", "tolerance",
                 "noise_floor", "worst_index", "passed", "verdict", "detail", "diagnosis"],
    "properties": {
        "kind": {"enum": ["gradient", "invariant", "reference", "implementation", "experiment"]},
        "name": {"type": "string"}, "tensor": {"type": ["string", "null"]},
        "shape": {"oneOf": [_INTS, {"type": "null"}]}, "max_abs_error": _NUMBER, "relative_error": _NUMBER,
        "tolerance": _NUMBER, "noise_floor": _NUMBER, "worst_index": {"oneOf": [_INTS, {"type": "null"}]},
        "passed": {"type": "boolean"}, "verdict": _CHECK_VERDICT, "fd_error": _NUMBER, "detectable": _NUMBER,
        "detail": {"type": "string"}, "diagnosis": {"oneOf": [{"type": "null"}, _DIAGNOSIS]},
    },
}

_SCENARIO = {
    "type": "object",
    "required": ["name", "index", "op", "dtype", "mode", "faults", "passed", "verdict", "checks", "hints", "config",
                 "reproduce", "elapsed_s"],
    "properties": {
        "name": {"type": "string"}, "index": {"type": "integer", "minimum": 0}, "op": {"type": "string"},
        "engine": {"type": "string"}, "dtype": {"type": "string"}, "epsilon": _NUMBER, "tolerance": _NUMBER,
        "mode": {"type": "string"}, "faults": _STRINGS, "passed": {"type": "boolean"}, "verdict": _VERDICT,
        "elapsed_s": {"type": "number", "minimum": 0},
        "compile_s": {"type": "number", "minimum": 0,
                      "description": "of elapsed_s, jax.jit's compile time for a JAX implementation (absent: none)"},
        "variants": {**_STRINGS, "description": "the attention variants (score stages) checked, in order, e.g. "
                                                "'softcap 30', 'bias 1x4x10x16 +grad', 'alibi distance' (absent: "
                                                "plain attention)"},
        "checks": {"type": "array", "items": _CHECK, "minItems": 1}, "hints": _STRINGS,
        "detectable": {"type": "object", "additionalProperties": _NUMBER}, "config": {"type": "string"},
        "reproduce": {"type": "string"},
    },
}

_CELL = {
    "type": "object",
    "required": ["fault", "scenario", "status", "effect", "caught_by"],
    "properties": {
        "fault": {"type": "string"}, "scenario": {"type": "string"},
        "status": {"enum": ["detected", "missed", "not applicable"]}, "effect": _NUMBER, "caught_by": _STRINGS,
        "reason": {"type": "string"},
    },
}


def report_schema() -> dict:
    """The schema of a JSON report of this schema_version."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://attn-gradcheck/report.schema.json",
        "title": "attn-gradcheck JSON report",
        "type": "object",
        "required": ["tool", "version", "schema_version", "config", "faults", "passed", "verdict", "summary",
                     "scenarios", "negative_controls", "shard", "interrupted"],
        "properties": {
            "tool": {"const": "attn-gradcheck"},
            "version": {"type": "string"},
            "schema_version": {"const": SCHEMA_VERSION},
            "config": {"type": ["string", "null"]},
            "faults": {"oneOf": [_STRINGS, {"type": "null"}]},
            "passed": {"type": "boolean"},
            "verdict": {"enum": ["pass", "fail", "inconclusive", "interrupted"]},
            "summary": {"type": "object", "required": ["scenarios", "checks", "passed", "failed", "inconclusive",
                                                       "not_applicable"],
                        "additionalProperties": {"type": "integer", "minimum": 0}},
            "engine": {"type": ["string", "null"]},
            "scenarios": {"type": "array", "items": _SCENARIO},
            "negative_controls": {"oneOf": [{"type": "null"}, {
                "type": "object", "required": ["passed", "cells"],
                "properties": {"passed": {"type": "boolean"}, "verdict": _VERDICT, "powerless": _STRINGS,
                               "cells": {"type": "array", "items": _CELL}}}]},
            "shard": {"oneOf": [{"type": "null"}, {
                "type": "object", "required": ["index", "count"],
                "properties": {"index": {"type": "integer", "minimum": 1}, "count": {"type": "integer", "minimum": 1},
                               "of": {"type": ["integer", "null"], "minimum": 0}, "select": _STRINGS,
                               "deselect": _STRINGS}}]},
            "interrupted": {"type": "boolean"},
            "merged_from": _STRINGS,
            "run_id": {"type": "string"},
        },
    }


def problems(data) -> list[str]:
    """What makes ``data`` not a JSON report of this schema_version: '' when it is one."""
    import jsonschema
    validator = jsonschema.Draft202012Validator(report_schema())
    out = []
    for error in sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))[:3]:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        message = error.message if len(error.message) < 160 else error.message[:157] + "..."
        out.append(f"{where or 'the top level'}: {message}")
    return out
