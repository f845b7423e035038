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
        raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc} (the module must be "
                         "importable from the YAML's folder or PYTHONPATH)") from None
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


def call(fn, what: str, args: tuple, expected: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
    """Call ``fn`` on copies of ``args`` (so changing them in place cannot affect the check) and check
    each returned array against ``expected`` (name -> (shape, dtype), in the order returned: one name
    means a single array, several a tuple)."""
    args = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    out = guarded(what, fn, *args)
    names = list(expected)
    values = [out] if len(names) == 1 else out
    if len(names) > 1 and (not isinstance(values, (tuple, list)) or len(values) != len(names)):
        got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ImplementationFailure(f"{what} must return ({', '.join(names)}), got {got}", names[0])
    result = {}
    for name, value in zip(names, values):
        shape, dtype = expected[name]
        if not isinstance(value, np.ndarray):
            raise ImplementationFailure(f"{what} must return numpy arrays; {name} is a {type(value).__name__}", name)
        arr = value
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
