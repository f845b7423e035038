"""Where a user's implementation (``module:attribute``) lives, found without running any of it, and
importing a module from the YAML's folder under its own name."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path

SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


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
