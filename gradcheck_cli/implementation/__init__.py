"""A user's own implementation under test: loading it (``module:attribute``) and calling it so that
whatever it does (raise, return the wrong shape or dtype, return NaN) becomes a failed check with a
message, never a traceback.

NumPy interface (docs/your-code.md "Checking your own implementation"; the torch interface is one
callable ``f(q, k, v, visible, scale, kv_map) -> o`` on torch tensors, differentiated by autograd):
  forward(q, k, v, visible, scale, kv_map) -> o
  backward(q, k, v, visible, scale, kv_map, grad_o) -> (dq, dk, dv)
with q [B, Hq, n_q, d_head], k [B, Hkv, n_k, d_head], v [B, Hkv, n_k, d_value], visible bool
[B, Hq, n_q, n_k], kv_map int [Hq]. Finite differences call ``forward`` with perturbed copies stacked
along the batch axis, so batch elements must be independent.

The parts: ``locating`` (finding a module's files without running it, importing one from the YAML's
folder) and ``failures`` (ImplementationFailure and the checks it becomes); this module loads and calls
an implementation, where a Ctrl-C must still stop the run (``CTRL_C_REACHES_HERE``).
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .failures import ImplementationFailure, determinism, failure_check, in_copies
from .locating import SPEC_RE, LoadError, _import_from_file, _local_file, locate, source_files

__all__ = ["CTRL_C_REACHES_HERE", "SPEC_RE", "ImplementationFailure", "LoadError", "call", "determinism",
           "failure_check", "guarded", "in_copies", "install_line", "load", "locate", "source_files"]


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
    local = None
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
        shadowed = _shadowed(exc, top, local, folder)
        if shadowed is not None:
            raise LoadError(f"cannot import {module_name!r}: {local.name} in the YAML's folder has the name of the "
                            f"installed module {top!r} ({shadowed}), which it imports ({type(exc).__name__}: {exc}); "
                            f"imported under its own name, the file hides that module from itself: rename the file "
                            f"(e.g. {top}_recipe.py) and the 'module:' part of implementation") from None
        library = _missing_library(exc, top)
        if library is not None:
            then = "" if isinstance(exc, ModuleNotFoundError) else \
                f" (the module then raised {type(exc).__name__}: {str(exc)[:200]})"
            raise LoadError(f"cannot import {module_name!r}: it needs the library {library}, which is not installed "
                            f"here: {install_line(library)}{then}") from None
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None and top != exc.name.split(".")[0]
        where = (f" (it was found, but it imports {exc.name!r}, which is not installed here)" if missing else
                 " (the module must be importable from the YAML's folder or PYTHONPATH)"
                 if isinstance(exc, ModuleNotFoundError) else " (raised while importing it)")
        raise LoadError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}{where}") from None
    obj: Any = module
    for part in attr_path.split("."):
        obj = _attribute(obj, part, module_name, attr_path)
    if flavour in ("torch", "jax"):
        if not _safe(callable, obj):
            raise LoadError(f"{spec} must be callable: a {flavour} function of the op's tensors, e.g. f(q, k, v, "
                            f"visible, scale, kv_map) -> o for attention (see docs/your-code.md: the {flavour} "
                            "interface)")
    else:
        missing = [name for name in ("forward", "backward")
                   if not _safe(callable, _attribute(obj, name, module_name, f"{attr_path}.{name}", missing_ok=True))]
        if missing:
            kind = type(obj).__name__
            raise LoadError(f"{spec} is a {kind} without callable {' and '.join(missing)}: the NumPy interface is an "
                            "object with forward(...) and backward(...) methods (an instance of a class that has "
                            "both, or a module defining both functions), whose arguments 'attn-gradcheck ops' lists "
                            "(see docs/your-code.md: the NumPy interface)")
    _LOADED[key] = obj
    return obj


_MISSING = object()


def _attribute(obj, name: str, module_name: str, attr_path: str, missing_ok: bool = False):
    """getattr, with anything but a missing attribute (a property or module __getattr__ that raises)
    reported as such."""
    try:
        return getattr(obj, name)
    except AttributeError:
        if missing_ok:
            return _MISSING
        raise LoadError(f"module {module_name!r} has no attribute {attr_path!r}{_did_you_mean(obj, name)}") from None
    except BaseException as exc:
        if _ctrl_c(exc):
            raise
        raise LoadError(f"reading {attr_path!r} of module {module_name!r} raised {type(exc).__name__}: {exc}") from None


def _did_you_mean(obj, name: str) -> str:
    """' (did you mean 'x'?)' from the public attributes of ``obj`` close to ``name``; '' when none is."""
    import difflib
    try:
        names = [n for n in dir(obj) if not n.startswith("_")]
    except Exception:  # noqa: BLE001 -- an object whose dir() raises: no suggestion
        return ""
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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


def raised_at(exc: BaseException) -> str:
    """' (at FILE:LINE in FUNCTION)': where ``exc`` was raised in the user's own code (the innermost frame
    outside installed packages and this tool; else the innermost frame outside this tool), or '' without one (a
    call the code refused, e.g. an unexpected keyword argument, raises in the tool's own call: no place of the
    code's to name)."""
    import os
    import traceback
    try:
        frames = traceback.extract_tb(exc.__traceback__)
    except Exception:  # noqa: BLE001 -- a traceback that cannot be read says nothing
        return ""
    tool = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = [f for f in frames if "site-packages" not in f.filename and not f.filename.startswith(tool)
           and not f.filename.startswith("<")]
    outside = [f for f in frames if not f.filename.startswith(tool)]
    frame = (own or outside or [None])[-1]
    if frame is None:
        return ""
    try:
        name = os.path.relpath(frame.filename)
    except ValueError:
        name = frame.filename
    name = frame.filename if name.startswith("..") else name
    return f" (at {name}:{frame.lineno} in {frame.name})"


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
        failure = ImplementationFailure(f"{what} raised {type(exc).__name__}: {exc}{raised_at(exc)}")
        if isinstance(exc, NotImplementedError) and "on CPU" in str(exc):
            failure.hint = (f"the code's {what} is not implemented on the CPU by its library (torch's flex_attention "
                            "has no CPU backward in torch 2.13): check it with device: cuda on a machine with a GPU; "
                            "nothing about its gradients could be checked here")
        raise failure from None


def call(fn, what: str, args: tuple, expected: dict[str, tuple[tuple[int, ...], np.dtype]],
         names: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """(see :func:`guarded_call`)"""
    return guarded_call(fn, what, args, expected, names, getattr(fn, "immutable", False))


def guarded_call(fn, what: str, args: tuple, expected: dict[str, tuple[tuple[int, ...], np.dtype]],
                 names: tuple[str, ...] = (), immutable: bool = False) -> dict[str, np.ndarray]:
    """Call ``fn`` on fresh copies of ``args`` and check each returned array against ``expected``
    (name -> (shape, dtype), in the order returned: one name means a single array, several a tuple).

    Nothing handed over is shared with the checker: the implementation gets copies, and what it
    returns is copied before it is used (a buffer it reuses on the next call cannot change a result).
    An argument changed in place (``names`` names them) is a failure naming it: the checker would
    otherwise compare against inputs the implementation no longer saw. ``immutable`` (a flavour whose
    wrapper hands the code its own immutable arrays and returns fresh ones: JAX's, ``fn.immutable``): no
    copies either way, nothing to compare."""
    given = args if immutable else tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
    out = guarded(what, fn, *given)
    for i, (before, after) in enumerate(zip(args, () if immutable else given)):
        if not isinstance(before, np.ndarray):
            continue
        same_kind = (isinstance(after, np.ndarray) and after.shape == before.shape and after.dtype == before.dtype)
        if not same_kind or not _equal(before, after):
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
        arr = np.asarray(value) if immutable and type(value) is np.ndarray else np.array(value, copy=True, subok=False)
        if arr.shape != shape:
            raise ImplementationFailure(f"{what} returned {name} of shape {list(arr.shape)}, "
                                        f"expected {list(shape)}", name)
        if arr.dtype != dtype:
            raise ImplementationFailure(f"{what} returned {name} of dtype {arr.dtype}, expected {dtype}", name)
        bad = ~np.isfinite(arr)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ImplementationFailure(f"{what} returned a non-finite {name}: {arr[index]} at {name}"
                                        f"[{', '.join(map(str, index))}]", name, index, non_finite=True)
        result[name] = arr
    return result


def _equal(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether an argument is unchanged (NaN where it was NaN): a plain comparison first, which is about ten
    times faster than equal_nan's and settles every argument without a NaN (it runs on every call)."""
    return np.array_equal(before, after) or (before.dtype.kind in "fc" and np.array_equal(before, after,
                                                                                          equal_nan=True))


#: Import names whose package on PyPI is named otherwise (pip's name, or the extra of this tool that
#: installs it); any other library is installed by its import name, with '_' written '-'.
PIP_NAMES = {"torch": "'attn-gradcheck[torch]'", "jax": "'attn-gradcheck[jax]'", "jaxlib": "'attn-gradcheck[jax]'",
             "sklearn": "scikit-learn", "cv2": "opencv-python", "PIL": "Pillow", "yaml": "PyYAML",
             "skimage": "scikit-image", "bs4": "beautifulsoup4", "haiku": "dm-haiku", "attr": "attrs",
             "dateutil": "python-dateutil"}


def install_line(library: str) -> str:
    """The command that installs the top-level module ``library`` ("pip install timm")."""
    return f"pip install {PIP_NAMES.get(library, library.replace('_', '-'))}"


def _missing_library(exc: BaseException, top: str) -> str | None:
    """The library that importing the user's module ``top`` needed and is not installed: named by a
    ModuleNotFoundError that ``exc`` is, or was raised while handling (a fallback that then failed, e.g.
    ``importlib.util.find_spec("timm").submodule_search_locations`` on None); None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        library = name.split(".")[0] if isinstance(name, str) and name else None
        if library and library != top:
            try:
                installed = importlib.util.find_spec(library) is not None
            except (ImportError, ValueError):
                installed = True  # found but broken: not a missing library
            if not installed:
                return library
        exc = exc.__cause__ or exc.__context__
    return None


def _shadowed(exc: BaseException, top: str, local: Path | None, folder: str) -> str | None:
    """Where the installed module ``top`` is, when importing the YAML folder's file of that name failed on its
    own import of that installed module (a recipe named like the library it wraps); else None."""
    name = getattr(exc, "name", None)
    if local is None or not isinstance(exc, ImportError) or not name or name.split(".")[0] != top:
        return None
    others = [p for p in sys.path if p and Path(p).resolve() != Path(folder)]
    try:
        found = importlib.machinery.PathFinder.find_spec(top, others)
    except (ImportError, ValueError):
        return None
    return None if found is None or not found.origin else found.origin
