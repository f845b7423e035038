"""What the terminal, the JSON, JUnit and HTML reports and the pytest plugin share: the counts and verdict of
results, the command that re-runs a scenario, the table's columns and cells, the power line, and the plain-text
lines of a failed check."""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..indices import ranges
from ..result import ScenarioResult, counts
from ..text import shell_word


def summary(results: Sequence[ScenarioResult]) -> dict:
    """The counts of a run: scenarios, checks, and checks by verdict (``result.COUNTS``)."""
    checks = [c for r in results for c in r.checks]
    return {"scenarios": len(results), "checks": len(checks), **counts(c.verdict for c in checks)}


def counted(s: dict) -> str:
    """'N passed, N failed[, N inconclusive][, N not applicable]' of a summary."""
    return (f"{s['passed']} passed, {s['failed']} failed" + (f", {s['inconclusive']} inconclusive" if s["inconclusive"]
                                                                else "")
            + (f", {s['not_applicable']} not applicable" if s.get("not_applicable") else ""))


def reproduce_command(config: str, name: str, faults: Sequence[str] = (), engine: str | None = None) -> str:
    """One line that re-runs just this scenario (with the same faults, and the --engine given); a path or name
    that holds a character that is not printable is quoted as ``$'...'``, visible and exact."""
    parts = ["attn-gradcheck", "run", shell_word(config), "--select", shell_word(name)]
    for fault in faults:
        parts += ["--fault", fault]
    if engine:
        parts += ["--engine", engine]
    return " ".join(parts)


def _g(x, spec: str = ".6g") -> str:
    """A number of a report's JSON, where a non-finite one is null."""
    return "non-finite" if x is None else format(x, spec)


#: The number columns of a scenario's table (docs/reports.md "The table"), each with the label it has on a narrow
#: terminal's second line. Each means one thing on every row and is blank where it does not apply:
#: max abs err: the error the check measured (the largest, or on an invariant with an allowance per element the
#: one closest to failing); rel err: that over the larger side's largest value (gradient and reference rows);
#: rel tol: a relative tolerance (gradient rows, and nondet_tol on "deterministic"); noise floor: the absolute
#: allowance for rounding added to it (gradient rows); allowed: an absolute allowance (reference and invariant
#: rows); detects: the check's power.
COLUMNS = (("max abs err", "abs"), ("rel err", "rel"), ("rel tol", "rtol"), ("noise floor", "floor"),
           ("allowed", "allowed"), ("detects", "detects"))


def _cell(x) -> str:
    """A number of the table: '' for none, 'non-finite' for inf, NaN, or the null a JSON report has for them."""
    if x is None:
        return "non-finite"
    return f"{x:.2e}" if math.isfinite(x) else "non-finite"


def number_cells(c) -> list[str]:
    """The cells of check ``c`` (a ``Check``, or a JSON report's check as an object) under ``COLUMNS``: '' where a
    column does not apply; an implementation's call that raised shows "did not run", one that only records what
    ran (no shape: the module's parameters, compilations) no numbers, one whose result is not finite that only."""
    kind = str(c.kind)
    blank = [""] * len(COLUMNS)
    if c.verdict == "not applicable":  # nothing was measured
        return blank
    if kind == "implementation" and c.shape is None:
        return (["did not run"] + blank[1:]) if not c.passed else blank
    cells = {"max abs err": _cell(c.max_abs_error)}
    if kind in ("gradient", "reference"):
        cells["rel err"] = _cell(c.relative_error)
    if kind == "gradient" or (kind == "implementation" and cells["max abs err"] != "non-finite"):
        cells["rel tol"] = _cell(c.tolerance)  # implementation: "deterministic", nondet_tol of the largest value
    if kind == "gradient":
        cells["noise floor"] = _cell(c.noise_floor)
    if kind in ("reference", "invariant"):
        cells["allowed"] = _cell(c.tolerance)
    if c.detectable is not None:
        cells["detects"] = _cell(c.detectable)
    return [cells.get(header, "") for header, _ in COLUMNS]


def labelled_numbers(c, short: bool = False) -> list[str]:
    """``label value`` for each number of check ``c`` that applies (``number_cells``), labelled by its column's
    header (``short``: its narrow label)."""
    return [cell if cell == "did not run" else f"{label if short else header} {cell}"
            for (header, label), cell in zip(COLUMNS, number_cells(c)) if cell]


def power_line(detectable: dict) -> str:
    """What the passing checks of a scenario would have caught (its ``detectable``: tensor -> relative error), or
    '' when none has power."""
    if not detectable:
        return ""
    return "power: would have caught uniform relative errors above " + ", ".join(
        f"{_cell(x)} in {power_name(t)}" for t, x in detectable.items())


def power_name(tensor: str) -> str:
    """How the power line names a checked tensor: O (or attention's log-sum-exp output), a gradient dq, or a part H_Q
    of a Hessian-vector product."""
    if tensor in ("o", "o_dot", "lse"):
        return {"o": "O", "o_dot": "the JVP", "lse": "the LSE"}[tensor]
    return f"H_{tensor[1].upper()}" if len(tensor) == 2 and tensor[0] == "h" else "d" + tensor


def where_text(d: dict) -> str:
    """The "where:" line of a diagnosis: how many elements are out of tolerance, and along each axis where."""
    where = [f"{d['out_of_tolerance']} of {d['checked']} checked elements out of tolerance"]
    last = list(d["axes"])[-1:]
    for axis, values in d["axes"].items():
        hit = [i for i, n in enumerate(values["out_of_tolerance"]) if n]
        if hit and (axis not in last or len(hit) < len(values["out_of_tolerance"])):  # the features: only a part
            where.append(f"{axis} {ranges(hit)} of {len(values['out_of_tolerance'])}")
    return "where: " + "; ".join(where)


def class_texts(d: dict) -> list[str]:
    """A line per class of rows of a diagnosis that has checked elements (a class with none is not shown)."""
    return [f"{cls['label']}: {cls['out_of_tolerance']} of {cls['checked']} out of tolerance"
            + (f" (max |error| {_g(cls['max_abs_error'], '.2e')})" if cls["out_of_tolerance"] else "")
            for cls in d["classes"] if cls["checked"]]


def worst_items(c) -> list[tuple[str, str, str]]:
    """(element, analytic, numeric) of each of the worst elements of check ``c``'s diagnosis."""
    return [(f"{c.tensor}{'[' + ', '.join(map(str, w['index'])) + ']' if w['index'] else ''}", _g(w["analytic"]),
             _g(w["numeric"])) for w in (c.diagnosis or {}).get("worst") or []]


def heat_cell(heat: dict) -> str:
    """What one cell of a heat map holds, when it bins several rows or columns ('' when it is one of each)."""
    per = [f"{b} {name}s" for b, name in zip(heat["bin"], (heat["rows"], heat["columns"])) if b > 1]
    return f"a cell is {' x '.join(per)}" if per else ""


def diagnosis_lines(c, indent: str = "    ") -> list[str]:
    """Plain text of a failed gradient check's diagnosis (docs/verdicts.md "Diagnosing a failure");
    [] when it has none."""
    d = c.diagnosis
    if not d:
        return []
    lines = [indent + where_text(d)] + [f"{indent}  {line}" for line in class_texts(d)]
    heat = d["heat"]
    if heat:
        cell = heat_cell(heat)
        lines.append(f"{indent}heat map, {heat['rows']} x {heat['columns']} (digit d: error 10^(d-1) to 10^d times "
                     "what is allowed; '.' within tolerance; ' ' not checked" + (f"; {cell}" if cell else "") + "):")
        width = len(str(len(heat["levels"]) * heat["bin"][0]))
        for i, row in enumerate(heat["levels"]):
            cells = "".join(" " if x < 0 else ("." if x == 0 else str(x)) for x in row)
            lines.append(f"{indent}  {str(i * heat['bin'][0]).rjust(width)} |{cells}|")
    worst = worst_items(c)
    if worst:
        lines.append(indent + "worst: " + "; ".join(f"{where} analytic {a} numeric {n}" for where, a, n in worst))
    return lines


def failure_message(c) -> str:
    """One line: the check, the tensor and where it is worst."""
    where = ""
    if c.worst_index is not None and c.kind == "invariant":
        where = (f" at {c.tensor}[{', '.join(map(str, c.worst_index))}] "
                 f"(violation {_g(c.max_abs_error, '.3g')}, allowed {_g(c.tolerance, '.3g')})")
    return f"{c.name} ({c.tensor}){where}: {c.detail}"
