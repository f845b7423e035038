"""Render results: rich tables for people, JSON and JUnit for machines, npz arrays for recomputation.
Files are written atomically (temp file in the same folder, then rename): never half-written."""
from __future__ import annotations

import errno
import io
import itertools
import json
import math
import shlex
import os
import re
import stat
import hashlib
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import __version__, report_schema
from . import files as _files
from .diagnose import ranges
from .errors import GradcheckError, ReportsFailed, ReportsInterrupted, Terminated
from .result import ControlCell, ScenarioResult, controls_verdict

#: Version of the JSON report layout (README "JSON report"). Bumped on any incompatible change.
JSON_SCHEMA_VERSION = report_schema.SCHEMA_VERSION


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def summary(results: Sequence[ScenarioResult]) -> dict:
    checks = [c for r in results for c in r.checks]
    passed = sum(c.passed for c in checks)
    inconclusive = sum(c.verdict == "inconclusive" for c in checks)
    return {"scenarios": len(results), "checks": len(checks), "passed": passed,
            "failed": len(checks) - passed - inconclusive, "inconclusive": inconclusive}


def verdict(results: Sequence[ScenarioResult]) -> str:
    """fail if any check fails; else inconclusive if any is; else pass."""
    s = summary(results)
    return "fail" if s["failed"] else ("inconclusive" if s["inconclusive"] else "pass")


def _table(console: Console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
           right: Sequence[bool], styles: Sequence[Sequence[str | None]] | None = None) -> None:
    """A rich table on a terminal; plain aligned columns otherwise (no wrapping, no trailing spaces)."""
    if console.is_terminal:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, padding=(0, 1), collapse_padding=True)
        for i, (h, r) in enumerate(zip(headers, right)):
            # names wrap on a narrow terminal; numbers and statuses never do
            table.add_column(h, justify="right" if r else "left", no_wrap=r or i == len(headers) - 1,
                             ratio=1 if i == 0 else None, min_width=len(h) if r else None)
        for i, row in enumerate(rows):
            style_row = styles[i] if styles else [None] * len(row)
            table.add_row(*(Text(cell, style=st or "") for cell, st in zip(row, style_row)))
        console.print(table)
        return
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    console.print(title, markup=False, highlight=False, soft_wrap=True)
    for cells in [headers] + [list(r) for r in rows]:
        console.print(line(cells), markup=False, highlight=False, soft_wrap=True)


def reproduce_command(config: str, name: str, faults: Sequence[str] = (), engine: str | None = None) -> str:
    """One line that re-runs just this scenario (with the same faults, and the --engine given)."""
    parts = ["attn-gradcheck", "run", shlex.quote(config), "--select", shlex.quote(name)]
    for fault in faults:
        parts += ["--fault", fault]
    if engine:
        parts += ["--engine", engine]
    return " ".join(parts)


def render_scenario(console: Console, r: ScenarioResult, description: str, reproduce: str | None = None) -> None:
    title = f"{r.name} ({description})" + (f"  faults: {', '.join(r.faults)}" if r.faults else "")
    rows, styles = [], []
    for c in r.checks:
        grad = c.kind == "gradient"
        relative = c.kind in ("gradient", "reference", "implementation")
        rows.append([c.name, f"{c.tensor} {'x'.join(map(str, c.shape))}" if c.shape else (c.tensor or ""),
                     _fmt(c.max_abs_error), _fmt(c.relative_error) if relative else "", _fmt(c.tolerance),
                     _fmt(c.noise_floor) if grad else "", _fmt(c.detectable) if c.detectable is not None else "",
                     {"pass": "pass", "fail": "FAIL"}.get(c.verdict, c.verdict)])
        styles.append([None] * 7 + [{"pass": "green", "fail": "bold red"}.get(c.verdict, "bold yellow")])
    _table(console, title, ["check", "tensor", "max abs err", "rel err", "tolerance", "noise floor", "detects",
                            "status"], rows, [False, False, True, True, True, True, True, False], styles)
    for c in r.checks:
        if c.kind == "experiment" and c.passed:  # an experiment's numbers are its result: always shown
            console.print(f"  {c.name}: {c.detail}", soft_wrap=True)
    for c in r.checks:
        if not c.passed:
            word, style = ("FAIL", "red") if c.verdict == "fail" else ("INCONCLUSIVE", "yellow")
            console.print(Text.assemble("  ", (word, style), f" {failure_message(c)}"), soft_wrap=True)
            for line in diagnosis_lines(c):
                console.print(_heat_text(line) if console.is_terminal else Text(line), soft_wrap=True)
    for hint in r.hints:
        console.print(Text.assemble("  ", ("hint:", "bold cyan"), f" {hint}"), soft_wrap=True)
    power = r.detectable
    if power:
        console.print("  power: would have caught uniform relative errors above "
                      + ", ".join(f"{_fmt(x)} in {'O' if t == 'o' else 'd' + t}" for t, x in power.items()),
                      highlight=False, soft_wrap=True)
    word = {"pass": "passed", "fail": "FAILED", "inconclusive": "INCONCLUSIVE"}[r.verdict]
    console.print(f"  {r.name}: {word} in {r.elapsed_s:.2f} s", highlight=False)
    if reproduce and not r.passed:
        console.print(f"  reproduce: {reproduce}", highlight=False, markup=False, soft_wrap=True)
    console.print()


#: Heat-map digits by severity (terminal only; plain output keeps the digits alone).
_HEAT_STYLES = {".": "green", "1": "yellow", "2": "yellow", "3": "red", "4": "red"}


def _heat_text(line: str) -> Text:
    if not line.rstrip().endswith("|") or "|" not in line:
        return Text(line)
    head, cells = line[:line.index("|") + 1], line[line.index("|") + 1:-1]
    text = Text(head)
    for ch in cells:
        text.append(ch, style=_HEAT_STYLES.get(ch, "bold red" if ch.isdigit() else ""))
    text.append("|")
    return text


def _g(x, spec: str = ".6g") -> str:
    """A number of a report's JSON, where a non-finite one is null."""
    return "non-finite" if x is None else format(x, spec)


def diagnosis_lines(c, indent: str = "    ") -> list[str]:
    """Plain text of a failed gradient check's diagnosis (README "Diagnosis"); [] when it has none."""
    d = c.diagnosis
    if not d:
        return []
    where = [f"{d['out_of_tolerance']} of {d['checked']} checked elements out of tolerance"]
    for axis, values in d["axes"].items():
        hit = [i for i, n in enumerate(values["out_of_tolerance"]) if n]
        if hit:
            where.append(f"{axis} {ranges(hit)} of {len(values['out_of_tolerance'])}")
    lines = [indent + "where: " + "; ".join(where)]
    for cls in d["classes"]:
        if cls["checked"]:
            lines.append(f"{indent}  {cls['label']}: {cls['out_of_tolerance']} of {cls['checked']} out of tolerance"
                         + (f" (max |error| {_g(cls['max_abs_error'], '.2e')})" if cls["out_of_tolerance"] else ""))
    heat = d["heat"]
    if heat:
        per = [f"{b} {name}s" for b, name in zip(heat["bin"], (heat["rows"], heat["columns"])) if b > 1]
        lines.append(f"{indent}heat map, {heat['rows']} x {heat['columns']} (digit d: error 10^(d-1) to 10^d times "
                     "what is allowed; '.' within tolerance; ' ' not checked"
                     + (f"; a cell is {' x '.join(per)}" if per else "") + "):")
        width = len(str(len(heat["levels"]) * heat["bin"][0]))
        for i, row in enumerate(heat["levels"]):
            cells = "".join(" " if x < 0 else ("." if x == 0 else str(x)) for x in row)
            lines.append(f"{indent}  {str(i * heat['bin'][0]).rjust(width)} |{cells}|")
    if d["worst"]:
        lines.append(indent + "worst: " + "; ".join(
            f"{c.tensor}{'[' + ', '.join(map(str, w['index'])) + ']' if w['index'] else ''} analytic {_g(w['analytic'])} numeric {_g(w['numeric'])}"
            for w in d["worst"]))
    return lines


def failure_message(c) -> str:
    """One line: the check, the tensor and where it is worst."""
    where = ""
    if c.worst_index is not None and c.kind == "invariant":
        where = f" at {c.tensor}[{', '.join(map(str, c.worst_index))}] (violation {_g(c.max_abs_error, '.3g')}, allowed {_g(c.tolerance, '.3g')})"
    return f"{c.name} ({c.tensor}){where}: {c.detail}"


def render_summary(console: Console, results: Sequence[ScenarioResult], interrupted_of: int | None = None) -> None:
    """The totals line; ``interrupted_of``: the number of scenarios the run was to check, when Ctrl-C
    stopped it."""
    s = summary(results)
    if interrupted_of is not None:
        word = (f"INTERRUPTED after {s['scenarios']} of {interrupted_of} scenario(s)"
                + (f"; {s['failed']} check(s) FAILED" if s["failed"] else ""))
    elif s["failed"]:
        word = f"{s['failed']} check(s) FAILED"
    elif s["inconclusive"]:
        word = (f"{s['inconclusive']} check(s) INCONCLUSIVE (they cannot decide: each says why, e.g. finite "
                "differences too inaccurate, no power, or code that computes in a lower precision)")
    else:
        word = "all checks passed"
    console.print(f"{s['scenarios']} scenario(s), {s['checks']} checks: {s['passed']} passed, {s['failed']} failed"
                  + (f", {s['inconclusive']} inconclusive" if s["inconclusive"] else "") + f" -- {word}",
                  highlight=False)


def render_controls(console: Console, cells: Sequence[ControlCell]) -> None:
    scenarios = list(dict.fromkeys(c.scenario for c in cells))
    faults = list(dict.fromkeys(c.fault for c in cells))
    look = {(c.fault, c.scenario): c for c in cells}
    text = {"detected": ("detected", "green"), "missed": ("MISSED", "bold red"), "not applicable": ("n/a", "dim")}
    # one row per scenario: sweeps make many scenarios, while an op has a handful of faults
    blank = ("", None)
    cell = {k: text[c.status] for k, c in look.items()}
    rows = [[name] + [cell.get((fault, name), blank)[0] for fault in faults] for name in scenarios]
    styles = [[None] + [cell.get((fault, name), blank)[1] for fault in faults] for name in scenarios]
    _table(console, "negative controls (scenario x fault)", ["scenario"] + faults, rows,
           [False] * (1 + len(faults)), styles)
    reasons = list(dict.fromkeys(c.reason for c in cells if c.status == "not applicable" and c.reason))
    if any(c.status == "not applicable" for c in cells):
        console.print("  n/a: the fault cannot apply to that scenario: " + ("; ".join(reasons) if reasons else
                      "it changes neither the output nor any gradient by more than 10x the tolerance")
                      + " (e.g. scale when scale = 1, gqa-sum without shared KV heads, swap-dk-dv when d_head != "
                      "d_value)", highlight=False, soft_wrap=not console.is_terminal)
    missed = [c for c in cells if c.status == "missed"]
    for c in missed:
        console.print(f"  MISSED {c.fault} on {c.scenario}: it changes the result by {_g(c.effect, '.2e')} (relative) "
                      "but no check failed; the scenario lacks power for it", highlight=False)
    outcome, powerless = controls_verdict(cells)
    for name in powerless:
        console.print(f"  INCONCLUSIVE {name}: no fault applies to it, so its negative controls prove nothing",
                      highlight=False)
    applicable = [c for c in cells if c.status != "not applicable"]
    console.print(f"{len(applicable) - len(missed)} of {len(applicable)} applicable fault(s) detected"
                  + {"fail": " -- negative controls FAILED", "inconclusive": " -- negative controls INCONCLUSIVE",
                     "pass": ""}[outcome], highlight=False)


def json_report(config: str, faults: Sequence[str], results: Sequence[ScenarioResult],
                controls: Sequence[ControlCell] | None = None, *, shard: dict | None = None,
                interrupted: bool = False, engine: str | None = None) -> dict:
    """The ``--json`` report (documented in the README; keys are stable within a schema version)."""
    s = summary(results)
    passed = s["failed"] == 0 and s["inconclusive"] == 0
    out = {
        "tool": "attn-gradcheck",
        "version": __version__,
        "schema_version": JSON_SCHEMA_VERSION,
        "config": config,
        "faults": list(faults),
        "passed": passed,
        "verdict": verdict(results),
        "summary": s,
        "engine": engine,
        "scenarios": [{**r.to_json(), "config": config, "reproduce": reproduce_command(config, r.name, faults, engine)}
                      for r in results],
        "negative_controls": None,
        "shard": dict(shard) if shard else None,
        "interrupted": interrupted,
    }
    if interrupted:  # what did not run cannot have passed
        out["passed"] = False
        if out["verdict"] != "fail":
            out["verdict"] = "interrupted"
    if controls is not None:
        _controls_into(out, [c.to_json() for c in controls])
    return _with_id(_json_safe(out))


def _with_id(report: dict) -> dict:
    """The report with its ``run_id``: a digest of everything in it but timings, which its JUnit report
    carries too (the same results always get the same id, so reports stay byte-identical)."""
    stable = json.loads(json.dumps(report))
    stable.pop("run_id", None)
    stable.pop("merged_from", None)  # the merge of a run's shards has the run's id
    for sc in stable.get("scenarios", []):
        if isinstance(sc, dict):
            sc.pop("elapsed_s", None)
    report["run_id"] = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    return report


def _controls_into(report: dict, cells: list[dict]) -> None:
    """Add the negative controls to a report and fold their verdict into the report's."""
    outcome, powerless = controls_verdict(cells)
    report["negative_controls"] = {"passed": outcome == "pass", "verdict": outcome, "powerless": powerless,
                                   "cells": cells}
    if outcome != "pass":
        report["passed"] = False
    if outcome == "fail":
        report["verdict"] = "fail"
    elif outcome == "inconclusive" and report["verdict"] == "pass":
        report["verdict"] = "inconclusive"


def merge_reports(reports: Sequence[tuple[str, dict]]) -> dict:
    """One report from several JSON reports (``(path, data)``), e.g. the shards of a CI matrix: the
    scenarios in file order, counts and verdict recomputed. Raises GradcheckError when a report is not
    ours, is from an interrupted run, or when shards are missing or overlap."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for path, data in reports:
        if not isinstance(data, dict) or data.get("tool") != "attn-gradcheck" or not isinstance(data.get("scenarios"), list):
            raise GradcheckError(f"{path}: not an attn-gradcheck JSON report")
        if data.get("schema_version") != JSON_SCHEMA_VERSION:
            raise GradcheckError(f"{path}: schema_version {data.get('schema_version')!r}; this version merges "
                                 f"schema_version {JSON_SCHEMA_VERSION}")
        problems = report_schema.problems(data)
        if problems:
            raise GradcheckError(f"{path}: not a valid attn-gradcheck JSON report (schema/report.schema.json): "
                                 + "; ".join(problems))
        _consistent(path, data)
        if data.get("interrupted"):
            raise GradcheckError(f"{path}: from an interrupted run; re-run it before merging")
        groups.setdefault(os.path.normpath(str(data.get("config"))), []).append((path, data))
    scenarios, cells, all_faults = [], [], set()
    with_controls = {data.get("negative_controls") is not None for _, data in reports}
    if len(with_controls) > 1:
        raise GradcheckError("some reports ran --negative-controls and some did not; merge like with like")
    for config, parts in groups.items():
        faults = {tuple(data.get("faults") or ()) for _, data in parts}
        if len(faults) > 1:
            raise GradcheckError(f"reports of {config} ran different faults: {sorted(faults)}")
        engines = {data.get("engine") for _, data in parts}
        if len(engines) > 1:
            raise GradcheckError(f"reports of {config} ran on different engines (--engine {sorted(map(str, engines))})")
        all_faults |= faults
        _check_shards(config, parts)
        seen: dict[str, str] = {}
        rows = []
        for path, data in parts:
            for sc in data["scenarios"]:
                if sc["name"] in seen:
                    raise GradcheckError(f"scenario {sc['name']} of {config} is in {seen[sc['name']]} and in {path}")
                seen[sc["name"]] = path
                rows.append(sc)
            if data.get("negative_controls"):
                cells.extend((config, c) for c in data["negative_controls"]["cells"])
        rows.sort(key=lambda sc: sc.get("index", 0))
        scenarios.extend(rows)
    order = {(os.path.normpath(str(sc["config"])), sc["name"]): k for k, sc in enumerate(scenarios)}
    cells.sort(key=lambda cc: order.get((cc[0], cc[1]["scenario"]), len(order)))
    checks = [c for sc in scenarios for c in sc["checks"]]
    failed = sum(c["verdict"] == "fail" for c in checks)
    inconclusive = sum(c["verdict"] == "inconclusive" for c in checks)
    summary_ = {"scenarios": len(scenarios), "checks": len(checks), "passed": len(checks) - failed - inconclusive,
                "failed": failed, "inconclusive": inconclusive}
    verdict_ = "fail" if failed else ("inconclusive" if inconclusive else "pass")
    merged = {
        "tool": "attn-gradcheck",
        "version": __version__,
        "schema_version": JSON_SCHEMA_VERSION,
        "config": next(iter(groups)) if len(groups) == 1 else None,
        "faults": list(next(iter(all_faults))) if len(all_faults) == 1 else None,
        "engine": (lambda e: e.pop() if len(e) == 1 else None)({data.get("engine") for _, data in reports}),
        "passed": verdict_ == "pass",
        "verdict": verdict_,
        "summary": summary_,
        "scenarios": scenarios,
        "negative_controls": None,
        "shard": None,
        "interrupted": False,
        "merged_from": [path for path, _ in reports],
    }
    if with_controls == {True}:
        _controls_into(merged, [c for _, c in cells])
    return _with_id(merged)


def _consistent(path: str, data: dict) -> None:
    """What the schema cannot say: each check's ``passed`` is its verdict, each scenario's verdict is
    its checks' (fail if any fails, else inconclusive if any is), and the summary counts what is there.
    A report that contradicts itself was edited or damaged: merging it would give a verdict nobody ran."""
    def bad(where: str, what: str):
        return GradcheckError(f"{path}: {where}: {what}: the report contradicts itself (edited or damaged); "
                              "use the report the run wrote")
    counts = {"scenarios": len(data["scenarios"]), "checks": 0, "passed": 0, "failed": 0, "inconclusive": 0}
    for i, sc in enumerate(data["scenarios"]):
        verdicts = set()
        for j, c in enumerate(sc["checks"]):
            if c["passed"] != (c["verdict"] == "pass"):
                raise bad(f"scenarios[{i}].checks[{j}]", f"passed is {str(c['passed']).lower()} but its verdict is "
                                                         f"{c['verdict']}")
            verdicts.add(c["verdict"])
            counts["checks"] += 1
            counts[{"pass": "passed", "fail": "failed", "inconclusive": "inconclusive"}[c["verdict"]]] += 1
        derived = "fail" if "fail" in verdicts else ("inconclusive" if "inconclusive" in verdicts else "pass")
        if sc["verdict"] != derived or sc["passed"] != (derived == "pass"):
            raise bad(f"scenarios[{i}] ({sc['name']})", f"its verdict is {sc['verdict']} (passed "
                                                        f"{str(sc['passed']).lower()}) but its checks say {derived}")
    summary_ = {k: data["summary"].get(k) for k in counts}
    if summary_ != counts:
        raise bad("summary", f"it counts {summary_} but the report holds {counts}")


def _check_shards(config, parts: Sequence[tuple[str, dict]]) -> None:
    """The shards of one config: all of 1..N, each once (reports without --shard are whole runs)."""
    shards = [(path, data.get("shard")) for path, data in parts]
    if not any(s for _, s in shards):
        return
    if not all(s for _, s in shards):
        raise GradcheckError(f"reports of {config} mix shards and whole runs: "
                             + ", ".join(p for p, s in shards if not s) + " ran without --shard")
    counts = {s["count"] for _, s in shards}
    if len(counts) > 1:
        raise GradcheckError(f"reports of {config} come from different splits (N = {sorted(counts)})")
    count = counts.pop()
    runs = {(tuple(s.get("select", ())), tuple(s.get("deselect", ())), s.get("of")) for _, s in shards}
    if len(runs) > 1:
        raise GradcheckError(f"shards of {config} selected different scenarios (--select / --deselect differ): "
                             "merge shards of one run")
    of = runs.pop()[2]
    given: dict[int, str] = {}
    for path, s in shards:
        if s["index"] > count:
            raise GradcheckError(f"{path}: shard {s['index']}/{count}: there is no such shard (index above count)")
        if s["index"] in given:
            raise GradcheckError(f"shard {s['index']}/{count} of {config} is given twice ({given[s['index']]}, {path})")
        given[s["index"]] = path
    if len(given) < count:  # name the first few missing without counting up to a huge N
        missing = [f"{i}/{count}" for i in itertools.islice((i for i in itertools.count(1) if i not in given), 5)]
        more = count - len(given) - len(missing)
        raise GradcheckError(f"shard {', '.join(missing)}{f' and {more:,} more' if more > 0 else ''} of {config} "
                             "missing; merge every shard of the run")
    held = sum(len(data["scenarios"]) for _, data in parts)
    if of is not None and held != of:
        raise GradcheckError(f"the shards of {config} hold {held} scenario(s) but the run selected {of}")


def render_merged(console: Console, data: dict) -> None:
    """A line per scenario (its failed checks under it), the totals and the negative controls."""
    for sc in data["scenarios"]:
        word = {"pass": "passed", "fail": "FAILED", "inconclusive": "INCONCLUSIVE"}[sc["verdict"]]
        console.print(f"{sc['name']} ({sc['config']}): {word}")
        for c in sc["checks"]:
            if c["verdict"] != "pass":
                console.print(f"  {c['verdict'].upper()} {c['name']} ({c['tensor']}): {c['detail']}", soft_wrap=True)
        for hint in sc.get("hints", []):
            console.print(f"  hint: {hint}", soft_wrap=True)
        if sc["verdict"] != "pass":
            console.print(f"  reproduce: {sc['reproduce']}", soft_wrap=True)
    s = data["summary"]
    console.print(f"{s['scenarios']} scenario(s), {s['checks']} checks: {s['passed']} passed, {s['failed']} failed"
                  + (f", {s['inconclusive']} inconclusive" if s["inconclusive"] else "")
                  + f" -- merged from {len(data['merged_from'])} report(s): {data['verdict']}")
    if data["negative_controls"] is not None:
        cells = data["negative_controls"]["cells"]
        applicable = [c for c in cells if c["status"] != "not applicable"]
        missed = [c for c in applicable if c["status"] == "missed"]
        for c in missed:
            console.print(f"  MISSED {c['fault']} on {c['scenario']}")
        console.print(f"{len(applicable) - len(missed)} of {len(applicable)} applicable fault(s) detected"
                      + (" -- negative controls FAILED" if missed else ""))


def _json_safe(value):
    """JSON has no NaN or Infinity: non-finite numbers are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _num(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "non-finite"


def junit_xml(report: dict) -> bytes:
    """JUnit XML of a JSON report (``json_report`` or ``merge_reports``): one testsuite per scenario,
    one testcase per check, and one per negative-control cell."""
    root = ET.Element("testsuites", name="attn-gradcheck", id=str(report.get("run_id", "")))
    for r in report["scenarios"]:
        checks = [SimpleNamespace(**c) for c in r["checks"]]
        suite = ET.SubElement(root, "testsuite", name=r["name"], tests=str(len(checks)),
                              failures=str(sum(not c.passed for c in checks)), errors="0",
                              time=f"{r['elapsed_s']:.6f}")
        for c in checks:
            case = ET.SubElement(suite, "testcase", classname=f"attn-gradcheck.{r['name']}",
                                 name=f"{c.name} [{c.tensor}]")
            if not c.passed:
                msg = (f"{c.name} ({c.tensor}): max abs error {_num(c.max_abs_error, '.3e')}, relative "
                       f"{_num(c.relative_error, '.3e')}, tolerance {_num(c.tolerance, '.1e')}, noise floor "
                       f"{_num(c.noise_floor, '.1e')}")
                text = "\n".join([failure_message(c)] + diagnosis_lines(c, indent="  ")
                                 + [f"hint: {h}" for h in r.get("hints", [])] + [f"reproduce: {r['reproduce']}"])
                ET.SubElement(case, "failure", message=msg).text = text
    controls = (report.get("negative_controls") or {}).get("cells")
    if controls is not None:
        suite = ET.SubElement(root, "testsuite", name="negative-controls", tests=str(len(controls)),
                              failures=str(sum(c["status"] == "missed" for c in controls)), errors="0",
                              skipped=str(sum(c["status"] == "not applicable" for c in controls)))
        for c in controls:
            case = ET.SubElement(suite, "testcase", classname="attn-gradcheck.negative-controls",
                                 name=f"{c['fault']} on {c['scenario']}")
            if c["status"] == "missed":
                ET.SubElement(case, "failure", message=f"fault {c['fault']} not detected (effect {_num(c['effect'], '.2e')})")
            elif c["status"] == "not applicable":
                ET.SubElement(case, "skipped", message=f"not applicable (effect {_num(c['effect'], '.2e')})"
                              + (f": {c['reason']}" if c.get("reason") else ""))
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue()


def _probe(folder: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".attn-gradcheck-probe.", dir=folder)
    os.close(fd)
    os.unlink(tmp)


#: Kinds of file a run reads that no report replaces, wherever they are (a helper module that an
#: implementation imports is not known before the run).
INPUT_SUFFIXES = {".py": "Python module", ".pyi": "Python stub", ".yaml": "YAML file", ".yml": "YAML file",
                  ".npy": "NumPy array", ".npz": "NumPy archive"}


def prepare_outputs(files: dict[str, str | None], folders: dict[str, str | None],
                    folder_files: dict[str, Sequence[str]] | None = None, inputs: Sequence[str] = ()) -> None:
    """Before anything runs: every file a run will write (``files``, and ``folder_files[opt]`` inside
    ``folders[opt]``) is distinct and is none of ``inputs``; folders exist (created if missing) and
    can be written."""
    for opt, p in [*files.items(), *folders.items()]:
        if p is not None and not str(p).strip():
            raise GradcheckError(f"{opt} {p!r}: an empty path; give a file path")
        if p and "\x00" in p:
            raise GradcheckError(f"{opt} {p!r}: the path contains a NUL byte")
    for opt, p in files.items():
        if p and (p.endswith(os.sep) or p.endswith("/")):
            raise GradcheckError(f"{opt} {p}: names a folder; give a file path, e.g. {p.rstrip('/' + os.sep)}/report")
    targets: dict[Path, str] = {Path(p).resolve(): f"the input {p}" for p in inputs}
    targets.update({Path(p).resolve(): f"the {opt} folder {p}" for opt, p in folders.items() if p})
    wanted = [(opt, Path(p)) for opt, p in files.items() if p]
    wanted += [(f"{opt} ({name})", Path(folders[opt]) / name)
               for opt, names in (folder_files or {}).items() if folders.get(opt) for name in names]
    for what, p in wanted:
        key = p.resolve()
        if key in targets:
            raise GradcheckError(f"{what} would overwrite {targets[key]} ({p}); give another path")
        if p.suffix.lower() in INPUT_SUFFIXES and p.suffix.lower() != ".npz" and _files.is_regular_or_absent(p) \
                and p.exists():
            raise GradcheckError(f"{what} would overwrite {p}, a {INPUT_SUFFIXES[p.suffix.lower()]} (perhaps one "
                                 "the run reads); a report never replaces one: give another path")
        targets[key] = what
    for opt, p in [(o, Path(p)) for o, p in {**files, **folders}.items() if p]:
        is_folder = opt in folders
        try:
            if is_folder:
                if p.exists() and not p.is_dir():
                    raise GradcheckError(f"{opt} {p}: exists and is not a folder")
                p.mkdir(parents=True, exist_ok=True)
                _probe(p)
            else:
                if p.is_dir():
                    raise GradcheckError(f"{opt} {p}: is a folder; give a file path")
                if not _files.is_regular_or_absent(p):
                    mode = os.stat(p).st_mode
                    if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
                        raise GradcheckError(f"{opt} {p}: is neither a regular file nor a device or FIFO to write "
                                             "through; give a file path")
                    if stat.S_ISFIFO(mode):
                        _hold_fifo(opt, p)
                    continue  # written through (``--json /dev/null`` discards), never renamed over
                p.parent.mkdir(parents=True, exist_ok=True)
                _probe(p.parent)
        except OSError as exc:
            raise GradcheckError(f"{opt} {p}: cannot write there ({exc.strerror or exc})") from None
    for what, p in wanted:
        if what not in files and (p.is_dir() or not _files.is_regular_or_absent(p)):  # a --save-arrays member
            raise GradcheckError(f"{what}: {p} exists and is not a regular file; remove it or choose another folder")
        try:
            longest = os.pathconf(p.parent if p.parent.exists() else ".", "PC_NAME_MAX")
        except (OSError, ValueError):
            longest = 255
        if len(os.fsencode(p.name)) > longest:
            raise GradcheckError(f"{p}: the file name is {len(os.fsencode(p.name))} bytes; this file system allows "
                                 f"{longest}")
    remove_stale_stages({p.parent for _, p in wanted if p.parent.exists()}, keep=inputs)


#: Staged report files are named .attn-gradcheck-<pid>-<random>.tmp beside their targets, whatever the
#: target's name (a long name cannot make the staging name too long), so a later run can recognise and
#: remove those that a killed run (kill -9) left behind.
STAGE_PREFIX = ".attn-gradcheck-"


class StagedWrites:
    """Write every report to a temp file beside its target, then put them all in place, so no report
    is ever half-written and the reports are all new or all as they were: each target that existed is
    kept under a hard link until every rename succeeded, and a failure (or Ctrl-C) while putting them
    in place puts the old ones back. A target that is a character device or a FIFO (``--json
    /dev/null``) is written through, never renamed over, and first: what it was sent cannot be taken
    back, but a failure there leaves every file as it was."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, Path]] = []
        self._through: list[tuple[Path, bytes]] = []
        self.committed: list[Path] = []

    def add(self, path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> None:
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
        if not _files.is_regular_or_absent(path):  # /dev/null, a FIFO: written through at commit
            buffer = io.BytesIO()
            write(buffer)
            self._through.append((path, buffer.getvalue()))
            return
        fd, tmp = _stage_file(path.parent)
        self._staged.append((tmp, path))
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)

    def __enter__(self) -> "StagedWrites":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            return
        replaced: list[tuple[Path, str | None]] = []  # (target, the hard link keeping its old file)
        try:
            for path, data in self._through:
                _write_through(path, data)
                self.committed.append(path)
            for tmp, path in self._staged:
                replaced.append((path, _keep_old(path)))
                os.replace(tmp, path)
                self.committed.append(path)
        except BaseException as failure:
            restored = _put_back(replaced, self.committed)
            self._discard()
            written = [str(p) for p in self.committed if p not in restored]
            pending = [str(p) for _, p in self._staged if str(p) not in written] + \
                [str(p) for p, _ in self._through if p not in self.committed]
            if isinstance(failure, KeyboardInterrupt):
                raise ReportsInterrupted(written, pending, isinstance(failure, Terminated)) from None
            raise ReportsFailed(written, pending, failure) from None
        for _, old in replaced:
            if old:
                Path(old).unlink(missing_ok=True)

    def _discard(self) -> None:
        for tmp, _ in self._staged:
            Path(tmp).unlink(missing_ok=True)


def _stage_file(folder: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", suffix=".tmp", dir=folder)


def _keep_old(path: Path) -> str | None:
    """A hard link to the file at ``path`` (a staging name); "" when there is no file there; None when
    the file system has no hard links (then a failure cannot put that one back, and says so)."""
    if not path.exists():
        return ""
    fd, name = _stage_file(path.parent)
    os.close(fd)
    os.unlink(name)
    try:
        os.link(path, name)
    except OSError:
        return None
    return name


def _put_back(replaced: list[tuple[Path, str | None]], committed: list[Path]) -> set[Path]:
    """Undo the renames that happened: the old file back where there was one, the new one removed where
    there was none. The targets put back (best effort: a second failure leaves that one new)."""
    done = set()
    for path, old in reversed(replaced):
        if path not in committed:
            if old:
                Path(old).unlink(missing_ok=True)
            continue
        if old is None:
            continue  # no hard link to put back: that report stays new, and is named so
        try:
            if old:
                os.replace(old, path)
            else:
                path.unlink()  # there was no file: the new one goes
            done.add(path)
        except BaseException:  # noqa: BLE001 -- a second Ctrl-C: that report stays new, and is named so
            pass
    return done


#: Seconds a special file may refuse every byte before the write is given up (a FIFO whose reader
#: holds it open but stopped reading).
STALL_S = 60.0


#: FIFOs given as report targets, opened for writing when the run starts (so one without a reader is
#: refused before the run) and kept open until the report is written through (closing it in between
#: would end its reader's input).
_HELD_FIFOS: dict[str, int] = {}


def _hold_fifo(opt: str, path: Path) -> None:
    key = os.path.abspath(path)
    if key in _HELD_FIFOS:
        return
    try:
        _HELD_FIFOS[key] = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise GradcheckError(f"{opt} {path}: a FIFO with no reader; start its reader first") from None
        raise


def _write_through(path: Path, data: bytes) -> None:
    """Write into a special file in place: a FIFO without a reader is an error, not a wait, and one
    whose reader stops reading for STALL_S seconds is an error too."""
    import select
    fd = _HELD_FIFOS.pop(os.path.abspath(path), None)
    if fd is None:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                if not select.select([], [fd], [], STALL_S)[1]:
                    raise OSError(errno.ETIMEDOUT, f"nothing could be written to {path} for {STALL_S:g} s (its "
                                                   "reader stopped reading)") from None
    finally:
        os.close(fd)


#: The exact shape of a staged file's name (tempfile.mkstemp's 8 random characters): nothing else that
#: merely starts with the prefix is ever removed.
_STAGE_NAME = re.compile(re.escape(STAGE_PREFIX) + r"(\d{1,7})-[a-z0-9_]{8}\.tmp")


def remove_stale_stages(folders, keep=()) -> None:
    """Staged files that runs killed with -9 left behind: a regular file of this user whose name has
    exactly the staging shape, whose process is gone, and that is not one of ``keep`` (this run's
    inputs)."""
    kept = {Path(p).resolve() for p in keep}
    for folder in {Path(f).resolve() for f in folders}:
        try:
            entries = list(folder.glob(f"{STAGE_PREFIX}*.tmp"))
        except OSError:
            continue
        for entry in entries:
            match = _STAGE_NAME.fullmatch(entry.name)
            if not match or entry in kept or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
                continue
            try:
                info = entry.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    entry.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def write_reports(json_path=None, json_data: dict | None = None, junit_path=None, junit_data: bytes | None = None,
                  arrays_dir=None, results: Sequence[ScenarioResult] = ()) -> None:
    """All requested reports, atomically; raises OSError when one cannot be written (then none is)."""
    with StagedWrites() as stage:
        if json_path:
            data = (json.dumps(json_data, indent=2, allow_nan=False) + "\n").encode()
            stage.add(json_path, lambda fh: fh.write(data))
        if junit_path:
            stage.add(junit_path, lambda fh: fh.write(junit_data))
        if arrays_dir:
            for r in results:
                stage.add(Path(arrays_dir) / f"{r.name}.npz", lambda fh, r=r: np.savez(fh, **r.arrays))


def render_sweep(console: Console, sweep, description: str) -> None:
    """A table per scenario: one row per step, the relative error of each input's sampled elements."""
    tensors = list(sweep.errors)
    best = {t: sweep.best(t) for t in tensors}
    rows = []
    for k, h in enumerate(sweep.steps):
        cells = [f"{h:.0e}"]
        for t in tensors:
            e = sweep.errors[t][k]
            cells.append(("inf" if not math.isfinite(e) else f"{e:.1e}") + (" *" if h == best[t] else "  "))
        rows.append(cells + (["<- run"] if h == sweep.chosen else [""]))
    _table(console, f"{sweep.name} ({description}): relative error against epsilon", ["epsilon"] + tensors + [""],
           rows, [True] * (1 + len(tensors)) + [False])
    console.print("  large steps: truncation (~h^2); small steps: rounding (~eps/h); * = smallest error; <- run = the step "
                  "the run uses", soft_wrap=True)
    console.print()


def plot_sweeps(sweeps, fh, fmt: str = "png") -> None:
    """Log-log curves of error against epsilon, one panel per scenario, the run's step marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(sweeps), 1, figsize=(7, 3.2 * len(sweeps)), squeeze=False)
    for ax, sweep in zip(axes[:, 0], sweeps):
        for t, errors in sweep.errors.items():
            values = np.asarray(errors, dtype=float)
            ok = np.isfinite(values) & (values > 0)
            ax.loglog(np.asarray(sweep.steps)[ok], values[ok], marker="o", label=t)
        ax.axvline(sweep.chosen, color="grey", linestyle="--", label=f"run's epsilon {sweep.chosen:g}")
        ax.set_title(f"{sweep.name} ({sweep.dtype})")
        ax.set_xlabel("epsilon")
        ax.set_ylabel("relative error")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(fh, format=fmt)
    plt.close(fig)
