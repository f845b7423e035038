"""Reports for machines: the ``--json`` report (with its ``run_id``) and its JUnit XML."""
from __future__ import annotations

import hashlib
import io
import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from types import SimpleNamespace

from .. import __version__
from ..result import ControlCell, ScenarioResult, controls_verdict, run_verdict
from ..text import text_only, visible_all
from . import schema as report_schema
from .common import diagnosis_lines, failure_message, labelled_numbers, reproduce_command, summary

#: Version of the JSON report layout (docs/reports.md "JSON report"). Bumped on any incompatible change.
JSON_SCHEMA_VERSION = report_schema.SCHEMA_VERSION


def json_report(config: str, faults: Sequence[str], results: Sequence[ScenarioResult],
                controls: Sequence[ControlCell] | None = None, *, shard: dict | None = None,
                interrupted: bool = False, engine: str | None = None) -> dict:
    """The ``--json`` report (documented in docs/reports.md "JSON report"; keys are stable within a schema version)."""
    s = summary(results)
    verdict = run_verdict((r.verdict for r in results), controls, interrupted)
    out = {
        "tool": "attn-gradcheck",
        "version": __version__,
        "schema_version": JSON_SCHEMA_VERSION,
        "config": config,
        "faults": list(faults),
        "passed": verdict == "pass",
        "verdict": verdict,
        "summary": s,
        "engine": engine,
        "scenarios": [{**r.to_json(), "config": config, "reproduce": reproduce_command(config, r.name, faults, engine)}
                      for r in results],
        "negative_controls": None,
        "shard": dict(shard) if shard else None,
        "interrupted": interrupted,
    }
    if controls is not None:
        out["negative_controls"] = _controls(controls)
    return _with_id(_json_safe(out))


def json_bytes(report: dict) -> bytes:
    """The bytes of a ``--json`` report file: indented, ending in a newline; NaN or Infinity refused."""
    return (json.dumps(report, indent=2, allow_nan=False) + "\n").encode()


def _with_id(report: dict) -> dict:
    """The report with its ``run_id``: a digest of everything in it but timings (elapsed_s, compile_s), which
    its JUnit report carries too (the same results always get the same id, so reports stay byte-identical)."""
    stable = json.loads(json.dumps(report))
    stable.pop("run_id", None)
    stable.pop("merged_from", None)  # the merge of a run's shards has the run's id
    for sc in stable.get("scenarios", []):
        if isinstance(sc, dict):
            sc.pop("elapsed_s", None)
            sc.pop("compile_s", None)
    report["run_id"] = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    return report


def _controls(cells: Sequence) -> dict:
    """A report's ``negative_controls``: the cells (``ControlCell`` or their JSON) and their verdict (which the
    report's own verdict already holds: ``run_verdict``)."""
    outcome, powerless = controls_verdict(cells)
    return {"passed": outcome == "pass", "verdict": outcome, "powerless": powerless,
            "cells": [c.to_json() if isinstance(c, ControlCell) else c for c in cells]}


def _json_safe(value):
    """JSON has no NaN or Infinity: non-finite numbers are written as null; nor, for a reader that wants text
    (``merge``), lone surrogates: written as their escapes (``text.text_only``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return text_only(value)
    if isinstance(value, dict):
        return {_json_safe(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _num(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "non-finite"


def junit_xml(report: dict) -> bytes:
    """JUnit XML of a JSON report (``json_report`` or ``merge_reports``): one testsuite per scenario,
    one testcase per check, and one per negative-control cell. Always valid XML 1.0: every text is made
    visible first (``text.visible``: no control character, lone surrogate or noncharacter is left)."""
    report = visible_all(report)
    root = ET.Element("testsuites", name="attn-gradcheck", id=str(report.get("run_id", "")))
    for r in report["scenarios"]:
        checks = [SimpleNamespace(**c) for c in r["checks"]]
        suite = ET.SubElement(root, "testsuite", name=r["name"], tests=str(len(checks)),
                              failures=str(sum(not c.passed for c in checks)), errors="0",
                              skipped=str(sum(c.verdict == "not applicable" for c in checks)),
                              time=f"{r['elapsed_s']:.6f}")
        for c in checks:
            case = ET.SubElement(suite, "testcase", classname=f"attn-gradcheck.{r['name']}",
                                 name=f"{c.name} [{c.tensor}]")
            if not c.passed:
                msg = f"{c.name} ({c.tensor}): " + ", ".join(labelled_numbers(c))  # the table's row
                text = "\n".join([failure_message(c)] + diagnosis_lines(c, indent="  ")
                                 + [f"hint: {h}" for h in r.get("hints", [])] + [f"reproduce: {r['reproduce']}"])
                ET.SubElement(case, "failure", message=msg).text = text
            elif c.verdict == "not applicable":
                ET.SubElement(case, "skipped", message=c.detail)
    controls = (report.get("negative_controls") or {}).get("cells")
    if controls is not None:
        suite = ET.SubElement(root, "testsuite", name="negative-controls", tests=str(len(controls)),
                              failures=str(sum(c["status"] == "missed" for c in controls)), errors="0",
                              skipped=str(sum(c["status"] == "not applicable" for c in controls)))
        for c in controls:
            case = ET.SubElement(suite, "testcase", classname="attn-gradcheck.negative-controls",
                                 name=f"{c['fault']} on {c['scenario']}")
            if c["status"] == "missed":
                ET.SubElement(case, "failure",
                              message=f"fault {c['fault']} not detected (effect {_num(c['effect'], '.2e')})")
            elif c["status"] == "not applicable":
                ET.SubElement(case, "skipped", message=f"not applicable (effect {_num(c['effect'], '.2e')})"
                              + (f": {c['reason']}" if c.get("reason") else ""))
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue()
