"""The command line's parameter types and value checks: I/N shards, fault names (from the registry),
--steps ranges, --plot's needs."""
from __future__ import annotations

import click
import numpy as np

from ..errors import GradcheckError
from ..ops import FAULTS

#: --fault: a name from the registry ('attn-gradcheck faults').
FAULT_CHOICE = click.Choice(tuple(FAULTS))


class _Shard(click.ParamType):
    """I/N with 1 <= I <= N: this run takes shard I of N (``runner.shard``)."""
    name = "I/N"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        i, sep, n = str(value).partition("/")
        try:
            index, count = int(i), int(n)
        except ValueError:
            index = count = 0
        if not sep or not 1 <= index <= count:
            self.fail(f"{value!r} is not I/N with 1 <= I <= N (e.g. 2/4)", param, ctx)
        return index, count


def _parse_steps(text: str) -> tuple[float, ...]:
    """HI:LO[:N] -> steps from HI down to LO (both included), N per decade."""
    bad = GradcheckError(f"--steps {text!r}: expected HI:LO[:N] with 0 < LO < HI <= 1 and N an integer from 1 "
                         "to 20 per decade, e.g. 1e-1:1e-12")
    parts = text.split(":")
    try:
        hi, lo = float(parts[0]), float(parts[1])
        per = float(parts[2]) if len(parts) > 2 else 1.0
    except (ValueError, IndexError):
        raise bad from None
    if len(parts) > 3 or not (0 < lo < hi <= 1) or not per.is_integer() or not 1 <= per <= 20:
        raise bad
    count = max(2, int(np.ceil(np.log10(hi / lo) * per - 1e-9)) + 1)
    if count > 200:
        raise GradcheckError(f"--steps {text!r}: {count} steps; at most 200")
    return tuple(float(x) for x in np.geomspace(hi, lo, count))


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GradcheckError("--plot needs matplotlib, which is not installed: pip install 'attn-gradcheck[plot]'") \
            from None
