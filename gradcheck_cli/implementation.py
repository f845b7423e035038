"""A user's own implementation under test: loading it (``module:attribute``) and calling it so that
whatever it does (raise, return the wrong shape or dtype, return NaN) becomes a failed check with a
message, never a traceback.

NumPy interface (README "Checking your own implementation"; the torch interface is one callable
``f(q, k, v, visible, scale, kv_map) -> o`` on torch tensors, differentiated by autograd):
  forward(q, k, v, visible, scale, kv_map) -> o
  backward(q, k, v, visible, scale, kv_map, grad_o) -> (dq, dk, dv)
with q [B, Hq, n_q, d_head], k [B, Hkv, n_k, d_head], v [B, Hkv, n_k, d_value], visible bool
[B, Hq, n_q, n_k], kv_map int [Hq]. Finite differences call ``forward`` with perturbed copies stacked
along the batch axis, so batch elements must be independent.
"""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ImplementationFailure(Exception):
    """The implementation under test misbehaved; ``tensor`` names what it returned (or None)."""

    def __init__(self, message: str, tensor: str | None = None, index: tuple[int, ...] | None = None):
        super().__init__(message)
        self.message, self.tensor, self.index = message, tensor, index


def load(spec: str, base_dir: Path, flavour: str = "numpy") -> Any:
    """Import ``module:attribute`` with the YAML's folder first on sys.path. ``flavour`` numpy needs
    ``forward``/``backward`` callables; torch needs the attribute itself to be callable. Raises
    ValueError with a message for the scenario loader to place (file, line, key)."""
    if not SPEC_RE.match(spec):
        raise ValueError(f"expected 'module:attribute', got {spec!r}")
    module_name, attr_path = spec.split(":", 1)
    folder = str(base_dir.resolve())
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's module may raise anything while importing, SystemExit too
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and \
            module_name.split(".")[0] != exc.name.split(".")[0]
        where = (f" (it was found, but it imports {exc.name!r}, which is not installed here)" if missing else
                 " (the module must be importable from the YAML's folder or PYTHONPATH)"
                 if isinstance(exc, ModuleNotFoundError) else " (raised while importing it)")
        raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{where}") from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if flavour == "torch":
        if not callable(obj):
            raise ValueError(f"{spec} must be callable as f(q, k, v, visible, scale, kv_map) -> o "
                             "(see the README: the torch interface)")
        return obj
    missing = [name for name in ("forward", "backward") if not callable(getattr(obj, name, None))]
    if missing:
        raise ValueError(f"{spec} needs callable {' and '.join(missing)} (see the README: the NumPy interface)")
    return obj


def guarded(what: str, fn, *args):
    """``fn(*args)``, with anything it raises (SystemExit included, Ctrl-C excepted) turned into an
    ImplementationFailure."""
    try:
        return fn(*args)
    except KeyboardInterrupt:
        raise
    except ImplementationFailure:
        raise
    except BaseException as exc:  # whatever the implementation raises is a failed check
        raise ImplementationFailure(f"{what} raised {type(exc).__name__}: {exc}") from None


def call(fn, what: str, args: tuple, expected: dict[str, tuple[tuple[int, ...], np.dtype]],
         names: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Call ``fn`` on fresh copies of ``args`` and check each returned array against ``expected``
    (name -> (shape, dtype), in the order returned: one name means a single array, several a tuple).

    Nothing handed over is shared with the checker: the implementation gets copies, and what it
    returns is copied before it is used (a buffer it reuses on the next call cannot change a result).
    An argument changed in place (``names`` names them) is a failure naming it: the checker would
    otherwise compare against inputs the implementation no longer saw."""
    given = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    out = guarded(what, fn, *given)
    for i, (before, after) in enumerate(zip(args, given)):
        if isinstance(before, np.ndarray) and not np.array_equal(before, after, equal_nan=before.dtype.kind == "f"):
            name = names[i] if i < len(names) else f"argument {i + 1}"
            changed = np.argwhere(before != after)
            index = tuple(int(x) for x in changed[0]) if len(changed) else None
            raise ImplementationFailure(f"{what} changed its argument {name} in place"
                                        + (f" (first at {name}[{', '.join(map(str, index))}])" if index else "")
                                        + ": an implementation must not modify its inputs", name)
    names_out = list(expected)
    values = [out] if len(names_out) == 1 else out
    if len(names_out) > 1 and (not isinstance(values, (tuple, list)) or len(values) != len(names_out)):
        got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ImplementationFailure(f"{what} must return ({', '.join(names_out)}), got {got}", names_out[0])
    result = {}
    for name, value in zip(names_out, values):
        shape, dtype = expected[name]
        if isinstance(value, np.ma.MaskedArray) or not isinstance(value, np.ndarray):
            kind = "a masked array" if isinstance(value, np.ma.MaskedArray) else f"a {type(value).__name__}"
            raise ImplementationFailure(f"{what} must return numpy arrays; {name} is {kind}", name)
        arr = np.array(value, copy=True, subok=False)
        if arr.shape != shape:
            raise ImplementationFailure(f"{what} returned {name} of shape {list(arr.shape)}, expected {list(shape)}", name)
        if arr.dtype != dtype:
            raise ImplementationFailure(f"{what} returned {name} of dtype {arr.dtype}, expected {dtype}", name)
        bad = ~np.isfinite(arr)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ImplementationFailure(f"{what} returned a non-finite {name}: {arr[index]} at {name}"
                                        f"[{', '.join(map(str, index))}]", name, index)
        result[name] = arr
    return result


def determinism(name: str, first: dict[str, np.ndarray], second: dict[str, np.ndarray], tolerance: float):
    """The check that two calls on the same inputs gave the same results: every element of the second
    within ``tolerance`` x the tensor's largest value of the first (0: bit for bit, as
    ``torch.autograd.gradcheck``'s ``nondet_tol``, there absolute)."""
    from .result import Check
    worst, worst_t, worst_i, allowed_w = 0.0, None, None, 0.0
    for t, a in first.items():
        b = second[t]
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        allowed = tolerance * float(np.abs(a).max(initial=0.0))
        if diff.size and (worst_t is None or float(diff.max()) - allowed > worst - allowed_w):
            flat = int(np.argmax(diff))
            worst, worst_t, allowed_w = float(diff.ravel()[flat]), t, allowed
            worst_i = tuple(int(i) for i in np.unravel_index(flat, diff.shape))
    passed = worst <= allowed_w
    differing = [t for t, a in first.items() if float(np.abs(a.astype(np.float64) - second[t].astype(np.float64))
                                                       .max(initial=0.0)) > tolerance * float(np.abs(a).max(initial=0.0))]
    where = f"{worst_t}[{', '.join(map(str, worst_i))}]" if worst_i else (worst_t or "-")
    detail = (f"{name} run twice on the same inputs: " + ("identical results" if worst == 0 else
              f"largest difference {worst:.3g} at {where}") + (f" (nondet_tol {tolerance:g} of the largest value)"
                                                              if tolerance else " (nondet_tol 0: must be identical)"))
    if not passed:
        part = "forward" if "o" in differing else "backward"
        detail += (f"; {', '.join('O' if t == 'o' else 'd' + t.upper() for t in differing)} differ; a {part} whose "
                   "result changes from call to call cannot be checked (finite differences, the "
                   "reference and the invariants compare separate calls); set check: {nondet_tol: ...} if that is "
                   "intended")
    return Check("implementation", "deterministic", worst_t or "-", tuple(first[worst_t].shape) if worst_t else None,
                 worst, worst, tolerance, 0.0, worst_i, bool(passed), detail)


def failure_check(name: str, exc: ImplementationFailure, tensor: str | None = None, prefix: str = ""):
    """A check that failed because the implementation under test misbehaved."""
    from .result import Check
    return Check("implementation", name, exc.tensor or tensor or "-", None, float("inf"), float("inf"), 0.0, 0.0,
                 exc.index, False, prefix + exc.message)


def in_copies(exc: ImplementationFailure, batch: int, name: str) -> ImplementationFailure:
    """Re-express a failure on copies stacked along the batch axis in the user's own indices."""
    if exc.index is None:
        return ImplementationFailure(f"{exc.message} (on perturbed copies of {name})", exc.tensor)
    copy, b = divmod(exc.index[0], batch)
    index = (b,) + tuple(exc.index[1:])
    where = f"{exc.tensor}[{', '.join(map(str, index))}]"
    message = exc.message.split(" at ")[0] + f" at {where} of perturbed copy {copy} of {name}"
    return ImplementationFailure(message, exc.tensor, index)
