"""A report to look at (``--html PATH``): one self-contained HTML file rendered from a JSON report (``json_report``
or ``merge_reports``), with no script and nothing fetched from the network. Per scenario: its verdict, the table
of checks, each failed check's message and diagnosis with the heat map of where the errors are (head x row, as
an inline SVG), the worst elements, the hints, the power line and the command that reproduces it: what the terminal
prints, drawn (the same cells, shared with it in ``common``); then the negative-control matrix, coloured."""
from __future__ import annotations

from html import escape
from types import SimpleNamespace

from ..text import visible_all
from .common import (
    COLUMNS,
    _g,
    class_texts,
    failure_message,
    heat_cell,
    number_cells,
    power_line,
    where_text,
    worst_items,
)

#: Colours of the heat map's levels: -1 not checked, 0 within tolerance, d >= 1: error 10^(d-1)..10^d x allowed.
_LEVEL_COLOURS = {-1: "#e8e8e8", 0: "#7bc47f", 1: "#f6e05e", 2: "#f6ad55", 3: "#ed8936", 4: "#e53e3e"}
_VERDICT = {"pass": "pass", "fail": "FAIL", "inconclusive": "inconclusive", "interrupted": "interrupted",
            "not applicable": "n/a"}
_CLASS = {"not applicable": "na"}  # a verdict's CSS class where its word is not one

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em; color: #1a202c; max-width: 1200px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #cbd5e0; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: .15em .6em; text-align: right; }
th { border-bottom: 1px solid #a0aec0; } td.name, th.name { text-align: left; }
.pass { color: #276749; } .fail { color: #c53030; font-weight: bold; } .inconclusive { color: #b7791f; }
.na { color: #718096; }
td.detected { background: #c6f6d5; } td.missed { background: #fed7d7; font-weight: bold; }
td.na { background: #edf2f7; color: #718096; }
pre { background: #f7fafc; padding: .5em; white-space: pre-wrap; word-break: break-word; }
.hint { background: #ebf8ff; padding: .4em .6em; border-left: 3px solid #3182ce; margin: .3em 0; }
figure { margin: .5em 0; } figcaption { color: #4a5568; font-size: .9em; }
p.where, p.power { margin: .3em 0; } ul.classes { margin: .2em 0; } table.worst code { font-size: .95em; }
"""


def _num(x) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return escape(x)
    return f"{x:.2e}" if x == x and abs(x) != float("inf") else ("inf" if x == x else "nan")


def _heat_svg(heat: dict, tensor: str) -> str:
    """The heat map of a diagnosis (``heat``: rows, columns, bin, levels) as an inline SVG, one square per cell."""
    levels = heat.get("levels") or []
    if not levels:
        return ""
    rows, columns = escape(heat.get("rows", "")), escape(heat.get("columns", ""))
    step = heat.get("bin") or [1, 1]
    cell = max(6, min(24, 480 // max(1, max(len(r) for r in levels))))
    width, height = cell * max(len(r) for r in levels), cell * len(levels)
    rects = []
    for i, row in enumerate(levels):
        for j, level in enumerate(row):
            colour = _LEVEL_COLOURS.get(level, "#9b2c2c" if level and level > 4 else "#e8e8e8")
            what = ("not checked" if level == -1 else "within tolerance" if level == 0 else
                    f"error 1e{level - 1} to 1e{level} x allowed")
            rects.append(f'<rect x="{j * cell}" y="{i * cell}" width="{cell - 1}" height="{cell - 1}" '
                         f'fill="{colour}"><title>{rows} {i * step[0]}, {columns} {j * step[1]}: {what}</title></rect>')
    per = heat_cell(heat)
    return (f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'role="img" aria-label="heat map of {escape(tensor)}">{"".join(rects)}</svg>'
            f'<figcaption>where {escape(tensor)} is wrong: {rows} (down) x {columns} (across)'
            + (f" ({escape(per)})" if per else "") + '; green within tolerance, yellow to red 10x to 10^4x '
            'or more over, grey not checked</figcaption></figure>')


#: What a check of a JSON report holds when a key is missing (the schema requires them; the page is drawn anyway).
_CHECK_KEYS = {"kind": "", "name": "", "tensor": None, "shape": None, "max_abs_error": None, "relative_error": None,
               "tolerance": None, "noise_floor": None, "worst_index": None, "verdict": "", "detail": "",
               "diagnosis": None, "detectable": None}


def _diagnosis(c) -> list[str]:
    """What the terminal prints under a failed check, drawn: where, the classes of rows that have checked
    elements, the heat map as an SVG, and the worst elements as a table."""
    d = c.diagnosis
    if not d:
        return []
    out = [f'<p class="where">{escape(where_text(d))}</p>']
    classes = class_texts(d)
    if classes:
        out.append('<ul class="classes">' + "".join(f"<li>{escape(line)}</li>" for line in classes) + "</ul>")
    if d.get("heat"):
        out.append(_heat_svg(d["heat"], str(c.tensor)))
    worst = worst_items(c)
    if worst:
        out.append('<table class="worst"><tr><th class="name">worst</th><th>analytic</th><th>numeric</th></tr>'
                   + "".join(f'<tr><td class="name"><code>{escape(where)}</code></td><td>{escape(a)}</td>'
                             f"<td>{escape(n)}</td></tr>" for where, a, n in worst) + "</table>")
    return out


def _scenario(s: dict) -> str:
    """A scenario's section: what the terminal prints for it (docs/reports.md "Reading a report"), drawn."""
    verdict = s.get("verdict", "")
    headers = ["check", "tensor", *(header for header, _ in COLUMNS), "status"]
    out = [f'<h2 id="{escape(s["name"], quote=True)}">{escape(s["name"])} '
           f'<span class="{escape(verdict)}">{escape(_VERDICT.get(verdict, verdict))}</span></h2>',
           f'<p>op {escape(str(s.get("op", "")))}, engine {escape(str(s.get("engine", "")))}, '
           f'{escape(str(s.get("dtype", "")))}, mode {escape(str(s.get("mode", "")))}'
           + (f', faults {escape(", ".join(s.get("faults") or []))}' if s.get("faults") else "")
           + f', {s.get("elapsed_s", 0):.2f} s</p>',
           '<table class="checks"><tr>' + "".join(('<th class="name">' if i < 2 else "<th>") + f"{escape(h)}</th>"
                                                  for i, h in enumerate(headers)) + "</tr>"]
    checks = [SimpleNamespace(**{**_CHECK_KEYS, "passed": c.get("verdict") == "pass", **c})
              for c in s.get("checks", [])]
    for c in checks:
        shape = "x".join(map(str, c.shape or []))
        out.append(f'<tr><td class="name">{escape(c.name)}</td>'
                   f'<td class="name">{escape(str(c.tensor or ""))} {shape}</td>'
                   + "".join(f"<td>{escape(cell)}</td>" for cell in number_cells(c))
                   + f'<td class="{_CLASS.get(c.verdict, escape(c.verdict))}">'
                   f'{escape(_VERDICT.get(c.verdict, c.verdict))}</td></tr>')
    out.append("</table>")
    out += [f"<p>{escape(c.name)}: {escape(c.detail)}</p>" for c in checks if c.kind == "experiment" and c.passed]
    out += [f'<p><span class="na">n/a</span> {escape(c.name)} ({escape(str(c.tensor))}): {escape(c.detail)}</p>'
            for c in checks if c.verdict == "not applicable"]
    for c in checks:
        if not c.passed:
            word = "FAIL" if c.verdict == "fail" else "INCONCLUSIVE"
            out.append(f'<h3 class="{escape(c.verdict)}">{word} {escape(c.name)} ({escape(str(c.tensor))})</h3>'
                       f"<pre>{escape(failure_message(c))}</pre>")
            out += _diagnosis(c)
    out += [f'<div class="hint">hint: {escape(h)}</div>' for h in s.get("hints", [])]
    power = power_line(s.get("detectable") or {})
    if power:
        out.append(f'<p class="power">{escape(power)}</p>')
    if s.get("reproduce") and not s.get("passed"):
        out.append(f'<p>reproduce: <code>{escape(s["reproduce"])}</code></p>')
    return "\n".join(out)


def _controls(nc: dict) -> str:
    cells = nc.get("cells") or []
    faults = list(dict.fromkeys(c["fault"] for c in cells))
    scenarios = list(dict.fromkeys(c["scenario"] for c in cells))
    by = {(c["scenario"], c["fault"]): c for c in cells}
    out = ['<h2 id="negative-controls">negative controls (scenario x fault)</h2><table class="controls"><tr>'
           '<th class="name">scenario</th>' + "".join(f"<th>{escape(f)}</th>" for f in faults) + "</tr>"]
    for sc in scenarios:
        row = [f'<td class="name">{escape(sc)}</td>']
        for f in faults:
            c = by.get((sc, f))
            if c is None:
                row.append("<td></td>")
                continue
            cls = {"detected": "detected", "missed": "missed"}.get(c["status"], "na")
            why = c.get("reason") or ", ".join(c.get("caught_by") or [])
            row.append(f'<td class="{cls}" title="{escape(why, quote=True)}">{escape(c["status"])}</td>')
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</table>")
    # the lines the terminal prints under the matrix
    reasons = list(dict.fromkeys(c["reason"] for c in cells if c["status"] == "not applicable" and c.get("reason")))
    if reasons:
        out.append(f"<p>n/a: the fault cannot apply to that scenario: {escape('; '.join(reasons))}</p>")
    applicable = [c for c in cells if c["status"] != "not applicable"]
    missed = [c for c in applicable if c["status"] == "missed"]
    out += [f'<p class="fail">MISSED {escape(c["fault"])} on {escape(c["scenario"])}: it changes the result by '
            f'{_g(c["effect"], ".2e")} (relative) but no check failed; the scenario lacks power for it</p>'
            for c in missed]
    out += [f'<p class="inconclusive">INCONCLUSIVE {escape(name)}: no fault applies to it, so its negative controls '
            "prove nothing</p>" for name in nc.get("powerless") or []]
    out.append(f"<p>{len(applicable) - len(missed)} of {len(applicable)} applicable fault(s) detected</p>")
    return "\n".join(out)


def html_report(report: dict) -> bytes:
    """The HTML report of a JSON report: self-contained (inline CSS and SVG, no script, no link out); its text
    made visible (``text.visible``) before it is escaped as HTML."""
    report = visible_all(report)
    title = f"attn-gradcheck: {report.get('config', '')}"
    summary = report.get("summary", {})
    verdict = report.get("verdict", "")
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>{escape(title)}</h1>",
             f'<p>verdict <span class="{escape(verdict)}">{escape(_VERDICT.get(verdict, verdict))}</span>: '
             + escape(", ".join(f"{k} {v}" for k, v in summary.items() if isinstance(v, (int, float))))
             + f'; run_id <code>{escape(str(report.get("run_id", "")))}</code></p>',
             "<ul>" + "".join(f'<li><a href="#{escape(s["name"], quote=True)}">{escape(s["name"])}</a> '
                              f'<span class="{escape(s.get("verdict", ""))}">'
                              f'{escape(_VERDICT.get(s.get("verdict", ""), ""))}</span></li>'
                              for s in report.get("scenarios", [])) + "</ul>"]
    parts += [_scenario(s) for s in report.get("scenarios", [])]
    if report.get("negative_controls"):
        parts.append(_controls(report["negative_controls"]))
    parts.append("</body></html>")
    return ("\n".join(parts) + "\n").encode("utf-8")


_LINE_COLOURS = ("#2b6cb0", "#c05621", "#2f855a", "#6b46c1", "#b83280", "#2c7a7b", "#744210", "#4a5568")


def _sweep_svg(sweep: dict) -> str:
    """The V curve of one sweep as an inline SVG: log10 relative error against log10 step, a line per tensor, the
    step the run uses dashed."""
    import math
    steps = sweep["steps"]
    lines = {t: [(math.log10(h), math.log10(e)) for h, e in zip(steps, errs) if e and e > 0 and e == e]
             for t, errs in sweep["errors"].items()}
    points = [p for pts in lines.values() for p in pts]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    w, h, pad = 420, 220, 36

    def at(x, y):
        return (pad + (x1 - x) / ((x1 - x0) or 1) * (w - 2 * pad),  # large steps left, small right, as printed
                pad / 2 + (y1 - y) / ((y1 - y0) or 1) * (h - 1.5 * pad))

    parts = [f'<rect x="0" y="0" width="{w}" height="{h}" fill="#fff" stroke="#cbd5e0"/>']
    chosen = sweep.get("chosen")
    if chosen:
        cx, _ = at(math.log10(chosen), y0)
        parts.append(f'<line x1="{cx:.1f}" y1="0" x2="{cx:.1f}" y2="{h - pad}" stroke="#a0aec0" '
                     f'stroke-dasharray="4 3"><title>the step the run uses: {chosen:g}</title></line>')
    for n, (tensor, pts) in enumerate(lines.items()):
        colour = _LINE_COLOURS[n % len(_LINE_COLOURS)]
        path = " ".join(f"{a:.1f},{b:.1f}" for a, b in (at(x, y) for x, y in pts))
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2">'
                     f'<title>{escape(tensor)}</title></polyline>')
        parts.append(f'<text x="{w - pad + 4}" y="{14 + 14 * n}" fill="{colour}" font-size="12">'
                     f'{escape(tensor)}</text>')
    parts.append(f'<text x="{pad}" y="{h - 8}" font-size="11">step 1e{x1:.0f} (left) to 1e{x0:.0f} (right); '
                 f'relative error 1e{y0:.0f} to 1e{y1:.0f}, log scales</text>')
    return (f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{w + 40}" height="{h}" role="img" '
            f'aria-label="error against step for {escape(sweep["name"])}">{"".join(parts)}</svg>'
            '<figcaption>relative error of the sampled elements against the finite-difference step: truncation '
            '(~h^2) on the left, rounding (~eps/h) on the right; dashed: the step the run uses</figcaption></figure>')


def sweeps_html(data: dict) -> bytes:
    """The HTML of a ``sweep-eps`` run (its JSON: ``sweeps``): per scenario the V curve (inline SVG) and the table
    of errors by step, the step the run uses and the best one marked."""
    data = visible_all(data)
    title = f"attn-gradcheck sweep-eps: {data.get('config', '')}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>", f"<h1>{escape(title)}</h1>"]
    for s in data.get("sweeps", []):
        tensors = list(s["errors"])
        parts.append(f'<h2 id="{escape(s["name"], quote=True)}">{escape(s["name"])} ({escape(s.get("dtype", ""))})'
                     f'</h2>')
        parts.append(_sweep_svg(s))
        rows = ['<table><tr><th>step</th>' + "".join(f"<th>{escape(t)}</th>" for t in tensors) + "<th></th></tr>"]
        for i, step in enumerate(s["steps"]):
            cells = []
            for t in tensors:
                best = s.get("best", {}).get(t) == step
                cells.append(f'<td class="{"pass" if best else ""}">{_num(s["errors"][t][i])}{" *" if best else ""}'
                             "</td>")
            mark = "&larr; run" if step == s.get("chosen") else ""
            rows.append(f"<tr><td>{step:g}</td>{''.join(cells)}<td>{mark}</td></tr>")
        parts.append("".join(rows) + "</table>")
    parts.append("</body></html>")
    return ("\n".join(parts) + "\n").encode("utf-8")
