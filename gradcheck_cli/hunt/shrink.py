"""Shrinking after hypothesis's: two passes over the sizes of the smallest failure, each scenario checked by the
search's ``evaluate`` (which counts it and keeps the smallest that fails the same way as ``hunt.smallest``)."""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from .found import Finding, Hunt
from .space import Space, scenario_values
from .start import Start, candidate, elements, with_values

#: Most scenarios the ascending search after hypothesis checks (``_ascend``).
ASCEND_CHECKS = 150
#: Most scenarios it loads to order them (refused ones included: where most are, it stops sooner).
ASCEND_LOADS = 3000


def made(start: Start, space: Space, values: dict) -> tuple:
    """(mapping, scenario or None when the loader refuses it, input elements) of a draw."""
    mapping = with_values(start.mapping, scenario_values(values, start))
    sc = candidate(start, mapping)
    return mapping, sc, elements(sc) if sc is not None else 0


def ascend(hunt: Hunt, start: Start, space: Space, evaluate: Callable, deadline: float) -> None:
    """The sizes below the smallest failure, in ascending input elements (best first from every size at its lowest,
    each size growing by one), the other keys as they are: the first that fails the same way is the smallest for
    those keys. At most ASCEND_CHECKS are checked: a failure that needs large sizes keeps what hypothesis found.
    (Varying the choices too, one at a time, spread the checks over nine times as many scenarios and found less.)"""
    base, limit = dict(hunt.smallest.values), hunt.smallest.elements
    sizes = [a for a in space.axes if a.kind == "int" and isinstance(base.get(a.key), int)]

    def at(vector: tuple) -> tuple:
        values = {**base, **{a.key: v for a, v in zip(sizes, vector)}}
        return values, made(start, space, values)

    first = tuple(a.low for a in sizes)
    values, m = at(first)
    heap, seen, order, checks, loads = [(m[2], 0, first, values, m)], {first}, 0, 0, 1
    while heap and checks < ASCEND_CHECKS and loads < ASCEND_LOADS and time.monotonic() < deadline:
        size, _, vector, values, m = heapq.heappop(heap)
        if m[1] is not None:
            if size >= limit:
                return
            checks += 1
            if evaluate(values, m) is hunt.smallest:
                return
        for i, a in enumerate(sizes):
            step = vector[:i] + (vector[i] + 1,) + vector[i + 1:]
            if vector[i] < a.high and step not in seen:
                seen.add(step)
                order += 1
                values_, m_ = at(step)
                loads += 1
                # a refused size has no input elements to count: those of its parent, grown as this size grew
                grown = max(size + 1, -(-size * (vector[i] + 1) // max(vector[i], 1)))
                heapq.heappush(heap, (m_[2] if m_[1] is not None else grown, order, step, values_, m_))


def polish(hunt: Hunt, space: Space, evaluate: Callable[[dict], Finding | None], deadline: float) -> None:
    """After hypothesis: each size of the smallest failure tried at every smaller value, one size at a time, the
    first that still fails the same way taken, until none does or the time is spent. Hypothesis's shrinker halves
    and steps; a failure that depends on the drawn values (an overflow at one input) can hide between its steps."""
    improved = True
    while improved:
        improved = False
        for axis in (a for a in space.axes if a.kind == "int"):
            current = hunt.smallest.values.get(axis.key)
            for value in range(axis.low, current if isinstance(current, int) else axis.low):
                if time.monotonic() > deadline:
                    return
                finding = evaluate({**hunt.smallest.values, axis.key: value})
                if finding is not None and hunt.smallest is finding:
                    improved = True
                    break
            if improved:
                break
