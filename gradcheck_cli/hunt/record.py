"""What a hunt leaves: the smallest failing scenario as a scenario file (with the command that reproduces it) and
the JSON record of the search (documented in docs/hunt.md "JSON record"; keys are stable within a schema)."""
from __future__ import annotations

import json

import yaml

from .. import report
from ..text import shell_word, visible
from .found import Finding, Hunt
from .plan import HuntPlan
from .start import found_name, scenario_text

#: The ``schema`` of the JSON record.
SCHEMA = "attn-gradcheck-hunt/1"
#: How the scenario file a hunt writes begins.
MARK = "# Found by: attn-gradcheck hunt "


def default_name(scenario: str) -> str:
    """``hunt-<name>.yaml`` (``start.found_name``)."""
    return f"{found_name(scenario)}.yaml"


def written_by_hunt(path: str) -> bool:
    """Whether ``path`` is a scenario file an earlier hunt wrote (a rerun replaces it; any other YAML file stays)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(MARK)) == MARK.encode()
    except OSError:
        return False


def command(plan: HuntPlan) -> str:
    """The command that repeats this hunt."""
    o = plan.options
    parts = ["attn-gradcheck", "hunt", shell_word(o.config), "--select", shell_word(o.select), "--seed", str(o.seed)]
    parts += ["--examples", str(o.examples)] if o.examples else ["--budget", f"{o.budget_s:g}"]
    for item in o.space:
        parts += ["--space", shell_word(item)]
    return " ".join(parts)


def reproduce(plan: HuntPlan) -> str:
    return report.reproduce_command(plan.out, found_name(plan.start.scenario.name))


def scenario_file(plan: HuntPlan, hunt: Hunt) -> str:
    """The smallest failing scenario as a file of its own (every key written out, the defaults merged in)."""
    smallest, first = hunt.smallest, hunt.first
    failed = ", ".join(sorted(smallest.signature[0]))
    header = MARK + visible(command(plan)[len("attn-gradcheck hunt "):]) + "\n" + "".join(
        f"# {visible(line)}\n" for line in (
        f"found after {hunt.tried_to_first} scenario(s) in {hunt.search_s:.1f} s; shrunk from {first.elements} to "
        f"{smallest.elements} input elements in {hunt.shrink_s:.1f} s ({hunt.tried - hunt.tried_to_first} more "
        "scenario(s))",
        f"It fails: {failed}",
        f"Reproduce: {reproduce(plan)}",
    ))
    return scenario_text(smallest.mapping, found_name(plan.start.scenario.name), header)


def keys_text(f: Finding) -> str:
    """A failing scenario's keys in one line (YAML's flow style), the name and implementation left out."""
    keys = {k: v for k, v in f.mapping.items() if k not in ("name", "implementation")}
    return yaml.safe_dump(keys, default_flow_style=True, sort_keys=False, width=10**6).strip()


def _finding(f: Finding | None) -> dict | None:
    if f is None:
        return None
    return {"elements": f.elements, "describe": f.scenario.describe(), "keys": f.mapping,
            "failed": sorted(f.signature[0]), "causes": sorted(f.signature[1])}


def _covered(hunt: Hunt) -> dict:
    out = {}
    for key, values in hunt.covered.items():
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers and len(numbers) == len(values):
            out[key] = {"min": min(numbers), "max": max(numbers), "distinct": len(set(numbers))}
        else:  # none (the key left out: its default) first, then numbers by value, then the rest
            distinct = {json.dumps(v): v for v in values}
            order = sorted(distinct.items(), key=lambda kv: (kv[1] is not None, not isinstance(kv[1], (int, float)),
                                                             kv[1] if isinstance(kv[1], (int, float)) else 0, kv[0]))
            out[key] = {"values": ["none" if v is None else text if isinstance(v, list) else str(v)
                                   for text, v in order]}
    return out


def json_record(plan: HuntPlan, hunt: Hunt) -> dict:
    o, shown = plan.options, hunt.smallest or hunt.first_inconclusive
    return {
        "schema": SCHEMA,
        "file": o.config,
        "scenario": plan.start.scenario.name,
        "command": command(plan),
        "verdict": hunt.verdict,
        "interrupted": hunt.interrupted,
        "seed": o.seed,
        "examples": o.examples,
        "budget_s": o.budget_s,
        "max_elements": plan.space.max_elements,
        "space": plan.space.ranges(),
        "fixed": dict(plan.space.fixed),
        "left_out": dict(hunt.left_out),
        "tried": hunt.tried,
        "tried_to_first": hunt.tried_to_first if hunt.first else None,
        "start_failed": hunt.start_failed,
        "skipped": hunt.skipped,
        "inconclusive": hunt.inconclusive,
        "inconclusive_float32": hunt.inconclusive_float32,
        "other_failures": hunt.other_failures,
        "covered": _covered(hunt),
        "search_s": round(hunt.search_s, 3),
        "shrink_s": round(hunt.shrink_s, 3),
        "stopped": hunt.stopped,
        "first": _finding(hunt.first),
        "smallest": _finding(hunt.smallest),
        "shrink_path": list(hunt.path),
        "out": plan.out if hunt.smallest else None,
        "reproduce": reproduce(plan) if hunt.smallest else None,
        "report": report.json_report(plan.out if hunt.smallest else o.config, (), [shown.result]) if shown else None,
    }
