"""Typed readers of a scenario's keys, for the scenario loader and the ops that parse their own keys (an op's
``Structure``): each returns the value or raises with the file, line and key. ``doc`` is the YAML document
(``scenario.yaml_lines``): it turns a key's path into an error with its line."""
from __future__ import annotations

import math
import reprlib
from typing import Any

from .errors import ScenarioError

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 6
_SHORT.maxlevel = 3


def show(value: Any) -> str:
    """A value as error messages echo it: its repr, cut to a readable length (a 10 MB string is not
    repeated back)."""
    return _SHORT.repr(value)


# --------------------------------------------------------------------------------------------------
# Typed readers: each returns the value or raises with the file, line and key.

class Fields:
    """One scenario's keys merged over the defaults, each remembering the path it came from."""

    def __init__(self, doc: Any, values: dict[str, tuple[Any, tuple]], path: tuple):
        self.doc, self.values, self.path = doc, values, path

    def has(self, key: str) -> bool:
        return key in self.values and self.values[key][0] is not None

    def where(self, key: str) -> tuple:
        return self.values[key][1] if key in self.values else self.path + tuple(key.split("."))

    def error(self, key: str, message: str, hint: str | None = None) -> ScenarioError:
        return self.doc.error(self.where(key), message, hint)

    def raw(self, key: str, default: Any = None) -> Any:
        return self.values[key][0] if self.has(key) else default

    def int(self, key: str, default: Any = None, minimum: int = 1) -> int:
        if not self.has(key):
            if default is None:
                raise self.error(key, "is required", hint=f"add '{key.split('.')[-1]}: <integer >= {minimum}>'")
            return default
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"expected an integer, got {show(v)}")
        if v < minimum:
            raise self.error(key, f"must be >= {minimum}, got {v}")
        return v

    def float(self, key: str, default: float, positive: bool = True) -> float:
        if not self.has(key):
            return default
        v = self.raw(key)
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise self.error(key, f"expected a number, got {show(v)}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, f"expected a finite number, got {show(v)}")
        if positive and v <= 0:
            raise self.error(key, f"must be > 0, got {v}")
        return float(v)

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        if not self.has(key):
            return default
        v = self.raw(key)
        if v not in choices:
            import difflib
            close = difflib.get_close_matches(str(v), choices, n=1) if isinstance(v, str) else []
            raise self.error(key, f"expected one of {', '.join(choices)}; got {show(v)}",
                             hint=f"did you mean '{close[0]}'?" if close else None)
        return v

    def int_list(self, key: str, lo: int, hi: int | None, what: str, unique: bool = False) -> tuple[int, ...] | None:
        if not self.has(key):
            return None
        v = self.raw(key)
        if not isinstance(v, list) or not v:
            raise self.error(key, f"expected a non-empty list of integers, got {show(v)}")
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int):
                raise self.doc.error(self.where(key) + (i,), f"expected an integer, got {show(x)}")
            if x < lo or (hi is not None and x > hi):
                bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise self.doc.error(self.where(key) + (i,), f"{x} is out of range: {what} must be {bounds}")
            if unique and x in v[:i]:
                raise self.doc.error(self.where(key) + (i,), f"{x} is listed twice", hint="list each once")
        return tuple(v)
