"""What the terminal, the JSON and JUnit reports and the pytest plugin share: the counts and verdict of
results, the command that re-runs a scenario, and the plain-text lines of a failed check."""
from __future__ import annotations

from collections.abc import Sequence

from ..indices import ranges
from ..result import ScenarioResult
from ..text import shell_word


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


def diagnosis_lines(c, indent: str = "    ") -> list[str]:
    """Plain text of a failed gradient check's diagnosis (docs/verdicts.md "Diagnosing a failure");
    [] when it has none."""
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
            f"{c.tensor}{'[' + ', '.join(map(str, w['index'])) + ']' if w['index'] else ''} "
            f"analytic {_g(w['analytic'])} numeric {_g(w['numeric'])}"
            for w in d["worst"]))
    return lines


def failure_message(c) -> str:
    """One line: the check, the tensor and where it is worst."""
    where = ""
    if c.worst_index is not None and c.kind == "invariant":
        where = (f" at {c.tensor}[{', '.join(map(str, c.worst_index))}] "
                 f"(violation {_g(c.max_abs_error, '.3g')}, allowed {_g(c.tolerance, '.3g')})")
    return f"{c.name} ({c.tensor}){where}: {c.detail}"
