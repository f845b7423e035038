"""``attn-gradcheck merge``: one report from several JSON reports (e.g. the shards of a CI matrix),
each checked against the report schema and for consistency before it is used."""
from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from .. import __version__
from ..errors import GradcheckError
from ..result import Verdict
from . import schema as report_schema
from .formats import JSON_SCHEMA_VERSION, _controls_into, _with_id


def merge_reports(reports: Sequence[tuple[str, dict]]) -> dict:
    """One report from several JSON reports (``(path, data)``), e.g. the shards of a CI matrix: the
    scenarios in file order, counts and verdict recomputed. Raises GradcheckError when a report is not
    ours, is from an interrupted run, or when shards are missing or overlap."""
    groups: dict[str, list[tuple[str, dict]]] = {}
    for path, data in reports:
        if (not isinstance(data, dict) or data.get("tool") != "attn-gradcheck"
                or not isinstance(data.get("scenarios"), list)):
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
        derived = Verdict.combine(verdicts)
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
