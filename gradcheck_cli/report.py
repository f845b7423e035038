"""Render results: rich tables for people, JSON and JUnit for machines, npz arrays for recomputation.
Files are written atomically (temp file in the same folder, then rename): never half-written."""
from __future__ import annotations

import io
import json
import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from . import __version__
from .result import ControlCell, ScenarioResult

#: Version of the JSON report layout (README "JSON report"). Bumped on any incompatible change.
JSON_SCHEMA_VERSION = 1


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def _status(ok: bool, styled: bool) -> str:
    if not styled:
        return "pass" if ok else "FAIL"
    return "[green]pass[/]" if ok else "[bold red]FAIL[/]"


def summary(results: Sequence[ScenarioResult]) -> dict:
    checks = [c for r in results for c in r.checks]
    passed = sum(c.passed for c in checks)
    return {"scenarios": len(results), "checks": len(checks), "passed": passed, "failed": len(checks) - passed}


def render_results(console: Console, results: Sequence[ScenarioResult], descriptions: dict[str, str]) -> None:
    styled = console.is_terminal
    for r in results:
        title = f"{r.name} ({descriptions.get(r.name, r.op)})"
        if r.faults:
            title += f"  faults: {', '.join(r.faults)}"
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD if styled else None,
                      show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
        # names wrap on a narrow terminal; numbers never do
        table.add_column("check", ratio=1, min_width=14)
        table.add_column("tensor", min_width=8)
        for col in ("max abs err", "rel err", "tolerance", "noise floor"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("status", no_wrap=True, min_width=6)
        for c in r.checks:
            tensor = f"{c.tensor} {'x'.join(map(str, c.shape))}" if c.shape else (c.tensor or "")
            table.add_row(c.name, tensor, _fmt(c.max_abs_error),
                          _fmt(c.relative_error) if c.kind == "gradient" else "",
                          _fmt(c.tolerance), _fmt(c.noise_floor) if c.kind == "gradient" else "",
                          _status(c.passed, styled))
        console.print(table)
        for c in r.checks:
            if not c.passed:
                where = f" at {c.tensor}[{', '.join(map(str, c.worst_index))}]" if c.worst_index and c.kind == "invariant" else ""
                console.print(f"  {'[red]' if styled else ''}FAIL{'[/]' if styled else ''} {c.name} ({c.tensor}){where}: {c.detail}",
                              highlight=False, markup=styled)
        console.print(f"  {r.name}: {'passed' if r.passed else 'FAILED'} in {r.elapsed_s:.2f} s", highlight=False)
        console.print()
    s = summary(results)
    verdict = "all checks passed" if s["failed"] == 0 else f"{s['failed']} check(s) FAILED"
    console.print(f"{s['scenarios']} scenario(s), {s['checks']} checks: {s['passed']} passed, {s['failed']} failed "
                  f"-- {verdict}", highlight=False)


def render_controls(console: Console, cells: Sequence[ControlCell]) -> None:
    styled = console.is_terminal
    scenarios = list(dict.fromkeys(c.scenario for c in cells))
    faults = list(dict.fromkeys(c.fault for c in cells))
    table = Table(title="negative controls (fault x scenario)", title_justify="left",
                  box=box.SIMPLE_HEAD if styled else None, show_edge=False, pad_edge=False)
    table.add_column("fault", no_wrap=True)
    for name in scenarios:
        table.add_column(name, no_wrap=True)
    look = {(c.fault, c.scenario): c for c in cells}
    text = {"detected": ("detected", "green"), "missed": ("MISSED", "bold red"), "not applicable": ("n/a", "dim")}
    for fault in faults:
        row = []
        for name in scenarios:
            c = look[(fault, name)]
            word, style = text[c.status]
            row.append(f"[{style}]{word}[/]" if styled else word)
        table.add_row(fault, *row)
    console.print(table)
    console.print("  n/a: the fault changes neither the output nor any gradient by more than 10x the "
                  "tolerance on that scenario (e.g. scale when scale = 1, gqa-sum without shared KV heads)",
                  highlight=False)
    missed = [c for c in cells if c.status == "missed"]
    for c in missed:
        console.print(f"  MISSED {c.fault} on {c.scenario}: it changes the result by {c.effect:.2e} (relative) "
                      "but no check failed; the scenario lacks power for it", highlight=False)
    applicable = [c for c in cells if c.status != "not applicable"]
    console.print(f"{len(applicable) - len(missed)} of {len(applicable)} applicable fault(s) detected"
                  + (" -- negative controls FAILED" if missed else ""), highlight=False)


def json_report(config: str, faults: Sequence[str], results: Sequence[ScenarioResult],
                controls: Sequence[ControlCell] | None = None) -> dict:
    """The ``--json`` report (documented in the README; keys are stable within a schema version)."""
    s = summary(results)
    passed = s["failed"] == 0
    out = {
        "tool": "attn-gradcheck",
        "version": __version__,
        "schema_version": JSON_SCHEMA_VERSION,
        "config": config,
        "faults": list(faults),
        "passed": passed,
        "summary": s,
        "scenarios": [r.to_json() for r in results],
        "negative_controls": None,
    }
    if controls is not None:
        ok = not any(c.status == "missed" for c in controls)
        out["negative_controls"] = {"passed": ok, "cells": [c.to_json() for c in controls]}
        out["passed"] = passed and ok
    return out


def junit_xml(results: Sequence[ScenarioResult], controls: Sequence[ControlCell] | None = None) -> bytes:
    """JUnit XML: one testsuite per scenario, one testcase per check (and one per control cell)."""
    root = ET.Element("testsuites", name="attn-gradcheck")
    for r in results:
        failures = sum(not c.passed for c in r.checks)
        suite = ET.SubElement(root, "testsuite", name=r.name, tests=str(len(r.checks)),
                              failures=str(failures), errors="0", time=f"{r.elapsed_s:.6f}")
        for c in r.checks:
            case = ET.SubElement(suite, "testcase", classname=f"attn-gradcheck.{r.name}",
                                 name=f"{c.name} [{c.tensor}]")
            if not c.passed:
                msg = (f"{c.name} ({c.tensor}): max abs error {c.max_abs_error:.3e}, relative "
                       f"{c.relative_error:.3e}, tolerance {c.tolerance:.1e}, noise floor {c.noise_floor:.1e}")
                ET.SubElement(case, "failure", message=msg).text = c.detail
    if controls is not None:
        missed = sum(c.status == "missed" for c in controls)
        suite = ET.SubElement(root, "testsuite", name="negative-controls", tests=str(len(controls)),
                              failures=str(missed), errors="0",
                              skipped=str(sum(c.status == "not applicable" for c in controls)))
        for c in controls:
            case = ET.SubElement(suite, "testcase", classname="attn-gradcheck.negative-controls",
                                 name=f"{c.fault} on {c.scenario}")
            if c.status == "missed":
                ET.SubElement(case, "failure", message=f"fault {c.fault} not detected (effect {c.effect:.2e})")
            elif c.status == "not applicable":
                ET.SubElement(case, "skipped", message=f"not applicable (effect {c.effect:.2e})")
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="utf-8", xml_declaration=True)
    return buf.getvalue()


def write_atomic(path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> None:
    """Write a file through ``write(fh)`` into a temp file beside it, then rename it into place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, report: dict) -> None:
    data = (json.dumps(report, indent=2) + "\n").encode()
    write_atomic(path, lambda fh: fh.write(data))


def write_junit(path: str | os.PathLike, data: bytes) -> None:
    write_atomic(path, lambda fh: fh.write(data))


def save_arrays(directory: str | os.PathLike, results: Sequence[ScenarioResult]) -> list[Path]:
    """One ``<scenario>.npz`` per scenario with the inputs, the upstream gradient, the output and the
    analytic (and, in full mode, numeric) gradients."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        target = directory / f"{r.name}.npz"
        write_atomic(target, lambda fh, r=r: np.savez(fh, **r.arrays))
        paths.append(target)
    return paths
