"""YAML with line numbers: a safe loader that records the line of every key and item of a document,
refuses tags outside YAML's core schema and caps what aliases expand to; and how error messages echo
values and sizes."""
from __future__ import annotations

from typing import Any

import yaml

from ..errors import ScenarioError
from ..keys import show as _show

#: A document may hold at most this many values once YAML aliases are expanded.
MAX_VALUES = 1_000_000
#: The deepest nesting of mappings and lists a document may have (a scenario file needs under ten levels:
#: scenarios[0].sweep.mask.visible and a 4-D inline mask): refused where it is exceeded, with its line and
#: key, before anything that walks the document recursively could run out of stack.
MAX_DEPTH = 64

def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        return f"unacceptable character {exc.character!r} (only printable UTF-8 text is allowed)"
    return getattr(exc, "problem", None) or str(exc).splitlines()[0]


def _yaml_line(exc: yaml.YAMLError, text: str) -> int | None:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    if mark is not None:
        return mark.line + 1
    position = getattr(exc, "position", None)
    return text.count("\n", 0, position) + 1 if position is not None else None


def _key(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _too_deep(text: str) -> int | None:
    """The line where ``text`` first nests deeper than MAX_DEPTH, from the parser's events (a flat stream:
    no recursion), or None when it cannot tell."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    return event.start_mark.line + 1
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        pass
    return None


#: The tags of YAML's core schema (and the merge key '<<', and timestamps, which YAML 1.1 resolves
#: plain dates to: the field readers refuse them by type). Any other tag is refused where it stands.
SAFE_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "str", "seq", "map",
                                                          "merge", "timestamp"))


class _Doc:
    """A parsed YAML document and the line of every key and item in it."""

    def __init__(self, text: str, file: str):
        self.file = file
        self.lines: dict[tuple, int] = {}
        self.values = 0
        self._constructor = yaml.SafeLoader("")
        try:
            node = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            self.value = self._convert(node, ()) if node is not None else None
        except yaml.YAMLError as exc:
            problem = _yaml_problem(exc)
            if "maximum nesting depth" in problem:  # libyaml's own bound (1,000 levels), met before ours
                raise ScenarioError(f"the YAML is nested more than {MAX_DEPTH} levels deep", file=file,
                                    line=_yaml_line(exc, text)) from None
            raise ScenarioError(f"not valid YAML: {problem}", file=file, line=_yaml_line(exc, text)) from None
        except RecursionError:  # PyYAML's pure-Python composer (without libyaml), which recurses per level
            raise ScenarioError(f"the YAML is nested more than {MAX_DEPTH} levels deep", file=file,
                                line=_too_deep(text)) from None

    def _convert(self, node, path: tuple) -> Any:
        if len(path) > MAX_DEPTH and isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            raise ScenarioError(f"nested more than {MAX_DEPTH} levels deep (a scenario file needs under ten)",
                                file=self.file, line=node.start_mark.line + 1,
                                key=_key(path[:8]) + "..." if len(path) > 8 else _key(path))
        if node.tag not in SAFE_TAGS:  # explicit tags outside YAML's core schema (!!python/object, !custom, ...)
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ScenarioError(f"the YAML tag {_show(tag)} is not allowed: scenario files hold plain "
                                "mappings, lists, strings, numbers, booleans and nulls", file=self.file,
                                line=node.start_mark.line + 1, key=_key(path) or None,
                                hint="remove the tag")
        self.values += 1
        if self.values > MAX_VALUES:
            raise ScenarioError(f"the document expands to more than {MAX_VALUES:,} values (YAML aliases?)",
                                file=self.file, line=node.start_mark.line + 1)
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict = {}
            merged: dict = {}
            for k_node, v_node in node.value:
                if k_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' merges, explicit keys win
                    sources = v_node.value if isinstance(v_node, yaml.SequenceNode) else [v_node]
                    for source in sources:
                        value = self._convert(source, path)
                        if not isinstance(value, dict):
                            raise self.error(path, "'<<' must merge a mapping")
                        merged = {**value, **merged}
                    continue
                if not isinstance(k_node, yaml.ScalarNode):  # a list or mapping as a key
                    kind = "a list" if isinstance(k_node, yaml.SequenceNode) else "a mapping"
                    raise ScenarioError(f"keys must be names, got {kind}", file=self.file,
                                        line=k_node.start_mark.line + 1, key=_key(path) or None)
                key = self._constructor.construct_object(k_node)
                if not isinstance(key, str):
                    raise ScenarioError(f"keys must be names, got {_show(key)}", file=self.file,
                                        line=k_node.start_mark.line + 1, key=_key(path) or None)
                if key in out:
                    raise ScenarioError(f"duplicate key '{key}'", file=self.file,
                                        line=k_node.start_mark.line + 1, key=_key(path + (key,)),
                                        hint="give each key once")
                self.lines[path + (key,)] = k_node.start_mark.line + 1
                out[key] = self._convert(v_node, path + (key,))
            return {**merged, **out}
        if isinstance(node, yaml.SequenceNode):
            return [self._convert(item, path + (i,)) for i, item in enumerate(node.value)]
        return self._constructor.construct_object(node)

    def line(self, path: tuple) -> int | None:
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path)

    def error(self, path: tuple, message: str, hint: str | None = None) -> ScenarioError:
        return ScenarioError(message, file=self.file, line=self.line(path), key=_key(path) or None, hint=hint)
