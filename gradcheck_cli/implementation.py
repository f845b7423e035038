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
import importlib.machinery
import importlib.util
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


class LoadError(ValueError):
    """The implementation a scenario names cannot be found, imported or used; the message says why
    (the caller places it: file, line, key)."""


def locate(spec: str, base_dir: Path) -> None:
    """Check ``module:attribute`` without running any of it: the spelling, and that the module's file
    exists in the YAML's folder or on the import path. Raises LoadError."""
    if not SPEC_RE.fullmatch(spec):
        raise LoadError(f"expected 'module:attribute', got {spec!r}")
    top = spec.split(":", 1)[0].split(".")[0]
    if _local_file(top, base_dir) is not None:
        return
    try:
        found = importlib.machinery.PathFinder.find_spec(top) or importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise LoadError(f"cannot find module {top!r} in the YAML's folder ({base_dir}) or on the import path "
                        "(PYTHONPATH)")


def source_files(spec: str, base_dir: Path) -> list[Path]:
    """The files of the module ``spec`` names, where they can be found without running it (a run must
    never write a report over them)."""
    module = spec.split(":", 1)[0]
    top = module.split(".")[0]
    local = _local_file(top, base_dir)
    if local is not None:
        if local.name == "__init__.py":
            tail = module.split(".")[1:]
            candidate = local.parent.joinpath(*tail)
            return [local] + [p for p in (candidate.with_suffix(".py"), candidate / "__init__.py") if p.is_file()]
        return [local]
    try:
        found = importlib.machinery.PathFinder.find_spec(top)
    except (ImportError, ValueError):
        found = None
    return [Path(found.origin)] if found is not None and found.origin and Path(found.origin).is_file() else []


def _local_file(top: str, base_dir: Path) -> Path | None:
    """The module file or package folder named ``top`` in the YAML's folder, if there is one."""
    folder = Path(base_dir).resolve()
    for candidate in (folder / f"{top}.py", folder / top / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


#: Implementations imported by this process: (folder, spec, flavour) -> object.
_LOADED: dict[tuple[str, str, str], Any] = {}


def load(spec: str, base_dir: Path, flavour: str = "numpy") -> Any:
    """Import ``module:attribute`` (once per process) and check it. A module in the YAML's folder is
    loaded from its file, so it can neither shadow nor be shadowed by an installed module of the same
    name; the folder is then appended to sys.path (after site-packages) for the module's own imports of
    its neighbours. ``flavour`` numpy needs ``forward``/``backward`` callables; torch needs the
    attribute itself to be callable. Raises LoadError."""
    key = (str(Path(base_dir).resolve()), spec, flavour)
    if key in _LOADED:
        return _LOADED[key]
    locate(spec, base_dir)
    module_name, attr_path = spec.split(":", 1)
    top = module_name.split(".")[0]
    folder = key[0]
    if folder not in sys.path:
        sys.path.append(folder)
    try:
        local = _local_file(top, Path(folder))
        if local is not None:
            _import_from_file(top, local)
        module = importlib.import_module(module_name)
    except LoadError:
        raise
    except BaseException as exc:  # the user's module may raise anything while importing, SystemExit too
        if _ctrl_c(exc):
            raise
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and top != exc.name.split(".")[0]
        where = (f" (it was found, but it imports {exc.name!r}, which is not installed here)" if missing else
                 " (the module must be importable from the YAML's folder or PYTHONPATH)"
                 if isinstance(exc, ModuleNotFoundError) else " (raised while importing it)")
        raise LoadError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{where}") from None
    obj: Any = module
    for part in attr_path.split("."):
        obj = _attribute(obj, part, module_name, attr_path)
    if flavour == "torch":
        if not _safe(callable, obj):
            raise LoadError(f"{spec} must be callable as f(q, k, v, visible, scale, kv_map) -> o "
                            "(see the README: the torch interface)")
    else:
        missing = [name for name in ("forward", "backward")
                   if not _safe(callable, _attribute(obj, name, module_name, f"{attr_path}.{name}", missing_ok=True))]
        if missing:
            raise LoadError(f"{spec} needs callable {' and '.join(missing)} (see the README: the NumPy interface)")
    _LOADED[key] = obj
    return obj


#: Modules this process imported from a YAML's folder: name -> file.
_FROM_FILES: dict[str, Path] = {}


def _import_from_file(top: str, path: Path) -> None:
    """Import module ``top`` from ``path`` (a file or a package's __init__.py) under its own name,
    refusing a name that an installed module already holds in this process (a module of another
    scenario file's folder by the same name is replaced)."""
    existing = sys.modules.get(top)
    if existing is not None:
        where = getattr(existing, "__file__", None)
        if where is not None and Path(where).resolve() == path.resolve():
            return
        if _FROM_FILES.get(top) is None:
            raise LoadError(f"module {top!r} in the YAML's folder has the name of a module this process already "
                            f"imported ({where or 'built in'}): rename the file")
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]  # the same name from another scenario file's folder
    spec = importlib.util.spec_from_file_location(
        top, path, submodule_search_locations=[str(path.parent)] if path.name == "__init__.py" else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(top, None)
        raise
    _FROM_FILES[top] = path


_MISSING = object()


def _attribute(obj, name: str, module_name: str, attr_path: str, missing_ok: bool = False):
    """getattr, with anything but a missing attribute (a property or module __getattr__ that raises)
    reported as such."""
    try:
        return getattr(obj, name)
    except AttributeError:
        if missing_ok:
            return _MISSING
        raise LoadError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    except BaseException as exc:
        if _ctrl_c(exc):
            raise
        raise LoadError(f"reading {attr_path!r} of module {module_name!r} raised {type(exc).__name__}: {exc}") from None


def _safe(test, obj) -> bool:
    if obj is _MISSING:
        return False
    try:
        return bool(test(obj))
    except Exception:
        return False


#: Whether a KeyboardInterrupt can be the user's Ctrl-C (then it propagates). Worker processes ignore
#: SIGINT and set this to False: there, one can only come from the implementation, and is its failure.
CTRL_C_REACHES_HERE = True


def _ctrl_c(exc: BaseException) -> bool:
    return isinstance(exc, KeyboardInterrupt) and CTRL_C_REACHES_HERE


def guarded(what: str, fn, *args):
    """``fn(*args)``, with anything it raises (SystemExit included, Ctrl-C excepted) turned into an
    ImplementationFailure."""
    try:
        return fn(*args)
    except ImplementationFailure:
        raise
    except BaseException as exc:  # whatever the implementation raises is a failed check
        if _ctrl_c(exc):
            raise
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
        if not isinstance(before, np.ndarray):
            continue
        same_kind = (isinstance(after, np.ndarray) and after.shape == before.shape and after.dtype == before.dtype)
        if not same_kind or not np.array_equal(before, after, equal_nan=before.dtype.kind == "f"):
            name = names[i] if i < len(names) else f"argument {i + 1}"
            changed = np.argwhere(before != after) if same_kind else []
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
    from .result import Check, Kind
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
    return Check(kind=Kind.IMPLEMENTATION, name="deterministic", tensor=worst_t or "-",
                 shape=tuple(first[worst_t].shape) if worst_t else None, max_abs_error=worst, relative_error=worst,
                 tolerance=tolerance, noise_floor=0.0, worst_index=worst_i, passed=bool(passed), detail=detail)


def failure_check(name: str, exc: ImplementationFailure, tensor: str | None = None, prefix: str = ""):
    """A check that failed because the implementation under test misbehaved."""
    from .result import Check, Kind
    return Check(kind=Kind.IMPLEMENTATION, name=name, tensor=exc.tensor or tensor or "-", shape=None,
                 max_abs_error=float("inf"), relative_error=float("inf"), tolerance=0.0, noise_floor=0.0,
                 worst_index=exc.index, passed=False, detail=prefix + exc.message)


def in_copies(exc: ImplementationFailure, batch: int, name: str) -> ImplementationFailure:
    """Re-express a failure on copies stacked along the batch axis in the user's own indices."""
    if exc.index is None:
        return ImplementationFailure(f"{exc.message} (on perturbed copies of {name})", exc.tensor)
    copy, b = divmod(exc.index[0], batch)
    index = (b,) + tuple(exc.index[1:])
    where = f"{exc.tensor}[{', '.join(map(str, index))}]"
    message = exc.message.split(" at ")[0] + f" at {where} of perturbed copy {copy} of {name}"
    return ImplementationFailure(message, exc.tensor, index)
