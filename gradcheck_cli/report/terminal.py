"""Rich tables and text for people: a scenario's checks, the totals, the negative controls, a merged
report and an epsilon sweep (plain aligned columns when the output is not a terminal)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..result import ControlCell, ScenarioResult, controls_verdict
from ..text import visible, visible_all
from .common import (
    COLUMNS,
    _g,
    counted,
    diagnosis_lines,
    failure_message,
    labelled_numbers,
    number_cells,
    power_line,
    summary,
)


def _narrow_table(console: Console, title: str, rows: Sequence[Sequence[str]], checks, styles: Sequence[str]) -> None:
    """The scenario table on a terminal too narrow for it: each check's name, tensor and status on one line, its
    numbers on the next, each labelled (``abs 1.38e-09  rel 6.55e-10  rtol 1.00e-06 ...``), so that nothing wraps
    at 80 columns; a longer name wraps at its words, and numbers that do not fit go on one more line, never split."""
    for line in _wrapped(title, console.width, ""):
        console.print(line, markup=False, highlight=False)
    status_width = max(len(row[-1]) for row in rows)
    name_width, tensor_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    aligned = name_width + 2 + tensor_width + 2 + status_width <= console.width  # in columns when they fit
    room = name_width + 2 + tensor_width + 1 if aligned else max(20, console.width - status_width - 1)
    for row, c, style in zip(rows, checks, styles):
        head = f"{row[0].ljust(name_width) if aligned else row[0]}  {row[1]}".rstrip()
        lines = [head] if aligned else _wrapped(head, room, "  ")
        console.print(Text.assemble(lines[0].ljust(room), " ", (row[-1], style)))
        for line in lines[1:]:
            console.print(line, markup=False, highlight=False)
        packed = ""
        for pair in labelled_numbers(c, short=True):
            if packed and len(packed) + 2 + len(pair) > console.width:
                console.print(packed, markup=False, highlight=False)
                packed = ""
            packed = f"{packed}  {pair}" if packed else f"    {pair}"
        if packed:
            console.print(packed, markup=False, highlight=False)


def _wrapped(text: str, width: int, indent: str) -> list[str]:
    """``text`` wrapped by the tool at word boundaries to ``width`` columns, continuation lines indented by
    ``indent``: a number or a path is never split (a word longer than the line stays whole)."""
    import re
    import textwrap
    lead = len(text) - len(text.lstrip(" "))
    # an index such as k[0, 1, 1, 4] is one word: its spaces are held (NUL, which textwrap does not split on)
    held = re.sub(r"\[[^\[\]]{0,60}\]", lambda m: m.group(0).replace(" ", "\0"), text)
    lines = textwrap.wrap(held, width=max(width, 20), subsequent_indent=" " * lead + indent, break_long_words=False,
                          break_on_hyphens=False, drop_whitespace=True) or [held]
    return [line.replace("\0", " ") for line in lines]


def _say(console: Console, text: str | Text, indent: str = "    ") -> None:
    """One diagnostic line: on a terminal wrapped at word boundaries to its width (styles kept for the first
    word run only when it fits); elsewhere one line, never wrapped (logs, pipes)."""
    plain = text.plain if isinstance(text, Text) else text
    if not console.is_terminal or len(plain) <= console.width:
        console.print(text, soft_wrap=True, markup=False, highlight=False)
        return
    for line in _wrapped(plain, console.width, indent):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


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


def _visible_result(r: ScenarioResult) -> ScenarioResult:
    """``r`` with the text it took from outside made visible (``text.visible``): its name, faults and hints, and
    each check's name, tensor, detail and diagnosis."""
    checks = tuple(dataclasses.replace(c, name=visible(c.name), tensor=None if c.tensor is None else visible(c.tensor),
                                       detail=visible(c.detail), diagnosis=visible_all(c.diagnosis))
                   for c in r.checks)
    return dataclasses.replace(r, name=visible(r.name), faults=tuple(map(visible, r.faults)),
                               hints=tuple(map(visible, r.hints)), checks=checks)


def render_scenario(console: Console, r: ScenarioResult, description: str, reproduce: str | None = None) -> None:
    r, description, reproduce = _visible_result(r), visible(description), reproduce and visible(reproduce)
    title = f"{r.name} ({description})" + (f"  faults: {', '.join(r.faults)}" if r.faults else "")
    statuses = [{"pass": "pass", "fail": "FAIL", "not applicable": "n/a"}.get(c.verdict, c.verdict) for c in r.checks]
    status_styles = [{"pass": "green", "fail": "bold red", "not applicable": "dim"}.get(c.verdict, "bold yellow")
                     for c in r.checks]
    rows = [[c.name, f"{c.tensor} {'x'.join(map(str, c.shape))}" if c.shape else (c.tensor or ""),
             *number_cells(c), status] for c, status in zip(r.checks, statuses)]
    headers = ["check", "tensor", *(header for header, _ in COLUMNS), "status"]
    wide = sum(max(len(h), *(len(row[i]) for row in rows)) + 2 for i, h in enumerate(headers)) - 2
    if console.is_terminal and wide > console.width:  # a table that would wrap its names: two lines per check
        _narrow_table(console, title, rows, r.checks, status_styles)
    else:
        _table(console, title, headers, rows, [False, False] + [True] * len(COLUMNS) + [False],
               [[None] * (len(headers) - 1) + [style] for style in status_styles])
    for c in r.checks:
        if c.kind == "experiment" and c.passed:  # an experiment's numbers are its result: always shown
            _say(console, f"  {c.name}: {c.detail}")
        if c.verdict == "not applicable":  # why it could not run: neither a pass nor a fail
            _say(console, Text.assemble("  ", ("n/a", "dim"), f" {c.name} ({c.tensor}): {c.detail}"), "      ")
    for c in r.checks:
        if not c.passed:
            word, style = ("FAIL", "red") if c.verdict == "fail" else ("INCONCLUSIVE", "yellow")
            _say(console, Text.assemble("  ", (word, style), f" {failure_message(c)}"))
            for line in diagnosis_lines(c):
                if console.is_terminal and line.rstrip().endswith("|"):  # a heat-map row: a grid, never wrapped
                    console.print(_heat_text(line), soft_wrap=True)
                else:
                    _say(console, _heat_text(line) if console.is_terminal else Text(line), "  ")
    for hint in r.hints:
        _say(console, Text.assemble("  ", ("hint:", "bold cyan"), f" {hint}"), "      ")
    if r.detectable:
        _say(console, "  " + power_line(r.detectable))
    word = {"pass": "passed", "fail": "FAILED", "inconclusive": "INCONCLUSIVE"}[r.verdict]
    compiling = f" (of which {r.compile_s:.2f} s compiling with jax.jit)" if r.compile_s else ""
    console.print(f"  {r.name}: {word} in {r.elapsed_s:.2f} s{compiling}", highlight=False)
    if reproduce and not r.passed:
        _say(console, f"  reproduce: {reproduce}")
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
    console.print(f"{s['scenarios']} scenario(s), {s['checks']} checks: {counted(s)} -- {word}", highlight=False)


def render_controls(console: Console, cells: Sequence[ControlCell]) -> None:
    cells = [dataclasses.replace(c, fault=visible(c.fault), scenario=visible(c.scenario), reason=visible(c.reason),
                                 caught_by=tuple(map(visible, c.caught_by))) for c in cells]
    scenarios = list(dict.fromkeys(c.scenario for c in cells))
    faults = list(dict.fromkeys(c.fault for c in cells))
    look = {(c.fault, c.scenario): c for c in cells}
    text = {"detected": ("detected", "green"), "missed": ("MISSED", "bold red"), "not applicable": ("n/a", "dim")}
    # one row per scenario: sweeps make many scenarios, while an op has a handful of faults
    blank = ("", None)
    cell = {k: text[c.status] for k, c in look.items()}
    rows = [[name] + [cell.get((fault, name), blank)[0] for fault in faults] for name in scenarios]
    styles = [[None] + [cell.get((fault, name), blank)[1] for fault in faults] for name in scenarios]
    headers = ["scenario"] + faults
    wide = sum(max([len(h)] + [len(r[i]) for r in rows]) + 2 for i, h in enumerate(headers))
    if console.is_terminal and wide > console.width:  # too many faults for the width: a line per scenario
        console.print("negative controls (scenario: faults by outcome)", highlight=False)
        for name in scenarios:
            groups = {}
            for fault in faults:
                if (fault, name) in look:
                    groups.setdefault(text[look[(fault, name)].status][0], []).append(fault)
            _say(console, f"  {name}: " + "; ".join(f"{word} {', '.join(fs)}" for word, fs in groups.items()),
                 "      ")
    else:
        _table(console, "negative controls (scenario x fault)", headers, rows, [False] * (1 + len(faults)), styles)
    reasons = list(dict.fromkeys(c.reason for c in cells if c.status == "not applicable" and c.reason))
    if any(c.status == "not applicable" for c in cells):
        _say(console, "  n/a: the fault cannot apply to that scenario: " + ("; ".join(reasons) if reasons else
             "it changes neither the output nor any gradient by more than 10x the tolerance")
             + " (e.g. scale when scale = 1, gqa-sum without shared KV heads, swap-dk-dv when d_head != d_value)")
    missed = [c for c in cells if c.status == "missed"]
    for c in missed:
        _say(console, f"  MISSED {c.fault} on {c.scenario}: it changes the result by {_g(c.effect, '.2e')} "
             "(relative) but no check failed; the scenario lacks power for it")
    outcome, powerless = controls_verdict(cells)
    for name in powerless:
        console.print(f"  INCONCLUSIVE {name}: no fault applies to it, so its negative controls prove nothing",
                      highlight=False)
    applicable = [c for c in cells if c.status != "not applicable"]
    console.print(f"{len(applicable) - len(missed)} of {len(applicable)} applicable fault(s) detected"
                  + {"fail": " -- negative controls FAILED", "inconclusive": " -- negative controls INCONCLUSIVE",
                     "pass": ""}[outcome], highlight=False)


def render_merged(console: Console, data: dict) -> None:
    """A line per scenario (its failed checks under it), the totals and the negative controls."""
    data = visible_all(data)  # reports read from files: any text at all
    for sc in data["scenarios"]:
        word = {"pass": "passed", "fail": "FAILED", "inconclusive": "INCONCLUSIVE"}[sc["verdict"]]
        console.print(f"{sc['name']} ({sc['config']}): {word}")
        for c in sc["checks"]:
            if c["verdict"] != "pass":
                word = "n/a" if c["verdict"] == "not applicable" else c["verdict"].upper()
                console.print(f"  {word} {c['name']} ({c['tensor']}): {c['detail']}", soft_wrap=True)
        for hint in sc.get("hints", []):
            console.print(f"  hint: {hint}", soft_wrap=True)
        if sc["verdict"] != "pass":
            console.print(f"  reproduce: {sc['reproduce']}", soft_wrap=True)
    s = data["summary"]
    console.print(f"{s['scenarios']} scenario(s), {s['checks']} checks: {counted(s)}"
                  + f" -- merged from {len(data['merged_from'])} report(s): {data['verdict']}")
    if data["negative_controls"] is not None:
        cells = data["negative_controls"]["cells"]
        applicable = [c for c in cells if c["status"] != "not applicable"]
        missed = [c for c in applicable if c["status"] == "missed"]
        for c in missed:
            console.print(f"  MISSED {c['fault']} on {c['scenario']}")
        console.print(f"{len(applicable) - len(missed)} of {len(applicable)} applicable fault(s) detected"
                      + (" -- negative controls FAILED" if missed else ""))


def render_sweep(console: Console, sweep, description: str) -> None:
    """A table per scenario: one row per step, the relative error of each input's sampled elements."""
    tensors = list(sweep.errors)
    best = {t: sweep.best(t) for t in tensors}
    description = visible(description)
    rows = []
    for k, h in enumerate(sweep.steps):
        cells = [f"{h:.0e}"]
        for t in tensors:
            e = sweep.errors[t][k]
            cells.append(("inf" if not math.isfinite(e) else f"{e:.1e}") + (" *" if h == best[t] else "  "))
        rows.append(cells + (["<- run"] if h == sweep.chosen else [""]))
    _table(console, f"{visible(sweep.name)} ({description}): relative error against epsilon",
           ["epsilon"] + [visible(t) for t in tensors] + [""],
           rows, [True] * (1 + len(tensors)) + [False])
    console.print("  large steps: truncation (~h^2); small steps: rounding (~eps/h); * = smallest error; "
                  "<- run = the step the run uses", soft_wrap=True)
    console.print()
