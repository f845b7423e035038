"""Reading scenario files: every scenario of a YAML file (defaults merged, sweeps expanded) as a
``Scenario``, and what the CLI does with the list (the files it reads, ``--engine``, ``--select``)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

from .. import files, implementation
from ..errors import GradcheckError, ScenarioError, ScenarioErrors
from ..ops import OPS
from .fields import TOP_KEYS, _Fields, _merge, _suggest
from .model import Scenario
from .parse import _parse_scenario
from .resources import available_memory, need
from .sweep import _sweep_axes, _sweep_cases
from .yaml_lines import _Doc, _show, _size


def load(path: str | os.PathLike, *, memory_limit: int | None = None, include: tuple[str, ...] = (),
         exclude: tuple[str, ...] = ()) -> list[Scenario]:
    """Read and validate every scenario of a YAML file; raises ``ScenarioError`` on the first problem. With
    ``include``/``exclude`` (``--select``/``--deselect``'s globs), a scenario they leave out is not refused for an
    optional library this machine lacks (torch, JAX, ml_dtypes): it is dropped; any other problem still counts."""
    if "\x00" in os.fspath(path):
        raise ScenarioError("the path contains a NUL byte", file=repr(os.fspath(path)))
    path = Path(path)
    try:  # a folder, a FIFO, a device, a name too long: one message each
        data = files.read_regular(path, files.MAX_CONFIG_BYTES)
    except files.FileProblem as exc:
        raise ScenarioError(str(exc), file=str(path), hint="give a YAML scenario file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError("not UTF-8 text", file=str(path), line=data.count(b"\n", 0, exc.start) + 1,
                            hint="save the file as UTF-8") from None
    return loads(text, file=str(path), base_dir=path.parent, memory_limit=memory_limit, include=include,
                 exclude=exclude)


def loads(text: str, *, file: str = "<string>", base_dir: str | os.PathLike = ".",
          memory_limit: int | None = None, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()
          ) -> list[Scenario]:
    """Like :func:`load`, from a string."""
    doc = _Doc(text, file)
    top = doc.value
    if not isinstance(top, dict):
        raise doc.error((), "expected a mapping with a 'scenarios' list at the top level",
                        hint="see configs/quickstart.yaml")
    for key in top:
        if key not in TOP_KEYS and not key.startswith("x-"):
            raise doc.error((key,), f"unknown top-level key '{key}'",
                            hint=_suggest(key, TOP_KEYS) + "; keys starting with 'x-' are ignored (for YAML anchors)")
    defaults = top.get("defaults")
    defaults = {} if defaults is None else defaults  # 'defaults:' with nothing under it
    if not isinstance(defaults, dict):
        raise doc.error(("defaults",), f"expected a mapping, got {_show(defaults)}")
    items = top.get("scenarios")
    if not isinstance(items, list) or not items:
        raise doc.error(("scenarios",), "expected a non-empty list of scenarios",
                        hint="add 'scenarios:' with at least one '- name: ...' item")
    limit = available_memory() if memory_limit is None else memory_limit
    seen: dict[str, int] = {}
    out = []
    held = 0  # bytes of the masks the scenarios loaded so far hold (a sweep of cases that each fit may not)
    problems: list[ScenarioError] = []  # the first problem of each scenario: all of them are reported at once
    reported: set[str] = set()
    for i, item in enumerate(items):
        try:
            held = _load_item(doc, defaults, item, i, base_dir, limit, seen, out, held)
        except ScenarioError as exc:
            many = exc.errors if isinstance(exc, ScenarioErrors) else [exc]
            name = item.get("name") if isinstance(item, dict) else None
            if (include or exclude) and isinstance(name, str) and all(p.missing for p in many) \
                    and not _chosen(name, include, exclude):
                continue  # left out by --select/--deselect: the library it needs is not wanted here
            for problem in many:
                if str(problem) not in reported:  # a bad key of defaults: once, not once per scenario
                    reported.add(str(problem))
                    problems.append(problem)
            if exc.final:  # the masks held so far: every later scenario would say so
                break
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ScenarioErrors(problems)
    return out


def _load_item(doc, defaults: dict, item, i: int, base_dir, limit: int, seen: dict, out: list, held: int) -> int:
    """The scenarios of ``scenarios[i]`` (its sweep's cases) appended to ``out``; returns the bytes of masks held
    so far. Raises ScenarioError at its first problem."""
    if not isinstance(item, dict):
        raise doc.error(("scenarios", i), f"expected a mapping, got {_show(item)}")
    flat = _merge(doc, defaults, item, i)
    cases: dict = {}
    for suffix, case in _sweep_cases(doc, flat, _sweep_axes(doc, defaults, item, i), i):
        try:
            sc = _parse_scenario(doc, _Fields(doc, case, ("scenarios", i)), Path(base_dir), limit)
        except ScenarioError as exc:
            if suffix:
                exc.message += f" (in the sweep case {item.get('name')}{suffix})"
            raise
        sc = dataclasses.replace(sc, name=sc.name + suffix, index=len(out))
        held += sc.visible.nbytes if sc.visible is not None else 0
        if held > limit // 2:
            full = doc.error(("scenarios", i), f"the scenarios up to {sc.name} hold masks of {_size(held)} "
                             f"together, more than half of the {_size(limit)} available",
                             hint="sweep fewer cases or smaller shapes, or split the file")
            full.final = True
            raise full
        if suffix:  # two spellings of one value (1e-6 and 1.0e-6) make the same scenario twice
            digest = hashlib.sha256(sc.visible.tobytes()).hexdigest() if sc.visible is not None else ""
            same = (dataclasses.replace(sc, name="", index=0), digest)
            if same in cases:
                raise doc.error(("scenarios", i, "sweep"), f"the sweep cases {cases[same]} and {sc.name} are the "
                                "same scenario", hint="list each value once")
            cases[same] = sc.name
        if sc.name in seen:
            raise doc.error(("scenarios", i, "name"), f"duplicate scenario name '{sc.name}' "
                            f"(first at scenarios[{seen[sc.name]}])", hint="names must be unique")
        seen[sc.name] = i
        out.append(sc)
    return held


def read_files(scenarios: list[Scenario]) -> list[str]:
    """The files checking these scenarios reads besides the scenario file: mask files and the modules of
    implementations (a run never writes a report over any of them)."""
    out: list[str] = []
    for sc in scenarios:
        if sc.visible_source and sc.visible_source != "inline":
            out.append(str(Path(sc.base_dir) / sc.visible_source))
        if sc.implementation:
            out += [str(p) for p in implementation.source_files(sc.implementation, Path(sc.base_dir))]
    return list(dict.fromkeys(out))


def with_engine(scenarios: list[Scenario], engine: str | None, *, memory_limit: int | None = None) -> list[Scenario]:
    """The scenarios with ``engine`` where it applies (an op that has it, on a scenario whose engine is
    chosen by ``engine:``, not implied by a backend or a user's implementation, and, for ``check: {mode: jvp}``
    or ``hvp``, an engine that computes that derivative); the others unchanged."""
    if engine is None:
        return list(scenarios)
    out, limit = [], memory_limit
    for sc in scenarios:
        op = OPS[sc.op]
        computes = op.directional_derivative(sc.mode)  # modes jvp and hvp: the engines that compute theirs
        elsewhere = computes is not None and engine not in computes[0]
        if engine in op.engine_choices and op.engine_for(sc) in op.engine_choices and not elsewhere:
            moved = dataclasses.replace(sc, engine=engine)
            if engine != sc.engine:  # e.g. the naive engine needs the n x n arrays the tiled one avoids
                limit = available_memory() if limit is None else limit
                needed = need(op, moved)
                if needed > limit:
                    raise ScenarioError(f"--engine {engine}: scenario '{sc.name}' needs about {needed / 2**30:.1f} "
                                        f"GiB on the {engine} engine, more than the {limit / 2**30:.1f} GiB available",
                                        file=sc.file, line=sc.line, hint=f"keep its engine: {sc.engine}")
            sc = moved
        out.append(sc)
    return out


def _chosen(name: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """``name`` matches an ``include`` glob (any, when none is given) and no ``exclude`` glob."""
    import fnmatch

    def matches(patterns) -> bool:
        return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)
    return (not include or matches(include)) and not matches(exclude)


def select(scenarios: list[Scenario], include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> list[Scenario]:
    """Scenarios whose name matches any ``include`` glob (all when none is given) and no ``exclude``
    glob. Globs match the whole name (``fnmatch``): a plain name selects exactly that scenario (also a
    generated sweep name such as ``causal[n_q=1]``, whose brackets would otherwise be a glob class),
    ``'*gqa*'`` every name containing gqa."""
    chosen = [sc for sc in scenarios if _chosen(sc.name, include, exclude)]
    if not chosen:
        names = ", ".join(sc.name for sc in scenarios)
        given = " ".join([f"--select '{p}'" for p in include] + [f"--deselect '{p}'" for p in exclude])
        raise GradcheckError(f"no scenario is left by {given} (scenarios: {names}); patterns are globs over "
                             f"whole names, e.g. '*gqa*'")
    return chosen

