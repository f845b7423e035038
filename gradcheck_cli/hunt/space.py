"""The space a hunt draws from: the op's axes (``Op.space``) around the starting scenario, narrowed or widened by
``--space KEY=RANGE``, as a hypothesis strategy of {key: value} that shrinks towards the simplest scenario."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import GradcheckError
from ..ops import OPS
from ..ops.registry import Axis
from .start import ABSENT, Start, refusal, with_values

#: The steps of a size drawn between its edges: log-uniform, so that small sizes (cheap to check) come often.
_STEPS = 1000


@dataclass(frozen=True)
class Space:
    """The axes a hunt varies (in drawing order), the keys it keeps at the starting value and why, and the most
    input elements a drawn scenario may have (larger draws are skipped)."""
    axes: tuple[Axis, ...]
    fixed: tuple[tuple[str, str], ...]
    max_elements: int
    named: tuple[str, ...] = ()  # the axes ``--space`` named

    def ranges(self) -> dict[str, str]:
        """What each axis covers, in words (``1..300``, ``none, upper-left, lower-right``)."""
        return {a.key: _range_text(a) for a in self.axes}

    def strategy(self, start: Start):
        """A strategy of {axis key: value}; dependent kinds (padding lengths, windows) read the sizes drawn before
        them, or the starting scenario's."""
        from hypothesis import strategies as st  # imported when a hunt runs, not with the command line
        axes = self.axes

        @st.composite
        def draw(draw_one):
            values: dict = {}
            for axis in axes:
                values[axis.key] = draw_one(_strategy(axis, values, start))
            return values
        return draw()


def scenario_values(values: dict, start: Start) -> dict:
    """The scenario keys a draw sets (``group`` becomes ``heads_q``)."""
    out = dict(values)
    if "group" in out:
        heads_kv = out.get("heads_kv", start.scenario.heads_kv)
        out["heads_q"] = heads_kv * out.pop("group")
    elif "heads_kv" in out:
        out["heads_q"] = out["heads_kv"] * max(1, start.scenario.heads_q // max(1, start.scenario.heads_kv))
    return out


def space_of(start: Start, overrides: dict[str, str], max_elements: int) -> Space:
    """The space around ``start``: the op's axes, each kept at the starting value where a key of the scenario fixes
    it (a mask file fixes the sizes), the optional ones (``when_set``) only where the scenario sets them or
    ``overrides`` names them, and ``overrides`` ({key: 'lo..hi' or 'a,b,c'}) applied. Raises GradcheckError on
    an override that names no axis, one fixed by the scenario, or a range that is wrong."""
    op = OPS[start.scenario.op]
    if not op.space:
        raise GradcheckError(f"op {op.name} declares no space to hunt in (it has no shapes to vary)")
    known = {a.key: a for a in op.space}
    for key in overrides:
        if key not in known:
            raise GradcheckError(f"--space {key}: op {op.name} has no such axis (its axes: {', '.join(known)})")
    axes, fixed = [], []
    for axis in op.space:
        fixer = next((k.removesuffix("[]") for k in axis.fixed_by if _fixes(start, k)), None)
        if fixer is not None:
            if axis.key in overrides:
                raise GradcheckError(f"--space {axis.key}: the starting scenario's {fixer} fixes it; remove {fixer} "
                                     f"from the scenario to vary {axis.key}")
            fixed.append((axis.key, f"fixed by {fixer}"))
            continue
        if axis.when_set and start.get(axis.key) is None and axis.key not in overrides:
            continue
        if axis.key == "dtype" and start.scenario.dtype not in axis.choices:
            axis = dataclasses.replace(axis, choices=(start.scenario.dtype,))
        if axis.key in overrides:
            listed = axis.kind == "choice"  # a size given as a list is not checked alone (see _loads_with)
            axis = _override(axis, overrides[axis.key])
            if listed:
                _loads_with(start, axis)
        axes.append(axis)
    return Space(tuple(axes), tuple(fixed), max_elements, tuple(k for k in overrides))


def _loads_with(start: Start, axis: Axis) -> None:
    """Each value ``--space`` lists for an axis, set on the starting scenario, is one the loader takes; else
    GradcheckError naming the value and the loader's reason (a dtype the backend has not, a mask kind that does
    not exist, a zero scale). A range's sizes are not: one may be refused with the starting sizes alone."""
    for value in axis.choices:
        if value is ABSENT:
            continue
        keys = scenario_values({axis.key: value}, start)
        problem = refusal(start, with_values(start.mapping, keys))
        if problem is not None:
            shown = "none" if value is ABSENT else value
            raise GradcheckError(f"--space {axis.key}={shown}: the starting scenario with it is refused: {problem}")


def _fixes(start: Start, key: str) -> bool:
    """Whether the starting scenario sets ``key`` (``key[]``: sets it to a list)."""
    value = start.get(key.removesuffix("[]"))
    return isinstance(value, list) if key.endswith("[]") else value is not None


def parse_overrides(items: tuple[str, ...]) -> dict[str, str]:
    """``--space KEY=RANGE`` options as {key: range}; raises GradcheckError on one without '='."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise GradcheckError(f"--space {item}: expected KEY=RANGE, e.g. --space n_k=1..300, "
                                 "--space d_head=16,64,128,160 or --space dtype=float32")
        if key.strip() in out:
            raise GradcheckError(f"--space {item}: {key.strip()} is given twice (--space {key.strip()}="
                                 f"{out[key.strip()]}); give each axis once, a list for several values")
        out[key.strip()] = value.strip()
    return out


def _override(axis: Axis, text: str) -> Axis:
    """``axis`` narrowed or widened to ``text``: 'lo..hi' (an integer range; the edges inside it stay) or a list
    'a,b,c' (those values, the simplest first as written; 'none' leaves the key out)."""
    lo, dots, hi = text.partition("..")
    if dots:
        if axis.kind != "int":
            raise GradcheckError(f"--space {axis.key}={text}: {axis.key} takes a list of values, not a range, e.g. "
                                 f"--space {axis.key}={_range_text(axis).replace(', ', ',')}")
        try:
            low, high = int(lo), int(hi)
        except ValueError:
            raise GradcheckError(f"--space {axis.key}={text}: expected whole numbers lo..hi, e.g. "
                                 f"--space {axis.key}=1..64") from None
        if not 1 <= low <= high:
            raise GradcheckError(f"--space {axis.key}={text}: expected 1 <= lo <= hi")
        return dataclasses.replace(axis, low=low, high=high, edges=tuple(e for e in axis.edges if low <= e <= high))
    values = tuple(_value(v.strip()) for v in text.split(",") if v.strip())
    if not values:
        raise GradcheckError(f"--space {axis.key}={text}: no value given")
    if axis.kind == "int":
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            raise GradcheckError(f"--space {axis.key}={text}: expected whole numbers >= 1 or a range lo..hi")
        return dataclasses.replace(axis, kind="choice", choices=tuple(sorted(set(values))))
    if axis.kind in ("lengths", "window") and values != (ABSENT,):
        raise GradcheckError(f"--space {axis.key}={text}: {axis.key} is drawn from the sizes; it can only be "
                             "turned off ('none')")
    if axis.kind in ("lengths", "window"):
        return dataclasses.replace(axis, kind="choice", choices=(ABSENT,))
    return dataclasses.replace(axis, choices=values)


def _value(text: str):
    if text.lower() in ("none", "null"):
        return ABSENT
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _range_text(axis: Axis) -> str:
    if axis.kind == "int":
        return f"{axis.low}..{axis.high}"
    if axis.kind == "choice":
        return ", ".join("none" if v is ABSENT else str(v) for v in axis.choices)
    return f"none or drawn within {axis.of}"


def _strategy(axis: Axis, values: dict, start: Start):
    from hypothesis import strategies as st
    if axis.kind == "choice":
        return st.sampled_from(axis.choices)
    if axis.kind == "int":
        sizes = _sizes(axis.low, axis.high)
        edges = [e for e in axis.edges if axis.low <= e <= axis.high]
        return st.one_of(st.sampled_from(edges), sizes) if edges else sizes
    bound = values.get(axis.of, getattr(start.scenario, axis.of))
    if axis.kind == "lengths":
        batch = values.get("batch", start.scenario.batch)
        return st.one_of(st.none(), st.lists(st.integers(1, bound), min_size=batch, max_size=batch))
    side = st.one_of(st.none(), st.integers(0, bound))
    return st.one_of(st.none(), st.tuples(side, side).filter(lambda w: w != (None, None)).map(list))


def _sizes(low: int, high: int):
    """Integers low..high, log-uniform (small ones often), shrinking towards ``low``."""
    from hypothesis import strategies as st
    if high <= low:
        return st.just(low)
    ratio = math.log(high / low)
    return st.integers(0, _STEPS).map(lambda u: min(high, max(low, round(low * math.exp(ratio * u / _STEPS)))))
