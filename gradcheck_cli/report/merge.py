"""``attn-gradcheck merge``: one report from several JSON reports (e.g. the shards of a CI matrix),
each checked against the report schema and for consistency before it is used."""
from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Sequence

from .. import __version__
from .. import files as _files
from ..errors import GradcheckError
from ..result import COUNTS, Verdict, counts, passes, run_verdict
from . import schema as report_schema
from .formats import JSON_SCHEMA_VERSION, _controls, _with_id

#: The deepest nesting of objects and arrays a report may have (one the tool writes nests 9 deep:
#: scenarios[i].checks[j].diagnosis.heat.levels[r][c]); checked before anything walks it recursively.
MAX_DEPTH = 32


class _Duplicate(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list) -> dict:
    """An object of a report, refusing a key given twice (JSON readers disagree on which value wins: merged,
    ``"verdict": "fail", ..., "verdict": "pass"`` would pass)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return out


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"it holds the number {text[:40]}, beyond float64 (a report holds finite numbers or null)")
    return value


def _no_constant(name: str):
    raise ValueError(f"it holds {name}, which a report never does (non-finite numbers are written as null)")


def read_report(path: str) -> dict:
    """The JSON report at ``path``, as ``merge`` takes it: a regular UTF-8 file of at most
    ``files.MAX_REPORT_BYTES``, JSON with finite numbers, no key repeated within an object and at most
    MAX_DEPTH levels of nesting. Raises GradcheckError naming the file (and the line, where there is one)."""
    try:
        text = _files.read_regular(path, _files.MAX_REPORT_BYTES).decode("utf-8")
    except _files.FileProblem as exc:
        raise GradcheckError(f"{path}: {exc}") from None
    except UnicodeDecodeError:
        raise GradcheckError(f"{path}: not UTF-8 text, so not a JSON report") from None
    too_deep = GradcheckError(f"{path}: not an attn-gradcheck JSON report (nested more than {MAX_DEPTH} levels "
                              "deep; a report nests 9)")
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape is no text
    except _Duplicate as exc:
        line, name = _duplicate_at(text, exc.key)
        raise GradcheckError(f"{path}{f':{line}' if line else ''}: the key {json.dumps(exc.key)[:80]} is given twice "
                             f"in one object{name}: a report never repeats a key (readers differ on which value "
                             "wins); use the report the run wrote") from None
    except UnicodeEncodeError:
        raise GradcheckError(f"{path}: not an attn-gradcheck JSON report (it holds a lone surrogate escape such as "
                             "\\ud800, which is not text)") from None
    except json.JSONDecodeError as exc:
        raise GradcheckError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:  # NaN, or integers beyond what a report holds
        raise GradcheckError(f"{path}: not an attn-gradcheck JSON report ({str(exc)[:120] or type(exc).__name__})"
                             ) from None
    where = _deeper_than(data, MAX_DEPTH)
    if where is not None:
        raise GradcheckError(f"{path}: not an attn-gradcheck JSON report (nested more than {MAX_DEPTH} levels deep "
                             f"at {where}; a report nests 9)")
    return data


def _deeper_than(data, limit: int) -> str | None:
    """The place (``scenarios[0].checks[0]...``) where ``data`` nests deeper than ``limit``, or None; walked
    without recursion."""
    stack = [(data, ())]
    while stack:
        value, path = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= limit:
            shown = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:6]).lstrip(".")
            return shown + "..."
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((v, path + (k,)) for k, v in items)
    return None


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"\s*:?|[{}\[\]]')


def _duplicate_at(text: str, key: str) -> tuple[int | None, str]:
    """(line, ' (in the object named ...)') of the second ``key`` of the first object of ``text`` that repeats
    it, and that object's name when it has one. The object is found by decoding again with the json module's
    pure-Python scanner, which says where each object starts and ends (the C one does not), and the key's
    place by reading that object's own keys; only a report being refused pays for this."""
    from json import decoder, scanner
    found: list = []

    def parse_object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None, _w=None):
        start = s_and_end[1] - 1
        pairs, end = decoder.JSONObject(s_and_end, strict, scan_once, None, list, memo)
        if not found and [k for k, _ in pairs].count(key) > 1:
            found.append((start, end, dict(pairs).get("name")))
        return dict(pairs), end

    context = json.JSONDecoder()
    context.parse_object = parse_object
    context.memo = {}
    try:
        scanner.py_make_scanner(context)(text, len(text) - len(text.lstrip()))
    except (ValueError, RecursionError, StopIteration):
        pass
    if not found:
        return None, ""
    start, end, name = found[0]
    depth, seen, where = 0, 0, start
    for m in _TOKENS.finditer(text, start, end):
        token = m.group()
        if token in "{[":
            depth += 1
        elif token in "}]":
            depth -= 1
        elif depth == 1 and token.endswith(":") and json.loads(token[:-1].rstrip()) == key:
            seen += 1
            if seen == 2:
                where = m.start()
                break
    named = f" (in the object named {json.dumps(name)[:80]})" if isinstance(name, str) else ""
    return text.count("\n", 0, where) + 1, named


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
        _check_shards(config, parts, groups)
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
    summary_ = {"scenarios": len(scenarios), "checks": len(checks), **counts(c["verdict"] for c in checks)}
    controls = [c for _, c in cells] if with_controls == {True} else None
    verdict_ = run_verdict((c["verdict"] for c in checks), controls)
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
        "negative_controls": None if controls is None else _controls(controls),
        "shard": None,
        "interrupted": False,
        "merged_from": [path for path, _ in reports],
    }
    return _with_id(merged)


def _consistent(path: str, data: dict) -> None:
    """What the schema cannot say: each check's ``passed`` is its verdict, each scenario's verdict is
    its checks' (fail if any fails, else inconclusive if any is), and the summary counts what is there.
    A report that contradicts itself was edited or damaged: merging it would give a verdict nobody ran."""
    def bad(where: str, what: str):
        return GradcheckError(f"{path}: {where}: {what}: the report contradicts itself (edited or damaged); "
                              "use the report the run wrote")
    tally = {"scenarios": len(data["scenarios"]), "checks": 0, **dict.fromkeys(COUNTS.values(), 0)}
    for i, sc in enumerate(data["scenarios"]):
        verdicts = set()
        for j, c in enumerate(sc["checks"]):
            if c["passed"] != passes(c["verdict"]):
                raise bad(f"scenarios[{i}].checks[{j}]", f"passed is {str(c['passed']).lower()} but its verdict is "
                                                         f"{c['verdict']}")
            verdicts.add(c["verdict"])
            tally["checks"] += 1
            tally[COUNTS[c["verdict"]]] += 1
        derived = Verdict.combine(verdicts)
        if sc["verdict"] != derived or sc["passed"] != (derived == "pass"):
            raise bad(f"scenarios[{i}] ({sc['name']})", f"its verdict is {sc['verdict']} (passed "
                                                        f"{str(sc['passed']).lower()}) but its checks say {derived}")
    summary_ = {k: data["summary"].get(k) for k in tally}
    if summary_ != tally:
        raise bad("summary", f"it counts {summary_} but the report holds {tally}")


def _files_of(parts: Sequence[tuple[str, dict]]) -> str:
    return ", ".join(p for p, _ in parts[:3]) + (", ..." if len(parts) > 3 else "")


def _check_shards(config, parts: Sequence[tuple[str, dict]], configs: dict) -> None:
    """The shards of one config: all of 1..N, each once (reports without --shard are whole runs);
    ``configs`` (config -> its reports) names the others when one is missing."""
    shards = [(path, data.get("shard")) for path, data in parts]
    if not any(s for _, s in shards):
        return
    if not all(s for _, s in shards):
        raise GradcheckError(f"reports of {config} mix shards and whole runs: "
                             + ", ".join(p for p, s in shards if not s) + " ran without --shard")
    splits = {s["count"] for _, s in shards}
    if len(splits) > 1:
        raise GradcheckError(f"reports of {config} come from different splits (N = {sorted(splits)})")
    count = splits.pop()
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
    if len(given) < count:  # name the first few missing, each within 1..N, without counting up to a huge N
        absent = count - len(given)
        missing = [f"{i}/{count}" for i in itertools.islice((i for i in range(1, count + 1) if i not in given), 5)]
        more = f" and {absent - len(missing):,} more" if absent > len(missing) else ""
        present = ", ".join(f"{i}/{count}" for i in sorted(given)[:5]) + (", ..." if len(given) > 5 else "")
        message = (f"shard{'s' if absent > 1 else ''} {', '.join(missing)}{more} of {config} missing (given: "
                   f"{present}); merge every shard of the run")
        others = [c for c in configs if c != config]
        if others:  # shards of different configs are never shards of one run
            message += (f"; the reports are of {len(configs)} configs ({config}: {_files_of(parts)}; "
                        + "; ".join(f"{c}: {_files_of(configs[c])}" for c in others[:3])
                        + ("; ..." if len(others) > 3 else "") + "), and the shards of one run share its config")
        raise GradcheckError(message)
    held = sum(len(data["scenarios"]) for _, data in parts)
    if of is not None and held != of:
        raise GradcheckError(f"the shards of {config} hold {held} scenario(s) but the run selected {of}")
